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

use super::fuse_casts::plain_op;
use super::lower::{plan_each, Lowering, Merges};
use crate::plan::{ActorIndex, ActorKind, DType, KernelConf, PlanIndex, RegstDescId, TensorMeta};
use regflow_plan::ops::{Binary, BinaryKind, Cast, EmbeddingGrad, OpAttrs, Slice};

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
        let actor = &mut plan.actors[fold.grad.index()];
        let position = actor.inputs.len();
        actor.inputs.push(fold.base);
        let ActorKind::Compute { kernel: KernelConf::Op(conf) } = &mut actor.kind else {
            unreachable!("a folded sum's gradient is an op actor (checked when the fold was planned)")
        };
        conf.attrs = EmbeddingGrad { base: Some(fold.base_meta.dtype), ..fold.op }.attrs();
        conf.inputs.push(fold.base_meta);
        conf.input_map.push(position);
        for consumer in plan.regst_descs[fold.base.index()].consumers.iter_mut() {
            if *consumer == fold.base_reader {
                *consumer = fold.grad;
            }
        }
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
    let conf = plain_op(plan, add, "binary")?;
    let actor = &plan.actors[add.index()];
    let (Binary(BinaryKind::Add), [a, b], [out], &[output]) =
        (conf.parse_attrs::<Binary>().ok()?, &conf.inputs[..], &conf.outputs[..], index.outputs_of(add))
    else {
        return None;
    };
    let &[first, second] = actor.inputs.as_slice() else { return None };
    if !matches!(out.dtype, DType::F32 | DType::F64) || a.shape != out.shape || b.shape != out.shape {
        return None;
    }
    let same_stream = |x: ActorIndex| plan.actors[x.index()].stream == actor.stream;
    let alone = |r: RegstDescId, reader: ActorIndex| {
        let desc = &plan.regst_descs[r.index()];
        desc.consumers == [reader] && desc.preloaded == 0
    };
    // Which operand the scatter made (the other is the base), as the add's op inputs say.
    let scatter_of = |r: RegstDescId| {
        let producer = plan.regst_descs[r.index()].producer;
        let grad = plain_op(plan, producer, "embedding_grad")?;
        let op = grad.parse_attrs::<EmbeddingGrad>().ok()?;
        let only = index.outputs_of(producer) == [r] && grad.outputs[..] == [out.clone()];
        (op.base.is_none() && only && alone(r, add) && same_stream(producer)).then_some((producer, op))
    };
    let (scatter, base_position) = match (scatter_of(first), scatter_of(second)) {
        (Some(found), _) => ((first, found), 1),
        (None, Some(found)) => ((second, found), 0),
        (None, None) => return None,
    };
    let (scatter_output, (grad, op)) = scatter;
    let mut base = actor.inputs[base_position];
    let operand = conf.input_map.iter().position(|&p| p == base_position)?;
    let mut base_meta = conf.inputs[operand].clone();
    let output_desc = &plan.regst_descs[output.index()];
    let grad_actor = &plan.actors[grad.index()];
    if first == second
        || output_desc.preloaded > 0
        || plan.regst_descs[base.index()].memory != output_desc.memory
        || grad_actor.inputs.contains(&base)
    {
        return None;
    }
    let (mut merged, mut removed, mut reader) = (vec![add], vec![scatter_output], add);
    // Through a slice of the base's first rows.
    if let Some((input, meta)) = prefix_slice_of(index, base, reader, &same_stream, out) {
        merged.push(plan.regst_descs[base.index()].producer);
        removed.push(base);
        reader = plan.regst_descs[base.index()].producer;
        (base, base_meta) = (input, meta);
    }
    // Through a cast of a 16-bit base to the f32 table.
    if let Some((input, meta)) = widening_cast_of(index, base, reader, &same_stream) {
        merged.push(plan.regst_descs[base.index()].producer);
        removed.push(base);
        reader = plan.regst_descs[base.index()].producer;
        (base, base_meta) = (input, meta);
    }
    // The register finally read as the base: not one the scatter reads already, and in the
    // memory its output is in.
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

/// The input register and meta of the `slice` that makes `base`, read by `reader` alone,
/// if it keeps the first rows of its input (axis 0 from 0) with the table's other
/// dimensions.
fn prefix_slice_of(
    index: &PlanIndex<'_>,
    base: RegstDescId,
    reader: ActorIndex,
    same_stream: &dyn Fn(ActorIndex) -> bool,
    table: &TensorMeta,
) -> Option<(RegstDescId, TensorMeta)> {
    let plan = index.plan();
    let desc = &plan.regst_descs[base.index()];
    let slice = desc.producer;
    let conf = plain_op(plan, slice, "slice")?;
    let op = conf.parse_attrs::<Slice>().ok()?;
    let (&[input], [from], [to], [0]) =
        (plan.actors[slice.index()].inputs.as_slice(), &conf.inputs[..], &conf.outputs[..], &conf.input_map[..])
    else {
        return None;
    };
    let (axis, _) = op.resolve(&from.shape).ok()?;
    let rows_of = |m: &TensorMeta| m.shape.dims().split_first().map(|(&rows, rest)| (rows, rest.to_vec()));
    let ((rows, rest), (_, table_rest)) = (rows_of(from)?, rows_of(table)?);
    let prefix = axis == 0 && op.start == 0 && *to == *table && rest == table_rest && rows >= op.end;
    let input_desc = &plan.regst_descs[input.index()];
    let alone = desc.consumers == [reader] && input_desc.consumers == [slice] && input_desc.preloaded == 0;
    (prefix && alone && from.dtype == to.dtype && same_stream(slice) && index.outputs_of(slice) == [base])
        .then(|| (input, from.clone()))
}

/// The input register and meta of the `cast` from bf16 or f16 to f32 that makes `base`,
/// read by `reader` alone.
fn widening_cast_of(
    index: &PlanIndex<'_>,
    base: RegstDescId,
    reader: ActorIndex,
    same_stream: &dyn Fn(ActorIndex) -> bool,
) -> Option<(RegstDescId, TensorMeta)> {
    let plan = index.plan();
    let desc = &plan.regst_descs[base.index()];
    let cast = desc.producer;
    let conf = plain_op(plan, cast, "cast")?;
    let (&[input], [from], [to], [0]) =
        (plan.actors[cast.index()].inputs.as_slice(), &conf.inputs[..], &conf.outputs[..], &conf.input_map[..])
    else {
        return None;
    };
    let widening = matches!(from.dtype, DType::Bf16 | DType::F16) && to.dtype == DType::F32;
    let input_desc = &plan.regst_descs[input.index()];
    let alone = desc.consumers == [reader] && input_desc.consumers == [cast] && input_desc.preloaded == 0;
    (conf.parse_attrs::<Cast>().ok()?.to == to.dtype
        && widening
        && from.shape == to.shape
        && alone
        && same_stream(cast)
        && index.outputs_of(cast) == [base])
    .then(|| (input, from.clone()))
}
