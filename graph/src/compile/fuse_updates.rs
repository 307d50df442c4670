//! Fused optimizer updates: a device's `update` actors whose gradients are ready together
//! become one `update_group` actor, which updates all their parameters in one firing and
//! one pass over their elements on all the device's threads (PyTorch's `fused=True`
//! AdamW, OneFlow's multi-tensor update). Results are bitwise those of one update per
//! parameter: every element is computed by the same formula from the same constants.
//!
//! Which updates fuse: compute actors of one stream running `update` with the same rule,
//! the same dtype, and the same learning-rate, step and gradient-scale registers, reading
//! no input through a window, whose gradients are ready at the same time: all made on the
//! update's own stream (a stream runs one firing after another, so waiting for the last of
//! them delays nothing another stream runs), or all made by one actor of another stream (a
//! gradient bucket's all-reduce). Gradients that arrive one by one from other streams
//! (each large weight's own all-reduce under data parallelism) keep one update each, so
//! each still runs as soon as its all-reduce lands, while the backward pass goes on;
//! except with a gradient scale (clipping by global norm, loss scaling): the scale comes
//! from every gradient's norm, so every update waits for all gradients anyway, and a
//! device's updates fuse whatever made their gradients.
//!
//! A group's outputs must be the merged actor's registers in plan order (a kernel's
//! outputs are its registers in that order), and no member may reach another within a
//! step (which would make the merged actor wait for itself): a group that breaks either
//! keeps its updates apart. Neither happens in plans the compiler makes today (an update's
//! outputs are made together, and what reads them belongs to the next step).
//!
//! On every device kind whose kernels have the op: cpu, sim and cuda (where a group is a
//! multi-tensor launch per 32 parameters instead of one launch per parameter,
//! `cuda/src/ops/optim/group.rs`).

use super::lower::{Lowering, Merges};
use crate::plan::{ActorIndex, ActorKind, DeviceKind, KernelConf, OpConf, Plan, RegstDescId, StreamIndex};
use regflow_plan::ops::{OpAttrs, Update, UpdateGroup};
use std::collections::BTreeMap;

/// When a member can run: once the gradient scale arrives (clipping's or loss scaling's
/// factor, made from every gradient's norm, so after all of them), else when its gradient
/// is ready: made on the update's own stream, or by one actor of another stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ready {
    WithTheScale,
    OnItsStream,
    MadeBy(ActorIndex),
}

/// What the members of one group share (see the module docs): stream, rule (its
/// attributes as JSON text), dtype, the learning-rate, step and scale registers, and when
/// their gradients are ready.
type GroupKey = (StreamIndex, String, String, Vec<RegstDescId>, Ready);

/// Fuses the updates of every cpu, sim and cuda device (module docs), unless the options
/// turn it off.
pub(crate) fn fuse_updates(low: &mut Lowering<'_>) {
    if !low.options.fuse_updates {
        return;
    }
    let plan = low.b.plan_mut();
    let groups = candidate_groups(plan);
    if groups.values().all(|m| m.len() < 2) {
        return;
    }
    // Every member has the lead's rule and scale input (the group's key says so).
    merge_groups(low, groups.into_values(), |first, members| {
        let Update(kind) = first.parse_attrs::<Update>().ok()?;
        let scaled = first.inputs.len() == 5 + kind.state_count();
        Some(Box::new(UpdateGroup { kind, params: members as u32, scaled }))
    });
}

/// Merges every group of `groups` of two or more members that can be one actor
/// ([`mergeable`]) into its first member, running the op `group_op` makes from the first
/// member's conf and the member count ([`Lowering::merge_op_actors`]; `None` leaves the
/// group apart), then drops the merged actors. Fused casts (`fuse_casts.rs`) merge the same
/// way.
pub(super) fn merge_groups(
    low: &mut Lowering<'_>,
    groups: impl IntoIterator<Item = Vec<ActorIndex>>,
    group_op: impl Fn(&OpConf, usize) -> Option<Box<dyn OpAttrs>>,
) {
    let plan = low.b.plan_mut();
    // Computed once for all groups (plans run to 10^5 actors, one group per device).
    let successors = plan.within_step_successors();
    let mut outputs_of = vec![Vec::new(); plan.actors.len()];
    for (r, desc) in plan.regst_descs.iter().enumerate() {
        outputs_of[desc.producer.index()].push(r);
    }
    let mut merges = Merges::new(plan);
    for members in groups.into_iter().filter(|m| m.len() > 1) {
        let Some(members) = mergeable(low.b.plan_mut(), &successors, &outputs_of, members) else { continue };
        let ActorKind::Compute { kernel: KernelConf::Op(first) } = &low.b.plan_mut().actors[members[0].index()].kind
        else {
            continue;
        };
        if let Some(op) = group_op(first, members.len()) {
            low.merge_op_actors(&members, op.as_ref(), &mut merges.into);
        }
    }
    low.drop_merged(&merges);
}

/// The update actors of cpu, sim and cuda devices, grouped by [`GroupKey`].
fn candidate_groups(plan: &Plan) -> BTreeMap<GroupKey, Vec<ActorIndex>> {
    let mut groups: BTreeMap<GroupKey, Vec<ActorIndex>> = BTreeMap::new();
    for (a, actor) in plan.actors.iter().enumerate() {
        let ActorKind::Compute { kernel: KernelConf::Op(conf) } = &actor.kind else { continue };
        let device = &plan.devices[plan.streams[actor.stream.index()].device.index()];
        if conf.op_type != "update" || !matches!(device.kind, DeviceKind::Cpu | DeviceKind::Sim | DeviceKind::Cuda) {
            continue;
        }
        let Ok(update) = conf.parse_attrs::<Update>() else { continue };
        let states = update.0.state_count();
        if !actor.windows.is_empty() || conf.inputs.len() < 4 + states {
            continue;
        }
        let register = |op_input: usize| actor.inputs[conf.input_map[op_input]];
        // lr, step and, when there is one, the gradient scale (the last input).
        let scaled = conf.inputs.len() == 5 + states;
        let mut shared = vec![register(2), register(3)];
        shared.extend(scaled.then(|| register(4 + states)));
        let grad_producer = plan.regst_descs[register(1).index()].producer;
        let ready = match (scaled, plan.actors[grad_producer.index()].stream == actor.stream) {
            (true, _) => Ready::WithTheScale,
            (false, true) => Ready::OnItsStream,
            (false, false) => Ready::MadeBy(grad_producer),
        };
        let key = (actor.stream, conf.attrs.to_string(), conf.dtype().to_string(), shared, ready);
        groups.entry(key).or_default().push(ActorIndex(a as u32));
    }
    groups
}

/// The members of a group, by their first output register, if they can be one actor (see
/// the module docs): their outputs follow one another in plan order, and none reaches
/// another within a step.
fn mergeable(
    plan: &Plan,
    successors: &[Vec<usize>],
    outputs_of: &[Vec<usize>],
    mut members: Vec<ActorIndex>,
) -> Option<Vec<ActorIndex>> {
    members.sort_by_key(|m| outputs_of[m.index()].first().copied());
    let in_order: Vec<usize> = members.iter().flat_map(|m| outputs_of[m.index()].iter().copied()).collect();
    let output_counts_fit = members.iter().all(|&m| {
        let ActorKind::Compute { kernel: KernelConf::Op(conf) } = &plan.actors[m.index()].kind else { return false };
        outputs_of[m.index()].len() == conf.outputs.len()
    });
    if !output_counts_fit || !in_order.windows(2).all(|pair| pair[0] < pair[1]) {
        return None;
    }
    // Whether some member reaches another through registers of the same step.
    let mut is_member = vec![false; plan.actors.len()];
    members.iter().for_each(|m| is_member[m.index()] = true);
    let mut seen = vec![false; plan.actors.len()];
    let mut stack: Vec<usize> = members.iter().flat_map(|m| successors[m.index()].iter().copied()).collect();
    while let Some(a) = stack.pop() {
        if std::mem::replace(&mut seen[a], true) {
            continue;
        }
        if is_member[a] {
            return None;
        }
        stack.extend(successors[a].iter().copied());
    }
    Some(members)
}
