//! Building a job: validate the plan, allocate its memory, size the inboxes, make the
//! kernels, feeders and fetchers, start the stream threads, the watchdog and the sources.

use super::{Job, DEFAULT_WATCHDOG};
use crate::arenas::PlanArenas;
use crate::bus::Router;
use crate::device::{CpuStream, DeviceStream, SimPoller};
use crate::inbox::{inbox, Envelope, InboxReceiver, InboxSender};
use crate::io::{CallbackSinkKernel, ChannelSinkKernel, CountSourceKernel, FedSourceKernel, Feeder, Fetcher};
use crate::kernel::{device_supported, JobKernels, Kernel, KernelFactory, KernelIo, KernelSpec, StreamContext};
use crate::stream::{ActorRuntime, JobShared, StreamExit, StreamProbe, StreamWorker};
use crate::sync::{Arc, AtomicBool, Mutex};
use crate::trace::TraceBuffer;
use crate::watchdog::{watch, Names};
use crate::RuntimeError;
use regflow_actors::{Actor, Body, Cmd, Message, PlanIds, StreamId};
use regflow_plan::{ActorIndex, ActorKind, DeviceKind, Plan, PlanIndex, SourcePieces};
use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::time::{Duration, Instant};

type SinkCallback = Box<dyn FnMut(&KernelIo<'_>) + Send>;

/// Configures a [`Job`]: `Job::builder(plan).watchdog(..).trace(..).build()?`.
pub struct JobBuilder {
    plan: Plan,
    watchdog: Option<Duration>,
    trace: Option<PathBuf>,
    kernels: JobKernels,
    sink_callbacks: HashMap<String, SinkCallback>,
    node: Option<u16>,
    fetch_depth: Option<u64>,
    preloads: Vec<(String, Vec<u8>)>,
    cpu_threads: usize,
    data_dir: Option<PathBuf>,
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
        self.kernels.registry.register_named(name, factory);
        self
    }

    /// Registers (or replaces) the kernel of op type `op_type` on devices of kind `device`
    /// for `dtype`: how a program brings kernels of its own for ops a plan names.
    pub fn op_kernel<F>(mut self, op_type: &str, device: DeviceKind, dtype: regflow_plan::DType, factory: F) -> Self
    where
        F: Fn(&KernelSpec<'_>) -> Result<Box<dyn Kernel>, crate::KernelError> + Send + Sync + 'static,
    {
        self.kernels.registry.register_op(op_type, device, dtype, std::sync::Arc::new(factory));
        self
    }

    /// Threads one kernel of a `cpu` device may use (matrix products split their output
    /// tiles over them; results are bitwise the same for any count). Default 1, so that
    /// devices on one machine do not compete for cores.
    pub fn cpu_threads(mut self, threads: usize) -> Self {
        self.cpu_threads = threads.max(1);
        self
    }

    /// The directory relative dataset paths of the plan are resolved against (default: the
    /// working directory). `regflow run` passes the plan file's directory.
    pub fn data_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.data_dir = Some(dir.into());
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
    /// e.g. a variable's weights from a checkpoint), instead of the value the plan's
    /// initializer draws. Other preloaded registers start zeroed.
    pub fn preload(mut self, regst: &str, bytes: Vec<u8>) -> Self {
        self.preloads.push((regst.to_string(), bytes));
        self
    }

    /// Validates the plan, allocates its memory, starts its threads and its sources.
    pub fn build(self) -> Result<Job, RuntimeError> {
        Job::start(self)
    }
}

/// Buffers a fed source cycles through: its register count plus one, so the user can stage
/// one piece ahead.
fn feed_depth(indexed: &PlanIndex<'_>, source: ActorIndex) -> u64 {
    let descs = &indexed.plan().regst_descs;
    u64::from(indexed.outputs_of(source).iter().map(|r| descs[r.index()].register_num).min().unwrap_or(1)) + 1
}

/// Pieces a channel sink may deliver ahead of the user's fetches.
fn fetch_depth(plan: &Plan, sink: ActorIndex, configured: Option<u64>) -> u64 {
    let inputs = &plan.actors[sink.index()].inputs;
    let register_num = inputs.iter().map(|r| plan.regst_descs[r.index()].register_num).max().unwrap_or(1);
    configured.unwrap_or(u64::from(register_num).max(4))
}

/// Upper bound of the messages that can be in flight to each stream: every `Ready` holds a
/// slot, every `Ack` answers one, every `ActDone` answers a launch that holds one. One pass
/// over the actors.
fn inbox_capacities(indexed: &PlanIndex<'_>, configured_fetch_depth: Option<u64>) -> Vec<usize> {
    let plan = indexed.plan();
    let mut capacities = vec![16usize; plan.streams.len()];
    for (a, actor) in plan.actors.iter().enumerate() {
        let index = ActorIndex(a as u32);
        let mut slots = 0usize;
        for input in &actor.inputs {
            slots += plan.regst_descs[input.index()].register_num as usize + 1;
        }
        for output in indexed.outputs_of(index) {
            let desc = &plan.regst_descs[output.index()];
            slots += desc.register_num as usize * (desc.consumers.len() + 1);
        }
        let capacity = &mut capacities[actor.stream.index()];
        *capacity += 2 * slots + 4;
        match actor.kind {
            ActorKind::Source { pieces: SourcePieces::Fed } => *capacity += feed_depth(indexed, index) as usize,
            ActorKind::Sink => *capacity += fetch_depth(plan, index, configured_fetch_depth) as usize,
            _ => {}
        }
    }
    capacities
}

impl Job {
    /// A builder for running `plan`.
    pub fn builder(plan: Plan) -> JobBuilder {
        JobBuilder {
            plan,
            watchdog: Some(DEFAULT_WATCHDOG),
            trace: None,
            kernels: JobKernels::default(),
            sink_callbacks: HashMap::new(),
            node: None,
            fetch_depth: None,
            preloads: Vec::new(),
            cpu_threads: 1,
            data_dir: None,
        }
    }

    /// Runs every node of `plan` in this process with default settings.
    pub fn local(plan: Plan) -> Result<Job, RuntimeError> {
        Self::builder(plan).build()
    }

    fn start(mut builder: JobBuilder) -> Result<Job, RuntimeError> {
        let plan = Arc::new(std::mem::replace(&mut builder.plan, Plan::empty()));
        plan.validate()?;
        // Every per-actor lookup below goes through the index: building is linear in the
        // plan's size.
        let indexed = PlanIndex::new(&plan);
        let ids = PlanIds::assign(&plan)?;
        let memory_plan = plan.memory()?;
        check_devices(&plan, builder.node)?;
        let arenas = PlanArenas::allocate(&plan, &memory_plan)?;
        write_variables(&plan, &arenas)?;
        write_preloads(&plan, &arenas, &builder.preloads)?;
        let arenas = Arc::new(arenas);
        let hosts = |node: u16| builder.node.is_none_or(|n| n == node);
        let stream_node = |s: usize| plan.devices[plan.streams[s].device.index()].node;

        // Sink callbacks must name sinks.
        for name in builder.sink_callbacks.keys() {
            let index = indexed.actor_by_name(name).ok_or_else(|| RuntimeError::UnknownActor { name: name.clone() })?;
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
        let mut senders: Vec<Option<InboxSender>> = Vec::with_capacity(plan.streams.len());
        let mut receivers: Vec<Option<InboxReceiver>> = Vec::with_capacity(plan.streams.len());
        let capacities = inbox_capacities(&indexed, builder.fetch_depth);
        for (s, &capacity) in capacities.iter().enumerate() {
            if hosts(stream_node(s)) {
                let (tx, rx) = inbox(capacity);
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
            let mut actor = Actor::from_plan(&indexed, &ids, index);
            let outputs: Vec<u64> =
                indexed.outputs_of(index).iter().map(|r| plan.regst_descs[r.index()].bytes).collect();
            let inputs: Vec<u64> = desc.inputs.iter().map(|r| plan.regst_descs[r.index()].bytes).collect();
            let setup = |message: String| RuntimeError::KernelSetup { actor: desc.name.clone(), message };
            let device = plan.devices[plan.streams[stream].device.index()].kind;
            let spec = KernelSpec { actor: &desc.name, device, op: None, input_bytes: &inputs, output_bytes: &outputs };
            // Sources start producing, and actors with preloaded outputs hand them out, on Start.
            if matches!(desc.kind, ActorKind::Source { .. })
                || indexed.outputs_of(index).iter().any(|r| plan.regst_descs[r.index()].preloaded > 0)
            {
                sources.push(id);
            }
            let kernel: Option<Box<dyn Kernel>> = match &desc.kind {
                ActorKind::Source { pieces: SourcePieces::Custom { kernel, .. } } => {
                    Some(builder.kernels.registry.make_named(kernel, &spec).map_err(|e| setup(e.0))?)
                }
                ActorKind::Source { pieces: SourcePieces::Dataset(conf) } => {
                    Some(crate::data::dataset_kernel(conf, builder.data_dir.as_deref(), &spec)?)
                }
                ActorKind::Source { pieces: SourcePieces::Count(_) } => Some(Box::new(CountSourceKernel)),
                ActorKind::Source { pieces: SourcePieces::Fed } => {
                    let bytes = outputs.iter().copied().min().unwrap_or(0);
                    let depth = feed_depth(&indexed, index) as usize;
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
                    Some(builder.kernels.make(kernel, &spec).map_err(|e| setup(e.0))?)
                }
                ActorKind::Discard => {
                    Some(builder.kernels.make(&regflow_plan::KernelConf::Noop, &spec).map_err(|e| setup(e.0))?)
                }
                ActorKind::Sink => match builder.sink_callbacks.remove(&desc.name) {
                    Some(callback) => Some(Box::new(CallbackSinkKernel(callback))),
                    None => {
                        let depth = fetch_depth(&plan, index, builder.fetch_depth);
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
                ActorKind::Repeat { .. } => {
                    Some(builder.kernels.make(&regflow_plan::KernelConf::Noop, &spec).map_err(|e| setup(e.0))?)
                }
            };
            // Launches in flight are bounded by the actor's own slots.
            let slots: usize = desc
                .inputs
                .iter()
                .copied()
                .chain(indexed.outputs_of(index).iter().copied())
                .map(|r| plan.regst_descs[r.index()].register_num as usize)
                .sum();
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

        // Every collective group complete in this job, on comm streams.
        builder.kernels.collectives().check(&indexed)?;

        let (snapshot_tx, snapshot_rx) = crossbeam_channel::unbounded();
        let shared = Arc::new(JobShared {
            probes: (0..plan.streams.len()).map(|_| StreamProbe::default()).collect(),
            error: Mutex::new(None),
            aborting: AtomicBool::new(false),
            snapshots: snapshot_tx,
            collectives: builder.kernels.collectives(),
        });

        // Stream threads.
        let epoch = Instant::now();
        let mut threads = Vec::new();
        // Bounded: one notice per stream, allocated now, so teardown allocates nothing.
        let (exit_tx, exits) = crossbeam_channel::bounded(plan.streams.len().max(1));
        // The most registers one firing reads or writes.
        let max_arity = (0..plan.actors.len())
            .map(|a| plan.actors[a].inputs.len().max(indexed.outputs_of(ActorIndex(a as u32)).len()))
            .max()
            .unwrap_or(0);
        for (s, (actors, runtimes)) in per_stream.into_iter().enumerate() {
            let Some(inbox) = receivers[s].take() else { continue };
            let device_desc = &plan.devices[plan.streams[s].device.index()];
            let device: Box<dyn DeviceStream> = match (&poller, device_desc.kind) {
                (Some(poller), DeviceKind::Sim) => match &senders[s] {
                    Some(tx) => Box::new(poller.stream(tx.clone())),
                    None => continue,
                },
                (_, DeviceKind::Cpu) => Box::new(CpuStream),
                (_, kind) => {
                    return Err(RuntimeError::UnsupportedDevice {
                        device: device_desc.label(),
                        available: format!("no stream backend for {} (broken invariant)", kind.name()),
                    })
                }
            };
            let context = StreamContext {
                device: device_desc.kind,
                device_index: device_desc.index,
                threads: builder.cpu_threads,
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
                context,
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

/// Refuses a plan whose devices (on the nodes this job runs) have no backend in this
/// build, naming the device, rather than running their kernels somewhere else.
fn check_devices(plan: &Plan, node: Option<u16>) -> Result<(), RuntimeError> {
    for device in &plan.devices {
        if node.is_some_and(|n| n != device.node) || device_supported(device.kind) {
            continue;
        }
        let available: Vec<&str> = crate::device::KINDS.iter().map(|k| k.name()).collect();
        return Err(RuntimeError::UnsupportedDevice { device: device.label(), available: available.join(", ") });
    }
    Ok(())
}

/// Writes every variable's first value, drawn from its initializer and cut to its
/// register's part, into the register's preloaded slots (before any thread runs). A
/// logical value shared by several parts is drawn once.
fn write_variables(plan: &Plan, arenas: &PlanArenas) -> Result<(), RuntimeError> {
    let mut drawn: HashMap<String, regflow_plan::HostArray> = HashMap::new();
    for variable in &plan.variables {
        let desc = &plan.regst_descs[variable.regst.index()];
        let fail = |message: String| RuntimeError::Preload { regst: desc.name.clone(), message };
        let key = format!("{:?}|{}", variable.init, variable.meta);
        let whole = drawn.entry(key).or_insert_with(|| variable.init.value(&variable.meta));
        let part = variable.region.cut(whole).to_le_bytes();
        if part.len() as u64 != desc.bytes {
            return Err(fail(format!(
                "variable '{}' has {} bytes in its region, its register's slots hold {}",
                variable.name,
                part.len(),
                desc.bytes
            )));
        }
        for slot in 0..desc.preloaded {
            let view = arenas.view(regflow_actors::RegstRef { desc: variable.regst, slot });
            // SAFETY: no stream thread exists yet; nothing else can touch the arena.
            unsafe { view.as_mut_slice() }.copy_from_slice(&part);
        }
    }
    Ok(())
}

/// Writes the initial bytes of preloaded registers into their slots (before any thread runs).
fn write_preloads(plan: &Plan, arenas: &PlanArenas, preloads: &[(String, Vec<u8>)]) -> Result<(), RuntimeError> {
    if preloads.is_empty() {
        return Ok(());
    }
    // Register by name; `None` for a name two registers share.
    let mut by_name: HashMap<&str, Option<usize>> = HashMap::with_capacity(plan.regst_descs.len());
    for (d, desc) in plan.regst_descs.iter().enumerate() {
        by_name.entry(desc.name.as_str()).and_modify(|found| *found = None).or_insert(Some(d));
    }
    for (name, bytes) in preloads {
        let Some(&Some(d)) = by_name.get(name.as_str()) else {
            return Err(RuntimeError::Preload {
                regst: name.clone(),
                message: "no single register has this name".into(),
            });
        };
        let desc = &plan.regst_descs[d];
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
            let view = arenas.view(regflow_actors::RegstRef { desc: regflow_plan::RegstDescId(d as u32), slot });
            // SAFETY: no stream thread exists yet; nothing else can touch the arena.
            unsafe { view.as_mut_slice() }.copy_from_slice(bytes);
        }
    }
    Ok(())
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
