//! A `Ready` or `Ack` between two actors of one stream taken straight into the recipient
//! ([`Actor::accept`], then [`Actor::resume`] when it can fire), as the stream threads do,
//! against the same plan driven with every message queued and handled in order
//! ([`Actor::handle`]): the same firings, the same pieces at every sink, the same errors.

mod common;

use common::{count, Net};
use regflow_actors::{
    Accepted, Actor, ActorEnv, ActorError, ActorId, Body, Cmd, Completion, EnvError, Firing, Lifecycle, Message,
    PlanIds, RunQueue,
};
use regflow_plan::{ActorIndex, ActorKind, KernelConf, Plan, PlanIndex, RegstDescId};
use std::collections::{BTreeMap, HashMap, VecDeque};

const COPY: ActorKind = ActorKind::Compute { kernel: KernelConf::Copy };

/// What a run did: firings per actor, the pieces each sink read in order, and whether
/// every actor finished.
#[derive(Debug, PartialEq, Eq)]
struct Outcome {
    fires: BTreeMap<String, u64>,
    sunk: BTreeMap<String, Vec<u64>>,
    all_done: bool,
}

/// The serial driver. With `direct`, same-stream `Ready`s and `Ack`s go to `accept` and
/// runnable actors take their turn before the next queued message, as in
/// `runtime/src/stream.rs`.
struct Driver {
    actors: Vec<Option<Actor>>,
    at: HashMap<ActorId, usize>,
    names: Vec<String>,
    sinks: Vec<bool>,
    queue: VecDeque<Message>,
    runnable: RunQueue,
    /// A recipient's refusal, reported as its own error (as the stream does).
    refused: Option<ActorError>,
    sunk: BTreeMap<String, Vec<u64>>,
    direct: bool,
    /// Index of the actor whose turn it is.
    current: usize,
    /// Messages that went to `accept` and were taken.
    taken: usize,
}

impl ActorEnv for Driver {
    fn send(&mut self, msg: Message) -> Result<(), EnvError> {
        let here = msg.dst.stream_id() == msg.src.stream_id();
        let j = self.at[&msg.dst];
        if self.direct && here && j != self.current {
            let recipient = self.actors[j].as_mut().expect("only the current actor is out");
            match recipient.accept(&msg) {
                Ok(Accepted::Runnable) => {
                    self.taken += 1;
                    self.runnable.push(j);
                    return Ok(());
                }
                Ok(Accepted::Taken) => {
                    self.taken += 1;
                    return Ok(());
                }
                Ok(Accepted::Declined) => {}
                Err(error) => {
                    self.refused = Some(error);
                    return Err(EnvError::Refused { dst: msg.dst });
                }
            }
        }
        self.queue.push_back(msg);
        Ok(())
    }

    fn launch(&mut self, f: &Firing<'_>) -> Result<Completion, EnvError> {
        if self.sinks[self.current] {
            self.sunk.entry(self.names[self.current].clone()).or_default().push(f.piece);
        }
        Ok(Completion::Done)
    }
}

fn run(plan: &Plan, direct: bool) -> (Result<Outcome, String>, usize) {
    run_moving(plan, direct, false)
}

/// [`run`]; with `moving`, every actor moves its state into new memory
/// ([`Actor::reallocate`]) every third turn, as a stream thread does once when it starts.
fn run_moving(plan: &Plan, direct: bool, moving: bool) -> (Result<Outcome, String>, usize) {
    let ids = PlanIds::assign(plan).expect("ids fit");
    let index = PlanIndex::new(plan);
    let actors: Vec<Option<Actor>> =
        (0..plan.actors.len()).map(|i| Some(Actor::from_plan(&index, &ids, ActorIndex(i as u32)))).collect();
    let at = actors.iter().enumerate().map(|(i, a)| (a.as_ref().expect("built").id(), i)).collect();
    let mut d = Driver {
        at,
        names: plan.actors.iter().map(|a| a.name.clone()).collect(),
        sinks: plan.actors.iter().map(|a| matches!(a.kind, ActorKind::Sink)).collect(),
        queue: VecDeque::new(),
        runnable: RunQueue::new(plan.actors.len()),
        refused: None,
        sunk: BTreeMap::new(),
        direct,
        current: 0,
        taken: 0,
        actors,
    };
    for actor in d.actors.iter().flatten() {
        let id = actor.id();
        d.queue.push_back(Message { dst: id, src: id, body: Body::Cmd(Cmd::Start) });
    }
    let mut turns = 0;
    loop {
        turns += 1;
        assert!(turns < 100_000, "the run does not end");
        let (j, msg) = if let Some(j) = d.runnable.pop() {
            (j, None)
        } else if let Some(msg) = d.queue.pop_front() {
            (d.at[&msg.dst], Some(msg))
        } else {
            break;
        };
        let mut actor = d.actors[j].take().expect("actor present");
        d.current = j;
        let result: Result<Lifecycle, ActorError> = match msg {
            None => actor.resume(&mut d),
            Some(msg) => actor.handle(&msg, &mut d),
        };
        d.actors[j] = Some(actor);
        if moving && turns % 3 == 0 {
            for actor in d.actors.iter_mut().flatten() {
                let before = actor.snapshot();
                actor.reallocate();
                assert_eq!(actor.snapshot(), before, "reallocating changed what the actor holds");
            }
        }
        if let Err(error) = result {
            return (Err(d.refused.take().unwrap_or(error).to_string()), d.taken);
        }
    }
    let actors = d.actors.iter().flatten();
    let fires = actors.clone().map(|a| (a.name().to_string(), a.fires())).collect();
    let all_done = actors.clone().all(|a| a.lifecycle() == Lifecycle::Done);
    (Ok(Outcome { fires, sunk: d.sunk, all_done }), d.taken)
}

/// Runs `plan` both ways; returns the outcome and how many messages went straight in.
fn same_both_ways(plan: &Plan) -> (Result<Outcome, String>, usize) {
    let (queued, none_taken) = run(plan, false);
    assert_eq!(none_taken, 0);
    let (direct, taken) = run(plan, true);
    assert_eq!(direct, queued, "direct delivery changed the outcome of {plan:?}");
    (direct, taken)
}

fn acc(count: u32) -> ActorKind {
    ActorKind::Acc { count, kernel: KernelConf::SumF32 }
}

/// `src → a → b → c → sink`, each actor on `streams[k]`, every register `regs` slots.
fn chain(n: u64, regs: u32, streams: [usize; 5], middle: [ActorKind; 3]) -> Plan {
    let mut net = Net::new();
    let mut prev = net.add("src", streams[0], count(n), &[], regs);
    for (k, kind) in middle.into_iter().enumerate() {
        prev = net.add(["a", "b", "c"][k], streams[k + 1], kind, &[prev], regs);
    }
    net.sink("sink", streams[4], &[prev]);
    net.build()
}

#[test]
fn a_chain_on_one_stream_fires_the_same_with_messages_taken_straight_in() {
    for regs in 1..=3 {
        let plan = chain(7, regs, [0; 5], [COPY, COPY, COPY]);
        let (outcome, taken) = same_both_ways(&plan);
        let outcome = outcome.expect("the chain runs");
        assert!(outcome.all_done);
        assert_eq!(outcome.sunk["sink"], (0..7).collect::<Vec<u64>>());
        // Every Ready and Ack between neighbours (4 edges, 7 pieces, both ways) went in,
        // but for the last Ack on an edge that finds its producer already a zombie.
        let all = 4 * 7 * 2;
        assert!((all - 4..=all).contains(&taken), "{regs} registers: {taken} of {all} taken");
    }
}

#[test]
fn chains_across_streams_acc_and_repeat_fire_the_same() {
    let layouts = [[0, 0, 1, 1, 0], [0, 1, 0, 1, 0], [2, 2, 2, 0, 0]];
    let kinds = [
        [COPY, acc(3), COPY],
        [COPY, ActorKind::Repeat { count: 3 }, COPY],
        [acc(2), COPY, ActorKind::Repeat { count: 2 }],
    ];
    for streams in layouts {
        for middle in kinds.clone() {
            for regs in [1, 2] {
                let plan = chain(5, regs, streams, middle.clone());
                let (outcome, _) = same_both_ways(&plan);
                assert!(outcome.expect("the chain runs").all_done, "{streams:?} {middle:?} {regs}");
            }
        }
    }
}

/// An actor whose state moved into new memory mid-run goes on as if it had not
/// (`StreamWorker::reallocate` moves every actor of a stream once, before it starts).
#[test]
fn actors_moved_into_new_memory_mid_run_fire_the_same() {
    for streams in [[0; 5], [0, 1, 0, 1, 0]] {
        for middle in [[COPY, acc(3), COPY], [COPY, ActorKind::Repeat { count: 3 }, COPY]] {
            for regs in [1, 2] {
                let plan = chain(5, regs, streams, middle.clone());
                for direct in [false, true] {
                    let (kept, _) = run_moving(&plan, direct, false);
                    let (moved, _) = run_moving(&plan, direct, true);
                    assert_eq!(moved, kept, "{streams:?} {middle:?} {regs} registers, direct {direct}");
                    assert!(moved.expect("the chain runs").all_done);
                }
            }
        }
    }
}

#[test]
fn a_diamond_on_one_stream_joins_in_step() {
    for regs in [1, 2] {
        let mut net = Net::new();
        let x = net.add("src", 0, count(6), &[], regs);
        let a = net.add("a", 0, COPY, &[x], regs);
        let b = net.add("b", 0, COPY, &[x], 1);
        let j = net.add("join", 0, COPY, &[a, b], regs);
        net.sink("sink", 0, &[j]);
        let (outcome, taken) = same_both_ways(&net.build());
        assert_eq!(outcome.expect("the diamond runs").sunk["sink"], (0..6).collect::<Vec<u64>>());
        assert!(taken > 0);
    }
}

/// A `Ready` taken straight in after another input of the recipient ended is the same
/// error as when it is handled: the recipient still checks whether it is drained.
#[test]
fn inputs_ending_unevenly_on_one_stream_are_the_same_error() {
    let mut net = Net::new();
    let a = net.add("three", 0, count(3), &[], 1);
    let b = net.add("five", 0, count(5), &[], 1);
    let j = net.add("join", 0, COPY, &[a, b], 1);
    net.sink("sink", 0, &[j]);
    let (outcome, _) = same_both_ways(&net.build());
    let error = outcome.expect_err("uneven inputs are an error");
    assert!(error.contains("join") && error.contains("ended after 3 pieces"), "{error}");
}

/// What `accept` takes: a running actor's `Ready` or `Ack` (not a repeat's `Ack`);
/// everything else is declined, and a protocol violation is refused as `handle` would.
#[test]
fn accept_takes_only_ready_and_ack_of_running_actors() {
    let plan = chain(2, 1, [0; 5], [COPY, ActorKind::Repeat { count: 2 }, COPY]);
    let ids = PlanIds::assign(&plan).expect("ids fit");
    let index = PlanIndex::new(&plan);
    let id = |name: &str| ids.of(plan.actor_by_name(name).expect(name));
    let actor = |name: &str| (Actor::from_plan(&index, &ids, plan.actor_by_name(name).expect(name)), id(name));
    let desc = |name: &str| RegstDescId(plan.regst_descs.iter().position(|d| d.name == name).expect(name) as u32);
    let (mut a, a_id) = actor("a");
    let (mut b, b_id) = actor("b");
    let src_id = id("src");
    let src_out = regflow_actors::RegstRef { desc: desc("src.out"), slot: 0 };
    let ready = |dst, src, regst, piece| Message { dst, src, body: Body::Ready { regst, piece, data: regst } };
    // A command or an end of data is declined: it goes through `handle`, in order.
    let start = Message { dst: a_id, src: a_id, body: Body::Cmd(Cmd::Start) };
    assert_eq!(a.accept(&start), Ok(Accepted::Declined));
    let eord = Message { dst: a_id, src: src_id, body: Body::Eord { desc: desc("src.out") } };
    assert_eq!(a.accept(&eord), Ok(Accepted::Declined));
    // A ready input with a free output: runnable.
    assert_eq!(a.accept(&ready(a_id, src_id, src_out, 0)), Ok(Accepted::Runnable));
    // The same piece again is the error `handle` gives: out of order, naming the recipient.
    let again = a.accept(&ready(a_id, src_id, src_out, 0)).expect_err("a second piece 0");
    assert!(matches!(&again, ActorError::PieceOrder { name, .. } if name == "a"), "{again}");
    // A repeat's Ack makes it send one of its own: declined.
    let a_out = regflow_actors::RegstRef { desc: desc("a.out"), slot: 0 };
    let b_out = regflow_actors::RegstRef { desc: desc("b.out"), slot: 0 };
    let ack = Message { dst: b_id, src: id("c"), body: Body::Ack { regst: b_out } };
    assert_eq!(b.accept(&ack), Ok(Accepted::Declined));
    // Its Ready is taken like any other.
    assert_eq!(b.accept(&ready(b_id, a_id, a_out, 0)), Ok(Accepted::Runnable));
}
