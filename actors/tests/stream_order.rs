//! The actor protocol on stream-ordered devices (`sim`, `cuda`), model-checked over random
//! schedules: a launch that nobody off its stream waits for completes at launch, and its
//! kernel runs later, when its stream gets to it. Every kernel must still read exactly the
//! bytes the protocol handed it: the last write to each slot it reads has run, and no later
//! write has.
//!
//! The model: stream 0 runs kernels at launch (a `cpu` stream); streams 1 and 2 queue them
//! and run them in launch order, one step of the schedule at a time, posting `ActDone` for
//! the launches that asked for completion. Each schedule step either delivers the oldest
//! message of a random stream or runs the oldest queued kernel of a random stream.

mod common;

use common::{count, Net, STREAMS};
use regflow_actors::{
    Actor, ActorEnv, ActorId, Body, Cmd, Completion, EnvError, Firing, Lifecycle, Message, PlanIds, RegstRef,
};
use regflow_plan::{ActorIndex, ActorKind, KernelConf, Plan, PlanIndex};
use std::collections::{HashMap, VecDeque};

const COPY: ActorKind = ActorKind::Compute { kernel: KernelConf::Copy };

/// A kernel queued on a stream: what it reads and writes, with the version of each slot
/// it expects to read (the writes the protocol ordered before it).
#[derive(Debug)]
struct Queued {
    actor: ActorId,
    reads: Vec<(RegstRef, u64)>,
    writes: Vec<RegstRef>,
    write_version: Vec<u64>,
    report: bool,
}

/// A stream-ordered device and message bus, with the slot versions it checks.
struct Model {
    /// Per stream, messages to its actors in arrival order.
    inboxes: Vec<VecDeque<Message>>,
    /// Per stream, kernels launched and not yet run, in launch order.
    queued: Vec<VecDeque<Queued>>,
    /// Per slot: the writes launched so far, and the last write that ran.
    issued: HashMap<RegstRef, u64>,
    ran: HashMap<RegstRef, u64>,
    /// Complete every launch at once (wrong: the negative control).
    ignore_wanted: bool,
    violations: Vec<String>,
    names: HashMap<ActorId, String>,
    /// The plan's stream index of each actor.
    streams: HashMap<ActorId, usize>,
}

impl Model {
    fn stream(&self, actor: ActorId) -> usize {
        self.streams[&actor]
    }

    fn run_kernel(&mut self, k: &Queued) {
        for &(slot, expected) in &k.reads {
            let ran = self.ran.get(&slot).copied().unwrap_or(0);
            if ran != expected {
                let name = &self.names[&k.actor];
                self.violations.push(format!("{name} read {slot:?} at version {ran}, expected {expected}"));
            }
        }
        for (&slot, &version) in k.writes.iter().zip(&k.write_version) {
            self.ran.insert(slot, version);
        }
    }
}

impl ActorEnv for Model {
    fn send(&mut self, msg: Message) -> Result<(), EnvError> {
        let stream = self.stream(msg.dst);
        self.inboxes[stream].push_back(msg);
        Ok(())
    }

    fn launch(&mut self, f: &Firing<'_>) -> Result<Completion, EnvError> {
        let reads = f.inputs.iter().map(|&r| (r, self.issued.get(&r).copied().unwrap_or(0))).collect();
        let mut write_version = Vec::new();
        for &w in f.outputs {
            let v = self.issued.entry(w).or_insert(0);
            *v += 1;
            write_version.push(*v);
        }
        let report = f.completion_wanted && !self.ignore_wanted;
        let k = Queued { actor: f.actor, reads, writes: f.outputs.to_vec(), write_version, report };
        let stream = self.stream(f.actor);
        if stream == 0 {
            self.run_kernel(&k);
            return Ok(Completion::Done);
        }
        self.queued[stream].push_back(k);
        Ok(if report { Completion::Pending } else { Completion::Done })
    }
}

/// Runs `plan` under the schedule of `seed`; returns the violations and the pieces each
/// sink read, or panics if the job does not finish.
fn run(plan: &Plan, seed: u64, ignore_wanted: bool) -> (Vec<String>, HashMap<String, u64>) {
    let ids = PlanIds::assign(plan).expect("ids fit");
    let index = PlanIndex::new(plan);
    let mut actors: HashMap<ActorId, Actor> = (0..plan.actors.len())
        .map(|i| Actor::from_plan(&index, &ids, ActorIndex(i as u32)))
        .map(|a| (a.id(), a))
        .collect();
    let names = actors.values().map(|a| (a.id(), a.name().to_string())).collect();
    let streams =
        plan.actors.iter().enumerate().map(|(i, d)| (ids.of(ActorIndex(i as u32)), d.stream.index())).collect();
    let mut model = Model {
        inboxes: vec![VecDeque::new(); STREAMS],
        queued: (0..STREAMS).map(|_| VecDeque::new()).collect(),
        issued: HashMap::new(),
        ran: HashMap::new(),
        ignore_wanted,
        violations: Vec::new(),
        names,
        streams,
    };
    for a in plan.actors.iter().filter(|a| matches!(a.kind, ActorKind::Source { .. })) {
        let id = ids.of(plan.actor_by_name(&a.name).expect("a source"));
        model.send(Message { dst: id, src: id, body: Body::Cmd(Cmd::Start) }).expect("queued");
    }
    let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move |n: usize| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % n as u64) as usize
    };
    for _ in 0..100_000 {
        // Work to do: a stream's next message, or a stream's next kernel.
        let mut choices: Vec<(bool, usize)> = Vec::new();
        choices.extend((0..STREAMS).filter(|&s| !model.inboxes[s].is_empty()).map(|s| (true, s)));
        choices.extend((0..STREAMS).filter(|&s| !model.queued[s].is_empty()).map(|s| (false, s)));
        if choices.is_empty() {
            break;
        }
        let (deliver, s) = choices[next(choices.len())];
        if deliver {
            let msg = model.inboxes[s].pop_front().expect("chosen non-empty");
            let actor = actors.get_mut(&msg.dst).expect("a known actor");
            actor.handle(&msg, &mut model).expect("no protocol error");
        } else {
            let k = model.queued[s].pop_front().expect("chosen non-empty");
            model.run_kernel(&k);
            if k.report {
                model.send(Message { dst: k.actor, src: k.actor, body: Body::ActDone }).expect("queued");
            }
        }
    }
    for a in actors.values() {
        assert_eq!(a.lifecycle(), Lifecycle::Done, "seed {seed}: {} did not finish: {:?}", a.name(), a.snapshot());
    }
    let sinks = actors
        .values()
        .filter(|a| plan.actors.iter().any(|d| d.name == a.name() && matches!(d.kind, ActorKind::Sink)))
        .map(|a| (a.name().to_string(), a.fires()))
        .collect();
    (model.violations, sinks)
}

/// A named test plan and the pieces each of its sinks must read.
type Case = (&'static str, Plan, Vec<(&'static str, u64)>);

/// Chains, fan-out, a repeat and an acc across a launch-time stream and two queued ones.
fn plans() -> Vec<Case> {
    let mut out = Vec::new();

    // A chain that stays on stream 1 for three kernels, then crosses to 2 and back to 0.
    let mut n = Net::new();
    let x = n.add("src", 0, count(6), &[], 2);
    let a = n.add("a", 1, COPY, &[x], 1);
    let b = n.add("b", 1, COPY, &[a], 2);
    let c = n.add("c", 1, COPY, &[b], 1);
    let d = n.add("d", 2, COPY, &[c], 1);
    n.sink("sink", 0, &[d]);
    out.push(("chain", n.build(), vec![("sink", 6)]));

    // Fan-out from stream 1 to consumers on 1 and 2, joined again on 2.
    let mut n = Net::new();
    let x = n.add("src", 0, count(5), &[], 1);
    let m = n.add("m", 1, COPY, &[x], 2);
    let near = n.add("near", 1, COPY, &[m], 1);
    let far = n.add("far", 2, COPY, &[m], 1);
    let join = n.add("join", 2, COPY, &[near, far], 1);
    n.sink("sink", 0, &[join]);
    out.push(("diamond", n.build(), vec![("sink", 5)]));

    // A repeat on stream 1 handing a register written on stream 2 to a reader whose other
    // peers are all on stream 1: the slot goes back to stream 2 through the repeat.
    let mut n = Net::new();
    let x = n.add("src", 0, count(3), &[], 1);
    let w = n.add("w", 2, COPY, &[x], 1);
    let r = n.add("rep", 1, ActorKind::Repeat { count: 3 }, &[w], 1);
    let u = n.add("use", 1, COPY, &[r], 1);
    let t = n.add("tail", 1, COPY, &[u], 1);
    n.sink("sink", 1, &[t]);
    out.push(("repeat", n.build(), vec![("sink", 9)]));

    // An acc on stream 1 (sums of 2; a partial last group) feeding stream 1 and 2.
    let mut n = Net::new();
    let x = n.add("src", 0, count(5), &[], 2);
    let a = n.add("a", 1, COPY, &[x], 1);
    let s = n.add("acc", 1, ActorKind::Acc { count: 2, kernel: KernelConf::SumF32 }, &[a], 1);
    let near = n.add("near", 1, COPY, &[s], 1);
    let far = n.add("far", 2, COPY, &[s], 1);
    n.sink("sink_near", 0, &[near]);
    n.sink("sink_far", 2, &[far]);
    out.push(("acc", n.build(), vec![("sink_near", 3), ("sink_far", 3)]));
    out
}

#[test]
fn stream_ordered_completion_never_lets_a_kernel_read_the_wrong_bytes() {
    for (name, plan, expected) in plans() {
        for seed in 0..300 {
            let (violations, sinks) = run(&plan, seed, false);
            assert!(violations.is_empty(), "{name}, seed {seed}: {violations:?}");
            for &(sink, pieces) in &expected {
                assert_eq!(sinks[sink], pieces, "{name}, seed {seed}: pieces at {sink}");
            }
        }
    }
}

/// The check can fail: a device that completes every launch at once, whoever waits, lets
/// some schedule read bytes that are not there yet.
#[test]
fn completing_every_launch_at_once_is_caught() {
    for (name, plan, _) in plans() {
        let caught = (0..300).any(|seed| !run(&plan, seed, true).0.is_empty());
        assert!(caught, "{name}: no schedule caught a read of unfinished bytes");
    }
}
