//! Collective order. A collective blocks its comm stream until its whole group has
//! arrived, as NCCL does, so every device must issue a stream's collectives in one order.
//! They are ordered by when their input is made: in one step's estimated schedule
//! ([`schedule`](super::schedule)) where the compiler has one (a `cpu` plan of one
//! micro-batch per step), else by the producing op's position in the graph, then
//! creation. Each stream's collectives are chained in that order by zero-byte registers
//! closed by a preloaded token, except on a cpu compute stream whose memory-sharing chain
//! (made from the same estimate, [`share`](super::share)) orders them with everything
//! else it runs; `Plan::check_collective_order` verifies any plan. The
//! estimate is one schedule of the whole plan in which a group's members start together, so
//! the order follows every dependency between collectives and is the same on every device.

use super::lower::Lowering;
use crate::plan::ActorIndex;
use std::collections::HashMap;

/// Which comm stream of its device a collective runs on. A collective holds its stream
/// until its group arrives, so collectives that 1F1B interleaves differently on different
/// stages must not share a stream: forward collectives of micro-batch j + 1 run while
/// backward ones of micro-batch j wait for their gradients. Each phase keeps its own
/// stream (thread) and its own order; per-step collectives (of averaged gradients) a third.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Phase {
    Forward,
    Backward,
    Step,
}

/// A collective actor and its place in its device's order.
#[derive(Debug)]
pub(crate) struct Issued {
    /// (when its input is made, creation number): the global order.
    pub(crate) key: (usize, usize),
    /// Its device slot.
    pub(crate) slot: usize,
    pub(crate) phase: Phase,
    pub(crate) actor: ActorIndex,
}

/// Chains every comm stream's collectives in the global order, closed by a token back to
/// the first, so every device issues them in one order step after step (or micro-batch
/// after micro-batch). Returns the collective groups in that order.
pub(crate) fn order_collectives(low: &mut Lowering<'_>, starts: Option<&[u64]>) -> Vec<String> {
    // Where the estimate is, every member of a group starts when the group does.
    let start_of = |actor: ActorIndex| starts.map_or(0, |starts| starts[actor.index()]);
    low.issued.sort_by_key(|i| (start_of(i.actor), i.key));
    let plan = low.b.plan_mut();
    let group_start: HashMap<String, u64> = low
        .issued
        .iter()
        .filter_map(|i| plan.collective_conf(i.actor.index()).map(|conf| (conf.group.clone(), start_of(i.actor))))
        .collect();
    // Chains in order of their first collective, found by stream.
    let mut chains: Vec<((usize, Phase), Vec<ActorIndex>)> = Vec::new();
    let mut chain_of: HashMap<(usize, Phase), usize> = HashMap::new();
    // Collectives on a cpu device's compute stream share one stream whatever their phase,
    // so they share one chain (one micro-batch per step: all fire once per step).
    let inline = low.collectives_on_compute;
    let cpu: Vec<bool> = low.placement.devices.iter().map(|d| d.kind == crate::plan::DeviceKind::Cpu).collect();
    for i in &low.issued {
        let phase = if inline && cpu.get(i.slot).copied().unwrap_or(false) { Phase::Step } else { i.phase };
        let k = *chain_of.entry((i.slot, phase)).or_insert_with(|| {
            chains.push(((i.slot, phase), Vec::new()));
            chains.len() - 1
        });
        chains[k].1.push(i.actor);
    }
    // On a compute stream whose actors the memory-sharing chain will order (one
    // micro-batch, memory reuse on, an estimated schedule), that chain, made from the same
    // estimate, orders the collectives too: a chain of their own would only add registers
    // and messages (`Plan::check_collective_order` checks the order either way).
    let memory_chained = inline && low.options.reuse_memory && low.facts.micro_batches == 1 && starts.is_some();
    for ((slot, phase), chain) in chains {
        let (Some(&first), Some(&last)) = (chain.first(), chain.last()) else { continue };
        if chain.len() < 2 || (memory_chained && cpu.get(slot).copied().unwrap_or(false)) {
            continue;
        }
        for pair in chain.windows(2) {
            let token = low.b.regst(&format!("comm_order@{slot}:{}", pair[0].0), pair[0], 0, 1);
            low.b.consume(pair[1], token);
        }
        let token = low.b.regst(&format!("comm_token@{slot}:{phase:?}"), last, 0, 1);
        low.b.preload(token, 1);
        low.b.consume(first, token);
    }
    let mut groups = std::mem::take(&mut low.groups);
    groups.sort_by_key(|(key, group)| (group_start.get(group).copied().unwrap_or(0), *key));
    groups.into_iter().map(|(_, g)| g).collect()
}
