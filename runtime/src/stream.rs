//! A stream thread: runs every actor of one stream, serially. A `Ready` or `Ack` between
//! two of its running actors is taken straight into the recipient's slot state, which then
//! waits in a run queue if it can fire; other messages between its own actors go through a
//! local queue, and other threads' messages arrive in its inbox. It blocks only on an empty
//! inbox, and ends when all its actors are done or the job aborts.

use crate::arenas::PlanArenas;
use crate::bus::Router;
use crate::collective::CollectiveGroups;
use crate::device::{DeviceStream, SliceTag};
use crate::inbox::{Envelope, InboxReceiver, Waited};
use crate::kernel::{Kernel, KernelIo, StreamContext};
use crate::lane::Lanes;
use crate::sync::{lock, Arc, AtomicBool, AtomicU64, Mutex, Ordering};
use crate::trace::{flow_id, TraceBuffer, TraceEvent};
use crate::RuntimeError;
use crossbeam_utils::CachePadded;
use regflow_actors::{
    Accepted, Actor, ActorEnv, ActorError, ActorId, ActorSnapshot, Body, Completion, EnvError, Firing, Lifecycle,
    Message, RunQueue, StreamId,
};
use regflow_memory::BufferView;
use regflow_plan::RegstDescId;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Most envelopes moved from the inbox to the local queue at once. The local queue is
/// allocated with room for every message it can hold (`job/setup.rs`,
/// `local_queue_capacity`), so it never grows.
pub(crate) const INBOX_BATCH: usize = 64;

/// What the watchdog and the job can see of a stream thread, without locks on the hot path.
#[derive(Debug, Default)]
pub(crate) struct StreamProbe {
    /// Firings so far.
    pub(crate) fires: CachePadded<AtomicU64>,
    /// Bits + 1 of the actor whose kernel is running, 0 when none.
    pub(crate) in_kernel: AtomicU64,
    /// Set when the thread has left its loop.
    pub(crate) exited: AtomicBool,
}

impl StreamProbe {
    /// The stream's kernel returned: none runs now, and one more firing is done.
    #[inline(always)]
    fn finished_kernel(&self) {
        self.in_kernel.store(0, Ordering::Relaxed);
        // One writer (this thread): a plain store avoids a locked read-modify-write.
        self.fires.store(self.fires.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    }
}

/// State shared by every thread of a job.
#[derive(Debug)]
pub(crate) struct JobShared {
    pub(crate) probes: Vec<StreamProbe>,
    /// The first error; later ones are consequences of the abort.
    pub(crate) error: Mutex<Option<RuntimeError>>,
    pub(crate) aborting: AtomicBool,
    /// Where threads answer the watchdog's snapshot requests: (stream, snapshots).
    pub(crate) snapshots: crossbeam_channel::Sender<(usize, Vec<ActorSnapshot>)>,
    /// Rendezvous of the job's collectives: a stream thread blocked in one does not read
    /// its inbox, so an abort wakes them directly.
    pub(crate) collectives: std::sync::Arc<CollectiveGroups>,
    /// Wakes the program's threads blocked on the job (a push waiting for a buffer) the
    /// moment it aborts, instead of their polling `aborting`.
    pub(crate) abort_signal: AbortSignal,
    /// Sends of stream threads that found no room (in a lane, or in the queue to another
    /// node), and whom each thread waits on now.
    pub(crate) send_waits: std::sync::Arc<crate::send_waits::SendWaits>,
}

/// A channel that carries nothing and disconnects when the job aborts: a thread that waits
/// on the job selects on it next to what it waits for.
#[derive(Debug)]
pub(crate) struct AbortSignal {
    sender: std::sync::Mutex<Option<crossbeam_channel::Sender<()>>>,
    receiver: crossbeam_channel::Receiver<()>,
}

impl AbortSignal {
    pub(crate) fn new() -> Self {
        // Capacity 1, not 0: selecting on a zero-capacity channel allocates a packet per
        // blocking wait, and a push may wait once per piece (nothing is ever sent anyway).
        let (sender, receiver) = crossbeam_channel::bounded(1);
        Self { sender: std::sync::Mutex::new(Some(sender)), receiver }
    }

    /// Disconnects: every `recv` on [`AbortSignal::receiver`] returns at once, now and later.
    fn fire(&self) {
        let mut sender = self.sender.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        sender.take();
    }

    /// Never receives a value; disconnected once the job aborted.
    pub(crate) fn receiver(&self) -> &crossbeam_channel::Receiver<()> {
        &self.receiver
    }
}

impl JobShared {
    /// The state of a job of `streams` streams, before any error.
    pub(crate) fn new(
        streams: usize,
        snapshots: crossbeam_channel::Sender<(usize, Vec<ActorSnapshot>)>,
        collectives: std::sync::Arc<CollectiveGroups>,
    ) -> Self {
        let abort_signal = AbortSignal::new();
        Self {
            probes: (0..streams).map(|_| StreamProbe::default()).collect(),
            error: Mutex::new(None),
            aborting: AtomicBool::new(false),
            snapshots,
            collectives,
            send_waits: std::sync::Arc::new(crate::send_waits::SendWaits::new(
                streams,
                abort_signal.receiver().clone(),
            )),
            abort_signal,
        }
    }

    /// Records the first error and tells every stream to stop.
    pub(crate) fn abort(&self, error: RuntimeError, router: &Router) {
        {
            let mut slot = lock(&self.error);
            if slot.is_none() {
                *slot = Some(error);
            }
        }
        if !self.aborting.swap(true, Ordering::AcqRel) {
            router.abort_peers(lock(&self.error).as_ref().unwrap_or(&RuntimeError::Stopped));
            router.broadcast(Envelope::Stop);
            self.collectives.abort_all();
            self.abort_signal.fire();
        }
    }
}

/// The runtime side of one actor: its kernel and what tracing needs.
pub(crate) struct ActorRuntime {
    /// Actor name, for the per-firing `tracing` span.
    pub(crate) name: String,
    pub(crate) kernel: Option<Box<dyn Kernel>>,
    pub(crate) modeled: Duration,
    pub(crate) plan_index: u32,
    pub(crate) input_descs: Vec<RegstDescId>,
    /// Per input, the window (offset, bytes) its kernel reads, if any; empty when none has
    /// one (the plan's `InputWindow`s, checked against their registers when it loaded).
    pub(crate) windows: Box<[Option<(usize, usize)>]>,
    /// Modeled (start, end) of launches not yet completed, oldest first (for flow arrows).
    pub(crate) pending_slices: VecDeque<(Instant, Instant)>,
    /// What the kernel held between firings when it was dropped, at the actor's end
    /// ([`ActorStats::held_bytes`]).
    pub(crate) held_bytes: u64,
}

impl ActorRuntime {
    /// What its kernel keeps between firings ([`Kernel::held_bytes`](regflow_kernels::Kernel::held_bytes)),
    /// or kept when it was dropped.
    fn kernel_held_bytes(&self) -> u64 {
        self.kernel.as_ref().map_or(self.held_bytes, |k| k.held_bytes())
    }
}

impl std::fmt::Debug for ActorRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActorRuntime").field("plan_index", &self.plan_index).finish_non_exhaustive()
    }
}

/// Everything one stream thread owns.
pub(crate) struct StreamWorker {
    pub(crate) index: usize,
    /// The stream's name in errors (`node0/cuda:0 Compute#0`).
    pub(crate) label: String,
    pub(crate) stream_id: StreamId,
    pub(crate) actors: Vec<Actor>,
    pub(crate) runtimes: Vec<ActorRuntime>,
    pub(crate) local: VecDeque<Message>,
    /// Actors that a message taken straight in made able to fire.
    pub(crate) runnable: RunQueue,
    pub(crate) inbox: InboxReceiver,
    /// Its lanes to the other streams it shares registers with (the rest goes through
    /// the router).
    pub(crate) lanes: Lanes,
    pub(crate) router: Router,
    pub(crate) device: Box<dyn DeviceStream>,
    pub(crate) memory: Arc<PlanArenas>,
    pub(crate) shared: Arc<JobShared>,
    pub(crate) trace: Option<TraceBuffer>,
    /// The views of a firing's inputs and outputs, overwritten by every launch: as many as
    /// the plan's most inputs (or outputs) of an actor, so a firing writes them by index,
    /// with no length or capacity bookkeeping.
    pub(crate) scratch_inputs: Box<[BufferView]>,
    pub(crate) scratch_outputs: Box<[BufferView]>,
    /// What kernels on this stream learn of it (device, threads per kernel, scratch).
    pub(crate) context: StreamContext,
    /// The memory of `context.scratch`, kept as long as the kernels that use it.
    pub(crate) _lent_scratch: Option<Box<dyn regflow_memory::ArenaMemory>>,
}

impl std::fmt::Debug for StreamWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamWorker").field("index", &self.index).finish_non_exhaustive()
    }
}

/// What a finished stream thread hands back.
#[derive(Debug)]
pub(crate) struct StreamExit {
    pub(crate) trace: Option<TraceBuffer>,
    pub(crate) snapshots: Vec<ActorStats>,
}

/// Counters of one actor at the end of a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActorStats {
    /// Actor name.
    pub name: String,
    /// Times it fired.
    pub fires: u64,
    /// Per output: most pieces in flight at once, and its `register_num`.
    pub max_in_flight: Vec<(u32, u32)>,
    /// Per input: most slots held at once, and the producer's `register_num`.
    pub max_held: Vec<(u32, usize)>,
    /// Whether it finished (not stopped by an abort).
    pub finished: bool,
    /// Bytes its kernel kept between firings outside the plan's registers when the job
    /// ended ([`Kernel::held_bytes`](regflow_kernels::Kernel::held_bytes): a product's
    /// packed panels of a weight that every micro-batch of a step reads), which the plan's
    /// memory layout does not count.
    pub held_bytes: u64,
}

/// What the actors of one stream share: the worker's parts the actors do not own. Made
/// once per drain of the local queue, not per turn: `current` says whose turn it is. Its
/// `ActorEnv` queues every message; a turn's [`Turn`] takes same-stream ones straight in
/// first.
struct Env<'w> {
    stream_id: StreamId,
    local: &'w mut VecDeque<Message>,
    runnable: &'w mut RunQueue,
    /// The error of a recipient that refused a message taken straight in: reported as
    /// the recipient's, not as the sender's failure to send.
    refused: Option<ActorError>,
    router: &'w Router,
    lanes: &'w Lanes,
    device: &'w mut dyn DeviceStream,
    runtimes: &'w mut [ActorRuntime],
    /// Index of the actor whose turn it is (a message handled or a run after `accept`).
    current: usize,
    /// Whether a `tracing` subscriber wants the per-firing spans (asked once per thread:
    /// asking per firing costs more than a no-op kernel).
    fire_spans: bool,
    memory: &'w PlanArenas,
    probe: &'w StreamProbe,
    trace: Option<&'w mut TraceBuffer>,
    scratch_inputs: &'w mut [BufferView],
    scratch_outputs: &'w mut [BufferView],
    context: &'w StreamContext,
    stream_index: usize,
    /// The firing whose messages are being sent: flow arrows start inside its slice.
    anchor: Option<(Instant, Instant)>,
    /// The device runs kernels inside its launch ([`DeviceStream::runs_at_launch`]).
    runs_at_launch: bool,
    /// A message for another stream of this node, held back in case the same firing
    /// sends a second one there (then both go as one [`Envelope::Pair`]). Sent before the
    /// next launch and once the actor's message is handled ([`Env::flush`]), so nothing
    /// waits behind a kernel or a blocked thread.
    outbox: Option<Message>,
}

impl Env<'_> {
    /// Records the flow arrow of a `Ready` sent by the firing being traced.
    #[cold]
    fn trace_flow_out(&mut self, msg: &Message) {
        if let (Some(trace), Body::Ready { regst, piece, .. }, Some((start, end))) =
            (self.trace.as_deref_mut(), msg.body, self.anchor)
        {
            let at = if end > start { end - Duration::from_nanos(1) } else { start };
            trace.events.push(TraceEvent::FlowOut { id: flow_id(regst.desc, piece, msg.dst), at });
        }
    }
}

impl Env<'_> {
    /// [`ActorEnv::send`] to another stream or node, or with a trace to write.
    #[inline(never)]
    fn send_elsewhere_or_traced(&mut self, msg: Message) -> Result<(), EnvError> {
        if self.trace.is_some() {
            self.trace_flow_out(&msg);
        }
        if msg.dst.stream_id() == self.stream_id {
            self.local.push_back(msg);
            Ok(())
        } else if self.router.hosts(msg.dst.node()) {
            self.hold_or_pair(msg)
        } else {
            self.router.send(msg)
        }
    }

    /// Holds `msg` for another stream of this node, or sends it with the held one as a
    /// pair when both go to the same stream (in the order they were sent).
    fn hold_or_pair(&mut self, msg: Message) -> Result<(), EnvError> {
        match self.outbox.replace(msg) {
            None => Ok(()),
            Some(held) if held.dst.stream_id() == msg.dst.stream_id() => {
                self.outbox = None;
                self.deliver(held, Some(msg))
            }
            Some(held) => self.deliver(held, None),
        }
    }

    /// Hands `first` (and `then`, for the same stream) to the stream of this node that
    /// runs `first.dst`, in one envelope: through the lane to it, if the plan gave the two
    /// streams one, else through the router. Either way the order of what this thread
    /// sends there is kept, since it always takes the same way.
    #[inline]
    fn deliver(&self, first: Message, then: Option<Message>) -> Result<(), EnvError> {
        let dst = first.dst;
        match (self.router.stream_index(dst).and_then(|s| self.lanes.to(s)), then) {
            (Some(lane), None) => lane.send(Envelope::Actor(first)),
            (Some(lane), Some(then)) => lane.send(Envelope::Pair(first, then)),
            (None, None) => return self.router.send(first),
            (None, Some(then)) => return self.router.send_pair(first, then),
        }
        .map_err(|_| EnvError::Disconnected { dst })
    }

    /// Sends the held message, if any.
    #[inline(always)]
    fn flush(&mut self) -> Result<(), EnvError> {
        if self.outbox.is_none() {
            return Ok(());
        }
        self.send_held()
    }

    #[inline(never)]
    fn send_held(&mut self) -> Result<(), EnvError> {
        match self.outbox.take() {
            None => Ok(()),
            Some(held) => self.deliver(held, None),
        }
    }
}

impl ActorEnv for Env<'_> {
    /// A message for this stream is written straight into the local queue, field by
    /// field; one for another stream or node is passed to the out-of-line path by value.
    /// (Written into the queue first and taken back out, as before, the cross-stream
    /// message was read back with 16-byte loads over the fields' narrower stores, a
    /// store-forwarding stall on every one.)
    #[inline(always)]
    fn send(&mut self, msg: Message) -> Result<(), EnvError> {
        if msg.dst.stream_id() == self.stream_id && self.trace.is_none() {
            self.local.push_back(msg);
            return Ok(());
        }
        self.send_elsewhere_or_traced(msg)
    }

    #[inline(always)]
    fn launch(&mut self, firing: &Firing<'_>) -> Result<Completion, EnvError> {
        if self.fire_spans {
            // By value: a reference would keep the firing in memory on the usual path too.
            return self.launch_in_span(*firing);
        }
        self.launch_kernel(firing)
    }
}

/// The `ActorEnv` of one actor's turn: the stream's [`Env`] and every *other* actor of the
/// stream, so that a `Ready` or `Ack` for one of them goes straight into its state
/// ([`Actor::accept`]) instead of through the local queue. The actor whose turn it is
/// (`actors[current]`, borrowed by the caller) gets its own messages queued.
struct Turn<'t, 'w> {
    env: &'t mut Env<'w>,
    /// `actors[..current]`.
    before: &'t mut [Actor],
    /// `actors[current + 1..]`.
    after: &'t mut [Actor],
}

impl<'t, 'w> Turn<'t, 'w> {
    /// Splits `actors` around `current`, which the caller gets back.
    #[inline(always)]
    fn new(env: &'t mut Env<'w>, actors: &'t mut [Actor], current: usize) -> (Self, &'t mut Actor) {
        let (before, rest) = actors.split_at_mut(current);
        let Some((actor, after)) = rest.split_first_mut() else {
            unreachable!("the caller checked that actor {current} exists")
        };
        env.current = current;
        (Self { env, before, after }, actor)
    }

    /// The other actor with index `index` on this stream, if any, from the actors
    /// `before` and `after` the current one (borrowed apart from the rest of the turn).
    #[inline(always)]
    fn other<'a>(before: &'a mut [Actor], after: &'a mut [Actor], index: usize) -> Option<&'a mut Actor> {
        let current = before.len();
        if index < current {
            before.get_mut(index)
        } else {
            after.get_mut(index.checked_sub(current + 1)?)
        }
    }

    /// Hands a message for `index`, another actor of this stream, to its `accept`;
    /// returns whether it took it.
    #[inline(always)]
    fn deliver_here(&mut self, index: usize, msg: &Message) -> Result<bool, EnvError> {
        let Some(recipient) = Self::other(self.before, self.after, index) else { return Ok(false) };
        match accept_into(recipient, index, msg, self.env.runnable) {
            Ok(took) => Ok(took),
            Err(error) => Err(self.env.refuse(error, msg.dst)),
        }
    }
}

/// Hands `msg` to `recipient` (actor `index` of its stream) without running it
/// ([`Actor::accept`]) and queues its turn in `runnable` if it can now fire; whether it
/// took the message (a declined one must be handled in order, through the local queue).
#[inline(always)]
fn accept_into(
    recipient: &mut Actor,
    index: usize,
    msg: &Message,
    runnable: &mut RunQueue,
) -> Result<bool, ActorError> {
    match recipient.accept(msg)? {
        Accepted::Runnable => {
            runnable.push(index);
            Ok(true)
        }
        Accepted::Taken => Ok(true),
        Accepted::Declined => Ok(false),
    }
}

impl ActorEnv for Turn<'_, '_> {
    #[inline(always)]
    fn send(&mut self, msg: Message) -> Result<(), EnvError> {
        // Traced runs queue every message: the trace draws each one's flow arrow.
        if msg.dst.stream_id() == self.env.stream_id
            && self.env.trace.is_none()
            && self.deliver_here(msg.dst.index() as usize, &msg)?
        {
            return Ok(());
        }
        self.env.send(msg)
    }

    #[inline(always)]
    fn launch(&mut self, firing: &Firing<'_>) -> Result<Completion, EnvError> {
        self.env.launch(firing)
    }
}

impl Env<'_> {
    /// Keeps a recipient's refusal to report it as the recipient's error.
    #[cold]
    #[inline(never)]
    fn refuse(&mut self, error: ActorError, dst: ActorId) -> EnvError {
        self.refused = Some(error);
        EnvError::Refused { dst }
    }
}

impl Env<'_> {
    /// A launch inside a `fire` span, for a `tracing` subscriber that wants them.
    #[cold]
    #[inline(never)]
    fn launch_in_span(&mut self, firing: Firing<'_>) -> Result<Completion, EnvError> {
        let name = self.runtimes[self.current].name.as_str();
        let _span =
            tracing::trace_span!("fire", actor = name, piece = firing.piece, stream = self.stream_index).entered();
        self.launch_kernel(&firing)
    }

    /// Runs or queues the current actor's kernel: its inputs' and outputs' views, the
    /// device's launch, the watchdog's probe, and the trace's slice when tracing.
    #[inline(always)]
    fn launch_kernel(&mut self, firing: &Firing<'_>) -> Result<Completion, EnvError> {
        // What earlier firings sent must not wait for this kernel.
        self.flush()?;
        let runtime = &mut self.runtimes[self.current];
        // Written by index into arrays as long as the plan's widest actor (checked once
        // per firing by the slicing): no length or capacity to keep, as a push would.
        let (inputs, outputs) = (firing.inputs.len(), firing.outputs.len());
        let (input_views, output_views) = (&mut self.scratch_inputs[..inputs], &mut self.scratch_outputs[..outputs]);
        if runtime.windows.is_empty() {
            for (view, &r) in input_views.iter_mut().zip(firing.inputs) {
                *view = self.memory.view(r);
            }
        } else {
            for ((view, &r), window) in input_views.iter_mut().zip(firing.inputs).zip(runtime.windows.iter()) {
                let whole = self.memory.view(r);
                *view = match *window {
                    Some((offset, bytes)) => {
                        whole.window(offset, bytes).ok_or_else(|| outside_window(offset, bytes, whole.len()))?
                    }
                    None => whole,
                };
            }
        }
        for (view, &r) in output_views.iter_mut().zip(firing.outputs) {
            *view = self.memory.view(r);
        }
        let mut io = KernelIo::new(firing.piece, firing.group, input_views, output_views, self.context);
        let Some(kernel) = runtime.kernel.as_deref_mut() else {
            return Err(EnvError::Kernel("actor has no kernel (broken invariant)".into()));
        };
        let probe = self.probe;
        probe.in_kernel.store(firing.actor.bits() + 1, Ordering::Relaxed);
        let timed = self.trace.is_some().then_some(SliceTag { actor: runtime.plan_index, piece: firing.piece });
        if self.runs_at_launch && timed.is_none() {
            // What the device's launch would do, without the call through it (nor the
            // `Launched` it would build, whose empty span is only checked and dropped).
            let ran = kernel.run(&mut io);
            probe.finished_kernel();
            return match ran {
                Ok(()) => Ok(Completion::Done),
                Err(e) => Err(EnvError::Kernel(e.0)),
            };
        }
        let launched =
            self.device.launch(firing.actor, kernel, &mut io, runtime.modeled, timed, firing.completion_wanted);
        probe.finished_kernel();
        let launched = launched.map_err(|e| EnvError::Kernel(e.0))?;
        if timed.is_none() {
            // The slice anchors flow arrows, which only a trace draws.
            return Ok(launched.completion);
        }
        self.anchor = launched.span;
        if let (Some(trace), Some((start, end))) = (self.trace.as_deref_mut(), launched.span) {
            let plan_index = runtime.plan_index;
            trace.events.push(TraceEvent::Slice { actor: plan_index, piece: firing.piece, start, end });
            for &desc in &runtime.input_descs {
                trace.events.push(TraceEvent::FlowIn { id: flow_id(desc, firing.piece, firing.actor), at: start });
            }
            if launched.completion == Completion::Pending {
                runtime.pending_slices.push_back((start, end));
            }
        }
        Ok(launched.completion)
    }
}

impl StreamWorker {
    /// Moves everything this thread writes while it runs (its actors' state, its queues,
    /// its lanes' ends, the firing's scratch lists) into memory it allocates itself, once,
    /// before the first message. The job builds every stream's part on one thread, so
    /// without this the small allocations of actors neighbouring in the plan lie side by
    /// side whatever stream runs them, and two stream threads write the same cache lines
    /// (false sharing). glibc's allocator gives each new thread an arena of its own (up to
    /// eight per core), so what a stream thread allocates lies apart from other streams'.
    /// `bench_actors b2`, alternated with the build before it: see BENCHMARKS.md.
    pub(crate) fn reallocate(&mut self) {
        use crate::own_memory;
        self.actors = own_memory::vec(&mut self.actors);
        for actor in &mut self.actors {
            actor.reallocate();
        }
        // The runtimes' lists of input registers and windows are only read.
        self.runtimes = own_memory::vec(&mut self.runtimes);
        for runtime in &mut self.runtimes {
            runtime.pending_slices = own_memory::queue(&mut runtime.pending_slices);
        }
        self.local = own_memory::queue(&mut self.local);
        self.runnable = self.runnable.clone();
        self.scratch_inputs = self.scratch_inputs.clone();
        self.scratch_outputs = self.scratch_outputs.clone();
        self.lanes.reallocate();
        self.inbox.reallocate();
    }

    /// The thread's main loop.
    pub(crate) fn run(mut self) -> StreamExit {
        self.reallocate();
        let _awake = crate::activity::Awake::start();
        let mut live = self.actors.iter().filter(|a| a.lifecycle() != Lifecycle::Done).count();
        let mut snapshot_due = false;
        // Subscribers are set up before jobs run: ask once, not per firing.
        let fire_spans = tracing::span_enabled!(tracing::Level::TRACE);
        let times_completions = self.device.times_completions();
        'outer: while live > 0 {
            if let Err(error) = self.drain_local(&mut live, fire_spans) {
                self.shared.abort(RuntimeError::Actor(error), &self.router);
                break 'outer;
            }
            if live == 0 {
                break;
            }
            // Every local message is handled: a snapshot now shows no message half-way.
            if snapshot_due {
                snapshot_due = false;
                let snapshots = self.actors.iter().map(Actor::snapshot).collect();
                let _ = self.shared.snapshots.send((self.index, snapshots));
                continue;
            }
            // Take one envelope (spinning briefly, then parking), then whatever else is
            // already queued, up to a batch, before going back to the local queue. A
            // device that times its own kernels (`sim`) has the wait end at the next
            // kernel's end, whose completion the thread then hands itself.
            let due = if times_completions { self.device.next_completion() } else { None };
            let mut next = match due {
                None => self.inbox.recv_spinning(),
                Some(at) => match self.inbox.recv_until(at) {
                    Ok(envelope) => Some(envelope),
                    Err(Waited::Due) => {
                        self.take_completions();
                        continue;
                    }
                    Err(Waited::Closed) => None,
                },
            };
            if next.is_none() {
                break;
            }
            let mut taken = 0;
            while let Some(envelope) = next {
                let took = match envelope {
                    Envelope::Actor(msg) => self.take_in(msg),
                    Envelope::Pair(a, b) => self.take_in(a).and_then(|()| self.take_in(b)),
                    Envelope::Snapshot => {
                        // Answered once the messages taken so far are handled.
                        snapshot_due = true;
                        break;
                    }
                    Envelope::Stop => break 'outer,
                    // Never handed out: the inbox swallows the lanes' wake-ups.
                    Envelope::Lanes => Ok(()),
                };
                if let Err(error) = took {
                    self.shared.abort(RuntimeError::Actor(error), &self.router);
                    break 'outer;
                }
                taken += 1;
                next = if taken < INBOX_BATCH { self.inbox.try_recv() } else { None };
            }
        }
        if live == 0 {
            // Every actor finished: what is still queued on the device must not fail unseen.
            let finished = self.device.finish().and_then(|()| match self.trace.as_mut() {
                // When the GPU ran the timed kernels, now that they all have.
                Some(trace) => self.device.drain_device_slices(&mut trace.events),
                None => Ok(()),
            });
            if let Err(e) = finished {
                let error = RuntimeError::QueuedWorkFailed { stream: self.label.clone(), message: e.0 };
                self.shared.abort(error, &self.router);
            }
        }
        let snapshots = self
            .actors
            .iter()
            .zip(&self.runtimes)
            .map(|(a, runtime)| ActorStats {
                name: a.name().to_string(),
                fires: a.fires(),
                max_in_flight: a.max_in_flight().collect(),
                max_held: a.max_held().collect(),
                finished: a.lifecycle() == Lifecycle::Done,
                held_bytes: runtime.kernel_held_bytes(),
            })
            .collect();
        self.shared.probes[self.index].exited.store(true, Ordering::Release);
        StreamExit { trace: self.trace.take(), snapshots }
    }

    /// Queues an `ActDone` for every launch the device says has completed by now.
    fn take_completions(&mut self) {
        let now = Instant::now();
        while let Some(actor) = self.device.take_completed(now) {
            self.local.push_back(Message { dst: actor, src: actor, body: Body::ActDone });
        }
    }

    /// Hands a message from another thread to its recipient's [`Actor::accept`], as one
    /// from an actor of this stream is (`Turn::deliver_here`), and queues the recipient's
    /// turn if it can now fire; queues the message itself if the recipient declines it,
    /// or when tracing (the trace draws each message's flow arrow as it is handled).
    /// Through the local queue, a message was written there and read back (two 48-byte
    /// copies, the second waiting for the first's stores) and dispatched, and most `Ack`s
    /// found their recipient with nothing to do: about two such messages per firing in a
    /// chain alternating over two streams (B2).
    #[inline(always)]
    fn take_in(&mut self, msg: Message) -> Result<(), ActorError> {
        let index = msg.dst.index() as usize;
        if let (Some(actor), None) = (self.actors.get_mut(index), self.trace.as_ref()) {
            if accept_into(actor, index, &msg, &mut self.runnable)? {
                return Ok(());
            }
        }
        self.local.push_back(msg);
        Ok(())
    }

    /// Gives every runnable actor its turn and hands every message of the local queue to
    /// its actor, including those the handling adds, and counts the actors that finish off
    /// `live`. Runnable actors go first: what just became ready is still in cache.
    fn drain_local(&mut self, live: &mut usize, fire_spans: bool) -> Result<(), ActorError> {
        if self.local.is_empty() && self.runnable.is_empty() {
            return Ok(());
        }
        let runs_at_launch = self.device.runs_at_launch();
        let mut env = Env {
            stream_id: self.stream_id,
            local: &mut self.local,
            runnable: &mut self.runnable,
            refused: None,
            router: &self.router,
            lanes: &self.lanes,
            device: self.device.as_mut(),
            runtimes: &mut self.runtimes,
            current: 0,
            fire_spans,
            memory: &self.memory,
            probe: &self.shared.probes[self.index],
            trace: self.trace.as_mut(),
            scratch_inputs: &mut self.scratch_inputs,
            scratch_outputs: &mut self.scratch_outputs,
            context: &self.context,
            stream_index: self.index,
            anchor: None,
            outbox: None,
            runs_at_launch,
        };
        let actors = self.actors.as_mut_slice();
        loop {
            let (index, msg) = if let Some(index) = env.runnable.pop() {
                (index, None)
            } else if let Some(&msg) = env.local.front() {
                // Copy from `front()` then pop: moving the `Option<Message>` out of
                // `pop_front` compiles to overlapping partial copies that stall
                // store-to-load forwarding on every message (measured: half the time of
                // this loop).
                env.local.pop_front();
                (msg.dst.index() as usize, Some(msg))
            } else {
                break;
            };
            if index >= actors.len() {
                // Runnable indices come from actors of this stream; a message's from anywhere.
                let Some(msg) = msg else { unreachable!("runnable actor {index} is not on the stream") };
                return Err(unknown_recipient(msg.dst, actors.len()));
            }
            let (mut turn, actor) = Turn::new(&mut env, actors, index);
            let was_done = actor.lifecycle() == Lifecycle::Done;
            let handled = match msg {
                None => actor.resume(&mut turn),
                Some(msg) => {
                    if turn.env.trace.is_some() {
                        turn.env.anchor = match msg.body {
                            Body::ActDone => turn.env.runtimes[index].pending_slices.pop_front(),
                            _ => None,
                        };
                    }
                    actor.handle(&msg, &mut turn)
                }
            };
            let lifecycle = match handled {
                Ok(lifecycle) => lifecycle,
                // A recipient's refusal is the recipient's error, not the sender's.
                Err(error) => return Err(turn.env.refused.take().unwrap_or(error)),
            };
            if let Err(source) = turn.env.flush() {
                return Err(ActorError::Env { name: actor.name().to_string(), id: actor.id(), source });
            }
            if !was_done && lifecycle == Lifecycle::Done {
                // Dropping the kernel closes what it feeds (a sink's fetcher sees the end).
                let runtime = &mut turn.env.runtimes[index];
                runtime.held_bytes = runtime.kernel_held_bytes();
                runtime.kernel = None;
                *live -= 1;
            }
        }
        Ok(())
    }
}

/// A window that does not fit its slot: the plan's check rules it out, so this names a
/// broken invariant instead of reading outside the slot.
#[cold]
fn outside_window(offset: usize, bytes: usize, len: usize) -> EnvError {
    EnvError::Kernel(format!(
        "input window [{offset}, {offset}+{bytes}) lies outside its slot of {len} bytes (broken invariant)"
    ))
}

fn unknown_recipient(dst: ActorId, count: usize) -> ActorError {
    ActorError::Unexpected {
        name: format!("<stream of {dst}>"),
        id: dst,
        detail: format!("message for actor index {} but the stream has {count} actors", dst.index()),
    }
}
