//! Loom models of the cross-thread register protocol: real actors, real stream workers,
//! real router and inboxes (loom's mutex/condvar queue), on two loom threads. Register
//! memory is shadowed by loom cells, so a producer that rewrote a slot before its consumer
//! had acked it would be reported as a causality violation.
//!
//! A third loom thread can stand for a device driver's callback thread: a stream whose
//! kernels complete later, their writes and `ActDone`s delivered from that thread in launch
//! order (a `cuda` stream's queued work and its host callbacks).
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p regflow-runtime --lib --release loom`
//!
//! **Preemption bounds.** Each model explores every interleaving with at most a few
//! preemptions: 3 where that stays within seconds, 2 for the models of whole jobs on two
//! streams whose state space grows the most (3 took them 150–170 s each, most of CI's loom
//! time). Mutations tried on 2026-11-29: a lane's tail published `Relaxed` (a causality
//! violation) and a sender that never rings the doorbell (a deadlock) fail both models at 2
//! as at 3; a compute actor acking its inputs before its kernel ran (a causality violation)
//! fails `loom_ready_and_ack_cross_both_ways_and_eord_cascades` at 2; the doorbell lowered
//! with a store instead of a swap passes both at 3 as at 2, and fails the dedicated
//! two-thread lane model (`loom_two_threads_trading_through_lanes_never_both_sleep`), which
//! stays at 3.
//! `LOOM_MAX_PREEMPTIONS=n` (loom's own variable) runs every model of this module at `n`
//! instead, for a deeper check by hand.

use crate::arenas::PlanArenas;
use crate::bus::Router;
use crate::device::{CpuStream, DeviceStream, Launched};
use crate::inbox::{inbox, Envelope, InboxSender};
use crate::kernel::{Kernel, KernelError, KernelIo, StreamContext};
use crate::stream::{ActorRuntime, JobShared, StreamWorker};
use crate::sync::Arc;
use loom::cell::UnsafeCell;
use regflow_actors::{Actor, ActorId, Body, Cmd, Completion, Message, PlanIds};
use regflow_memory::BufferView;
use regflow_plan::{
    ActorIndex, ActorKind, DeviceKind, KernelConf, Plan, PlanBuilder, PlanIndex, SourcePieces, StreamKind,
};
use std::collections::VecDeque;
use std::time::Duration;

/// One shadow cell per slot of each register descriptor; the kernels touch the shadow of
/// the slot they read or write, so loom checks those accesses are ordered.
struct Shadow {
    slots: Vec<Vec<UnsafeCell<u64>>>,
}

// SAFETY: this is the claim under test: the register protocol never lets two threads touch
// one slot concurrently. Loom's cells check every access against that claim.
unsafe impl Sync for Shadow {}
// SAFETY: as above.
unsafe impl Send for Shadow {}

/// Writes the piece into the shadow of its output slot (slots cycle in piece order).
struct Write {
    shadow: std::sync::Arc<Shadow>,
    desc: usize,
}

impl Kernel for Write {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let slots = &self.shadow.slots[self.desc];
        let piece = io.piece();
        slots[(piece % slots.len() as u64) as usize].with_mut(|p| unsafe { *p = piece });
        Ok(())
    }
}

/// What a device's driver thread does for a stream whose work completes later, in launch
/// order: a kernel's write of its output slot, and a firing's `ActDone` to its stream.
enum Queued {
    Write {
        desc: usize,
        piece: u64,
    },
    Done {
        inbox: InboxSender,
        actor: ActorId,
    },
    /// The stream is gone (loom's channels do not report their senders' end).
    End,
}

/// [`Write`] as queued device work: the write happens on the driver's thread, later.
struct QueuedWrite {
    queue: loom::sync::mpsc::Sender<Queued>,
    desc: usize,
}

impl Kernel for QueuedWrite {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let queued = Queued::Write { desc: self.desc, piece: io.piece() };
        self.queue.send(queued).map_err(|_| KernelError("the driver thread is gone".into()))
    }
}

/// A stream whose firings complete on the driver's thread (what a `cuda` stream does for a
/// firing someone off the stream waits for: its completion callback, after its work). A
/// staged feed on a copy stream is such a firing: its copy lands, then its consumers hear.
struct QueuedStream {
    queue: loom::sync::mpsc::Sender<Queued>,
    inbox: InboxSender,
}

impl DeviceStream for QueuedStream {
    fn launch(
        &mut self,
        actor: ActorId,
        kernel: &mut dyn Kernel,
        io: &mut KernelIo<'_>,
        _modeled: Duration,
        _timed: Option<crate::device::SliceTag>,
        completion_wanted: bool,
    ) -> Result<Launched, KernelError> {
        kernel.run(io)?;
        if !completion_wanted {
            return Ok(Launched { completion: Completion::Done, span: None });
        }
        let done = Queued::Done { inbox: self.inbox.clone(), actor };
        self.queue.send(done).map_err(|_| KernelError("the driver thread is gone".into()))?;
        Ok(Launched { completion: Completion::Pending, span: None })
    }
}

impl Drop for QueuedStream {
    fn drop(&mut self) {
        let _ = self.queue.send(Queued::End);
    }
}

/// The driver's thread: performs the queued writes and sends the queued `ActDone`s, in
/// order, until the stream is gone.
fn drive(queue: loom::sync::mpsc::Receiver<Queued>, shadow: std::sync::Arc<Shadow>) {
    while let Ok(queued) = queue.recv() {
        match queued {
            Queued::Write { desc, piece } => {
                let slots = &shadow.slots[desc];
                slots[(piece % slots.len() as u64) as usize].with_mut(|p| unsafe { *p = piece });
            }
            Queued::Done { inbox, actor } => {
                let _ = inbox.send(Envelope::Actor(Message { dst: actor, src: actor, body: Body::ActDone }));
            }
            Queued::End => break,
        }
    }
}

/// Reads the shadow of its input slot, checks it holds this piece, then writes its output.
struct ReadThenWrite {
    shadow: std::sync::Arc<Shadow>,
    input: usize,
    output: Option<usize>,
}

impl Kernel for ReadThenWrite {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let piece = io.piece();
        let slots = &self.shadow.slots[self.input];
        let seen = slots[(piece % slots.len() as u64) as usize].with(|p| unsafe { *p });
        if seen != piece {
            return Err(KernelError(format!("read piece {seen} while consuming piece {piece}")));
        }
        if let Some(output) = self.output {
            let slots = &self.shadow.slots[output];
            slots[(piece % slots.len() as u64) as usize].with_mut(|p| unsafe { *p = piece });
        }
        Ok(())
    }
}

/// `source (stream 0) -> middle (stream 1) -> sink (stream 0)`: Ready and Ack cross the
/// threads in both directions.
fn ping_pong_plan(register_num: u32, pieces: u64, with_middle: bool) -> Plan {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s0 = b.stream(cpu, StreamKind::Compute);
    let s1 = b.stream(cpu, StreamKind::Compute);
    let src = b.actor("src", s0, ActorKind::Source { pieces: SourcePieces::Count(pieces) });
    let mut last = b.regst("src.out", src, 8, register_num);
    if with_middle {
        let middle = b.actor("middle", s1, ActorKind::Compute { kernel: KernelConf::Noop });
        b.consume(middle, last);
        last = b.regst("middle.out", middle, 8, register_num);
    }
    let sink = b.actor("sink", if with_middle { s0 } else { s1 }, ActorKind::Sink);
    b.consume(sink, last);
    b.build().unwrap()
}

/// A cpu stream whose device reports a failure of its queued work when the stream's actors
/// are done (what a `cuda` kernel that nobody off its stream waited for may do).
struct FinishFails(CpuStream);

impl DeviceStream for FinishFails {
    fn launch(
        &mut self,
        actor: regflow_actors::ActorId,
        kernel: &mut dyn Kernel,
        io: &mut KernelIo<'_>,
        modeled: Duration,
        timed: Option<crate::device::SliceTag>,
        completion_wanted: bool,
    ) -> Result<Launched, KernelError> {
        self.0.launch(actor, kernel, io, modeled, timed, completion_wanted)
    }

    fn finish(&mut self) -> Result<(), KernelError> {
        Err(KernelError("an illegal address in a queued kernel".into()))
    }
}

/// Runs `plan` on two loom threads.
fn run_model(plan: &Plan) {
    if let Some(error) = run_model_on(plan, None) {
        panic!("job failed: {error}");
    }
}

/// How the model runs one stream's kernels.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Device {
    /// At launch, on the stream thread.
    Cpu,
    /// At launch, but the device reports a failure of queued work at the end.
    FinishFails,
    /// Queued: writes and completions on a driver thread ([`QueuedStream`]).
    Queued,
}

/// Runs `plan` on two stream threads; stream `failing` (if any) has a device whose queued
/// work fails at the end. Returns the job's error, after checking every actor's counts
/// when there is none.
fn run_model_on(plan: &Plan, failing: Option<usize>) -> Option<crate::RuntimeError> {
    let devices = [0, 1].map(|s| if failing == Some(s) { Device::FinishFails } else { Device::Cpu });
    run_model_with(plan, devices)
}

/// [`run_model_on`] with each stream's device given.
fn run_model_with(plan: &Plan, devices: [Device; 2]) -> Option<crate::RuntimeError> {
    let ids = PlanIds::assign(plan).unwrap();
    let indexed = PlanIndex::new(plan);
    let memory = plan.memory().unwrap();
    let arenas = Arc::new(PlanArenas::allocate(plan, &memory, None, &Default::default()).unwrap());
    let shadow = std::sync::Arc::new(Shadow {
        slots: plan
            .regst_descs
            .iter()
            .map(|d| (0..d.register_num).map(|_| UnsafeCell::new(u64::MAX)).collect())
            .collect(),
    });
    let (tx0, mut rx0) = inbox(64);
    let (tx1, mut rx1) = inbox(64);
    // The streams talk through lanes, as in a job (their channels carry the rest).
    let mut lanes = [crate::lane::Lanes::new(2), crate::lane::Lanes::new(2)];
    lanes[0].insert(1, rx1.lane(16, tx1.clone(), Default::default(), (0, 1)));
    lanes[1].insert(0, rx0.lane(16, tx0.clone(), Default::default(), (1, 0)));
    let inboxes = [tx0.clone(), tx1.clone()];
    let router = Router::new(None, vec![vec![0, 1]], vec![Some(tx0.clone()), Some(tx1)], None);
    let (queue, driven) = loom::sync::mpsc::channel();
    let driver = devices.contains(&Device::Queued).then(|| {
        let shadow = shadow.clone();
        loom::thread::spawn(move || drive(driven, shadow))
    });
    let (snapshots, _) = crossbeam_channel::unbounded();
    let shared = Arc::new(JobShared::new(2, snapshots, Default::default()));
    let mut workers = Vec::new();
    for ((s, rx), lanes) in [(0usize, rx0), (1usize, rx1)].into_iter().zip(lanes) {
        let mut actors = Vec::new();
        let mut runtimes = Vec::new();
        for (a, desc) in plan.actors.iter().enumerate() {
            if desc.stream.index() != s {
                continue;
            }
            let index = ActorIndex(a as u32);
            let outputs: Vec<usize> = indexed.outputs_of(index).iter().map(|r| r.index()).collect();
            let kernel: Box<dyn Kernel> = match desc.kind {
                ActorKind::Source { .. } if devices[s] == Device::Queued => {
                    Box::new(QueuedWrite { queue: queue.clone(), desc: outputs[0] })
                }
                ActorKind::Source { .. } => Box::new(Write { shadow: shadow.clone(), desc: outputs[0] }),
                _ => Box::new(ReadThenWrite {
                    shadow: shadow.clone(),
                    input: desc.inputs[0].index(),
                    output: outputs.first().copied(),
                }),
            };
            actors.push(Actor::from_plan(&indexed, &ids, index));
            runtimes.push(ActorRuntime {
                name: desc.name.clone(),
                kernel: Some(kernel),
                modeled: Duration::ZERO,
                plan_index: a as u32,
                input_descs: desc.inputs.clone(),
                windows: Box::default(),
                pending_slices: VecDeque::new(),
                held_bytes: 0,
            });
        }
        let stream_id = actors[0].id().stream_id();
        let device: Box<dyn DeviceStream> = match devices[s] {
            Device::Cpu => Box::new(CpuStream),
            Device::FinishFails => Box::new(FinishFails(CpuStream)),
            Device::Queued => Box::new(QueuedStream { queue: queue.clone(), inbox: inboxes[s].clone() }),
        };
        let runnable = regflow_actors::RunQueue::new(actors.len());
        workers.push(StreamWorker {
            index: s,
            label: format!("stream {s}"),
            stream_id,
            actors,
            runtimes,
            local: VecDeque::new(),
            runnable,
            inbox: rx,
            lanes,
            router: router.clone(),
            device,
            memory: arenas.clone(),
            shared: shared.clone(),
            trace: None,
            scratch_inputs: vec![BufferView::empty(); crate::job::max_arity(&indexed)].into_boxed_slice(),
            scratch_outputs: vec![BufferView::empty(); crate::job::max_arity(&indexed)].into_boxed_slice(),
            context: StreamContext::default(),
            _lent_scratch: None,
        });
    }
    drop((router, queue, inboxes));
    let source = ids.of(ActorIndex(0));
    tx0.send(Envelope::Actor(Message { dst: source, src: source, body: Body::Cmd(Cmd::Start) })).unwrap();
    drop(tx0);
    let handles: Vec<_> = workers.into_iter().map(|w| loom::thread::spawn(move || w.run())).collect();
    let exits: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    if let Some(driver) = driver {
        driver.join().unwrap();
    }
    if let Some(error) = crate::sync::lock(&shared.error).take() {
        return Some(error);
    }
    let pieces = match plan.actors[0].kind {
        ActorKind::Source { pieces: SourcePieces::Count(n) } => n,
        _ => unreachable!(),
    };
    for stats in exits.iter().flat_map(|e| &e.snapshots) {
        assert!(stats.finished, "{} did not finish", stats.name);
        assert_eq!(stats.fires, pieces, "{} fired {} times", stats.name, stats.fires);
        for &(max, register_num) in &stats.max_in_flight {
            assert!(max <= register_num, "{} had {max} pieces in flight with {register_num} registers", stats.name);
        }
    }
    None
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    model_bounded(3, f);
}

/// [`model`] with at most `preemptions` preemptions, unless `LOOM_MAX_PREEMPTIONS` says
/// otherwise (see the module's docs).
fn model_bounded(preemptions: usize, f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    if std::env::var_os("LOOM_MAX_PREEMPTIONS").is_none() {
        builder.preemption_bound = Some(preemptions);
    }
    builder.check(f);
}

#[test]
fn loom_one_register_is_rewritten_only_after_the_cross_thread_ack() {
    model(|| run_model(&ping_pong_plan(1, 2, false)));
}

#[test]
fn loom_two_registers_let_the_producer_run_ahead_safely() {
    // Bound 2: see the module's docs.
    model_bounded(2, || run_model(&ping_pong_plan(2, 3, false)));
}

/// The middle actor (stream 1) sends its `Ready` to the sink and its `Ack` to the source,
/// both on stream 0: they travel as one `Envelope::Pair`, in every interleaving.
#[test]
fn loom_ready_and_ack_cross_both_ways_and_eord_cascades() {
    // Bound 2: see the module's docs.
    model_bounded(2, || run_model(&ping_pong_plan(1, 2, true)));
}

/// Work a device still had queued when its stream's actors finished fails: the job ends
/// with that error, naming the stream, in every interleaving (not a success, not a hang).
#[test]
fn loom_a_failure_of_queued_work_after_the_last_firing_fails_the_job() {
    model(|| {
        let error = run_model_on(&ping_pong_plan(1, 2, false), Some(1));
        match error {
            Some(crate::RuntimeError::QueuedWorkFailed { stream, message }) => {
                assert_eq!(stream, "stream 1");
                assert!(message.contains("illegal address"), "{message}");
            }
            other => panic!("expected QueuedWorkFailed, got {other:?}"),
        }
    });
}

/// A source whose firings complete on the driver's thread (a staged feed on a `cuda` copy
/// stream: the copy is queued, the callback after it tells the consumers): its consumer on
/// the other stream reads a slot only after the queued write landed, and the source writes
/// its one slot again only after that read was acked.
#[test]
fn loom_a_source_completing_on_the_drivers_thread_is_read_only_after_its_write() {
    // A fourth thread (the driver's) multiplies the interleavings: preemptions bounded at
    // 2, not 3, keep the model to CI's budget.
    model_bounded(2, || {
        let error = run_model_with(&ping_pong_plan(1, 2, false), [Device::Queued, Device::Cpu]);
        assert!(error.is_none(), "job failed: {error:?}");
    });
}

/// The receiver's bounded spin, then park: an envelope sent while it spins, or after it
/// parked, is received, in order, and the senders' going away ends the wait.
#[test]
fn loom_spinning_receiver_gets_every_envelope_then_the_end() {
    model(|| {
        let (tx, rx) = inbox(4);
        let sender = loom::thread::spawn(move || {
            tx.send(Envelope::Snapshot).unwrap();
            tx.send(Envelope::Stop).unwrap();
        });
        assert_eq!(rx.recv_spinning(), Some(Envelope::Snapshot));
        assert_eq!(rx.recv_spinning(), Some(Envelope::Stop));
        assert_eq!(rx.recv_spinning(), None);
        sender.join().unwrap();
    });
}

/// An inbox whose only sender is a lane, and a loom thread that sends a `Snapshot` then a
/// `Stop` through that lane and ends (which ends the inbox's channel).
fn lane_sending_snapshot_then_stop() -> (crate::inbox::InboxReceiver, loom::thread::JoinHandle<()>) {
    let (tx, mut rx) = inbox(4);
    let lane = rx.lane(2, tx, Default::default(), (0, 1));
    let sender = loom::thread::spawn(move || {
        lane.send(Envelope::Snapshot).unwrap();
        lane.send(Envelope::Stop).unwrap();
    });
    (rx, sender)
}

/// A lane into a receiver that goes to sleep: whatever the interleaving of the sender's
/// publish-then-look and the receiver's raise-then-look, every envelope arrives, in order,
/// through the lane (never lost in a lane while the receiver sleeps), and the end of the
/// senders ends the wait.
#[test]
fn loom_a_lane_wakes_its_sleeping_receiver_and_keeps_order() {
    model(|| {
        let (rx, sender) = lane_sending_snapshot_then_stop();
        assert_eq!(rx.recv(), Some(Envelope::Snapshot));
        assert_eq!(rx.recv(), Some(Envelope::Stop));
        // A wake-up the sender sent while the receiver found the envelope anyway is not
        // returned; the channel ends with the lane's sender.
        assert_eq!(rx.recv(), None);
        sender.join().unwrap();
    });
}

/// A sleep that ends at a deadline (a `sim` stream waiting for its kernel's modeled end)
/// races a lane's sender: the receiver raises its doorbell, finds nothing, times out
/// (under loom, at once) and lowers the doorbell, while the sender publishes and looks
/// at the doorbell. Whatever the interleaving, the envelopes come through in order on a
/// later look, and none is lost in the lane or returned twice.
#[test]
fn loom_a_sleep_that_times_out_loses_nothing_a_lane_sent() {
    model(|| {
        let (rx, sender) = lane_sending_snapshot_then_stop();
        let due = std::time::Instant::now();
        let mut got = Vec::new();
        while got.len() < 2 {
            match rx.park(Some(due)) {
                Ok(envelope) => got.push(envelope),
                Err(crate::inbox::Waited::Due) => loom::thread::yield_now(),
                Err(crate::inbox::Waited::Closed) => panic!("the inbox closed with {got:?} received"),
            }
        }
        assert_eq!(got, [Envelope::Snapshot, Envelope::Stop]);
        assert_eq!(rx.recv(), None);
        sender.join().unwrap();
    });
}

/// Two threads that each send through a lane and then sleep on their own inbox, round
/// after round, as two stream threads of a chain do: nobody sleeps with an envelope left
/// in its lane. (With the receiver lowering its doorbell by a plain store, loom finds the
/// deadlock: a sender's swap ordered before that store, the next raise reading the store.)
#[test]
fn loom_two_threads_trading_through_lanes_never_both_sleep() {
    model(|| {
        let (tx_a, mut rx_a) = inbox(4);
        let (tx_b, mut rx_b) = inbox(4);
        let to_a = rx_a.lane(4, tx_a, Default::default(), (1, 0));
        let to_b = rx_b.lane(4, tx_b, Default::default(), (0, 1));
        const ROUNDS: usize = 2;
        let other = loom::thread::spawn(move || {
            for _ in 0..ROUNDS {
                to_b.send(Envelope::Snapshot).unwrap();
                assert_eq!(rx_a.recv(), Some(Envelope::Snapshot));
            }
        });
        for _ in 0..ROUNDS {
            assert_eq!(rx_b.recv(), Some(Envelope::Snapshot));
            to_a.send(Envelope::Snapshot).unwrap();
        }
        other.join().unwrap();
    });
}

/// A lane and the channel into one sleeping receiver: an envelope of each arrives.
#[test]
fn loom_a_receiver_sleeping_on_lane_and_channel_gets_both() {
    model(|| {
        let (tx, mut rx) = inbox(4);
        let lane = rx.lane(2, tx.clone(), Default::default(), (0, 1));
        let from_lane = loom::thread::spawn(move || lane.send(Envelope::Snapshot).unwrap());
        let from_channel = loom::thread::spawn(move || tx.send(Envelope::Stop).unwrap());
        let mut got = Vec::new();
        while got.len() < 2 {
            match rx.recv() {
                Some(envelope) => got.push(envelope),
                None => panic!("the channel ended before both envelopes arrived: {got:?}"),
            }
        }
        got.sort_by_key(|e| matches!(e, Envelope::Stop));
        assert_eq!(got, [Envelope::Snapshot, Envelope::Stop]);
        from_lane.join().unwrap();
        from_channel.join().unwrap();
    });
}

/// One register per member, each a loom cell.
struct Registers([UnsafeCell<u64>; 2]);

// SAFETY: the claim under test: the rendezvous never lets a peer read a register while its
// owner rewrites it. Loom's cells check every access against that claim.
unsafe impl Sync for Registers {}

/// Two members, two rounds, through the real rendezvous: each member's "register" is a loom
/// cell that its owner rewrites as soon as `round` returns (what its producer does after the
/// ack). A peer that read a cell after its owner's release would be a causality violation;
/// every member must see the sum of both members' values of the same round.
#[test]
fn loom_rendezvous_members_see_the_full_sum_and_read_nothing_after_release() {
    use crate::collective::{PeerInput, Rendezvous};
    model(|| {
        const ROUNDS: u64 = 2;
        let rendezvous = Arc::new(Rendezvous::new("g", 2));
        let cells = std::sync::Arc::new(Registers([UnsafeCell::new(0u64), UnsafeCell::new(0u64)]));
        let value = |rank: usize, round: u64| 10 * round + rank as u64 + 1;
        let member = |rank: usize| {
            let (rendezvous, cells) = (rendezvous.clone(), cells.clone());
            move || {
                let mut peers = [PeerInput::new(&[]); 2];
                for round in 0..ROUNDS {
                    // The producer writes this member's register for the round.
                    cells.0[rank].with_mut(|v| unsafe { *v = value(rank, round) });
                    // Publish the cell's address (as an empty byte slice there).
                    // SAFETY: a zero-length slice at a valid, non-null address.
                    let at =
                        unsafe { std::slice::from_raw_parts(&cells.0[rank] as *const UnsafeCell<u64> as *const u8, 0) };
                    let mine = PeerInput::new(at);
                    let sum = rendezvous
                        .round(rank, mine, &mut peers, |peers| {
                            (0..2)
                                .map(|r| {
                                    // SAFETY: the rendezvous published a pointer to cell `r`.
                                    let cell = unsafe { &*(peers.addr(r) as *const UnsafeCell<u64>) };
                                    cell.with(|v| unsafe { *v })
                                })
                                .sum::<u64>()
                        })
                        .unwrap();
                    assert_eq!(sum, value(0, round) + value(1, round), "rank {rank}, round {round}");
                }
            }
        };
        let other = loom::thread::spawn(member(1));
        member(0)();
        other.join().unwrap();
    });
}

/// An abort racing with the arrivals: the members agree on whether the round happened
/// (both computed, or both failed), and nobody waits for ever.
#[test]
fn loom_rendezvous_abort_wakes_waiters_and_members_agree_on_the_round() {
    use crate::collective::{PeerInput, Rendezvous};
    model(|| {
        let rendezvous = Arc::new(Rendezvous::new("g", 2));
        let member = |rank: usize| {
            let rendezvous = rendezvous.clone();
            move || {
                let mut peers = [PeerInput::new(&[]); 2];
                rendezvous.round(rank, PeerInput::new(&[]), &mut peers, |_| ()).is_ok()
            }
        };
        let other = loom::thread::spawn(member(1));
        let aborter = {
            let rendezvous = rendezvous.clone();
            loom::thread::spawn(move || rendezvous.abort())
        };
        let mine = member(0)();
        let theirs = other.join().unwrap();
        aborter.join().unwrap();
        assert_eq!(mine, theirs, "one member computed the round while the other failed it");
    });
}
