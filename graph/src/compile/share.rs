//! Memory sharing: lifetimes from one topological order of the compute actors, offsets
//! from the greedy planner, and the ordering chain that makes them hold. Applies to plans
//! of one micro-batch per step (a pipeline keeps several micro-batches' activations, which
//! one order cannot serve).

use super::error::CompileError;
use crate::plan::{ActorIndex, ActorKind, PlanBuilder, PlanIndex, RegstDesc, RegstDescId};
use std::collections::BTreeMap;

/// Lets one-slot activation registers whose lifetimes do not overlap share memory.
///
/// Lifetimes are positions in one topological order of the compute actors, so that order
/// must be the order they run in: the actors are chained by zero-byte ordering registers,
/// and the last one hands a preloaded token back to the first, so step k + 1 starts only
/// when step k has finished. On one stream that costs nothing (it runs serially anyway).
/// Registers read by a sink, fed inputs and variables keep memory of their own.
///
/// `starts`: one step's estimated schedule ([`schedule`](super::schedule)), where the
/// compiler has one; the order then runs each actor where the step would start it.
pub(crate) fn share_memory(
    b: &mut PlanBuilder,
    constants: &[RegstDescId],
    starts: Option<&[u64]>,
) -> Result<(), CompileError> {
    let plan = b.plan_mut().clone();
    let computes: Vec<usize> = (0..plan.actors.len()).filter(|&a| is_compute(&plan, a)).collect();
    if computes.is_empty() {
        return Ok(());
    }
    // Topological order of the compute actors over registers that are not preloaded
    // (Kahn's algorithm; ties by creation order, so the result is deterministic).
    let index = PlanIndex::new(&plan);
    // The registers `a` produces that order actors (those not preloaded).
    let ordering_outputs = |a: usize| {
        index.outputs_of(ActorIndex(a as u32)).iter().map(|r| &plan.regst_descs[r.index()]).filter(|d| d.preloaded == 0)
    };
    // With collectives (a parallel plan), a device's chain must not make its stream wait
    // for communication while it has other work.
    let order = match (computes.iter().any(|&a| plan.collective_conf(a).is_some()), starts) {
        (false, _) => topological(&plan, &computes, &ordering_outputs, |a| (0, 0, a))?,
        // The estimate knows when each actor's inputs are made, collectives included: the
        // stream runs what is ready, not what was written first.
        (true, Some(starts)) => {
            let at = |a: usize| starts.get(a).map_or(usize::MAX, |&s| usize::try_from(s).unwrap_or(usize::MAX));
            topological(&plan, &computes, &ordering_outputs, |a| (at(a), 0, a))?
        }
        (true, None) => by_collective_waits(&plan, &computes, &ordering_outputs)?,
    };
    let mut position = vec![usize::MAX; plan.actors.len()];
    for (p, &a) in order.iter().enumerate() {
        position[a] = p;
    }
    // One chain per compute stream (one per device in a parallel plan), in that order:
    // collectives on comm streams and copies on copy streams stay outside the chains, so
    // they still overlap, and the global order keeps every chain consistent with them.
    // Copies on a compute stream (`ParallelOptions::copy_streams`) are in its chain, at
    // their place in the global order, after the producer they copy from.
    let mut streams: Vec<crate::plan::StreamIndex> = Vec::new();
    for &a in &order {
        let stream = plan.actors[a].stream;
        if plan.streams[stream.index()].kind == crate::plan::StreamKind::Compute && !streams.contains(&stream) {
            streams.push(stream);
        }
    }
    let single = streams.len() == 1;
    for stream in streams {
        let chain: Vec<usize> = order.iter().copied().filter(|&a| plan.actors[a].stream == stream).collect();
        let on_chain = |a: usize| plan.actors[a].stream == stream && is_compute(&plan, a);
        // Which registers share, and their lifetimes [producer, last reader].
        let mut shared: Vec<(RegstDescId, u64, std::ops::Range<u32>)> = Vec::new();
        for (r, desc) in plan.regst_descs.iter().enumerate() {
            let readers_in_chain = desc.consumers.iter().all(|c| on_chain(c.index()));
            if !on_chain(desc.producer.index())
                || desc.register_num != 1
                || desc.preloaded != 0
                || desc.bytes == 0
                || !readers_in_chain
                // A constant variable's slots hold its value for the whole job.
                || constants.contains(&RegstDescId(r as u32))
                // A weight's updated part that may lie within the gathered weight instead.
                || may_gather_in_place(&plan, &index, RegstDescId(r as u32))
            {
                continue;
            }
            let start = position[desc.producer.index()] as u32;
            let end = desc.consumers.iter().map(|c| position[c.index()] as u32).max().unwrap_or(start) + 1;
            shared.push((RegstDescId(r as u32), desc.bytes, start..end));
        }
        let blocks: Vec<(u64, std::ops::Range<u32>)> =
            shared.iter().map(|(_, bytes, live)| (*bytes, live.clone())).collect();
        let layout = regflow_memory::ReusedLayout::plan(&blocks)
            .map_err(|e| CompileError::MemorySharing { reason: e.to_string() })?;
        for (i, (regst, _, _)) in shared.iter().enumerate() {
            b.plan_mut().regst_descs[regst.index()].shared_offset = Some(layout.offset(i));
        }
        // The chain that makes the order real, closed by the step token. A lone actor is
        // its own order (and a token it both reads and writes would hold its one slot).
        if chain.len() < 2 {
            continue;
        }
        for pair in chain.windows(2) {
            let (before, after) = (ActorIndex(pair[0] as u32), ActorIndex(pair[1] as u32));
            let name = format!("order:{}", plan.actors[pair[0]].name);
            let token = b.regst(&name, before, 0, 1);
            b.consume(after, token);
        }
        if let (Some(&first), Some(&last)) = (chain.first(), chain.last()) {
            let name = if single { "step_token".to_string() } else { format!("step_token@{}", stream.0) };
            let token = b.regst(&name, ActorIndex(last as u32), 0, 1);
            b.preload(token, 1);
            b.consume(ActorIndex(first as u32), token);
        }
    }
    write_updates_in_place(b);
    Ok(())
}

/// Marks every loop register its update may write in place ([`in_place_registers`]) and
/// every sharded weight its all-gather may gather in place ([`gather_in_place`]).
///
/// A plan of one micro-batch per step calls it from [`share_memory`], after the chains
/// that order its readers. A plan of several (gradient accumulation, pipeline stages) has
/// no such chains and shares no activation memory, but its updates still qualify where
/// the graph itself orders every reader before the update: each micro-batch reads the
/// step's weight through a repeat, and each of those reads feeds the accumulated gradient
/// the update waits for ([`InPlaceCheck`](crate::plan::InPlaceCheck) follows repeats).
/// Without it each parameter and state keeps two buffers and every update copies all of
/// them first (BENCHMARKS.md, issue 13, "twenty-sixth").
pub(crate) fn write_updates_in_place(b: &mut PlanBuilder) {
    for regst in in_place_registers(b.plan_mut()) {
        b.plan_mut().regst_descs[regst.index()].aliased_slots = true;
    }
    gather_in_place(b.plan_mut());
}

/// Sharded weights gathered in place: where a weight's loop register is made by an
/// all-gather of its updated parts (sharded optimizer state), the update writes its part
/// where that part lies in the weight ([`RegstDesc::within`](crate::plan::RegstDesc)), the
/// all-gather copies only the other parts, and the weight is one buffer. Per device that
/// saves a copy of its part (by the update, from the weight into its own output) and a
/// second (by the all-gather, back), and a weight's second slot plus the part's register.
///
/// Chosen by the rule plan validation enforces
/// ([`InPlaceCheck::check_within`](crate::plan::InPlaceCheck::check_within)): all of them are
/// marked, each is checked on its own against the chains just built, and those the rule
/// refuses (a reader of the weight that the chain puts after its update, devices of several
/// nodes, other kinds of device), with every other member of their group, go back to two
/// slots and a part of their own.
fn gather_in_place(plan: &mut crate::plan::Plan) {
    use crate::plan::Within;
    let mut marked = Vec::new();
    let index = PlanIndex::new(plan);
    for t in 0..plan.regst_descs.len() {
        let target = &plan.regst_descs[t];
        // The all-gather's output, not the order tokens it also writes.
        if index.outputs_of(target.producer).first() != Some(&RegstDescId(t as u32)) || target.bytes == 0 {
            continue;
        }
        // An all-gather along dimension 0 (the only collective with an own part in place).
        let Some(conf) = plan.collective_conf(target.producer.index()) else { continue };
        let Some(own) = conf.own_part_bytes() else { continue };
        let Some(&view) = plan.actors[target.producer.index()].inputs.first() else { continue };
        let part = &plan.regst_descs[view.index()];
        // Read by this all-gather alone (a part gathered twice is no one place's part), into
        // a loop register.
        if !may_gather_in_place(plan, &index, view)
            || target.aliased_slots
            || target.shared_offset.is_some()
            || part.within.is_some()
            || part.aliased_slots
            || part.shared_offset.is_some()
        {
            continue;
        }
        marked.push((view, RegstDescId(t as u32), own.start, conf.group.clone(), conf.size as usize, conf.rank));
    }
    for (view, target, offset, ..) in &marked {
        plan.regst_descs[target.index()].aliased_slots = true;
        plan.regst_descs[view.index()].within = Some(Within { regst: *target, offset: *offset });
    }
    // A group gathers in place on all its members or on none, so that its devices hold the
    // same bytes (a part that only some members read through a window, others through a
    // copy, as an offset that is no multiple of 64 bytes makes it, stays a part of its own).
    let accepted: std::collections::HashSet<String> = {
        let index = PlanIndex::new(plan);
        let mut rule = crate::plan::InPlaceCheck::new(plan, &index);
        let mut members: std::collections::HashMap<&str, (usize, usize, bool)> = std::collections::HashMap::new();
        for (view, _, _, group, size, _) in &marked {
            let entry = members.entry(group.as_str()).or_insert((0, *size, true));
            entry.0 += 1;
            entry.2 &= rule.check_within(*view).is_ok();
        }
        members.into_iter().filter(|&(_, (n, size, ok))| ok && n == size).map(|(g, _)| g.to_string()).collect()
    };
    let mut gathered: BTreeMap<String, Vec<(u32, RegstDescId, RegstDescId)>> = BTreeMap::new();
    for (view, target, _, group, _, rank) in marked {
        if accepted.contains(&group) {
            gathered.entry(group).or_default().push((rank, target, view));
        } else {
            plan.regst_descs[target.index()].aliased_slots = false;
            plan.regst_descs[view.index()].within = None;
        }
    }
    hold_gathered_once(plan, gathered);
}

/// Weights gathered in place by every member of their all-gather are held once for the
/// process ([`RegstDesc::home`](crate::plan::RegstDesc)): rank 0's gathered weight is the
/// buffer of every member's, each member's update writes its part there, and the all-gather
/// copies nothing (its members only meet, so that no device reads the weight before every
/// part is written). Per device that saves copying the other members' parts every step, and
/// the bytes of a weight on every device but one; and the devices' products read one copy
/// of the weight from the caches they share. Data-parallel MLP with sharded AdamW state on
/// two cpu devices: 1.63–1.75× → 1.80–1.89× one device (BENCHMARKS.md, issue 13, "twenty-seventh").
///
/// In-process cpu devices share the host's memory, so the weight is the same bytes on
/// every device anyway; what the plan must still make sure of is that no member's update
/// writes its part while another device's reader still reads those bytes
/// ([`InPlaceCheck::check_within`](crate::plan::InPlaceCheck::check_within): a collective
/// both devices take part in lies between them). A group any member of which the rule
/// refuses keeps a weight per device.
fn hold_gathered_once(plan: &mut crate::plan::Plan, groups: BTreeMap<String, Vec<(u32, RegstDescId, RegstDescId)>>) {
    let groups: Vec<Vec<(u32, RegstDescId, RegstDescId)>> = groups
        .into_values()
        .filter(|members| members.len() > 1)
        .map(|mut members| {
            members.sort_unstable_by_key(|&(rank, ..)| rank);
            members
        })
        .collect();
    for members in &groups {
        let home = members[0].1;
        for &(_, target, _) in &members[1..] {
            plan.regst_descs[target.index()].home = Some(home);
        }
    }
    let refused: Vec<&Vec<(u32, RegstDescId, RegstDescId)>> = {
        let index = PlanIndex::new(plan);
        let mut rule = crate::plan::InPlaceCheck::new(plan, &index);
        groups
            .iter()
            .filter(|members| {
                !members.iter().all(|&(rank, target, view)| {
                    (rank == members[0].0 || rule.check_home(target).is_ok()) && rule.check_within(view).is_ok()
                })
            })
            .collect()
    };
    for members in refused {
        for &(_, target, _) in members {
            plan.regst_descs[target.index()].home = None;
        }
    }
}

/// Whether `part` is read by one all-gather alone, as its own part of a loop register (a
/// weight gathered after its sharded update): [`gather_in_place`] may put it within that
/// register, so it keeps out of the shared memory (only collectives on the compute streams,
/// `CollectiveStreams::ComputeStreams`, put such a reader on the chain).
fn may_gather_in_place(plan: &crate::plan::Plan, index: &PlanIndex<'_>, part: RegstDescId) -> bool {
    let desc = &plan.regst_descs[part.index()];
    let [gather] = desc.consumers.as_slice() else { return false };
    let own_part = plan.collective_conf(gather.index()).is_some_and(|conf| conf.own_part_bytes().is_some());
    let output = index.outputs_of(*gather).first().map(|o| &plan.regst_descs[o.index()]);
    own_part && plan.actors[gather.index()].inputs.first() == Some(&part) && output.is_some_and(|o| o.preloaded == 1)
}

/// The loop registers (one preloaded slot) that may be one buffer their update writes in
/// place ([`RegstDesc::aliased_slots`](crate::plan::RegstDesc)), by the rule plan
/// validation enforces ([`InPlaceCheck`](crate::plan::InPlaceCheck)): one buffer instead
/// of two for each parameter and optimizer state, and an update that reads and writes the
/// same cache lines instead of streaming into the other slot (AdamW is memory-bound).
///
/// The chains just built are what makes the rule hold: every other reader of step k's
/// value comes before the update in its stream's chain. A fetched weight or a 16-bit one
/// keeps two buffers, and a weight written by its all-gather (sharded state) is left to
/// [`gather_in_place`]; each of an update's registers qualifies on its own (with sharded
/// state the moments go in place here).
fn in_place_registers(plan: &crate::plan::Plan) -> Vec<RegstDescId> {
    let index = PlanIndex::new(plan);
    let mut rule = crate::plan::InPlaceCheck::new(plan, &index);
    (0..plan.regst_descs.len() as u32)
        .map(RegstDescId)
        .filter(|r| {
            let desc = &plan.regst_descs[r.index()];
            desc.preloaded == 1 && desc.bytes > 0 && rule.check(*r).is_ok()
        })
        .collect()
}

/// Without an estimated schedule: an actor that depends on more collectives goes later,
/// and among those waiting on collectives, the one whose collective is issued first goes
/// first (a data-parallel step updates each weight as its all-reduce lands, after the whole
/// backward pass).
fn by_collective_waits<'p, I: Iterator<Item = &'p RegstDesc>>(
    plan: &crate::plan::Plan,
    computes: &[usize],
    ordering_outputs: &impl Fn(usize) -> I,
) -> Result<Vec<usize>, CompileError> {
    let order = topological(plan, computes, ordering_outputs, |a| (0, 0, a))?;
    let mut position = vec![0usize; plan.actors.len()];
    for (p, &a) in order.iter().enumerate() {
        position[a] = p;
    }
    // (collectives on a path to it, latest position of such a collective)
    let mut waits = vec![(0usize, 0usize); plan.actors.len()];
    for &a in &order {
        let own = if plan.collective_conf(a).is_some() { (waits[a].0 + 1, position[a] + 1) } else { waits[a] };
        for desc in ordering_outputs(a) {
            for c in desc.consumers.iter().map(|c| c.index()).filter(|&c| is_compute(plan, c)) {
                waits[c] = (waits[c].0.max(own.0), waits[c].1.max(own.1));
            }
        }
        waits[a] = own;
    }
    topological(plan, computes, ordering_outputs, |a| (waits[a].0, waits[a].1, a))
}

/// Kahn's algorithm over the compute actors and the registers that are not preloaded
/// (`ordering_outputs` of an actor), taking the ready actor with the smallest `priority`
/// first.
fn topological<'p, I: Iterator<Item = &'p RegstDesc>>(
    plan: &crate::plan::Plan,
    computes: &[usize],
    ordering_outputs: &impl Fn(usize) -> I,
    priority: impl Fn(usize) -> (usize, usize, usize),
) -> Result<Vec<usize>, CompileError> {
    let mut indegree = vec![0usize; plan.actors.len()];
    for desc in plan.regst_descs.iter().filter(|d| d.preloaded == 0 && is_compute(plan, d.producer.index())) {
        for c in desc.consumers.iter().filter(|c| is_compute(plan, c.index())) {
            indegree[c.index()] += 1;
        }
    }
    let mut ready: std::collections::BTreeSet<((usize, usize, usize), usize)> =
        computes.iter().copied().filter(|&a| indegree[a] == 0).map(|a| (priority(a), a)).collect();
    let mut order = Vec::with_capacity(computes.len());
    while let Some((_, a)) = ready.pop_first() {
        order.push(a);
        for desc in ordering_outputs(a) {
            for c in desc.consumers.iter().filter(|c| is_compute(plan, c.index())) {
                indegree[c.index()] -= 1;
                if indegree[c.index()] == 0 {
                    ready.insert((priority(c.index()), c.index()));
                }
            }
        }
    }
    if order.len() != computes.len() {
        return Err(CompileError::invariant("the compute actors form a cycle without a preloaded register"));
    }
    Ok(order)
}

/// Whether actor `a` runs a kernel (an op or a collective member), and so takes part in the
/// orders.
fn is_compute(plan: &crate::plan::Plan, a: usize) -> bool {
    matches!(plan.actors[a].kind, ActorKind::Compute { .. })
}
