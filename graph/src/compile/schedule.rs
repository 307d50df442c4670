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
//! only holds for one kind of device: an op's arithmetic (`OpDef::flops`, the figure the
//! layout chooser weighs: a product's multiply-adds, twice) at 100 per nanosecond, an op
//! without any at 10 bytes per nanosecond (read plus written), an in-process collective at
//! 5 bytes per nanosecond of its tensor, and 1 µs per firing on top: one core of the
//! AVX-512 hosts this was measured on. So it is used only for plans whose devices are all
//! `cpu` ([`applies_to`]). On a GPU, NCCL and the kernels have other ratios, and a `sim`
//! plan gets its modeled times after it is compiled: ordered by this estimate, the `sim`
//! data-parallel benchmark went from 1.03× to 1.045× of its ideal step (BENCHMARKS.md,
//! issue 13, "twelfth"). Loop registers (preloaded) are not edges: one step is estimated.

use super::lower::Lowering;
use crate::plan::{ActorKind, KernelConf, Plan};
use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap};

/// Estimated cost of one firing besides its work, in nanoseconds.
const FIRING_NANOS: u64 = 1_000;

/// Whether the estimate's costs fit `plan`: every device a `cpu` (module docs).
pub(crate) fn applies_to(plan: &Plan) -> bool {
    plan.devices.iter().all(|d| d.kind == crate::plan::DeviceKind::Cpu)
}

/// Per actor of the lowered plan, the arithmetic its op does on its local shapes
/// (`OpDef::flops`); 0 for actors that run no op of the graph.
pub(crate) fn actor_flops(low: &Lowering<'_>) -> Vec<f64> {
    let mut flops = Vec::new();
    for op_actors in &low.op_actors {
        let Some(local) = low.layouts.local.get(&op_actors.node) else { continue };
        for (actor, (op, inputs, outputs)) in op_actors.actors.iter().zip(local) {
            if flops.len() <= actor.index() {
                flops.resize(actor.index() + 1, 0.0);
            }
            // `+=`: a fused update runs the ops of several parameters.
            flops[actor.index()] += op.flops(inputs, outputs);
        }
    }
    flops
}

/// Per actor, its estimated start in one step (nanoseconds), or `None` where the estimate
/// cannot place every actor (a cycle without a preloaded register, or a collective whose
/// members wait on one another: plans the compiler's later checks refuse anyway). `flops`
/// is [`actor_flops`].
///
/// The members of one collective start together, when every member's input is made and
/// every member's stream is free, as a rendezvous does: so a collective that depends on
/// another, on any device, starts after it has ended, and ordering groups by their start
/// respects every dependency between them.
pub(crate) fn estimate_starts(plan: &Plan, flops: &[f64]) -> Option<Vec<u64>> {
    let mut schedule = ListSchedule::new(plan);
    let succs = plan.within_step_successors();
    let mut preds = vec![0usize; plan.actors.len()];
    for &c in succs.iter().flatten() {
        preds[c] += 1;
    }
    for a in (0..plan.actors.len()).filter(|&a| preds[a] == 0) {
        schedule.make_ready(a);
    }
    let mut scheduled = 0;
    while let Some((at, started)) = schedule.next_start() {
        for a in started {
            scheduled += 1;
            let end = at.saturating_add(cost(plan, flops, a));
            schedule.start(a, at, end);
            for &c in &succs[a] {
                schedule.ready_at[c] = schedule.ready_at[c].max(end);
                preds[c] -= 1;
                if preds[c] == 0 {
                    schedule.make_ready(c);
                }
            }
        }
    }
    (scheduled == plan.actors.len()).then_some(schedule.starts)
}

/// The state of [`estimate_starts`]: per stream, actors whose inputs will be made at a
/// known time, `(time, actor)`, those that could start as soon as the stream is free, and
/// when it is; collective members wait apart, per group, until every member's inputs are
/// made.
struct ListSchedule<'p> {
    plan: &'p Plan,
    waiting: Vec<BTreeSet<(u64, usize)>>,
    available: Vec<BTreeSet<usize>>,
    free: Vec<u64>,
    /// When each actor's inputs are made (so far).
    ready_at: Vec<u64>,
    starts: Vec<u64>,
    /// Each collective member's group, each group's members, how many of them are ready,
    /// and the groups all of whose members are, keyed by (when the group could start, its
    /// first member) as last computed. A group starts when its members' inputs are made
    /// and their streams are free, and streams only get free later, so a key is never
    /// past the group's true start: the least key, recomputed until it holds, is the
    /// group to start next. (Looking at every ready group on every start made compiling
    /// a 16-device plan with its collectives on the compute streams, where groups wait
    /// long for busy streams, take 35 % longer.)
    group_of: Vec<Option<usize>>,
    members: Vec<Vec<usize>>,
    members_ready: Vec<usize>,
    groups_ready: BinaryHeap<Reverse<(u64, usize, usize)>>,
}

impl<'p> ListSchedule<'p> {
    fn new(plan: &'p Plan) -> Self {
        let (n, streams) = (plan.actors.len(), plan.streams.len());
        let mut group_of = vec![None; n];
        let mut members: Vec<Vec<usize>> = Vec::new();
        let mut index: HashMap<&str, usize> = HashMap::new();
        for (a, group) in group_of.iter_mut().enumerate() {
            if let Some(conf) = plan.collective_conf(a) {
                let g = *index.entry(conf.group.as_str()).or_insert_with(|| {
                    members.push(Vec::new());
                    members.len() - 1
                });
                members[g].push(a);
                *group = Some(g);
            }
        }
        Self {
            plan,
            waiting: vec![BTreeSet::new(); streams],
            available: vec![BTreeSet::new(); streams],
            free: vec![0; streams],
            ready_at: vec![0; n],
            starts: vec![u64::MAX; n],
            group_of,
            members_ready: vec![0; members.len()],
            members,
            groups_ready: BinaryHeap::new(),
        }
    }

    fn stream_of(&self, a: usize) -> usize {
        self.plan.actors[a].stream.index()
    }

    /// (When group `g` could start now: its members' inputs made and their streams free,
    /// its first member, `g`).
    fn group_key(&self, g: usize) -> (u64, usize, usize) {
        let members = &self.members[g];
        let at = members.iter().map(|&m| self.ready_at[m].max(self.free[self.stream_of(m)])).max().unwrap_or(0);
        (at, members.iter().copied().min().unwrap_or(0), g)
    }

    /// Every input of `a` is made (at `ready_at[a]`).
    fn make_ready(&mut self, a: usize) {
        match self.group_of[a] {
            Some(g) => {
                self.members_ready[g] += 1;
                if self.members_ready[g] == self.members[g].len() {
                    let key = self.group_key(g);
                    self.groups_ready.push(Reverse(key));
                }
            }
            None => {
                let s = self.stream_of(a);
                self.waiting[s].insert((self.ready_at[a], a));
            }
        }
    }

    /// What can start first, and when: an actor on its stream, or a whole collective on
    /// its members' streams (ties: the earliest made, so the graph's order decides).
    fn next_start(&mut self) -> Option<(u64, Vec<usize>)> {
        let mut next: Option<(u64, usize, Option<usize>)> = None;
        let consider = |next: &mut Option<(u64, usize, Option<usize>)>, candidate: (u64, usize, Option<usize>)| {
            if next.is_none_or(|(t, a, _)| (candidate.0, candidate.1) < (t, a)) {
                *next = Some(candidate);
            }
        };
        for s in 0..self.free.len() {
            while let Some(&(at, a)) = self.waiting[s].first() {
                if at > self.free[s] {
                    break;
                }
                self.waiting[s].pop_first();
                self.available[s].insert(a);
            }
            match (self.available[s].first(), self.waiting[s].first()) {
                (Some(&a), _) => consider(&mut next, (self.free[s], a, None)),
                (None, Some(&(at, a))) => consider(&mut next, (at, a, None)),
                (None, None) => {}
            }
        }
        // The ready group that can start first: keys only fall behind, so refresh the least
        // until it is current, unless even its stale key loses to a stream's actor.
        while let Some(&Reverse(key)) = self.groups_ready.peek() {
            if next.is_some_and(|(t, a, _)| (t, a) < (key.0, key.1)) {
                break;
            }
            let now = self.group_key(key.2);
            if now == key {
                consider(&mut next, (key.0, key.1, Some(key.2)));
                break;
            }
            self.groups_ready.pop();
            self.groups_ready.push(Reverse(now));
        }
        let (at, a, group) = next?;
        let started = match group {
            Some(g) => {
                self.groups_ready.pop();
                self.members[g].clone()
            }
            None => {
                let s = self.stream_of(a);
                if !self.available[s].remove(&a) {
                    self.waiting[s].remove(&(self.ready_at[a], a));
                }
                vec![a]
            }
        };
        Some((at, started))
    }

    /// `a` runs from `at` to `end` on its stream.
    fn start(&mut self, a: usize, at: u64, end: u64) {
        self.starts[a] = at;
        let s = self.stream_of(a);
        self.free[s] = end;
    }
}

/// The modeled nanoseconds of one firing of actor `a` (module docs).
fn cost(plan: &Plan, flops: &[f64], a: usize) -> u64 {
    let work = match &plan.actors[a].kind {
        ActorKind::Compute { kernel: KernelConf::Op(conf) } => match flops.get(a).copied().unwrap_or(0.0) {
            0.0 => conf.inputs.iter().chain(&conf.outputs).map(|m| m.bytes()).sum::<usize>() as u64 / 10,
            arithmetic => (arithmetic / 100.0) as u64,
        },
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
        // [100, 100] x [100, 100]: 10^6 multiply-adds, 20 µs at 100 flops per nanosecond.
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
        let mut flops = vec![0.0; 5];
        flops[long.index()] = 2e6;
        let starts = estimate_starts(b.plan_mut(), &flops).unwrap();
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
