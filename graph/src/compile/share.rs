//! Memory sharing in compiled plans: lifetimes from one topological order of the compute
//! actors, offsets from the greedy planner, and the ordering chain that makes them hold.

use super::b_plan_regst;
use crate::plan::{ActorKind, PlanBuilder, RegstDescId};

/// Lets one-slot activation registers whose lifetimes do not overlap share memory.
///
/// Lifetimes are positions in one topological order of the compute actors, so that order
/// must be the order they run in: the actors are chained by zero-byte ordering registers,
/// and the last one hands a preloaded token back to the first, so step k + 1 starts only
/// when step k has finished. On one stream that costs nothing (it runs serially anyway).
/// Registers read by a sink, fed inputs and variables keep memory of their own.
pub(super) fn share_memory(b: &mut PlanBuilder) -> Result<(), String> {
    use crate::plan::ActorIndex;
    let plan = b.plan_mut().clone();
    let is_compute = |a: usize| matches!(plan.actors[a].kind, ActorKind::Compute { .. });
    let computes: Vec<usize> = (0..plan.actors.len()).filter(|&a| is_compute(a)).collect();
    if computes.is_empty() {
        return Ok(());
    }
    // Topological order of the compute actors over registers that are not preloaded
    // (Kahn's algorithm; ties by creation order, so the result is deterministic).
    let mut indegree = vec![0usize; plan.actors.len()];
    for desc in plan.regst_descs.iter().filter(|d| d.preloaded == 0 && is_compute(d.producer.index())) {
        for c in desc.consumers.iter().filter(|c| is_compute(c.index())) {
            indegree[c.index()] += 1;
        }
    }
    let mut ready: std::collections::BTreeSet<usize> = computes.iter().copied().filter(|&a| indegree[a] == 0).collect();
    let mut order = Vec::with_capacity(computes.len());
    while let Some(a) = ready.pop_first() {
        order.push(a);
        for desc in plan.regst_descs.iter().filter(|d| d.preloaded == 0 && d.producer.index() == a) {
            for c in desc.consumers.iter().filter(|c| is_compute(c.index())) {
                indegree[c.index()] -= 1;
                if indegree[c.index()] == 0 {
                    ready.insert(c.index());
                }
            }
        }
    }
    if order.len() != computes.len() {
        return Err("the compute actors form a cycle without a preloaded register (broken invariant)".into());
    }
    let mut position = vec![usize::MAX; plan.actors.len()];
    for (p, &a) in order.iter().enumerate() {
        position[a] = p;
    }
    // Which registers share, and their lifetimes [producer, last reader].
    let mut shared: Vec<(RegstDescId, u64, std::ops::Range<u32>)> = Vec::new();
    for (r, desc) in plan.regst_descs.iter().enumerate() {
        let readers_in_chain = desc.consumers.iter().all(|c| is_compute(c.index()));
        if !is_compute(desc.producer.index())
            || desc.register_num != 1
            || desc.preloaded != 0
            || desc.bytes == 0
            || !readers_in_chain
        {
            continue;
        }
        let start = position[desc.producer.index()] as u32;
        let end = desc.consumers.iter().map(|c| position[c.index()] as u32).max().unwrap_or(start) + 1;
        shared.push((RegstDescId(r as u32), desc.bytes, start..end));
    }
    let blocks: Vec<(u64, std::ops::Range<u32>)> =
        shared.iter().map(|(_, bytes, live)| (*bytes, live.clone())).collect();
    let layout = regflow_memory::ReusedLayout::plan(&blocks).map_err(|e| e.to_string())?;
    for (i, (regst, _, _)) in shared.iter().enumerate() {
        b_plan_regst(b, *regst).shared_offset = Some(layout.offset(i));
    }
    // The chain that makes the order real, closed by the step token.
    for pair in order.windows(2) {
        let (before, after) = (ActorIndex(pair[0] as u32), ActorIndex(pair[1] as u32));
        let name = format!("order:{}", plan.actors[pair[0]].name);
        let token = b.regst(&name, before, 0, 1);
        b.consume(after, token);
    }
    let (first, last) = (ActorIndex(order[0] as u32), ActorIndex(order[order.len() - 1] as u32));
    let token = b.regst("step_token", last, 0, 1);
    b.preload(token, 1);
    b.consume(first, token);
    Ok(())
}
