//! A pre-norm block's residual gradient summed by its layer norm's gradient: the gradient
//! of the residual stream at a block's input is the `add` of the gradient from above and
//! the layer norm gradient's `dx`, an f32 add that reads two activation-sized tensors and
//! writes one (and, under mixed precision, its 16-bit copy for the products that read it,
//! the add's second output since `fold_casts`). GPT-2 has 24 of them a step, each a pass of
//! about 88 MB on the GPU. Folded, the layer norm gradient reads the other gradient as its
//! `base` and adds it to each element of `dx` as it writes it ([`LayerNormGrad::base`]:
//! the computed `dx` and the base, one addition, as the add made it, so the bits do not
//! change), and writes the 16-bit copy too ([`LayerNormGrad::dx_narrow`], rounded as the
//! add's copy was). The add and its registers go.
//!
//! What folds, on one stream of a cpu, sim or cuda device, no actor involved reading
//! through a window: an f32 or f64 `add` of two operands of its output's dtype and shape
//! (one output, or two with the 16-bit copy), one the `dx` of a plain `layer_norm_grad`
//! (no base, no copy yet) read by the add alone. The other operand becomes the base,
//! unless it is made from the gradient's other outputs (the fold would then wait on
//! itself).
//!
//! Registers keep their plan order (an actor's outputs are its registers in descriptor
//! order): the gradient's `dx` register stays where it is and takes the add's name and
//! readers, the add's own sum register goes (every reference to it is pointed at `dx`'s),
//! and the add's 16-bit copy, made after the gradient's outputs, becomes its fourth.
//! Runs after `fold_casts` (which gives the add its copy) and before `fuse_casts`. The
//! layer norm gradient now waits for the gradient from above too; nothing else changes
//! order, and memory sharing runs after this pass, on the registers left.

use super::fuse_casts::{plain_add, plain_op, PlainAdd};
use super::lower::{move_read, op_conf_mut, plan_each, push_op_input, reads_transitively, Lowering, Merges};
use crate::plan::{ActorIndex, DType, PlanIndex, RegstDescId, TensorMeta};
use regflow_plan::ops::{LayerNormGrad, OpAttrs};

/// One sum to fold, planned from the index before the plan changes.
#[derive(Debug)]
struct Fold {
    /// The `layer_norm_grad` that takes the sum over, and its attributes.
    grad: ActorIndex,
    op: LayerNormGrad,
    /// The add.
    add: ActorIndex,
    /// The gradient's `dx` register, which holds the sum from now on.
    dx: RegstDescId,
    /// The add's sum register, which goes.
    sum: RegstDescId,
    /// The add's 16-bit copy, if it has one: the gradient's fourth output.
    narrow: Option<(RegstDescId, TensorMeta)>,
    /// The register read as the base, and its meta.
    base: RegstDescId,
    base_meta: TensorMeta,
}

/// Folds every residual gradient's sum into its layer norm gradient (module docs), unless
/// the options turn it off.
pub(crate) fn fold_norm_grads(low: &mut Lowering<'_>) {
    if !low.options.fold_norm_grads {
        return;
    }
    let folds = plan_each(low.b.plan_mut(), fold_of);
    let mut merges = Merges::new(low.b.plan_mut());
    // Sums already moved into their `dx` registers: a block's base is often the sum the
    // block above folded (the residual gradient flows down through every block).
    let mut moved: Vec<Option<RegstDescId>> = vec![None; low.b.plan_mut().regst_descs.len()];
    for mut fold in folds {
        fold.base = moved[fold.base.index()].unwrap_or(fold.base);
        let plan = low.b.plan_mut();
        let dx_narrow = fold.narrow.as_ref().map(|(_, meta)| meta.dtype);
        op_conf_mut(plan, fold.grad).attrs = LayerNormGrad { base: true, dx_narrow, ..fold.op }.attrs();
        push_op_input(plan, fold.grad, fold.base, fold.base_meta);
        if let Some((narrow, meta)) = fold.narrow {
            op_conf_mut(plan, fold.grad).outputs.push(meta);
            plan.regst_descs[narrow.index()].producer = fold.grad;
        }
        move_read(plan, fold.base, fold.add, fold.grad);
        // `dx` now holds the sum: it takes the sum register's name and readers.
        let sum = &plan.regst_descs[fold.sum.index()];
        let (name, readers) = (sum.name.clone(), sum.consumers.clone());
        let dx = &mut plan.regst_descs[fold.dx.index()];
        dx.name = name;
        dx.consumers = readers;
        moved[fold.sum.index()] = Some(fold.dx);
        merges.removed_registers[fold.sum.index()] = true;
        merges.into[fold.add.index()] = Some(fold.grad);
    }
    // Every sum's readers read its `dx` register now: one pass over the plan for all folds.
    low.replace_registers(&moved);
    low.drop_merged(&merges);
}

/// Actor `add` as a residual gradient's sum to fold (module docs), if it is one.
fn fold_of(index: &PlanIndex<'_>, add: ActorIndex) -> Option<Fold> {
    let plan = index.plan();
    let PlainAdd { operands: [first, second], metas: [a, b], outputs, output_metas } = plain_add(index, add)?;
    let actor = &plan.actors[add.index()];
    let out = output_metas.first()?;
    let (&sum, narrow) = match (outputs, output_metas) {
        ([sum], [_]) => (sum, None),
        ([sum, narrow], [_, narrow_meta]) => (sum, Some((*narrow, narrow_meta.clone()))),
        _ => return None,
    };
    if !matches!(out.dtype, DType::F32 | DType::F64) || a != out || b != out {
        return None;
    }
    let same_stream = |x: ActorIndex| plan.actors[x.index()].stream == actor.stream;
    // Which operand the layer norm gradient made as its `dx` (the other is the base).
    let dx_of = |r: RegstDescId| {
        let desc = &plan.regst_descs[r.index()];
        let producer = desc.producer;
        let grad = plain_op(plan, producer, "layer_norm_grad")?;
        let op = grad.parse_attrs::<LayerNormGrad>().ok()?;
        let plain = !op.base && op.dx_narrow.is_none();
        let dx = index.outputs_of(producer).first() == Some(&r) && grad.outputs.first() == Some(out);
        let alone = desc.consumers == [add] && desc.preloaded == 0;
        (plain && dx && alone && same_stream(producer)).then_some((producer, op))
    };
    let (dx, (grad, op), base) = match (dx_of(first), dx_of(second)) {
        (Some(found), _) => (first, found, second),
        (None, Some(found)) => (second, found, first),
        (None, None) => return None,
    };
    // The sum moves into `dx`'s register: they must be alike but for their readers. The
    // copy must come after the gradient's own outputs (descriptor order is output order),
    // and the base must be a register the gradient does not read already.
    let (dx_desc, sum_desc) = (&plan.regst_descs[dx.index()], &plan.regst_descs[sum.index()]);
    let alike = dx_desc.register_num == sum_desc.register_num
        && dx_desc.bytes == sum_desc.bytes
        && dx_desc.memory == sum_desc.memory
        && sum_desc.preloaded == 0
        && dx_desc.within.is_none()
        && sum_desc.within.is_none()
        && !dx_desc.aliased_slots
        && !sum_desc.aliased_slots;
    let copy_last = narrow.as_ref().is_none_or(|(r, _)| index.outputs_of(grad).iter().all(|o| o < r));
    let reads_base = plan.actors[grad.index()].inputs.contains(&base);
    if !alike || !copy_last || reads_base {
        return None;
    }
    // Reading the base must not make the gradient wait on itself: the base may not be
    // made from its other outputs (autodiff never does so: activation gradients do not
    // depend on parameter gradients, but a graph built by hand may).
    let base_producer = plan.regst_descs[base.index()].producer;
    let others = index.outputs_of(grad).get(1..).unwrap_or_default();
    (!reads_transitively(index, base_producer, others)).then(|| Fold {
        grad,
        op,
        add,
        dx,
        sum,
        narrow,
        base,
        base_meta: out.clone(),
    })
}
