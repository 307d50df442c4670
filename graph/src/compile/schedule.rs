//! A static estimate of when each actor of one step would start: list scheduling of the
//! plan's actors on their streams with modeled costs, so that the orders the compiler
//! fixes (each comm stream's collective chain, each compute stream's memory-sharing chain)
//! follow the order a step runs in, not the order the graph was written in.
//!
//! Why: a data-parallel MLP's plan chained the all-reduce of `dW1` behind the all-gather of
//! `dW2` (graph order: layer 2's gradients are made first), while its compute stream ran
//! `dW1`'s product first (`dW2`'s waits for two collectives). `dW1`'s all-reduce, ready at
//! the end of the backward pass, then waited about 5 ms for `dW2`'s, and the next step's
//! first product for it: about 1 ms of every 17 ms step idle on each device (BENCHMARKS.md,
//! issue 13, "twelfth").
//!
//! The estimate needs no accuracy, only the right order of magnitude between ops, and that
//! only holds for one kind of device: products at 50 multiply-adds per nanosecond,
//! everything else at 10 bytes per nanosecond (read plus written), an in-process collective
//! at 5 bytes per nanosecond of its tensor, and 1 µs per firing on top: one core of the
//! AVX-512 hosts this was measured on. So it is used only for plans whose devices are all
//! `cpu` ([`applies_to`]). On a GPU, NCCL and the kernels have other ratios, and a `sim`
//! plan gets its modeled times after it is compiled: ordered by this estimate, the `sim`
//! data-parallel benchmark went from 1.03× to 1.045× of its ideal step (BENCHMARKS.md,
//! issue 13, "twelfth"). Loop registers (preloaded) are not edges: one step is estimated.
//! Members of one collective are not synchronised in the estimate.

use crate::plan::{ActorKind, KernelConf, Plan};
use std::collections::BTreeSet;

/// Estimated cost of one firing besides its work, in nanoseconds.
const FIRING_NANOS: u64 = 1_000;

/// Whether the estimate's costs fit `plan`: every device a `cpu` (module docs).
pub(crate) fn applies_to(plan: &Plan) -> bool {
    plan.devices.iter().all(|d| d.kind == crate::plan::DeviceKind::Cpu)
}

/// Per actor, its estimated start in one step (nanoseconds), or `None` where the estimate
/// cannot place every actor (a cycle without a preloaded register, or a collective whose
/// members wait on one another: plans the compiler's later checks refuse anyway).
///
/// The members of one collective start together, when every member's input is made and
/// every member's stream is free, as a rendezvous does: so a collective that depends on
/// another, on any device, starts after it has ended, and ordering groups by their start
/// respects every dependency between them.
pub(crate) fn estimate_starts(plan: &Plan) -> Option<Vec<u64>> {
    let n = plan.actors.len();
    let mut preds = vec![0usize; n];
    let mut succs: Vec<Vec<usize>> = vec![Vec::new(); n];
    for desc in plan.regst_descs.iter().filter(|d| d.preloaded == 0) {
        let producer = desc.producer.index();
        for consumer in desc.consumers.iter().map(|c| c.index()).filter(|&c| c != producer) {
            preds[consumer] += 1;
            succs[producer].push(consumer);
        }
    }
    // Each collective member's group, and each group's members.
    let mut group_of: Vec<Option<usize>> = vec![None; n];
    let mut members: Vec<Vec<usize>> = Vec::new();
    let mut group_index: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for (a, actor) in plan.actors.iter().enumerate() {
        if let ActorKind::Compute { kernel: KernelConf::Collective(conf) } = &actor.kind {
            let g = *group_index.entry(conf.group.as_str()).or_insert_with(|| {
                members.push(Vec::new());
                members.len() - 1
            });
            members[g].push(a);
            group_of[a] = Some(g);
        }
    }
    let streams = plan.streams.len();
    let stream_of = |a: usize| plan.actors[a].stream.index();
    // Per stream: actors whose inputs will be made at a known time, (time, actor); those
    // that could start when the stream is free; when it is free. Collective members wait
    // apart, per group, until every member's inputs are made.
    let mut waiting: Vec<BTreeSet<(u64, usize)>> = vec![BTreeSet::new(); streams];
    let mut available: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); streams];
    let mut free = vec![0u64; streams];
    let mut ready_at = vec![0u64; n];
    let mut start = vec![u64::MAX; n];
    let mut members_ready = vec![0usize; members.len()];
    let mut groups_ready: BTreeSet<usize> = BTreeSet::new();
    let mut scheduled = 0usize;
    let make_ready = |a: usize,
                      waiting: &mut Vec<BTreeSet<(u64, usize)>>,
                      ready_at: &[u64],
                      members_ready: &mut Vec<usize>,
                      groups_ready: &mut BTreeSet<usize>| match group_of[a] {
        Some(g) => {
            members_ready[g] += 1;
            if members_ready[g] == members[g].len() {
                groups_ready.insert(g);
            }
        }
        None => {
            waiting[stream_of(a)].insert((ready_at[a], a));
        }
    };
    for a in (0..n).filter(|&a| preds[a] == 0) {
        make_ready(a, &mut waiting, &ready_at, &mut members_ready, &mut groups_ready);
    }
    loop {
        // What can start first: an actor on its stream, or a whole collective on its
        // members' streams (ties: the earliest made, so the graph's order decides).
        let mut next: Option<(u64, usize, Option<usize>)> = None;
        let mut consider = |candidate: (u64, usize, Option<usize>)| {
            if next.is_none_or(|(t, a, _)| (candidate.0, candidate.1) < (t, a)) {
                next = Some(candidate);
            }
        };
        for s in 0..streams {
            while let Some(&(at, a)) = waiting[s].first() {
                if at > free[s] {
                    break;
                }
                waiting[s].pop_first();
                available[s].insert(a);
            }
            match (available[s].first(), waiting[s].first()) {
                (Some(&a), _) => consider((free[s], a, None)),
                (None, Some(&(at, a))) => consider((at, a, None)),
                (None, None) => {}
            }
        }
        for &g in &groups_ready {
            let at = members[g].iter().map(|&m| ready_at[m].max(free[stream_of(m)])).max().unwrap_or(0);
            consider((at, members[g].iter().copied().min().unwrap_or(0), Some(g)));
        }
        let Some((at, a, group)) = next else { break };
        let started: Vec<usize> = match group {
            Some(g) => {
                groups_ready.remove(&g);
                members[g].clone()
            }
            None => {
                let s = stream_of(a);
                if !available[s].remove(&a) {
                    waiting[s].remove(&(ready_at[a], a));
                }
                vec![a]
            }
        };
        for a in started {
            start[a] = at;
            scheduled += 1;
            let end = at.saturating_add(cost(plan, a));
            free[stream_of(a)] = end;
            for &c in &succs[a] {
                ready_at[c] = ready_at[c].max(end);
                preds[c] -= 1;
                if preds[c] == 0 {
                    make_ready(c, &mut waiting, &ready_at, &mut members_ready, &mut groups_ready);
                }
            }
        }
    }
    (scheduled == n).then_some(start)
}

/// The modeled nanoseconds of one firing of actor `a` (module docs).
fn cost(plan: &Plan, a: usize) -> u64 {
    let actor = &plan.actors[a];
    let work = match &actor.kind {
        ActorKind::Compute { kernel: KernelConf::Op(conf) } => {
            let numel = |m: &crate::plan::TensorMeta| m.shape.numel() as f64;
            let bytes: usize = conf.inputs.iter().chain(&conf.outputs).map(|m| m.bytes()).sum();
            match (conf.op_type.contains("matmul"), conf.inputs.first(), conf.inputs.get(1), conf.outputs.first()) {
                // (m·k)·(k·n)·(m·n) = (m·k·n)²: the multiply-adds of any transposition.
                (true, Some(x), Some(y), Some(out)) => ((numel(x) * numel(y) * numel(out)).sqrt() / 50.0) as u64,
                _ => bytes as u64 / 10,
            }
        }
        ActorKind::Compute { kernel: KernelConf::Collective(conf) } => {
            (conf.shape.iter().product::<usize>() * conf.dtype.size()) as u64 / 5
        }
        _ => 0,
    };
    FIRING_NANOS + work
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{ActorKind, DeviceKind, KernelConf, PlanBuilder, StreamKind};

    /// Two streams: a long product on the first and a short chain on the second start when
    /// their inputs are made, and among actors ready together the earliest made goes first.
    #[test]
    fn actors_start_when_their_inputs_are_made_and_their_stream_is_free() {
        use crate::plan::ops::{MatMul, OpConf};
        use crate::plan::{DType, TensorMeta};
        let mut b = PlanBuilder::new();
        let device = b.device(0, DeviceKind::Cpu, 0);
        let (s0, s1) = (b.stream(device, StreamKind::Compute), b.stream(device, StreamKind::Comm));
        let noop = || ActorKind::Compute { kernel: KernelConf::Noop };
        // [100, 100] x [100, 100]: 10^6 multiply-adds, 20 µs at 50 per nanosecond.
        let meta = TensorMeta::new([100, 100], DType::F32);
        let product = OpConf::new(&MatMul::default(), vec![meta.clone(), meta.clone()], vec![0, 0], vec![meta]);
        let source = b.actor("source", s0, noop());
        let long = b.actor("long", s0, ActorKind::Compute { kernel: KernelConf::Op(product) });
        let short = b.actor("short", s1, noop());
        let after_short = b.actor("after_short", s0, noop());
        let after_long = b.actor("after_long", s0, noop());
        let out = b.regst("source.out", source, 4, 1);
        b.consume(long, out);
        b.consume(short, out);
        let long_out = b.regst("long.out", long, 4, 1);
        b.consume(after_long, long_out);
        let short_out = b.regst("short.out", short, 4, 1);
        b.consume(after_short, short_out);
        assert!(applies_to(b.plan_mut()));
        let starts = estimate_starts(b.plan_mut()).unwrap();
        assert_eq!(starts[source.index()], 0);
        assert_eq!(starts[long.index()], FIRING_NANOS);
        assert_eq!(starts[short.index()], FIRING_NANOS, "another stream, free at once");
        // Both wait for the product's stream; `after_short` was made first.
        let long_end = FIRING_NANOS + FIRING_NANOS + 20_000;
        assert_eq!(starts[after_short.index()], long_end);
        assert_eq!(starts[after_long.index()], long_end + FIRING_NANOS);
        // Any other kind of device keeps the graph's orders.
        b.plan_mut().devices[0].kind = DeviceKind::Sim;
        assert!(!applies_to(b.plan_mut()));
    }
}
