//! A pre-norm block's residual add done by the layer norm that reads its sum: the residual
//! stream's `x + block(x)` (an f32 add, its 16-bit operand widened as it loads since
//! `fold_casts`) writes the sum, and the next block's layer norm reads it straight back.
//! Folded, the layer norm reads the two summands, adds them as the add did (one addition,
//! the 16-bit one widened exactly: the same bits), writes the sum as its first output (the
//! stream goes on from it, and the norm's gradient reads it) and normalizes it into its
//! second ([`LayerNorm::residual`]). The norm no longer reads the sum back, and the add's
//! launch goes: on GPT-2, 23 of them a step, about 25 MB of traffic each.
//!
//! What folds, on one stream of a cpu, sim or cuda device, no actor involved reading
//! through a window: a plain `layer_norm` (no summand yet) whose input is the only output
//! of an f32 or f64 `add` of two operands of its shape, one in the sum's dtype (the norm's
//! input 0) and the other in it too or bf16 or f16 beside f32 (the summand). The sum's
//! register stays, produced by the norm now (descriptor order is output order: it was
//! made before the norm's own output), with its readers; the add goes. Not where the norm's
//! scale or shift is made from the sum (the norm would then wait on itself). Where the
//! narrower summand is the output of a bias add (rows of its shape plus a `[D]` bias of its
//! dtype: the block's last product and its bias) read by the residual add alone, that add
//! folds too: the norm reads the rows and the bias and adds them first, rounded as the bias
//! add rounded ([`LayerNorm::summand_bias`]), and the bias add and its output go. Runs after
//! `fold_casts` (which gives the add its 16-bit operand) and before `fuse_casts`.

use super::fuse_casts::{plain_add, plain_op, PlainAdd};
use super::lower::{made_by, move_read, op_conf_mut, plan_each, push_op_input, Lowering, Merges};
use crate::plan::{ActorIndex, DType, PlanIndex, RegstDescId, TensorMeta};
use regflow_plan::ops::{LayerNorm, OpAttrs};

/// One residual add to fold, planned from the index before the plan changes.
#[derive(Debug)]
struct Fold {
    /// The `layer_norm` that takes the add over, and its attributes.
    norm: ActorIndex,
    op: LayerNorm,
    /// The add.
    add: ActorIndex,
    /// The add's output, the sum: the norm's first output from now on.
    sum: RegstDescId,
    sum_meta: TensorMeta,
    /// The summands: the one in the sum's dtype (the norm's input 0), and the other.
    first: RegstDescId,
    second: RegstDescId,
    second_meta: TensorMeta,
    /// Where the second summand is a bias add's output read by the add alone: that add,
    /// its rows (the norm's summand now) and its bias (`LayerNorm::summand_bias`).
    biased: Option<BiasAdd>,
}

/// A bias add folded into the norm with the residual add.
#[derive(Debug)]
struct BiasAdd {
    add: ActorIndex,
    rows: RegstDescId,
    bias: RegstDescId,
    bias_meta: TensorMeta,
}

/// Folds every residual add into the layer norm that reads its sum (module docs), unless
/// the options turn it off.
pub(crate) fn fold_norm_inputs(low: &mut Lowering<'_>) {
    if !low.options.fold_norm_inputs {
        return;
    }
    let plan = low.b.plan_mut();
    let folds = plan_each(plan, fold_of);
    let mut merges = Merges::new(plan);
    for fold in folds {
        // Input 0 (the sum) becomes the first summand; the second (or the bias add's rows,
        // and its bias) are appended.
        let conf = op_conf_mut(plan, fold.norm);
        let summand_bias = fold.biased.is_some();
        conf.attrs = LayerNorm { residual: Some(fold.second_meta.dtype), summand_bias, ..fold.op }.attrs();
        conf.outputs.insert(0, fold.sum_meta);
        let position = conf.input_map[0];
        plan.actors[fold.norm.index()].inputs[position] = fold.first;
        move_read(plan, fold.first, fold.add, fold.norm);
        match &fold.biased {
            None => {
                push_op_input(plan, fold.norm, fold.second, fold.second_meta);
                move_read(plan, fold.second, fold.add, fold.norm);
            }
            Some(biased) => {
                push_op_input(plan, fold.norm, biased.rows, fold.second_meta);
                push_op_input(plan, fold.norm, biased.bias, biased.bias_meta.clone());
                move_read(plan, biased.rows, biased.add, fold.norm);
                move_read(plan, biased.bias, biased.add, fold.norm);
                merges.removed_registers[fold.second.index()] = true;
                merges.into[biased.add.index()] = Some(fold.norm);
            }
        }
        let sum = &mut plan.regst_descs[fold.sum.index()];
        sum.producer = fold.norm;
        sum.consumers.retain(|&c| c != fold.norm);
        merges.into[fold.add.index()] = Some(fold.norm);
    }
    low.drop_merged(&merges);
}

/// Actor `norm` as a layer norm whose input's add folds into it (module docs), if it is one.
fn fold_of(index: &PlanIndex<'_>, norm: ActorIndex) -> Option<Fold> {
    let plan = index.plan();
    let conf = plain_op(plan, norm, "layer_norm")?;
    let op = conf.parse_attrs::<LayerNorm>().ok()?;
    let actor = &plan.actors[norm.index()];
    if op.residual.is_some() || conf.inputs.len() != 3 || conf.outputs.len() != 1 {
        return None;
    }
    let sum = *actor.inputs.get(conf.input_map[0])?;
    let sum_desc = &plan.regst_descs[sum.index()];
    let add = sum_desc.producer;
    let PlainAdd { operands: [a_reg, b_reg], metas: [a, b], outputs, output_metas } = plain_add(index, add)?;
    let (&[only], [out]) = (outputs, output_metas) else { return None };
    let same_stream = plan.actors[add.index()].stream == actor.stream;
    if only != sum || sum_desc.preloaded > 0 || !same_stream || *out != conf.inputs[0] {
        return None;
    }
    if !matches!(out.dtype, DType::F32 | DType::F64) || a.shape != out.shape || b.shape != out.shape {
        return None;
    }
    // Which summand has the sum's dtype (the norm's input 0); the other may be narrower.
    let ((first, _), (second, second_meta)) =
        if a.dtype == out.dtype { ((a_reg, a), (b_reg, b)) } else { ((b_reg, b), (a_reg, a)) };
    let widened = out.dtype == DType::F32 && second_meta.dtype.is_half();
    if first == sum
        || !(second_meta.dtype == out.dtype || widened)
        || plan.regst_descs[first.index()].memory != sum_desc.memory
    {
        return None;
    }
    // The sum becomes the norm's first output: it must come before the norm's own.
    if !index.outputs_of(norm).iter().all(|&o| sum < o)
        || actor.inputs.contains(&first)
        || actor.inputs.contains(&second)
    {
        return None;
    }
    // Not where the scale or the shift is made from the sum.
    let parameters: Vec<RegstDescId> = actor.inputs.iter().copied().filter(|&r| r != sum).collect();
    if made_by(index, &parameters, add) {
        return None;
    }
    let biased = bias_add_of(index, second, second_meta, add, &actor.inputs);
    Some(Fold { norm, op, add, sum, sum_meta: out.clone(), first, second, second_meta: second_meta.clone(), biased })
}

/// The bias add that makes `summand` (of `meta`), if it folds with the residual add `add`
/// that reads it: a plain `binary` add on the same stream of rows of `meta` and a `[D]`
/// bias of its dtype (`D` its last dimension), whose output is read by `add` alone, and
/// whose operands the norm (reading `norm_inputs`) does not read already.
fn bias_add_of(
    index: &PlanIndex<'_>,
    summand: RegstDescId,
    meta: &TensorMeta,
    add: ActorIndex,
    norm_inputs: &[RegstDescId],
) -> Option<BiasAdd> {
    let plan = index.plan();
    let desc = &plan.regst_descs[summand.index()];
    let producer = desc.producer;
    let PlainAdd { operands: [rows, bias], metas: [rows_meta, bias_meta], outputs, output_metas } =
        plain_add(index, producer)?;
    let (&[only], [out]) = (outputs, output_metas) else { return None };
    let features = meta.shape.dims().last().copied();
    let bias_fits = bias_meta.shape.dims() == features.as_slice() && bias_meta.dtype == meta.dtype;
    let alone = desc.consumers == [add] && desc.preloaded == 0 && only == summand;
    let same_stream = plan.actors[producer.index()].stream == plan.actors[add.index()].stream;
    let fresh = ![rows, bias].iter().any(|r| norm_inputs.contains(r));
    (out == meta && rows_meta == meta && bias_fits && alone && same_stream && fresh).then(|| BiasAdd {
        add: producer,
        rows,
        bias,
        bias_meta: bias_meta.clone(),
    })
}
