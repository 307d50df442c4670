//! Casts folded into the ops beside them: mixed precision runs layer norms and the
//! residual stream in f32, so each transformer block's norm is followed by a `cast` of its
//! output to bf16 (or f16) for the block's products, its gradient is preceded by a `cast`
//! of the products' bf16 input gradient back to f32 (its `dy`), each residual add reads a
//! block's bf16 output through a `cast` to f32, and each sum of residual gradients is cast
//! to bf16 for a block's products. GPT-2 124M has 97 such lone casts per step: on a GPU a
//! launch each and a pass over an activation, 15 µs or so on an H100. Folded, the layer
//! norm writes the bf16 tensor itself ([`LayerNorm::out`]), its gradient reads the bf16
//! `dy` ([`LayerNormGrad::dy`]), the add reads its bf16 operand (a `binary` op may have one
//! 16-bit operand beside an f32 one and an f32 output), and the sum writes its bf16 copy
//! beside its f32 result (a `binary` op of f32 operands may have a second, 16-bit output):
//! no separate pass makes, stores or reads the converted copy. The kernels compute in f32
//! exactly as before and round (or widen) each element with the cast's own conversion, so
//! the bits do not change. (Fused casts, `fuse_casts.rs`, are another thing: casts grouped
//! with casts.)
//!
//! What folds, on one stream of a cpu, sim or cuda device (whose kernels have both forms),
//! with no actor involved reading through a window:
//! - a `cast` from f32 to bf16 or f16 whose one input is the only output of an f32
//!   `layer_norm` and is read by that cast alone: the layer norm writes the cast's output
//!   register (which keeps its readers and slots), and its own f32 register and the cast
//!   go;
//! - a `cast` from f32 to bf16 or f16 of the only output of an f32 `binary` op of
//!   operands of its shape, none made by a cast: the op writes the cast's output register
//!   as its second output (after its own, as descriptor order, which is op output order,
//!   requires), its own register keeps its other readers, and the cast goes;
//! - a `cast` from bf16 or f16 to f32 whose output is read by one actor alone, as one
//!   input and nothing else: a `layer_norm_grad`'s `dy` (f32 `x`), or one operand of an
//!   f32 `binary` op. The reader reads the cast's input register instead, and the cast and
//!   its f32 register go.
//!
//! What it saves is a device's: a GPU's kernels read and write the 16-bit tensors as they
//! are. A CPU kernel computes 16-bit tensors in f32 buffers it keeps (`kernels/src/host.rs`),
//! so on a `cpu` device a folded add holds an f32 copy of its 16-bit operand, and a folded
//! sum an f32 buffer for its 16-bit copy, in its kernel, outside the plan's registers (the
//! layer norms widen a row at a time and hold none); CPU mixed precision is there to give
//! a GPU's results bit for bit, not speed.
//!
//! None changes what a step computes or in which order its registers are made: the
//! fused actor runs where the pair did, back to back on their stream. A folded input is
//! kept until its reader runs, right after where the cast freed it. In-place slots
//! (`plan/src/in_place.rs`) concern optimizer updates only, and memory sharing runs after
//! this pass, on the registers that are left.

use super::fuse_casts::plain_op;
use super::lower::{move_read, op_conf_mut, plan_each, Lowering, Merges};
use crate::plan::{ActorIndex, DType, PlanIndex, RegstDescId, TensorMeta};
use regflow_plan::ops::{Binary, Cast, LayerNorm, LayerNormGrad, OpAttrs};

/// One cast to fold, planned from the index before the plan changes.
#[derive(Debug)]
enum Fold {
    /// The layer norm `norm` (running `op`) writes `to` into the cast's output register
    /// `output`; its own register `norm_output` goes.
    Forward {
        cast: ActorIndex,
        norm: ActorIndex,
        op: LayerNorm,
        norm_output: RegstDescId,
        output: RegstDescId,
        to: DType,
    },
    /// The f32 `binary` op `op_actor` writes its result narrowed to `to` into the cast's
    /// output register `output` too, as its second output; its own f32 register keeps its
    /// other readers.
    Narrowed { cast: ActorIndex, op_actor: ActorIndex, output: RegstDescId, to: TensorMeta },
    /// Actor `reader` reads the cast's input register `input` (of `from`) as its op's
    /// input `operand`, at its actor input `position`, with its op's attributes replaced
    /// by `attrs` where it has any to change (a `layer_norm_grad`'s `dy`); the cast's
    /// output register `output` goes.
    Widened {
        cast: ActorIndex,
        reader: ActorIndex,
        attrs: Option<serde_json::Value>,
        operand: usize,
        position: usize,
        input: RegstDescId,
        output: RegstDescId,
        from: DType,
    },
}

/// Folds the lone casts of every cpu, sim and cuda device into their neighbours (module docs),
/// unless the options turn it off.
pub(crate) fn fold_casts(low: &mut Lowering<'_>) {
    if !low.options.fold_casts {
        return;
    }
    let plan = low.b.plan_mut();
    let folds = plan_each(plan, fold_of);
    let mut merges = Merges::new(plan);
    for fold in folds {
        match fold {
            Fold::Forward { cast, norm, op, norm_output, output, to } => {
                let conf = op_conf_mut(plan, norm);
                conf.attrs = LayerNorm { out: Some(to), ..op }.attrs();
                conf.outputs[0].dtype = to;
                plan.regst_descs[output.index()].producer = norm;
                merges.removed_registers[norm_output.index()] = true;
                merges.into[cast.index()] = Some(norm);
            }
            Fold::Narrowed { cast, op_actor, output, to } => {
                op_conf_mut(plan, op_actor).outputs.push(to);
                plan.regst_descs[output.index()].producer = op_actor;
                merges.into[cast.index()] = Some(op_actor);
            }
            Fold::Widened { cast, reader, attrs, operand, position, input, output, from } => {
                let conf = op_conf_mut(plan, reader);
                if let Some(attrs) = attrs {
                    conf.attrs = attrs;
                }
                conf.inputs[operand].dtype = from;
                plan.actors[reader.index()].inputs[position] = input;
                move_read(plan, input, cast, reader);
                merges.removed_registers[output.index()] = true;
                merges.into[cast.index()] = Some(reader);
            }
        }
    }
    low.drop_merged(&merges);
}

/// Actor `cast` as a cast to fold (module docs), if it is one.
fn fold_of(index: &PlanIndex<'_>, cast: ActorIndex) -> Option<Fold> {
    let plan = index.plan();
    let conf = plain_op(index.plan(), cast, "cast")?;
    let actor = &plan.actors[cast.index()];
    // One input register (no tick), one output register.
    let (&[input], &[output]) = (actor.inputs.as_slice(), index.outputs_of(cast)) else { return None };
    let ([from], [to], [0]) = (&conf.inputs[..], &conf.outputs[..], &conf.input_map[..]) else { return None };
    if conf.parse_attrs::<Cast>().ok()?.to != to.dtype || from.shape != to.shape {
        return None;
    }
    let (input_desc, output_desc) = (&plan.regst_descs[input.index()], &plan.regst_descs[output.index()]);
    if input_desc.preloaded > 0 || output_desc.preloaded > 0 {
        return None;
    }
    let same_stream = |a: ActorIndex| plan.actors[a.index()].stream == actor.stream;
    match (from.dtype, to.dtype) {
        (DType::F32, DType::Bf16 | DType::F16) => {
            // The narrow copy is written where the f32 result is made, so by its producer.
            let producer = input_desc.producer;
            if !same_stream(producer) || input_desc.memory != output_desc.memory {
                return None;
            }
            if plain_op(index.plan(), producer, "binary").is_some() {
                return narrowed_output(index, cast, input, output, to);
            }
            let norm_conf = plain_op(index.plan(), producer, "layer_norm")?;
            let op = norm_conf.parse_attrs::<LayerNorm>().ok()?;
            let f32_norm = op.out.is_none() && norm_conf.inputs.iter().all(|m| m.dtype == DType::F32);
            let alone =
                index.outputs_of(producer) == [input] && norm_conf.outputs.len() == 1 && input_desc.consumers == [cast];
            (f32_norm && alone && norm_conf.outputs[..] == [from.clone()]).then_some(Fold::Forward {
                cast,
                norm: producer,
                op,
                norm_output: input,
                output,
                to: to.dtype,
            })
        }
        (DType::Bf16 | DType::F16, DType::F32) => {
            let &[reader] = output_desc.consumers.as_slice() else { return None };
            let actor_inputs = &plan.actors[reader.index()].inputs;
            let position = actor_inputs.iter().position(|&r| r == output)?;
            // The reader reads the cast's input through no input of its own already.
            if !same_stream(reader) || actor_inputs.contains(&input) {
                return None;
            }
            let (attrs, operand) = widened_input(index, reader, position, to, from.dtype)?;
            Some(Fold::Widened { cast, reader, attrs, operand, position, input, output, from: from.dtype })
        }
        _ => None,
    }
}

/// Where the f32 register `wide` at actor input `position` of `reader` may be read as its
/// 16-bit source of `narrow` instead: the op input it is (read as that alone) and the new
/// attributes that say so, if `reader` is a `layer_norm_grad` reading it as its `dy` or an
/// f32 `binary` op reading it as one operand (which needs none: its kernels read the
/// operand's dtype from its meta).
fn widened_input(
    index: &PlanIndex<'_>,
    reader: ActorIndex,
    position: usize,
    wide: &TensorMeta,
    narrow: DType,
) -> Option<(Option<serde_json::Value>, usize)> {
    let conf =
        plain_op(index.plan(), reader, "layer_norm_grad").or_else(|| plain_op(index.plan(), reader, "binary"))?;
    // The op inputs the register is: exactly one.
    let mut operands = conf.input_map.iter().enumerate().filter(|&(_, &p)| p == position).map(|(k, _)| k);
    let (Some(operand), None) = (operands.next(), operands.next()) else { return None };
    let all_f32 = conf.inputs.iter().chain(&conf.outputs).all(|m| m.dtype == DType::F32);
    if !all_f32 || conf.inputs[operand] != *wide {
        return None;
    }
    if conf.op_type == "binary" {
        conf.parse_attrs::<Binary>().ok()?;
        return Some((None, operand));
    }
    let op = conf.parse_attrs::<LayerNormGrad>().ok()?;
    (operand == 2 && op.dy.is_none()).then(|| (Some(LayerNormGrad { dy: Some(narrow), ..op }.attrs()), operand))
}

/// Cast `cast` of the f32 register `input` into `output` (of `to`) as the second output of
/// the f32 `binary` op that makes `input`, if it may be one: the op reads operands of its
/// output's shape (the narrowed entries have no broadcast form) and has no other output,
/// and `output` comes after `input` in descriptor order, which is the order an actor's
/// registers are its op's outputs in. `input` may have other readers: the sums of a
/// residual stream's gradients are read in f32 by the next sum and in bf16 by a block's
/// products. (The caller checked the stream and the memory kind.)
fn narrowed_output(
    index: &PlanIndex<'_>,
    cast: ActorIndex,
    input: RegstDescId,
    output: RegstDescId,
    to: &TensorMeta,
) -> Option<Fold> {
    let plan = index.plan();
    let input_desc = &plan.regst_descs[input.index()];
    let op_actor = input_desc.producer;
    let conf = plain_op(index.plan(), op_actor, "binary")?;
    conf.parse_attrs::<Binary>().ok()?;
    let [out] = &conf.outputs[..] else { return None };
    let all_f32 = conf.inputs.iter().chain([out]).all(|m| m.dtype == DType::F32);
    let unbroadcast = conf.inputs.iter().all(|m| m.shape == out.shape);
    let in_order = index.outputs_of(op_actor) == [input] && output.index() > input.index();
    // One narrowed copy (this cast the only one reading the result), and operands that
    // stay f32: none made by a cast, which this pass might fold into the op as a 16-bit
    // operand (the narrowed entries take f32 operands).
    let is_cast = |a: &ActorIndex| plain_op(index.plan(), *a, "cast").is_some();
    let one_copy = input_desc.consumers.iter().filter(|c| is_cast(c)).count() == 1;
    let f32_sources =
        plan.actors[op_actor.index()].inputs.iter().all(|r| !is_cast(&plan.regst_descs[r.index()].producer));
    (all_f32 && unbroadcast && in_order && one_copy && f32_sources && out.shape == to.shape).then(|| Fold::Narrowed {
        cast,
        op_actor,
        output,
        to: to.clone(),
    })
}
