//! A tied table's two gradients summed by the embedding gradient itself: a language model
//! that reads its token table twice (the embedding, and the output projection's weight)
//! gets the table's gradient as an `add` of the `embedding_grad` scatter and the
//! projection's weight gradient. On GPT-2 that add reads and writes three `[50257, 768]`
//! f32 tensors (0.23 ms of a 24 ms bf16 step on an H200), and with a padded vocabulary
//! (`Gpt::pad_vocab`) the projection's gradient first goes through a `cast` to f32 and a
//! `slice` of its first 50257 rows (0.07 and 0.13 ms more). Folded, the embedding
//! gradient reads the projection's gradient as its `base` ([`EmbeddingGrad::base`]): each
//! row's sum of `dy` rows is added to the base's row as the add added it (same operands,
//! same rounding, so the bits do not change), through the slice (the base may have more
//! rows than the table: the first ones are read) and the cast (a bf16 or f16 base is
//! widened as it loads). One kernel writes the table gradient; the add, the slice, the
//! cast and their registers go.
//!
//! What folds, on one stream of a cpu, sim or cuda device, no actor involved reading
//! through a window: an f32 or f64 `add` of two operands of its output's shape, one the
//! only output of a plain `embedding_grad` (no base yet) read by the add alone. The other
//! operand becomes the base, and then, while the base register is read by the fold alone:
//! a `slice` of its first rows (axis 0 from 0) reads its input instead, and a `cast` from
//! bf16 or f16 to f32 (the table f32) reads its 16-bit input instead. Runs after
//! `fold_casts` (which may already have made the add read a 16-bit operand: the base is
//! then 16-bit) and before `fuse_casts` (so a cast folded here joins no group).
//!
//! The embedding gradient now runs where the add did: it waits for the projection's
//! gradient as well as its own inputs. Nothing else changes order; memory sharing runs
//! after this pass, on the registers left.

use super::fuse_casts::{plain_add, plain_op, PlainAdd};
use super::lower::{move_read, op_conf_mut, plan_each, push_op_input, Lowering, Merges};
use crate::plan::{ActorIndex, DType, OpConf, PlanIndex, RegstDescId, TensorMeta};
use regflow_plan::ops::{Cast, EmbeddingGrad, OpAttrs, Slice};

/// One sum to fold, planned from the index before the plan changes.
#[derive(Debug)]
struct Fold {
    /// The `embedding_grad` that takes the sum over.
    grad: ActorIndex,
    op: EmbeddingGrad,
    /// The add, then the slice and the cast the base was read through (those that fold).
    merged: Vec<ActorIndex>,
    /// The registers that go: the scatter's own output, and the slice's and cast's outputs.
    removed: Vec<RegstDescId>,
    /// The add's output, which the gradient writes now.
    output: RegstDescId,
    /// The register read as the base, its meta, and the actor that read it until now.
    base: RegstDescId,
    base_meta: TensorMeta,
    base_reader: ActorIndex,
}

/// Folds every tied table's gradient sum into its `embedding_grad` (module docs), unless the
/// options turn it off.
pub(crate) fn fold_table_grads(low: &mut Lowering<'_>) {
    if !low.options.fold_table_grads {
        return;
    }
    let plan = low.b.plan_mut();
    let folds = plan_each(plan, fold_of);
    let mut merges = Merges::new(plan);
    for fold in folds {
        op_conf_mut(plan, fold.grad).attrs = EmbeddingGrad { base: Some(fold.base_meta.dtype), ..fold.op }.attrs();
        push_op_input(plan, fold.grad, fold.base, fold.base_meta);
        move_read(plan, fold.base, fold.base_reader, fold.grad);
        plan.regst_descs[fold.output.index()].producer = fold.grad;
        for r in fold.removed {
            merges.removed_registers[r.index()] = true;
        }
        for a in fold.merged {
            merges.into[a.index()] = Some(fold.grad);
        }
    }
    low.drop_merged(&merges);
}

/// Actor `add` as a table gradient's sum to fold (module docs), if it is one.
fn fold_of(index: &PlanIndex<'_>, add: ActorIndex) -> Option<Fold> {
    let plan = index.plan();
    let PlainAdd { operands: [first, second], metas, outputs, output_metas } = plain_add(index, add)?;
    let (&[output], [out]) = (outputs, output_metas) else { return None };
    let actor = &plan.actors[add.index()];
    if !matches!(out.dtype, DType::F32 | DType::F64) || metas.iter().any(|m| m.shape != out.shape) {
        return None;
    }
    let same_stream = |x: ActorIndex| plan.actors[x.index()].stream == actor.stream;
    let alone = |r: RegstDescId, reader: ActorIndex| {
        let desc = &plan.regst_descs[r.index()];
        desc.consumers == [reader] && desc.preloaded == 0
    };
    // Which operand the scatter made (the other is the base).
    let scatter_of = |r: RegstDescId| {
        let producer = plan.regst_descs[r.index()].producer;
        let grad = plain_op(plan, producer, "embedding_grad")?;
        let op = grad.parse_attrs::<EmbeddingGrad>().ok()?;
        let only = index.outputs_of(producer) == [r] && grad.outputs[..] == [out.clone()];
        (op.base.is_none() && only && alone(r, add) && same_stream(producer)).then_some((producer, op))
    };
    let (scatter_output, (grad, op), mut base, base_operand) = match (scatter_of(first), scatter_of(second)) {
        (Some(found), _) => (first, found, second, 1),
        (None, Some(found)) => (second, found, first, 0),
        (None, None) => return None,
    };
    let mut base_meta = metas[base_operand].clone();
    let output_desc = &plan.regst_descs[output.index()];
    if output_desc.preloaded > 0 {
        return None;
    }
    let (mut merged, mut removed, mut reader) = (vec![add], vec![scatter_output], add);
    // Through a slice of the base's first rows, then through a cast of a 16-bit base to the
    // f32 table: the base becomes that op's input, and the op and its output go.
    let slice_of_table = |from: &TensorMeta, to: &TensorMeta, op: &OpConf| prefix_slice(from, to, op, out);
    let steps: [(&str, &ThroughOp<'_>); 2] = [("slice", &slice_of_table), ("cast", &widening_cast)];
    for (op_type, folds) in steps {
        if let Some((producer, input, meta)) = single_input_op(index, base, reader, op_type, &same_stream, folds) {
            merged.push(producer);
            removed.push(base);
            (reader, base, base_meta) = (producer, input, meta);
        }
    }
    // The register finally read as the base: not one the scatter reads already, and in the
    // memory its output is in.
    let grad_actor = &plan.actors[grad.index()];
    if grad_actor.inputs.contains(&base) || plan.regst_descs[base.index()].memory != output_desc.memory {
        return None;
    }
    let widened = out.dtype == DType::F32 && matches!(base_meta.dtype, DType::Bf16 | DType::F16);
    (base_meta.dtype == out.dtype || widened).then_some(Fold {
        grad,
        op,
        merged,
        removed,
        output,
        base,
        base_meta,
        base_reader: reader,
    })
}

/// Whether the scatter may read through an op of these input and output metas and conf.
type ThroughOp<'a> = dyn Fn(&TensorMeta, &TensorMeta, &OpConf) -> bool + 'a;

/// The producer of `base`, its input register and that input's meta, if the producer is a
/// plain `op_type` op of one input and one output on `reader`'s stream that `folds` accepts
/// (given its input and output metas and conf), and `base` and that input are read by
/// `reader` and the producer alone: what the scatter may read through.
fn single_input_op(
    index: &PlanIndex<'_>,
    base: RegstDescId,
    reader: ActorIndex,
    op_type: &str,
    same_stream: &dyn Fn(ActorIndex) -> bool,
    folds: &ThroughOp<'_>,
) -> Option<(ActorIndex, RegstDescId, TensorMeta)> {
    let plan = index.plan();
    let desc = &plan.regst_descs[base.index()];
    let producer = desc.producer;
    let conf = plain_op(plan, producer, op_type)?;
    let (&[input], [from], [to], [0]) =
        (plan.actors[producer.index()].inputs.as_slice(), &conf.inputs[..], &conf.outputs[..], &conf.input_map[..])
    else {
        return None;
    };
    let input_desc = &plan.regst_descs[input.index()];
    let alone = desc.consumers == [reader] && input_desc.consumers == [producer] && input_desc.preloaded == 0;
    (alone && same_stream(producer) && index.outputs_of(producer) == [base] && folds(from, to, conf))
        .then(|| (producer, input, from.clone()))
}

/// Whether a `slice` of `from` into `to` keeps the first rows of its input (axis 0 from
/// 0) with the `table`'s other dimensions, in its dtype: `to` is the table.
fn prefix_slice(from: &TensorMeta, to: &TensorMeta, conf: &OpConf, table: &TensorMeta) -> bool {
    let Ok(op) = conf.parse_attrs::<Slice>() else { return false };
    let rows_of = |m: &TensorMeta| m.shape.dims().split_first().map(|(&rows, rest)| (rows, rest.to_vec()));
    let (Ok((axis, _)), Some((rows, rest)), Some((_, table_rest))) =
        (op.resolve(&from.shape), rows_of(from), rows_of(table))
    else {
        return false;
    };
    axis == 0 && op.start == 0 && to == table && rest == table_rest && rows >= op.end && from.dtype == to.dtype
}

/// Whether a `cast` of `from` into `to` widens bf16 or f16 to f32, element for element.
fn widening_cast(from: &TensorMeta, to: &TensorMeta, conf: &OpConf) -> bool {
    let widening = matches!(from.dtype, DType::Bf16 | DType::F16) && to.dtype == DType::F32;
    widening && from.shape == to.shape && conf.parse_attrs::<Cast>().is_ok_and(|c| c.to == to.dtype)
}
