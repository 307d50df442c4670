//! Fused casts: mixed precision casts every weight to bf16 (or f16) at each step's start
//! and every weight's gradient back to f32 for the update, one `cast` actor each: GPT-2
//! 124M has 145 of each (its products' weights and biases, and the tied table), 290 small
//! casts per step of 3–10 µs on a GPU, more launch than work; fused, 289 of them run as two
//! groups (the table's gradient cast is read by an add, the embedding's gradient, and stays
//! alone). A device's casts that are ready together, or whose results are awaited together,
//! become one `cast_group` actor, which converts every member in one firing (on CUDA one
//! multi-tensor launch per 32 members, `cuda/src/ops/cast.rs`). Each element is converted
//! by the same function as one `cast`'s, so the bits do not change.
//!
//! Which casts fuse: compute actors of one stream running `cast` between f32 and bf16 or
//! f16 (either way), reading no input through a window, that
//! - read registers made by one actor (`Together::MadeBy`): the weights, written together
//!   by the previous step's fused update, so grouping delays none of them; or else
//! - write registers read by exactly the same actors (`Together::ReadBy`): the gradients,
//!   all read by the device's fused update (and its fused norm). Each of those readers
//!   waits for every member anyway, so converting them all once the last is ready delays
//!   no reader. Under data parallelism the all-reduces read the bf16 gradients, before
//!   their casts (half the bytes), so grouping the casts after them holds none back; a
//!   cast whose result a collective of its own read would have readers of its own, and
//!   keep its own actor.
//!
//! The cost is memory: a grouped gradient's bf16 input is kept until the last member's
//! gradient is made, where a lone cast freed it at once (half an f32 gradient per weight,
//! at the end of the backward pass, when activations are mostly gone).
//!
//! As with fused updates, a group's outputs must follow one another in plan order and no
//! member may reach another within a step; a group that breaks either stays apart
//! (`fuse_updates::merge_groups`).

use super::lower::Lowering;
use crate::plan::{
    ActorIndex, ActorKind, DType, DeviceKind, KernelConf, OpConf, Plan, PlanIndex, RegstDescId, StreamIndex, TensorMeta,
};
use regflow_plan::ops::{Binary, BinaryKind, Cast, CastGroup};
use std::collections::BTreeMap;

/// Why members are ready together (module docs).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Together {
    /// Their inputs are made by this actor.
    MadeBy(ActorIndex),
    /// Their outputs are read by exactly these actors (sorted).
    ReadBy(Vec<ActorIndex>),
}

/// What the members of a group share: stream, the dtypes converted from and to (by name),
/// and why they are ready together.
type GroupKey = (StreamIndex, String, String, Together);

/// One fusable cast: its actor, its input's producer and its output's readers.
struct Candidate {
    actor: ActorIndex,
    key: (StreamIndex, String, String),
    made_by: ActorIndex,
    read_by: Vec<ActorIndex>,
}

/// Fuses the casts of every cpu, sim and cuda device (module docs), unless the options
/// turn it off.
pub(crate) fn fuse_casts(low: &mut Lowering<'_>) {
    if !low.options.fuse_casts {
        return;
    }
    let plan = low.b.plan_mut();
    let groups = candidate_groups(plan);
    if groups.is_empty() {
        return;
    }
    super::fuse_updates::merge_groups(low, groups.into_values(), |first, members| {
        let Cast { to } = first.parse_attrs::<Cast>().ok()?;
        Some(Box::new(CastGroup { to, members: members as u32 }))
    });
}

/// The casts of cpu, sim and cuda devices in groups of two or more, by [`GroupKey`]: by
/// their inputs' producer first, the rest by their outputs' readers.
fn candidate_groups(plan: &Plan) -> BTreeMap<GroupKey, Vec<ActorIndex>> {
    let mut output_of = vec![None; plan.actors.len()];
    for (r, desc) in plan.regst_descs.iter().enumerate() {
        output_of[desc.producer.index()].get_or_insert(r);
    }
    let candidates: Vec<Candidate> =
        (0..plan.actors.len()).filter_map(|a| candidate(plan, ActorIndex(a as u32), output_of[a]?)).collect();
    let mut by_producer: BTreeMap<GroupKey, Vec<ActorIndex>> = BTreeMap::new();
    for c in &candidates {
        let (stream, from, to) = &c.key;
        by_producer.entry((*stream, from.clone(), to.clone(), Together::MadeBy(c.made_by))).or_default().push(c.actor);
    }
    by_producer.retain(|_, members| members.len() > 1);
    let taken: std::collections::HashSet<ActorIndex> = by_producer.values().flatten().copied().collect();
    let mut groups = by_producer;
    let mut by_readers: BTreeMap<GroupKey, Vec<ActorIndex>> = BTreeMap::new();
    for c in candidates.iter().filter(|c| !taken.contains(&c.actor) && !c.read_by.is_empty()) {
        let (stream, from, to) = &c.key;
        by_readers
            .entry((*stream, from.clone(), to.clone(), Together::ReadBy(c.read_by.clone())))
            .or_default()
            .push(c.actor);
    }
    groups.extend(by_readers.into_iter().filter(|(_, members)| members.len() > 1));
    groups
}

/// Actor `a`, whose first output register is `out`, as a fusable cast (module docs), or
/// `None`.
fn candidate(plan: &Plan, a: ActorIndex, out: usize) -> Option<Candidate> {
    let actor = &plan.actors[a.index()];
    let conf = plain_op(plan, a, "cast")?;
    let ([input], [output], [map]) = (&conf.inputs[..], &conf.outputs[..], &conf.input_map[..]) else { return None };
    let fusable_pair =
        (input.dtype == DType::F32 && output.dtype.is_half()) || (input.dtype.is_half() && output.dtype == DType::F32);
    if !fusable_pair {
        return None;
    }
    let register = *actor.inputs.get(*map)?;
    let made_by = plan.regst_descs[register.index()].producer;
    let mut read_by = plan.regst_descs[out].consumers.clone();
    read_by.sort();
    read_by.dedup();
    Some(Candidate {
        actor: a,
        key: (actor.stream, input.dtype.to_string(), output.dtype.to_string()),
        made_by,
        read_by,
    })
}

/// The op of actor `a` when it is a compute actor of a cpu, sim or cuda device (whose
/// kernels the cast passes know) running `op_type` that reads every register whole (no
/// windows).
pub(super) fn plain_op<'p>(plan: &'p Plan, a: ActorIndex, op_type: &str) -> Option<&'p OpConf> {
    let actor = &plan.actors[a.index()];
    let ActorKind::Compute { kernel: KernelConf::Op(conf) } = &actor.kind else { return None };
    let device = &plan.devices[plan.streams[actor.stream.index()].device.index()];
    let kernels = matches!(device.kind, DeviceKind::Cpu | DeviceKind::Sim | DeviceKind::Cuda);
    (kernels && conf.op_type == op_type && actor.windows.is_empty()).then_some(conf)
}

/// A plain `binary` add (see [`plain_op`]) of two different registers: what the folds of a
/// sum into the op beside it start from.
pub(super) struct PlainAdd<'i> {
    /// The operands' registers and metas, in the op's order.
    pub(super) operands: [RegstDescId; 2],
    pub(super) metas: [&'i TensorMeta; 2],
    /// Its output registers (in the op's order) and their metas: the sum, and for some a
    /// 16-bit copy of it (`fold_casts`).
    pub(super) outputs: &'i [RegstDescId],
    pub(super) output_metas: &'i [TensorMeta],
}

/// Actor `a` as a [`PlainAdd`], if it is one.
pub(super) fn plain_add<'i>(index: &'i PlanIndex<'_>, a: ActorIndex) -> Option<PlainAdd<'i>> {
    let plan = index.plan();
    let conf = plain_op(plan, a, "binary")?;
    let inputs = plan.actors[a.index()].inputs.as_slice();
    let (Binary(BinaryKind::Add), [x, y], &[i, j], 2) =
        (conf.parse_attrs::<Binary>().ok()?, &conf.inputs[..], &conf.input_map[..], inputs.len())
    else {
        return None;
    };
    let operands = [*inputs.get(i)?, *inputs.get(j)?];
    let outputs = index.outputs_of(a);
    (operands[0] != operands[1] && outputs.len() == conf.outputs.len()).then_some(PlainAdd {
        operands,
        metas: [x, y],
        outputs,
        output_metas: &conf.outputs,
    })
}
