//! Actor protocol tests: every actor of a plan driven by one deterministic message loop.

mod common;

use common::{count, Net};

use regflow_actors::{
    Actor, ActorEnv, ActorError, ActorId, Body, Cmd, Completion, EnvError, Firing, GroupPosition, Lifecycle, Message,
    PlanIds, RegstRef, WaitReason,
};
use regflow_plan::{ActorIndex, ActorKind, KernelConf, Plan, PlanIndex, RegstDescId, SourcePieces};
use std::collections::{HashMap, VecDeque};

type Desc = RegstDescId;

const COPY: ActorKind = ActorKind::Compute { kernel: KernelConf::Copy };
const FED: ActorKind = ActorKind::Source { pieces: SourcePieces::Fed };
const FEED: Body = Body::Cmd(Cmd::Feed);
const CLOSE: Body = Body::Cmd(Cmd::CloseFeed);

fn acc(count: u32) -> ActorKind {
    let kernel = KernelConf::SumF32;
    ActorKind::Acc { count, kernel }
}

fn repeat(count: u32) -> ActorKind {
    ActorKind::Repeat { count }
}

fn msg(dst: ActorId, src: ActorId, body: Body) -> Message {
    Message { dst, src, body }
}

/// `src` (stream 0, output `regst#0` of `rs` slots) → `mid` (stream 1, `regst#1` of `rm`) →
/// `sink` (stream 2).
fn line(source: ActorKind, rs: u32, mid: &str, kind: ActorKind, rm: u32, pending: &[&str]) -> Harness {
    let mut net = Net::new();
    let x = net.add("src", 0, source, &[], rs);
    let y = net.add(mid, 1, kind, &[x], rm);
    net.sink("sink", 2, &[y]);
    Harness::new(net.build(), pending)
}

/// One launch as the kernel saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Fired {
    actor: ActorId,
    piece: u64,
    group: GroupPosition,
    inputs: Vec<RegstRef>,
    outputs: Vec<RegstRef>,
    completion_wanted: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Event {
    Deliver(Message),
    Send(Message),
    Launch(Fired),
}

/// Sends go to one global FIFO; launches of the actors in `asynchronous` stay pending until
/// their `ActDone` is posted. With `stream_ordered`, a launch nobody off its stream waits
/// for completes at once, as on `sim` and `cuda`.
#[derive(Debug, Default)]
struct Env {
    queue: VecDeque<Message>,
    log: Vec<Event>,
    asynchronous: Vec<ActorId>,
    in_flight: Vec<ActorId>,
    stream_ordered: bool,
}

impl ActorEnv for Env {
    fn send(&mut self, msg: Message) -> Result<(), EnvError> {
        self.log.push(Event::Send(msg));
        self.queue.push_back(msg);
        Ok(())
    }

    fn launch(&mut self, f: &Firing<'_>) -> Result<Completion, EnvError> {
        let (actor, piece, group) = (f.actor, f.piece, f.group);
        let (inputs, outputs) = (f.inputs.to_vec(), f.outputs.to_vec());
        let completion_wanted = f.completion_wanted;
        let fired = Fired { actor, piece, group, inputs, outputs, completion_wanted };
        self.log.push(Event::Launch(fired));
        if self.asynchronous.contains(&actor) && (completion_wanted || !self.stream_ordered) {
            self.in_flight.push(actor);
            return Ok(Completion::Pending);
        }
        Ok(Completion::Done)
    }
}

struct Harness {
    plan: Plan,
    ids: PlanIds,
    actors: HashMap<ActorId, Actor>,
    env: Env,
    /// (actor, lifecycle entered, log index of the delivery that caused it).
    transitions: Vec<(ActorId, Lifecycle, usize)>,
}

impl Harness {
    /// Builds every actor of `plan`; launches of the actors named in `pending` complete later.
    fn new(plan: Plan, pending: &[&str]) -> Self {
        let ids = PlanIds::assign(&plan).expect("ids fit");
        let index = PlanIndex::new(&plan);
        let build = |i| Actor::from_plan(&index, &ids, ActorIndex(i as u32));
        let actors = (0..plan.actors.len()).map(build).map(|a| (a.id(), a)).collect();
        let (env, transitions) = (Env::default(), Vec::new());
        let mut h = Self { plan, ids, actors, env, transitions };
        h.env.asynchronous = pending.iter().map(|name| h.id(name)).collect();
        h
    }

    fn id(&self, name: &str) -> ActorId {
        self.ids.of(self.plan.actor_by_name(name).expect(name))
    }

    fn desc(&self, name: &str) -> Desc {
        let i = self.plan.regst_descs.iter().position(|d| d.name == name);
        RegstDescId(i.expect(name) as u32)
    }

    fn actor(&self, name: &str) -> &Actor {
        &self.actors[&self.id(name)]
    }

    /// Queues a message from the runtime (an `ActDone` or a command) to `name`.
    fn post(&mut self, name: &str, body: Body) {
        let id = self.id(name);
        self.env.queue.push_back(msg(id, id, body));
    }

    fn start(&mut self) {
        let sources = self.plan.actors.iter().filter(|a| matches!(a.kind, ActorKind::Source { .. }));
        let ids: Vec<ActorId> = sources.map(|a| self.id(&a.name)).collect();
        for id in ids {
            self.env.queue.push_back(msg(id, id, Body::Cmd(Cmd::Start)));
        }
    }

    /// Delivers the oldest queued message; `Ok(false)` when the queue is empty.
    fn step(&mut self) -> Result<bool, ActorError> {
        let Some(m) = self.env.queue.pop_front() else {
            return Ok(false);
        };
        self.env.log.push(Event::Deliver(m));
        let at = self.env.log.len() - 1;
        let actor = self.actors.get_mut(&m.dst).expect("a known actor");
        let before = actor.lifecycle();
        let after = actor.handle(&m, &mut self.env)?;
        if after != before {
            self.transitions.push((m.dst, after, at));
        }
        Ok(true)
    }

    fn run(&mut self) -> Result<(), ActorError> {
        while self.step()? {}
        Ok(())
    }

    /// Completes the oldest pending launch of `name`.
    fn complete(&mut self, name: &str) {
        let id = self.id(name);
        let i = self.env.in_flight.iter().position(|&a| a == id);
        self.env.in_flight.remove(i.expect("a pending launch"));
        self.post(name, Body::ActDone);
    }

    /// Runs to quiescence, completing pending launches stream by stream: each stream in
    /// launch order, the next stream picked pseudo-randomly from `seed`.
    fn finish(&mut self, mut seed: u64) -> Result<(), ActorError> {
        loop {
            self.run()?;
            let mut streams: Vec<_> = self.env.in_flight.iter().map(|a| a.stream_id()).collect();
            streams.sort();
            streams.dedup();
            if streams.is_empty() {
                return Ok(());
            }
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            let stream = streams[(seed >> 33) as usize % streams.len()];
            let i = self.env.in_flight.iter().position(|a| a.stream_id() == stream);
            let id = self.env.in_flight.remove(i.expect("a launch on that stream"));
            self.env.queue.push_back(msg(id, id, Body::ActDone));
        }
    }

    fn fired(&self, name: &str) -> Vec<Fired> {
        let id = self.id(name);
        let launches = self.env.log.iter().filter_map(|e| match e {
            Event::Launch(f) if f.actor == id => Some(f.clone()),
            _ => None,
        });
        launches.collect()
    }

    fn pieces(&self, name: &str) -> Vec<u64> {
        self.fired(name).iter().map(|f| f.piece).collect()
    }

    /// Every sent message matching `pred`, with the log index of the delivery that sent it.
    fn sent(&self, pred: impl Fn(&Message) -> bool) -> Vec<(Message, usize)> {
        let mut cause = usize::MAX;
        let mut out = Vec::new();
        for (i, e) in self.env.log.iter().enumerate() {
            match e {
                Event::Deliver(_) => cause = i,
                Event::Send(m) if pred(m) => out.push((*m, cause)),
                _ => {}
            }
        }
        out
    }

    /// Log indices of the deliveries matching `pred`.
    fn deliveries(&self, pred: impl Fn(&Message) -> bool) -> Vec<usize> {
        let hit = |i: &usize| matches!(&self.env.log[*i], Event::Deliver(m) if pred(m));
        (0..self.env.log.len()).filter(hit).collect()
    }

    fn delivered(&self, i: usize) -> Message {
        let Event::Deliver(m) = self.env.log[i] else { panic!("log entry {i} is no delivery") };
        m
    }

    fn lifecycles(&self, name: &str) -> Vec<Lifecycle> {
        let id = self.id(name);
        let mine = self.transitions.iter().filter(|t| t.0 == id);
        mine.map(|t| t.1).collect()
    }

    /// Quiescent, every actor Done, and no register ever had more pieces out than slots.
    fn assert_finished(&self, ctx: &str) {
        assert!(self.env.queue.is_empty() && self.env.in_flight.is_empty(), "{ctx}");
        for (i, desc) in self.plan.actors.iter().enumerate() {
            let a = &self.actors[&self.ids.of(ActorIndex(i as u32))];
            let what = format!("{ctx}: {}: {:?}", a.name(), a.snapshot());
            assert_eq!((a.lifecycle(), a.pending_launches()), (Lifecycle::Done, 0), "{what}");
            assert!(a.max_in_flight().all(|(most, regs)| most <= regs), "{what}");
            let slots = desc.inputs.iter().map(|d| self.plan.regst_descs[d.index()].register_num);
            for ((most, regs), slots) in a.max_held().zip(slots) {
                assert_eq!(regs, slots as usize, "{what}");
                assert!(most <= slots, "{what}: held {most} of {slots}");
            }
        }
    }
}

fn is_ready(m: &Message) -> bool {
    matches!(m.body, Body::Ready { .. })
}

fn is_ack(m: &Message) -> bool {
    matches!(m.body, Body::Ack { .. })
}

fn is_eord(m: &Message) -> bool {
    matches!(m.body, Body::Eord { .. })
}

fn err_text(result: Result<(), ActorError>) -> String {
    result.expect_err("a protocol error").to_string()
}

/// Which actors complete asynchronously, and the seed for the order streams complete in.
type Timing = (&'static [&'static str], u64);
const SYNC: Timing = (&[], 0);

#[test]
fn chain_delivers_every_piece_in_order_within_register_bounds() {
    let all = &["src", "f", "sink"][..];
    let layouts = [([0, 0, 0], SYNC), ([0, 1, 2], SYNC), ([0, 1, 2], (all, 1)), ([0, 0, 1], (all, 7))];
    for n in [0, 1, 2, 7] {
        for (rs, rf) in [(1, 1), (2, 1), (1, 3), (3, 2)] {
            for (s, (pending, seed)) in layouts {
                let ctx = format!("n={n} regs=({rs},{rf}) streams={s:?} pending={pending:?}");
                let mut net = Net::new();
                let x = net.add("src", s[0], count(n), &[], rs);
                let y = net.add("f", s[1], COPY, &[x], rf);
                net.sink("sink", s[2], &[y]);
                let mut h = Harness::new(net.build(), pending);
                h.start();
                h.finish(seed).unwrap_or_else(|e| panic!("{ctx}: {e}"));
                let pieces: Vec<u64> = (0..n).collect();
                assert_eq!(h.pieces("src"), pieces, "{ctx}");
                assert_eq!(h.pieces("f"), pieces, "{ctx}");
                assert_eq!(h.pieces("sink"), pieces, "{ctx}");
                assert_eq!(h.actor("sink").fires(), n, "{ctx}");
                h.assert_finished(&ctx);
                if pending.is_empty() {
                    // Once started, the source runs ahead exactly as far as its slots allow.
                    let most: Vec<_> = h.actor("src").max_in_flight().collect();
                    assert_eq!(most, [(rs.min(n as u32), rs)], "{ctx}");
                }
            }
        }
    }
}

#[test]
fn eord_cascades_and_producers_stay_zombie_until_their_last_ack() {
    let n = 3;
    let mut h = line(count(n), 1, "f", COPY, 1, &["src", "f", "sink"]);
    h.start();
    h.finish(5).unwrap();
    h.assert_finished("zombie");
    for (producer, consumer) in [("src", "f"), ("f", "sink")] {
        let (p, c) = (h.id(producer), h.id(consumer));
        let zombie_then_done = [Lifecycle::Zombie, Lifecycle::Done];
        assert_eq!(h.lifecycles(producer), zombie_then_done, "{producer}");
        let at = |l| h.transitions.iter().find(|t| t.0 == p && t.1 == l).expect("entered").2;
        let (zombie, done) = (at(Lifecycle::Zombie), at(Lifecycle::Done));
        let acks = h.deliveries(|m| m.dst == p && is_ack(m));
        assert_eq!(acks.len() as u64, n, "{producer}: one ack per piece");
        // With one slot, the last piece is still out when the producer drains ...
        let early = acks.iter().filter(|&&i| i < zombie).count() as u64;
        assert_eq!(early, n - 1, "{producer}");
        // ... and the last ack, from the consumer, is what lets it finish.
        assert_eq!((done, h.delivered(done).src), (acks[acks.len() - 1], c), "{producer}");
        let eords = h.sent(|m| m.src == p && is_eord(m));
        assert_eq!(eords.len(), 1, "{producer}: one Eord");
        assert_eq!((eords[0].0.dst, eords[0].1), (c, zombie), "{producer}");
    }
    // The sink lends no slots: it goes straight to Done.
    assert_eq!(h.lifecycles("sink"), [Lifecycle::Done]);
}

#[test]
fn diamond_keeps_both_branches_in_step() {
    let n = 5;
    for regs in 0..16u32 {
        let r = |bit: u32| 1 + ((regs >> bit) & 1);
        let all = &["src", "a", "b", "join", "sink"][..];
        for (pending, seed) in [SYNC, (all, u64::from(regs))] {
            let ctx = format!("regs={regs:04b} pending={pending:?}");
            let mut net = Net::new();
            let x = net.add("src", 0, count(n), &[], r(0));
            let ya = net.add("a", 1, COPY, &[x], r(1));
            let yb = net.add("b", 2, COPY, &[x], r(2));
            let j = net.add("join", 0, COPY, &[ya, yb], r(3));
            net.sink("sink", 1, &[j]);
            let mut h = Harness::new(net.build(), pending);
            h.start();
            h.finish(seed).unwrap_or_else(|e| panic!("{ctx}: {e}"));
            let (a, b, join) = (h.fired("a"), h.fired("b"), h.fired("join"));
            assert_eq!(join.len() as u64, n, "{ctx}");
            for (p, f) in join.iter().enumerate() {
                // The join's piece p reads exactly what each branch wrote for piece p.
                let expected = [a[p].outputs[0], b[p].outputs[0]];
                assert_eq!((f.piece, &f.inputs[..]), (p as u64, &expected[..]), "{ctx}");
            }
            assert_eq!(h.pieces("sink"), (0..n).collect::<Vec<_>>(), "{ctx}");
            h.assert_finished(&ctx);
        }
    }
}

#[test]
fn acc_folds_groups_of_k_and_flushes_a_partial_last_group() {
    for n in 0..8u64 {
        for k in 1..4u32 {
            for (pending, seed) in [SYNC, (&["acc", "sink"][..], n)] {
                let ctx = format!("n={n} k={k} pending={pending:?}");
                let mut h = line(count(n), 2, "acc", acc(k), 1, pending);
                h.start();
                h.finish(seed).unwrap_or_else(|e| panic!("{ctx}: {e}"));
                let fired = h.fired("acc");
                assert_eq!(fired.len() as u64, n, "{ctx}");
                let size = k as usize;
                for (i, f) in fired.iter().enumerate() {
                    let group = GroupPosition { index: i as u32 % k, count: k };
                    assert_eq!((f.piece, f.group), (i as u64, group), "{ctx}");
                    // The whole group folds into the slot its first piece took.
                    assert_eq!(f.outputs, fired[i - i % size].outputs, "{ctx}");
                }
                let groups = n.div_ceil(u64::from(k));
                assert_eq!(h.pieces("sink"), (0..groups).collect::<Vec<_>>(), "{ctx}");
                for (g, f) in h.fired("sink").iter().enumerate() {
                    assert_eq!(f.inputs, fired[g * size].outputs, "{ctx}: group {g}");
                }
                h.assert_finished(&ctx);
            }
        }
    }
}

#[test]
fn repeat_hands_its_input_to_k_pieces_without_copy_and_acks_it_last() {
    let (n, k) = (3u64, 3usize);
    let mut h = line(count(n), 2, "rep", repeat(k as u32), 2, &[]);
    let y = h.desc("rep.out");
    assert!(!h.plan.owns_memory(y), "a repeat's output owns no memory");
    h.start();
    h.finish(0).unwrap();
    h.assert_finished("repeat");
    // Each hand-off is a no-op launch on the repeat's stream (so other streams hear of the
    // input only once its producer's kernel completed): it writes nothing, reads the input.
    let handed = h.fired("rep");
    assert_eq!(handed.len() as u64, n * k as u64);
    assert!(handed.iter().all(|f| f.outputs.is_empty() && f.inputs.len() == 1), "{handed:?}");
    assert_eq!(h.actor("rep").fires(), n * k as u64);
    let src = h.fired("src");
    assert_eq!(h.pieces("sink"), (0..n * k as u64).collect::<Vec<_>>());
    for (j, f) in h.fired("sink").iter().enumerate() {
        assert_eq!(f.inputs, src[j / k].outputs, "piece {j} reads the source's register");
    }
    let (rep, sink_id, src_id) = (h.id("rep"), h.id("sink"), h.id("src"));
    for (m, _) in h.sent(|m| m.src == rep && is_ready(m)) {
        let Body::Ready { regst, piece, data } = m.body else { unreachable!() };
        assert_eq!((regst.desc, data), (y, src[piece as usize / k].outputs[0]), "{piece}");
    }
    // Input i is acked while the repeat handles the ack of its k-th (last) output piece.
    let acks_in = h.deliveries(|m| m.src == sink_id && m.dst == rep && is_ack(m));
    let acks_out = h.sent(|m| m.src == rep && m.dst == src_id && is_ack(m));
    assert_eq!((acks_in.len(), acks_out.len()), (n as usize * k, n as usize));
    for (i, (ack, cause)) in acks_out.iter().enumerate() {
        assert_eq!(*cause, acks_in[(i + 1) * k - 1], "input {i}");
        let regst = src[i].outputs[0];
        assert_eq!(ack.body, Body::Ack { regst });
    }
}

fn fed_plan(pending: &[&str]) -> Harness {
    line(FED, 2, "f", COPY, 1, pending)
}

#[test]
fn fed_source_produces_one_piece_per_feed_and_ends_on_close() {
    let mut h = fed_plan(&[]);
    h.start();
    h.run().unwrap();
    let launches = h.env.log.iter().filter(|e| matches!(e, Event::Launch(_)));
    assert_eq!(launches.count(), 0, "nothing fires before Feed");
    assert_eq!(h.actor("src").snapshot().waits, [WaitReason::Feed]);
    for _ in 0..3 {
        h.post("src", FEED);
    }
    h.run().unwrap();
    assert_eq!((h.pieces("src"), h.pieces("sink")), (vec![0, 1, 2], vec![0, 1, 2]));
    assert_eq!(h.actor("src").lifecycle(), Lifecycle::Running);
    assert!(h.sent(is_eord).is_empty());
    h.post("src", CLOSE);
    h.run().unwrap();
    assert_eq!(h.sent(is_eord).len(), 2);
    assert_eq!(h.pieces("sink"), [0, 1, 2]);
    h.assert_finished("fed");
}

#[test]
fn feed_after_close_feed_is_an_error() {
    // `f` keeps the last piece, so the closed source is still a zombie.
    let mut h = fed_plan(&["f"]);
    h.start();
    h.post("src", FEED);
    h.post("src", CLOSE);
    h.run().unwrap();
    assert_eq!(h.actor("src").lifecycle(), Lifecycle::Zombie);
    for (body, cmd) in [(FEED, "Feed"), (CLOSE, "CloseFeed")] {
        h.post("src", body);
        let text = err_text(h.run());
        let what = format!("{cmd}: not an open fed source");
        assert!(text.contains("actor 'src' (") && text.contains(&what), "{text}");
    }
    // Feeding a counted source is just as wrong.
    let mut net = Net::new();
    let x = net.add("counted", 0, count(2), &[], 1);
    net.sink("sink", 1, &[x]);
    let mut h = Harness::new(net.build(), &[]);
    h.post("counted", FEED);
    assert!(err_text(h.run()).contains("actor 'counted' ("));
}

#[test]
fn feed_after_close_feed_is_an_error_even_once_the_source_is_done() {
    let mut h = fed_plan(&[]);
    h.start();
    h.post("src", CLOSE);
    h.run().unwrap();
    h.assert_finished("closed");
    h.post("src", FEED);
    assert!(err_text(h.run()).contains("after the actor finished"));
}

#[test]
fn protocol_errors_name_the_actor() {
    // A fed chain with one piece through it: every actor is still running.
    let fresh = || {
        let mut h = fed_plan(&[]);
        h.start();
        h.post("src", FEED);
        h.run().unwrap();
        assert_eq!(h.pieces("sink"), [0]);
        h
    };
    let expect = |h: &mut Harness, m: Message, actor: &str, what: &str| {
        h.env.queue.push_back(m);
        let text = err_text(h.run());
        let named = text.contains(&format!("actor '{actor}' ("));
        assert!(named && text.contains(what), "{what}: got {text}");
    };
    let mut h = fresh();
    let (src, f, sink) = (h.id("src"), h.id("f"), h.id("sink"));
    let ack = h.delivered(h.deliveries(|m| m.dst == src && is_ack(m))[0]);
    expect(&mut h, ack, "src", "which does not hold it (acked twice?)");

    let mut h = fresh();
    let regst = RegstRef { desc: h.desc("src.out"), slot: 1 };
    let stray = msg(src, sink, Body::Ack { regst });
    expect(&mut h, stray, "src", "ack of slot 1 from n0.d0.s2.a0, which does not consume it");

    let mut h = fresh();
    let again = h.delivered(h.deliveries(|m| m.dst == f && is_ready(m))[0]);
    expect(&mut h, again, "f", "out of order: regst#0 delivered piece 0, expected piece 1");

    // Slots go round in order: piece 1 of a 2-slot register is in slot 1.
    let mut h = fresh();
    let wrong_slot = RegstRef { desc: h.desc("src.out"), slot: 0 };
    let ready = msg(f, src, Body::Ready { regst: wrong_slot, piece: 1, data: wrong_slot });
    expect(&mut h, ready, "f", "delivered piece 1 in slot 0, but piece 1 of a register of 2 slots is in slot 1");

    // Slots come back oldest first: `f`, whose kernel still reads slot 0, gives back 1.
    let mut h = fed_plan(&["f"]);
    h.start();
    h.post("src", FEED);
    h.run().unwrap();
    let early = msg(src, f, Body::Ack { regst });
    expect(&mut h, early, "src", "slot 1 acked by n0.d0.s1.a0 out of order: it holds 1 slot(s) from slot 0");

    let mut h = fresh();
    let ready = msg(sink, src, Body::Ready { regst, piece: 0, data: regst });
    expect(&mut h, ready, "sink", "Ready of regst#0 from n0.d0.s0.a0, which it does not consume");

    let mut h = fresh();
    expect(&mut h, msg(f, f, Body::ActDone), "f", "ActDone with no kernel in flight");

    let mut h = fresh();
    let eord = msg(f, src, Body::Eord { desc: h.desc("f.out") });
    expect(&mut h, eord, "f", "Eord for regst#1, which it does not consume");
}

#[test]
fn inputs_ending_unevenly_are_an_error() {
    let mut net = Net::new();
    let a = net.add("three", 0, count(3), &[], 1);
    let b = net.add("five", 1, count(5), &[], 1);
    let j = net.add("join", 2, COPY, &[a, b], 1);
    net.sink("sink", 0, &[j]);
    let mut h = Harness::new(net.build(), &[]);
    h.start();
    let text = err_text(h.run());
    assert!(text.contains("actor 'join' (") && text.contains("pieces out of order"), "{text}");
    let what = "input regst#0 ended after 3 pieces but input regst#1 still has piece 3 ready";
    assert!(text.contains(what), "{text}");
    assert_eq!(h.pieces("join"), [0, 1, 2]);
}

/// `src` → `mid` (both stream 0) → `near` (stream 0) and `far` (stream 1); all asynchronous.
fn fan_out(middle: ActorKind) -> Harness {
    let mut net = Net::new();
    let x = net.add("src", 0, count(1), &[], 1);
    let m = net.add("mid", 0, middle, &[x], 1);
    net.sink("near", 0, &[m]);
    net.sink("far", 1, &[m]);
    Harness::new(net.build(), &["src", "mid", "near", "far"])
}

#[test]
fn same_stream_consumers_hear_at_launch_others_and_producers_at_completion() {
    let mut h = fan_out(COPY);
    let (mid, near, far) = (h.id("mid"), h.id("near"), h.id("far"));
    h.start();
    h.run().unwrap();
    h.complete("src");
    h.run().unwrap();
    assert_eq!((h.pieces("mid"), h.pieces("near")), (vec![0], vec![0]));
    let to = |dst| move |m: &Message| m.src == mid && m.dst == dst && is_ready(m);
    // `near` heard at mid's launch (while mid handled src's Ready); `far` has not.
    let near_ready = h.sent(to(near));
    assert_eq!(near_ready.len(), 1);
    let cause = h.delivered(near_ready[0].1);
    assert!(cause.dst == mid && is_ready(&cause), "{cause:?}");
    assert!(h.sent(to(far)).is_empty(), "not even src's completion tells far");
    let acks_from = |h: &Harness, who| h.sent(move |m| m.src == who && is_ack(m));
    assert!(acks_from(&h, mid).is_empty() && acks_from(&h, near).is_empty());
    h.complete("mid");
    h.run().unwrap();
    let mid_done = h.deliveries(|m| m.dst == mid && m.body == Body::ActDone)[0];
    let far_ready = h.sent(to(far));
    assert_eq!((far_ready.len(), far_ready[0].1), (1, mid_done), "far hears at completion");
    let mid_acks = acks_from(&h, mid);
    assert_eq!((mid_acks.len(), mid_acks[0].1), (1, mid_done), "mid acks at completion");
    assert!(acks_from(&h, near).is_empty(), "near's kernel is still running");
    h.finish(0).unwrap();
    h.assert_finished("streams");
}

#[test]
fn repeat_does_not_forward_unfinished_data_to_another_stream() {
    let mut h = fan_out(repeat(2));
    let (mid, far) = (h.id("mid"), h.id("far"));
    h.start();
    h.run().unwrap();
    assert_eq!(h.pieces("src"), [0], "src launched; its kernel is still running");
    let early = h.sent(|m| m.src == mid && m.dst == far && is_ready(m));
    assert!(early.is_empty(), "far (stream 1) told before src completed: {early:?}");
}

#[test]
fn snapshot_names_the_holder_of_a_full_output_and_the_producer_of_an_empty_input() {
    let mut net = Net::new();
    let x = net.add("src", 0, count(3), &[], 1);
    net.sink("sink", 1, &[x]);
    let mut h = Harness::new(net.build(), &["sink"]);
    let (src, sink) = (h.id("src"), h.id("sink"));
    assert_eq!(h.actor("src").snapshot().waits, [WaitReason::NotStarted]);
    h.start();
    h.run().unwrap();
    let snap = h.actor("src").snapshot();
    assert_eq!((snap.lifecycle, snap.fires), (Lifecycle::Running, 1));
    let holders = vec![sink];
    let full = WaitReason::OutputFull { desc: x, register_num: 1, holders };
    assert_eq!(snap.waits, std::slice::from_ref(&full));
    let text = format!("output regst#0 is full: all 1 slots held by [{sink}]");
    assert_eq!(full.to_string(), text);
    let empty = WaitReason::Input { desc: x, producer: src };
    let kernel = WaitReason::Kernel { launches: 1 };
    assert_eq!(h.actor("sink").snapshot().waits, [empty.clone(), kernel]);
    let text = format!("waits on input regst#0: empty, produced by {src}");
    assert_eq!(empty.to_string(), text);
    h.finish(0).unwrap();
    h.assert_finished("snapshot");
    assert_eq!(h.actor("sink").snapshot().waits, []);
}

#[test]
fn snapshot_of_acc_mid_group_blames_only_its_producer() {
    let mut h = line(FED, 1, "acc", acc(2), 1, &[]);
    h.start();
    h.post("src", FEED);
    h.run().unwrap();
    assert_eq!((h.pieces("acc"), h.pieces("sink")), (vec![0], vec![]));
    let (desc, producer) = (h.desc("src.out"), h.id("src"));
    let empty = WaitReason::Input { desc, producer };
    assert_eq!(h.actor("acc").snapshot().waits, [empty]);
}

#[test]
fn snapshot_of_repeat_waiting_for_acks_is_not_empty() {
    let mut h = line(count(1), 1, "rep", repeat(2), 3, &["sink"]);
    h.start();
    h.run().unwrap();
    let rep = h.actor("rep");
    assert_eq!((rep.fires(), rep.lifecycle()), (2, Lifecycle::Running));
    assert!(!rep.snapshot().waits.is_empty(), "{:?}", rep.snapshot());
}

/// Which launches want a completion event: only those someone off the stream waits for.
#[test]
fn completion_is_wanted_only_where_another_stream_waits() {
    let mut net = Net::new();
    let x = net.add("src", 0, count(3), &[], 2);
    let a = net.add("a", 0, COPY, &[x], 2);
    let b = net.add("b", 0, COPY, &[a], 1);
    let c = net.add("c", 1, COPY, &[b], 1);
    net.sink("sink", 1, &[c]);
    // A repeat hands its slot back to its producer when its consumers ack: they must ack
    // at completion, even on the repeat's own stream.
    let y = net.add("src2", 0, count(1), &[], 1);
    let r = net.add("rep", 0, repeat(2), &[y], 1);
    net.sink("after_repeat", 0, &[r]);
    // An acc may flush a partial sum without a launch: with a consumer elsewhere, each
    // of its launches reports completion; with one on its stream, none does.
    let z = net.add("src3", 0, count(3), &[], 1);
    let far = net.add("acc_far", 0, acc(2), &[z], 1);
    net.sink("far_sink", 1, &[far]);
    let w = net.add("src4", 0, count(3), &[], 1);
    let near = net.add("acc_near", 0, acc(2), &[w], 1);
    net.sink("near_sink", 0, &[near]);
    let mut h = Harness::new(net.build(), &[]);
    h.start();
    h.run().unwrap();
    h.assert_finished("no launch pending");
    let wanted = |h: &Harness, name: &str| -> Vec<bool> { h.fired(name).iter().map(|f| f.completion_wanted).collect() };
    assert_eq!(wanted(&h, "src"), [false; 3], "src: only a, on its stream, hears of it");
    assert_eq!(wanted(&h, "a"), [false; 3], "a: producer and consumer on its stream");
    assert_eq!(wanted(&h, "b"), [true; 3], "b: its consumer c is on stream 1");
    assert_eq!(wanted(&h, "c"), [true; 3], "c: its producer b is on stream 0");
    assert_eq!(wanted(&h, "sink"), [false; 3], "sink: its producer c is on its stream");
    assert_eq!(wanted(&h, "rep"), [false; 2], "rep: its consumer is on its stream");
    assert_eq!(wanted(&h, "after_repeat"), [true; 2], "after_repeat: its producer is a repeat");
    assert_eq!(wanted(&h, "acc_far"), [true; 3], "acc_far: a consumer on stream 1");
    assert_eq!(wanted(&h, "acc_near"), [false; 3], "acc_near: its consumer is on its stream");
}

/// Completions are reported in launch order, so a launch behind a pending one wants its
/// own completion even when nobody off the stream waits for it.
#[test]
fn a_launch_behind_a_pending_one_wants_completion() {
    let mut net = Net::new();
    let x = net.add("src", 0, count(2), &[], 2);
    let a = net.add("a", 0, COPY, &[x], 2);
    net.sink("sink", 0, &[a]);
    let mut h = Harness::new(net.build(), &["a"]);
    h.start();
    h.run().unwrap();
    let wanted: Vec<bool> = h.fired("a").iter().map(|f| f.completion_wanted).collect();
    assert_eq!(wanted, [false, true], "the second launch of a found the first still pending");
    h.finish(0).unwrap();
    h.assert_finished("a completed");
}

/// On a stream-ordered device (launches nobody off the stream waits for complete at once)
/// every plan shape still delivers every piece in order and finishes, in any completion
/// order across streams.
#[test]
fn stream_ordered_completion_delivers_everything() {
    for seed in 0..16 {
        let mut net = Net::new();
        let x = net.add("src", 0, count(5), &[], 2);
        let a = net.add("a", 0, COPY, &[x], 1);
        let b = net.add("b", 1, acc(2), &[a], 1);
        let r = net.add("rep", 1, repeat(2), &[b], 1);
        let c = net.add("c", 1, COPY, &[r], 2);
        let d = net.add("d", 2, COPY, &[c], 1);
        net.sink("sink", 0, &[d]);
        let names = ["src", "a", "b", "rep", "c", "d", "sink"];
        let mut h = Harness::new(net.build(), &names);
        h.env.stream_ordered = true;
        h.start();
        h.finish(seed).unwrap();
        h.assert_finished("stream ordered");
        assert_eq!(h.pieces("sink"), [0, 1, 2, 3, 4, 5], "seed {seed}");
    }
}

#[test]
fn an_actor_with_more_registers_than_it_scans_finds_each_by_lookup() {
    // 12 sources into one actor (as a fused optimizer update reads hundreds of registers)
    // that writes 10 outputs, each read by a sink: past the scan of 8, a Ready, an Ack and
    // an Eord find their register by binary search. The actor's inputs are listed in the
    // reverse of the registers' order, so positions and register ids disagree.
    let n = 4;
    for (pending, seed) in [(&[][..], 1), (&["big", "s3", "k7"][..], 9)] {
        let mut net = Net::new();
        let inputs: Vec<Desc> =
            (0..12).map(|k| net.add(&format!("s{k}"), k % 3, count(n), &[], 1 + k as u32 % 2)).collect();
        let reversed: Vec<Desc> = inputs.iter().rev().copied().collect();
        let big = net.actor("big", 1, COPY, &reversed);
        let outputs: Vec<Desc> = (0..10).map(|k| net.b.regst(&format!("big.out{k}"), big, 8, 1 + k % 2)).collect();
        for (k, &out) in outputs.iter().enumerate() {
            net.sink(&format!("k{k}"), k % 3, &[out]);
        }
        let mut h = Harness::new(net.build(), pending);
        h.start();
        h.finish(seed).unwrap_or_else(|e| panic!("pending {pending:?}: {e}"));
        let fired = h.fired("big");
        assert_eq!(fired.iter().map(|f| f.piece).collect::<Vec<_>>(), (0..n).collect::<Vec<_>>());
        for f in &fired {
            assert_eq!(f.inputs.iter().map(|r| r.desc).collect::<Vec<_>>(), reversed, "inputs in the actor's order");
            assert_eq!(f.outputs.iter().map(|r| r.desc).collect::<Vec<_>>(), outputs, "outputs in plan order");
        }
        for k in 0..10 {
            assert_eq!(h.pieces(&format!("k{k}")), (0..n).collect::<Vec<_>>(), "sink k{k}");
        }
        h.assert_finished(&format!("pending {pending:?}"));
    }
}
