//! `Job`: loads a plan in-process, starts one thread per stream, lets the embedding program
//! push pieces in and take results out, and waits for the end (or the first error).

use crate::arenas::PlanArenas;
use crate::bus::Router;
use crate::device::{CpuStream, DeviceStream, SimPoller};
use crate::inbox::{inbox, Envelope, InboxReceiver, InboxSender};
use crate::io::{CallbackSinkKernel, ChannelSinkKernel, CountSourceKernel, FedSourceKernel, Feeder, Fetcher};
use crate::kernel::{Kernel, KernelFactory, KernelIo, KernelRegistry, KernelSpec};
use crate::stream::{ActorRuntime, ActorStats, JobShared, StreamExit, StreamProbe, StreamWorker};
use crate::sync::{lock, Arc, AtomicBool, Mutex};
use crate::trace::TraceBuffer;
use crate::watchdog::{watch, Names};
use crate::RuntimeError;
use regflow_actors::{Actor, Body, Cmd, Message, PlanIds, StreamId};
use regflow_graph::plan::{ActorIndex, ActorKind, DeviceKind, Plan, SourcePieces};
use regflow_memory::MemoryReport;
use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Default watchdog timeout: long enough for any sane kernel, short enough to notice a hang.
pub const DEFAULT_WATCHDOG: Duration = Duration::from_secs(60);

/// After an abort, how long `wait` gives stream threads to stop before it leaves behind
/// those still inside a kernel (they keep the job's memory alive until they return).
const ABORT_GRACE: Duration = Duration::from_secs(2);

type SinkCallback = Box<dyn FnMut(&KernelIo<'_>) + Send>;

/// Configures a [`Job`]: `Job::builder(plan).watchdog(..).trace(..).build()?`.
pub struct JobBuilder {
    plan: Plan,
    watchdog: Option<Duration>,
    trace: Option<PathBuf>,
    kernels: KernelRegistry,
    sink_callbacks: HashMap<String, SinkCallback>,
    node: Option<u16>,
    fetch_depth: Option<u64>,
    preloads: Vec<(String, Vec<u8>)>,
}

impl std::fmt::Debug for JobBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobBuilder")
            .field("watchdog", &self.watchdog)
            .field("trace", &self.trace)
            .field("kernels", &self.kernels)
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

impl JobBuilder {
    /// Aborts the job with a wait-for graph when pieces are pending and nothing has fired
    /// for `timeout` (default [`DEFAULT_WATCHDOG`]).
    pub fn watchdog(mut self, timeout: Duration) -> Self {
        self.watchdog = Some(timeout);
        self
    }

    /// Turns the watchdog off.
    pub fn without_watchdog(mut self) -> Self {
        self.watchdog = None;
        self
    }

    /// Records a Chrome-trace / Perfetto timeline and writes it to `path` when the job ends.
    pub fn trace(mut self, path: impl Into<PathBuf>) -> Self {
        self.trace = Some(path.into());
        self
    }

    /// Registers a kernel for `KernelConf::Custom { name }`.
    pub fn kernel<F>(mut self, name: &str, factory: F) -> Self
    where
        F: Fn(&KernelSpec<'_>) -> Result<Box<dyn Kernel>, crate::KernelError> + Send + Sync + 'static,
    {
        let factory: KernelFactory = std::sync::Arc::new(factory);
        self.kernels.register(name, factory);
        self
    }

    /// Hands every piece of sink `name` to `callback` on the sink's stream thread, without
    /// a copy, instead of delivering it to a [`Fetcher`].
    pub fn on_sink<F>(mut self, name: &str, callback: F) -> Self
    where
        F: FnMut(&KernelIo<'_>) + Send + 'static,
    {
        self.sink_callbacks.insert(name.to_string(), Box::new(callback));
        self
    }

    /// Runs only the actors of `node`; messages to other nodes fail with "not connected"
    /// until the transport exists. By default a job runs every node in-process.
    pub fn node(mut self, node: u16) -> Self {
        self.node = Some(node);
        self
    }

    /// How many delivered pieces a sink may hand a fetcher before the user takes them
    /// (default: 4, or the sink's register count if larger).
    pub fn fetch_depth(mut self, pieces: u64) -> Self {
        self.fetch_depth = Some(pieces.max(1));
        self
    }

    /// The initial bytes of the preloaded slots of register `regst` (a loop's first value,
    /// e.g. a variable's initial weights). Registers not given bytes start zeroed.
    pub fn preload(mut self, regst: &str, bytes: Vec<u8>) -> Self {
        self.preloads.push((regst.to_string(), bytes));
        self
    }

    /// Validates the plan, allocates its memory, starts its threads and its sources.
    pub fn build(self) -> Result<Job, RuntimeError> {
        Job::start(self)
    }
}

/// A plan running in this process.
#[derive(Debug)]
pub struct Job {
    plan: Arc<Plan>,
    threads: Vec<(usize, JoinHandle<StreamExit>)>,
    /// Each stream thread sends its index here as it ends.
    exits: crossbeam_channel::Receiver<usize>,
    shared: Arc<JobShared>,
    router: Router,
    feeders: HashMap<String, Feeder>,
    fetchers: HashMap<String, Fetcher>,
    watchdog: Option<(crossbeam_channel::Sender<()>, JoinHandle<()>)>,
    poller: Option<SimPoller>,
    memory: MemoryReport,
    arenas: Option<Arc<PlanArenas>>,
    epoch: Instant,
    trace_path: Option<PathBuf>,
}

/// What a finished job reports.
#[derive(Debug, Clone)]
pub struct JobReport {
    /// Counters per actor, in plan order of streams.
    pub actors: Vec<ActorStats>,
    /// From start to the last thread's end.
    pub elapsed: Duration,
    /// Bytes per device.
    pub memory: MemoryReport,
    /// Where the timeline was written, if it was recorded.
    pub trace: Option<PathBuf>,
}

impl JobReport {
    /// Counters of the actor with this name.
    pub fn actor(&self, name: &str) -> Option<&ActorStats> {
        self.actors.iter().find(|a| a.name == name)
    }
}

/// Upper bound of the messages that can be in flight to one stream: every `Ready` holds a
/// slot, every `Ack` answers one, every `ActDone` answers a launch that holds one.
fn inbox_capacity(plan: &Plan, stream: usize, feed_depth: u64, fetch_depth: u64) -> usize {
    let mut capacity = 16usize;
    for (a, actor) in plan.actors.iter().enumerate() {
        if actor.stream.index() != stream {
            continue;
        }
        let mut slots = 0usize;
        for input in &actor.inputs {
            slots += plan.regst_descs[input.index()].register_num as usize + 1;
        }
        for output in plan.outputs_of(ActorIndex(a as u32)) {
            let desc = &plan.regst_descs[output.index()];
            slots += desc.register_num as usize * (desc.consumers.len() + 1);
        }
        capacity += 2 * slots + 4;
        match actor.kind {
            ActorKind::Source { pieces: SourcePieces::Fed } => capacity += feed_depth as usize,
            ActorKind::Sink => capacity += fetch_depth as usize,
            _ => {}
        }
    }
    capacity
}

impl Job {
    /// A builder for running `plan`.
    pub fn builder(plan: Plan) -> JobBuilder {
        JobBuilder {
            plan,
            watchdog: Some(DEFAULT_WATCHDOG),
            trace: None,
            kernels: KernelRegistry::default(),
            sink_callbacks: HashMap::new(),
            node: None,
            fetch_depth: None,
            preloads: Vec::new(),
        }
    }

    /// Runs every node of `plan` in this process with default settings.
    pub fn local(plan: Plan) -> Result<Job, RuntimeError> {
        Self::builder(plan).build()
    }

    fn start(mut builder: JobBuilder) -> Result<Job, RuntimeError> {
        let plan = Arc::new(std::mem::replace(&mut builder.plan, Plan::empty()));
        plan.validate()?;
        let ids = PlanIds::assign(&plan)?;
        let memory_plan = plan.memory()?;
        let arenas = PlanArenas::allocate(&plan, &memory_plan)?;
        write_preloads(&plan, &arenas, &builder.preloads)?;
        let arenas = Arc::new(arenas);
        let hosts = |node: u16| builder.node.is_none_or(|n| n == node);
        let stream_node = |s: usize| plan.devices[plan.streams[s].device.index()].node;

        // Sink callbacks must name sinks.
        for name in builder.sink_callbacks.keys() {
            let index = plan.actor_by_name(name).ok_or_else(|| RuntimeError::UnknownActor { name: name.clone() })?;
            let kind = &plan.actors[index.index()].kind;
            if !matches!(kind, ActorKind::Sink) {
                return Err(RuntimeError::WrongKind {
                    name: name.clone(),
                    kind: kind.name(),
                    expected: "on_sink needs a sink",
                });
            }
        }

        // Inboxes and the router.
        let fetch_depth_of = |actor: &regflow_graph::plan::ActorDesc| {
            let register_num = actor.inputs.iter().map(|r| plan.regst_descs[r.index()].register_num).max().unwrap_or(1);
            builder.fetch_depth.unwrap_or(u64::from(register_num).max(4))
        };
        let mut senders: Vec<Option<InboxSender>> = Vec::with_capacity(plan.streams.len());
        let mut receivers: Vec<Option<InboxReceiver>> = Vec::with_capacity(plan.streams.len());
        for s in 0..plan.streams.len() {
            if hosts(stream_node(s)) {
                let max_register = plan.regst_descs.iter().map(|r| r.register_num).max().unwrap_or(1);
                let fetch = builder.fetch_depth.unwrap_or(u64::from(max_register).max(4));
                let (tx, rx) = inbox(inbox_capacity(&plan, s, u64::from(max_register) + 1, fetch));
                senders.push(Some(tx));
                receivers.push(Some(rx));
            } else {
                senders.push(None);
                receivers.push(None);
            }
        }
        let mut stream_of = vec![Vec::new(); plan.devices.len()];
        for (s, stream) in plan.streams.iter().enumerate() {
            stream_of[stream.device.index()].push(s as u32);
        }
        let router = Router::new(builder.node, stream_of, senders.clone());

        // Sim poller, sized by the launches that can be in flight on sim streams.
        let sim_streams: Vec<usize> = (0..plan.streams.len())
            .filter(|&s| plan.devices[plan.streams[s].device.index()].kind == DeviceKind::Sim)
            .collect();
        let poller = if sim_streams.is_empty() {
            None
        } else {
            let capacity: usize = plan.regst_descs.iter().map(|r| r.register_num as usize * 2).sum::<usize>() + 64;
            Some(
                SimPoller::start(capacity)
                    .map_err(|e| RuntimeError::Spawn { thread: "sim poller".into(), message: e.to_string() })?,
            )
        };

        // Actors, kernels, feeders and fetchers, per stream.
        let mut per_stream: Vec<(Vec<Actor>, Vec<ActorRuntime>)> =
            (0..plan.streams.len()).map(|_| (Vec::new(), Vec::new())).collect();
        let mut feeders = HashMap::new();
        let mut fetchers = HashMap::new();
        let mut sources = Vec::new();
        for (a, desc) in plan.actors.iter().enumerate() {
            let stream = desc.stream.index();
            let Some(inbox) = senders[stream].clone() else { continue };
            let index = ActorIndex(a as u32);
            let id = ids.of(index);
            let mut actor = Actor::from_plan(&plan, &ids, index);
            let outputs: Vec<u64> = plan.outputs_of(index).map(|r| plan.regst_descs[r.index()].bytes).collect();
            let inputs: Vec<u64> = desc.inputs.iter().map(|r| plan.regst_descs[r.index()].bytes).collect();
            let setup = |message: String| RuntimeError::KernelSetup { actor: desc.name.clone(), message };
            if plan.outputs_of(index).any(|r| plan.regst_descs[r.index()].preloaded > 0) {
                // Hands out its preloaded slots when started.
                sources.push(id);
            }
            let kernel: Option<Box<dyn Kernel>> = match &desc.kind {
                ActorKind::Source { pieces: SourcePieces::Custom { kernel, .. } } => {
                    if !sources.contains(&id) {
                        sources.push(id);
                    }
                    let spec = KernelSpec { actor: &desc.name, input_bytes: &inputs, output_bytes: &outputs };
                    let conf = regflow_graph::plan::KernelConf::Custom { name: kernel.clone() };
                    Some(builder.kernels.make(&conf, &spec).map_err(|e| setup(e.0))?)
                }
                ActorKind::Source { pieces: SourcePieces::Count(_) } => {
                    if !sources.contains(&id) {
                        sources.push(id);
                    }
                    Some(Box::new(CountSourceKernel))
                }
                ActorKind::Source { pieces: SourcePieces::Fed } => {
                    if !sources.contains(&id) {
                        sources.push(id);
                    }
                    let bytes = outputs.iter().copied().min().unwrap_or(0);
                    let register_num =
                        plan.outputs_of(index).map(|r| plan.regst_descs[r.index()].register_num).min().unwrap_or(1);
                    let depth = register_num as usize + 1;
                    let (data_tx, data_rx) = crossbeam_channel::bounded(depth);
                    let (pool_tx, pool_rx) = crossbeam_channel::bounded(depth);
                    for _ in 0..depth {
                        let _ = pool_tx.send(Vec::with_capacity(bytes as usize));
                    }
                    feeders.insert(
                        desc.name.clone(),
                        Feeder {
                            name: desc.name.clone(),
                            source: id,
                            bytes,
                            data: data_tx,
                            pool: pool_rx,
                            inbox,
                            closed: false,
                        },
                    );
                    Some(Box::new(FedSourceKernel { data: data_rx, pool: pool_tx }))
                }
                ActorKind::Compute { kernel } | ActorKind::Acc { kernel, .. } => {
                    let spec = KernelSpec { actor: &desc.name, input_bytes: &inputs, output_bytes: &outputs };
                    Some(builder.kernels.make(kernel, &spec).map_err(|e| setup(e.0))?)
                }
                ActorKind::Sink => match builder.sink_callbacks.remove(&desc.name) {
                    Some(callback) => Some(Box::new(CallbackSinkKernel(callback))),
                    None => {
                        let depth = fetch_depth_of(desc);
                        actor.set_sink_credits(depth);
                        let (delivery_tx, delivery_rx) = crossbeam_channel::bounded(depth as usize);
                        let (pool_tx, pool_rx) = crossbeam_channel::bounded(depth as usize);
                        for _ in 0..depth {
                            let parts = inputs.iter().map(|&b| Vec::with_capacity(b as usize)).collect();
                            let _ = pool_tx.send(parts);
                        }
                        fetchers.insert(
                            desc.name.clone(),
                            Fetcher { sink: id, deliveries: delivery_rx, pool: pool_tx.clone(), inbox: inbox.clone() },
                        );
                        Some(Box::new(ChannelSinkKernel {
                            deliveries: delivery_tx,
                            pool: pool_rx,
                            give_back: pool_tx,
                            inbox,
                            sink: id,
                        }))
                    }
                },
                // The hand-off is a no-op launch on the repeat's stream (see the actor).
                ActorKind::Repeat { .. } => Some(
                    builder
                        .kernels
                        .make(
                            &regflow_graph::plan::KernelConf::Noop,
                            &KernelSpec { actor: &desc.name, input_bytes: &inputs, output_bytes: &[] },
                        )
                        .map_err(|e| setup(e.0))?,
                ),
            };
            let slots = plan.regst_descs.iter().map(|r| r.register_num as usize).sum::<usize>().min(1 << 12);
            per_stream[stream].0.push(actor);
            per_stream[stream].1.push(ActorRuntime {
                name: desc.name.clone(),
                kernel,
                modeled: Duration::from_nanos(desc.sim_nanos.unwrap_or(0)),
                plan_index: a as u32,
                input_descs: desc.inputs.clone(),
                pending_slices: VecDeque::with_capacity(if builder.trace.is_some() { slots } else { 0 }),
            });
        }

        let (snapshot_tx, snapshot_rx) = crossbeam_channel::unbounded();
        let shared = Arc::new(JobShared {
            probes: (0..plan.streams.len()).map(|_| StreamProbe::default()).collect(),
            error: Mutex::new(None),
            aborting: AtomicBool::new(false),
            snapshots: snapshot_tx,
        });

        // Stream threads.
        let epoch = Instant::now();
        let mut threads = Vec::new();
        // Bounded: one notice per stream, allocated now, so teardown allocates nothing.
        let (exit_tx, exits) = crossbeam_channel::bounded(plan.streams.len().max(1));
        let max_arity =
            plan.actors.iter().map(|a| a.inputs.len()).max().unwrap_or(0).max(plan.regst_descs.len().min(64));
        for (s, (actors, runtimes)) in per_stream.into_iter().enumerate() {
            let Some(inbox) = receivers[s].take() else { continue };
            let device: Box<dyn DeviceStream> = match (&poller, plan.devices[plan.streams[s].device.index()].kind) {
                (Some(poller), DeviceKind::Sim) => match &senders[s] {
                    Some(tx) => Box::new(poller.stream(tx.clone())),
                    None => continue,
                },
                _ => Box::new(CpuStream),
            };
            let stream_id =
                actors.first().map(|a| a.id().stream_id()).unwrap_or_else(|| placeholder_stream_id(&plan, &ids, s));
            let worker = StreamWorker {
                index: s,
                stream_id,
                actors,
                runtimes,
                local: VecDeque::with_capacity(256),
                inbox,
                router: router.clone(),
                device,
                memory: arenas.clone(),
                shared: shared.clone(),
                trace: builder.trace.as_ref().map(|_| TraceBuffer::new(s)),
                scratch_inputs: Vec::with_capacity(max_arity),
                scratch_outputs: Vec::with_capacity(max_arity),
            };
            let name = format!("regflow-s{s}");
            let shared_for_panic = shared.clone();
            let router_for_panic = router.clone();
            let label = stream_label(&plan, s);
            let exit_notice = ExitNotice(exit_tx.clone(), s);
            let handle = std::thread::Builder::new()
                .name(name.clone())
                .spawn(move || {
                    // Dropped last, after a panic has been recorded as the job's error.
                    let _notice = exit_notice;
                    run_stream(worker, s, label, shared_for_panic, router_for_panic)
                })
                .map_err(|e| RuntimeError::Spawn { thread: name, message: e.to_string() });
            match handle {
                Ok(handle) => threads.push((s, handle)),
                Err(e) => {
                    shared.abort(RuntimeError::Stopped, &router);
                    for (_, t) in threads {
                        let _ = t.join();
                    }
                    return Err(e);
                }
            }
        }

        // Watchdog.
        let watchdog = match builder.watchdog {
            None => None,
            Some(timeout) => {
                let names = Names {
                    actors: plan.actors.iter().enumerate().map(|(a, d)| (ids.actors[a], d.name.clone())).collect(),
                    descs: plan.regst_descs.iter().map(|d| d.name.clone()).collect(),
                    streams: (0..plan.streams.len()).map(|s| stream_label(&plan, s)).collect(),
                    hosted: (0..plan.streams.len()).filter(|&s| hosts(stream_node(s))).collect(),
                };
                let (stop_tx, stop_rx) = crossbeam_channel::bounded::<()>(0);
                let (shared, router) = (shared.clone(), router.clone());
                let handle = std::thread::Builder::new()
                    .name("regflow-watchdog".into())
                    .spawn(move || watch(shared, router, names, timeout, stop_rx, snapshot_rx))
                    .map_err(|e| RuntimeError::Spawn { thread: "watchdog".into(), message: e.to_string() })?;
                Some((stop_tx, handle))
            }
        };

        // Go.
        for source in sources {
            let msg = Message { dst: source, src: source, body: Body::Cmd(Cmd::Start) };
            if let Some(inbox) = router.inbox_of(source) {
                let _ = inbox.send(Envelope::Actor(msg));
            }
        }
        Ok(Job {
            memory: arenas.report().clone(),
            arenas: Some(arenas),
            plan,
            threads,
            exits,
            shared,
            router,
            feeders,
            fetchers,
            watchdog,
            poller,
            epoch,
            trace_path: builder.trace,
        })
    }

    /// The feeder of fed source `name` (once).
    pub fn feeder(&mut self, name: &str) -> Result<Feeder, RuntimeError> {
        self.take(name, "feeder", |job| job.feeders.remove(name), "a feeder needs a source with `pieces: fed`")
    }

    /// The fetcher of sink `name` (once). Pieces of a sink whose fetcher is never taken are
    /// dropped when [`Job::wait`] runs.
    pub fn fetcher(&mut self, name: &str) -> Result<Fetcher, RuntimeError> {
        self.take(
            name,
            "fetcher",
            |job| job.fetchers.remove(name),
            "a fetcher needs a sink without an on_sink callback",
        )
    }

    fn take<T>(
        &mut self,
        name: &str,
        what: &'static str,
        remove: impl FnOnce(&mut Self) -> Option<T>,
        expected: &'static str,
    ) -> Result<T, RuntimeError> {
        if let Some(found) = remove(self) {
            return Ok(found);
        }
        let index =
            self.plan.actor_by_name(name).ok_or_else(|| RuntimeError::UnknownActor { name: name.to_string() })?;
        let actor = &self.plan.actors[index.index()];
        let node = self.plan.devices[self.plan.device_of(index).index()].node;
        if !self.router.hosts(node) {
            return Err(RuntimeError::NotLocal { name: name.to_string(), node });
        }
        let fits = matches!(
            (what, &actor.kind),
            ("feeder", ActorKind::Source { pieces: SourcePieces::Fed }) | ("fetcher", ActorKind::Sink)
        );
        if fits {
            Err(RuntimeError::AlreadyTaken { what, name: name.to_string() })
        } else {
            Err(RuntimeError::WrongKind { name: name.to_string(), kind: actor.kind.name(), expected })
        }
    }

    /// Bytes per device, known before anything ran.
    pub fn memory_report(&self) -> &MemoryReport {
        &self.memory
    }

    /// The plan being run.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Aborts the job: every stream stops at once; `wait` then returns this error.
    pub fn abort(&self, reason: RuntimeError) {
        self.shared.abort(reason, &self.router);
    }

    /// Waits until every actor has finished, then reports; or returns the first error.
    ///
    /// Feeders not taken are closed; pieces for fetchers not taken are dropped. A fed
    /// source whose feeder the caller still holds open keeps the job running.
    pub fn wait(mut self) -> Result<JobReport, RuntimeError> {
        self.feeders.clear();
        self.fetchers.clear();
        let end = self.join_threads();
        let mut actors = Vec::new();
        let mut buffers = Vec::new();
        for exit in end.exits {
            actors.extend(exit.snapshots);
            buffers.extend(exit.trace);
        }
        self.stop_helpers();
        if let Some(error) = lock(&self.shared.error).take() {
            return Err(error);
        }
        if let Some(path) = &self.trace_path {
            let file = std::fs::File::create(path)
                .map_err(|e| RuntimeError::Trace { path: path.display().to_string(), message: e.to_string() })?;
            crate::trace::write_chrome_trace(file, &self.plan, self.epoch, &buffers)
                .map_err(|e| RuntimeError::Trace { path: path.display().to_string(), message: e.to_string() })?;
        }
        Ok(JobReport {
            actors,
            elapsed: end.at - self.epoch,
            memory: self.memory.clone(),
            trace: self.trace_path.clone(),
        })
    }

    /// Waits for every stream thread to end. After an abort, threads still inside a kernel
    /// after [`ABORT_GRACE`] are left behind rather than waited on for ever.
    fn join_threads(&mut self) -> Joined {
        let mut ended = Vec::with_capacity(self.threads.len());
        let mut aborted_at: Option<Instant> = None;
        let mut at = Instant::now();
        while ended.len() < self.threads.len() {
            match self.exits.recv_timeout(Duration::from_millis(50)) {
                Ok(s) => {
                    ended.push(s);
                    at = Instant::now();
                }
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                    if self.shared.aborting.load(crate::sync::Ordering::Acquire) {
                        let since = *aborted_at.get_or_insert_with(Instant::now);
                        if since.elapsed() >= ABORT_GRACE {
                            break;
                        }
                    }
                }
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
            }
        }
        let mut exits = Vec::new();
        for (s, handle) in std::mem::take(&mut self.threads) {
            // A thread that sent its notice has left its body: joining it returns at once.
            if ended.contains(&s) {
                if let Ok(exit) = handle.join() {
                    exits.push(exit);
                }
            } else {
                tracing::warn!(stream = s, "stream thread still inside a kernel after the abort; leaving it behind");
            }
        }
        Joined { exits, at }
    }

    fn stop_helpers(&mut self) {
        if let Some((stop, handle)) = self.watchdog.take() {
            drop(stop);
            let _ = handle.join();
        }
        self.poller.take();
        self.arenas.take();
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            // Dropped without `wait`: stop the threads rather than leave them running.
            self.shared.abort(RuntimeError::Stopped, &self.router);
            self.join_threads();
        }
        self.stop_helpers();
    }
}

/// A stream thread's body: runs the worker; a panic aborts the job with its message.
fn run_stream(worker: StreamWorker, s: usize, label: String, shared: Arc<JobShared>, router: Router) -> StreamExit {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| worker.run())) {
        Ok(exit) => exit,
        Err(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            shared.probes[s].exited.store(true, crate::sync::Ordering::Release);
            shared.abort(RuntimeError::Panicked { stream: label, message }, &router);
            StreamExit { trace: None, snapshots: Vec::new() }
        }
    }
}

/// Writes the initial bytes of preloaded registers into their slots (before any thread runs).
fn write_preloads(plan: &Plan, arenas: &PlanArenas, preloads: &[(String, Vec<u8>)]) -> Result<(), RuntimeError> {
    for (name, bytes) in preloads {
        let mut matches = plan.regst_descs.iter().enumerate().filter(|(_, d)| &d.name == name);
        let (Some((d, desc)), None) = (matches.next(), matches.next()) else {
            return Err(RuntimeError::Preload {
                regst: name.clone(),
                message: "no single register has this name".into(),
            });
        };
        if desc.preloaded == 0 {
            return Err(RuntimeError::Preload { regst: name.clone(), message: "has no preloaded slots".into() });
        }
        if bytes.len() as u64 != desc.bytes {
            return Err(RuntimeError::Preload {
                regst: name.clone(),
                message: format!("got {} bytes, its slots hold {}", bytes.len(), desc.bytes),
            });
        }
        for slot in 0..desc.preloaded {
            let view = arenas.view(regflow_actors::RegstRef { desc: regflow_graph::plan::RegstDescId(d as u32), slot });
            // SAFETY: no stream thread exists yet; nothing else can touch the arena.
            unsafe { view.as_mut_slice() }.copy_from_slice(bytes);
        }
    }
    Ok(())
}

/// Stream threads that ended, and when the last one did.
struct Joined {
    exits: Vec<StreamExit>,
    at: Instant,
}

/// Sent when a stream thread ends, however it ends (dropped last, even on panic).
struct ExitNotice(crossbeam_channel::Sender<usize>, usize);

impl Drop for ExitNotice {
    fn drop(&mut self) {
        let _ = self.0.send(self.1);
    }
}

fn stream_label(plan: &Plan, s: usize) -> String {
    let stream = &plan.streams[s];
    format!("{}/{:?}#{s}", plan.devices[stream.device.index()].label(), stream.kind)
}

/// The id of a stream that has no actors (its thread ends at once).
fn placeholder_stream_id(plan: &Plan, ids: &PlanIds, s: usize) -> StreamId {
    let device = plan.streams[s].device;
    let node = plan.devices[device.index()].node;
    regflow_actors::ActorId::new(node, device.0, ids.stream_position[s], 0)
        .map(|id| id.stream_id())
        .unwrap_or_else(|| unreachable!("PlanIds::assign accepted stream {s}, so its id fits"))
}
