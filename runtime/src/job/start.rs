//! Building a job: validate the plan, allocate its memory, size the inboxes, make the
//! kernels, feeders and fetchers, start the stream threads, the watchdog and the sources.

use super::make::UserEnds;
use super::setup::{
    check_devices, check_sink_callbacks, deliveries, kernel_memory, lend_scratches, make_actors, max_arity,
    sim_capacity, start_sources, start_watchdog, stream_device, stream_label, user_records, variable_preloads,
    watch_names, write_preloads, write_variables, Deliveries, LentScratch,
};
use super::{Job, DEFAULT_WATCHDOG, MAX_CPU_THREADS};
use crate::arenas::PlanArenas;
use crate::bus::Router;
use crate::device::GpuMap;
use crate::inbox::InboxReceiver;
use crate::lane::Lanes;

use crate::kernel::{JobKernels, Kernel, KernelFactory, KernelIo, KernelSpec, StreamContext};
use crate::stream::{JobShared, StreamExit, StreamWorker};
use crate::sync::Arc;
use crate::trace::TraceBuffer;
use crate::RuntimeError;
use regflow_actors::{PlanIds, StreamId};
use regflow_kernels::StreamScratch;
use regflow_plan::{ActorKind, DeviceKind, Plan, PlanIndex, StreamKind};
use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::time::{Duration, Instant};

type SinkCallback = Box<dyn FnMut(&KernelIo<'_>) + Send>;

/// Configures a [`Job`]: `Job::builder(plan).watchdog(..).trace(..).build()?`.
pub struct JobBuilder {
    pub(super) plan: Plan,
    pub(super) watchdog: Option<Duration>,
    pub(super) trace: Option<PathBuf>,
    pub(super) kernels: JobKernels,
    pub(super) sink_callbacks: HashMap<String, SinkCallback>,
    pub(super) node: Option<u16>,
    pub(super) fetch_depth: Option<u64>,
    pub(super) preloads: Vec<(String, Vec<u8>)>,
    pub(super) variable_values: Vec<(String, regflow_plan::HostArray)>,
    pub(super) cpu_threads: usize,
    pub(super) gpus: crate::device::GpuMap,
    pub(super) data_dir: Option<PathBuf>,
    pub(super) keep_state: bool,
    pub(super) cluster: Option<crate::net::Cluster>,
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

    /// Threads one kernel of a `cpu` device may use: its stream thread and `threads − 1`
    /// helpers of it, which share products (blocks of rows or columns), row-wise kernels and
    /// updates; results are bitwise the same for any count. Default 1, so that devices on
    /// one machine do not compete for cores. 0, or more than [`MAX_CPU_THREADS`], is refused
    /// when the job is built.
    pub fn cpu_threads(mut self, threads: usize) -> Self {
        self.cpu_threads = threads;
        self
    }

    /// Runs plan device `cuda:i` on GPU `ordinals[i]` (by default on GPU `i`). Several
    /// devices may share one GPU: two data-parallel devices on a one-GPU machine, reduced by
    /// the in-process collectives (NCCL refuses two ranks on one GPU).
    pub fn cuda_ordinals(mut self, ordinals: &[usize]) -> Self {
        self.gpus = crate::device::GpuMap::new(ordinals.to_vec());
        self
    }

    /// The directory relative dataset paths of the plan are resolved against (default: the
    /// working directory). `regflow run` passes the plan file's directory.
    pub fn data_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.data_dir = Some(dir.into());
        self
    }

    /// Hands every piece of sink `name` to `callback` on the sink's stream thread, without
    /// a copy (on a `cuda` device: the device's copy of its inputs into page-locked memory),
    /// instead of delivering it to a [`Fetcher`](crate::Fetcher).
    pub fn on_sink<F>(mut self, name: &str, callback: F) -> Self
    where
        F: FnMut(&KernelIo<'_>) + Send + 'static,
    {
        self.sink_callbacks.insert(name.to_string(), Box::new(callback));
        self
    }

    /// Runs only the actors of `node`; messages to other nodes fail with "not connected"
    /// unless the job has a [`JobBuilder::cluster`]. By default a job runs every node
    /// in-process.
    pub fn node(mut self, node: u16) -> Self {
        self.node = Some(node);
        self
    }

    /// Runs the actors of `cluster`'s node, and reaches the other nodes of the plan over
    /// its connections: registers, collectives and aborts cross them (see
    /// [`crate::Cluster`]). Every node must build its job from the same plan.
    pub fn cluster(mut self, cluster: crate::net::Cluster) -> Self {
        self.node = Some(cluster.rank());
        self.cluster = Some(cluster);
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

    /// The initial value of variable `name` (its logical name, as the graph calls it; e.g.
    /// from a checkpoint), instead of the value the plan's initializer draws. At build it
    /// must have the variable's dtype and shape (a transposed weight is refused, not loaded),
    /// and each device's register gets its part (its region of the value).
    pub fn preload_variable(mut self, name: &str, value: regflow_plan::HostArray) -> Self {
        self.variable_values.push((name.to_string(), value));
        self
    }

    /// Reads the final value of every variable (weights and optimizer state: AdamW moments,
    /// the step counter) when the job ends: [`JobReport::state`](super::JobReport::state),
    /// whole logical tensors by the names the graph gave them, each gathered from its
    /// devices' parts. Off by default: a job that does not ask copies nothing.
    pub fn keep_state(mut self) -> Self {
        self.keep_state = true;
        self
    }

    /// The plan this builder will run.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The plan's variables by logical name (a variable split over devices once), with
    /// their whole dtype and shape, in the plan's order: what
    /// [`JobBuilder::preload_variable`] takes and [`JobBuilder::keep_state`] reads.
    pub fn variables(&self) -> Vec<(String, regflow_plan::TensorMeta)> {
        let mut seen = std::collections::HashSet::new();
        self.plan
            .variables
            .iter()
            .filter(|v| seen.insert(super::logical_name(&v.name)))
            .map(|v| (super::logical_name(&v.name).to_string(), v.meta.clone()))
            .collect()
    }

    /// Validates the plan, allocates its memory, starts its threads and its sources.
    pub fn build(self) -> Result<Job, RuntimeError> {
        Job::start(self)
    }
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
            variable_values: Vec::new(),
            cpu_threads: 1,
            gpus: Default::default(),
            data_dir: None,
            keep_state: false,
            cluster: None,
        }
    }

    /// Runs every node of `plan` in this process with default settings.
    pub fn local(plan: Plan) -> Result<Job, RuntimeError> {
        Self::builder(plan).build()
    }

    fn start(mut builder: JobBuilder) -> Result<Job, RuntimeError> {
        // A node that cannot start tells the others at once rather than leave them waiting.
        let mut cluster = builder.cluster.take();
        let started = Self::start_with(builder, &mut cluster);
        if let (Err(error), Some(cluster)) = (&started, cluster) {
            cluster.refuse(error);
        }
        started
    }

    fn start_with(mut builder: JobBuilder, cluster: &mut Option<crate::net::Cluster>) -> Result<Job, RuntimeError> {
        check_cpu_threads(builder.cpu_threads)?;
        let plan = Arc::new(std::mem::replace(&mut builder.plan, Plan::empty()));
        plan.validate()?;
        // Every per-actor lookup below goes through the index: building is linear in the
        // plan's size.
        let indexed = PlanIndex::new(&plan);
        let ids = PlanIds::assign(&plan)?;
        // Firings of each actor per step (its micro-batches): how many pieces a program may
        // push into one input before the next, and which step a piece belongs to. A
        // hand-built plan whose rates do not balance counts pieces as steps.
        let per_step = regflow_actors::firings_per_step(&indexed).unwrap_or_else(|_| vec![1; plan.actors.len()]);
        let memory_plan = plan.memory()?;
        check_devices(&plan, builder.node, &builder.gpus)?;
        let arenas = PlanArenas::allocate(&plan, &memory_plan, builder.node, &builder.gpus)?;
        write_variables(&plan, &arenas)?;
        let mut preloads = std::mem::take(&mut builder.preloads);
        preloads.extend(variable_preloads(&plan, &builder.variable_values)?);
        write_preloads(&plan, &arenas, &preloads)?;
        let arenas = Arc::new(arenas);
        let node = builder.node;
        let hosts = move |n: u16| node.is_none_or(|only| only == n);
        let stream_node = |s: usize| plan.devices[plan.streams[s].device.index()].node;

        let callback_sinks: Vec<String> = builder.sink_callbacks.keys().cloned().collect();
        check_sink_callbacks(&builder, &indexed)?;

        // Inboxes and lanes, then the router.
        let (snapshot_tx, snapshot_rx) = crossbeam_channel::unbounded();
        let shared = Arc::new(JobShared::new(plan.streams.len(), snapshot_tx, builder.kernels.collectives()));
        let hosted: Vec<usize> = (0..plan.streams.len()).filter(|&s| hosts(stream_node(s))).collect();
        let Deliveries { senders, mut receivers, mut lanes, stream_threads } =
            deliveries(&indexed, builder.fetch_depth, &per_step, &hosted, &shared.send_waits);
        let mut stream_of = vec![Vec::new(); plan.devices.len()];
        for (s, stream) in plan.streams.iter().enumerate() {
            stream_of[stream.device.index()].push(s as u32);
        }
        let net = match cluster.as_ref() {
            Some(cluster) => Some(net_channels(&plan, cluster, &shared, &builder.kernels)?),
            None => None,
        };
        let router = Router::new(builder.node, stream_of, senders.clone(), net.as_ref().map(|(out, _, _)| out.clone()));
        let (user, records) = user_records(
            &indexed,
            |a| senders[plan.actors[a.index()].stream.index()].is_some(),
            |name| builder.sink_callbacks.contains_key(name),
            builder.fetch_depth,
            &per_step,
        );
        let user = std::sync::Arc::new(user);
        let mut ends = UserEnds {
            user: &user,
            records: &records,
            shared: &shared,
            feeders: HashMap::new(),
            fetchers: HashMap::new(),
        };

        let made = make_actors(&mut builder, &indexed, &ids, &per_step, &senders, &mut ends)?;
        let (per_stream, sources, host_kernels) = (made.per_stream, made.sources, made.on_host);
        let kernel_memory = kernel_memory(&plan, &made.stream_scratch, &made.largest_scratch, &arenas)?;

        let UserEnds { feeders, fetchers, .. } = ends;

        // Every collective group complete in this job, on comm streams.
        builder.kernels.collectives().check(&indexed)?;

        // The connections' threads, before any stream runs.
        let (net, watch_net) = match (net, cluster.take()) {
            (Some((out, receivers, groups)), Some(cluster)) => {
                let (mut watch_net, watch_senders) = crate::net::watch_channels(out.clone());
                watch_net.groups = Some(groups.clone());
                let plane = crate::net::NetPlane::start(
                    cluster,
                    out,
                    receivers,
                    plan.clone(),
                    &ids,
                    arenas.clone(),
                    groups,
                    shared.clone(),
                    router.clone(),
                    watch_senders,
                    per_step.clone(),
                )?;
                watch_net.recorders = plane.recorders();
                (Some(plane), Some(watch_net))
            }
            _ => (None, None),
        };

        let mut scratches = lend_scratches(&plan, &made.stream_scratch, |s| receivers[s].is_some(), &builder.gpus)?;

        // Stream threads.
        let epoch = Instant::now();
        let mut threads = Vec::new();
        // Bounded: one notice per stream, allocated now, so teardown allocates nothing.
        let (exit_tx, exits) = crossbeam_channel::bounded(plan.streams.len().max(1));
        let parts = WorkerParts {
            plan: &plan,
            ids: &ids,
            gpus: &builder.gpus,
            cpu_threads: builder.cpu_threads,
            traced: builder.trace.is_some(),
            router: &router,
            memory: &arenas,
            shared: &shared,
            max_arity: max_arity(&indexed),
            local_room: super::setup::local_queue_capacities(&plan),
        };
        let sim_room = sim_capacity(&plan);
        for (s, made) in per_stream.into_iter().enumerate() {
            let Some(inbox) = receivers[s].take() else { continue };
            let device = match stream_device(&plan, s, senders[s].as_ref(), &builder.gpus, sim_room) {
                Ok(Some(device)) => device,
                Ok(None) => continue,
                Err(e) => return Err(stop_started(threads, &shared, &router, e)),
            };
            let lanes = std::mem::take(&mut lanes[s]);
            let worker = parts.worker(s, made, inbox, lanes, device, scratches[s].take());
            let exit_notice = ExitNotice(exit_tx.clone(), s);
            match spawn_stream(worker, &shared, &router, exit_notice) {
                Ok(handle) => threads.push((s, handle)),
                Err(e) => return Err(stop_started(threads, &shared, &router, e)),
            }
        }

        hint_collectives_on_compute(&plan, threads.iter().map(|&(s, _)| s), builder.cpu_threads);

        let watchdog = match builder.watchdog {
            None => None,
            Some(timeout) => {
                let names = watch_names(&plan, &ids, &hosted);
                Some(start_watchdog(names, &shared, &user, &router, timeout, snapshot_rx, watch_net)?)
            }
        };

        start_sources(&router, sources);
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
            callback_sinks,
            user,
            watchdog,
            epoch,
            trace_path: builder.trace,
            keep_state: builder.keep_state,
            net,
            host_kernels,
            kernel_memory,
            _stream_threads: stream_threads,
        })
    }
}

/// Refuses a thread count per cpu kernel outside 1 to [`MAX_CPU_THREADS`].
fn check_cpu_threads(threads: usize) -> Result<(), RuntimeError> {
    if (1..=MAX_CPU_THREADS).contains(&threads) {
        return Ok(());
    }
    Err(RuntimeError::Setting {
        setting: "cpu_threads",
        value: threads.to_string(),
        reason: format!(
            "a cpu device's kernels run on 1 to {MAX_CPU_THREADS} threads (this machine has {})",
            std::thread::available_parallelism().map_or(1, usize::from)
        ),
    })
}

/// What the stream workers of a job share, for [`WorkerParts::worker`].
struct WorkerParts<'a> {
    plan: &'a Plan,
    ids: &'a PlanIds,
    gpus: &'a GpuMap,
    cpu_threads: usize,
    /// The job records a timeline.
    traced: bool,
    router: &'a Router,
    memory: &'a Arc<PlanArenas>,
    shared: &'a Arc<JobShared>,
    /// The most inputs (or outputs) of an actor of the plan.
    max_arity: usize,
    /// Room of each stream's local queue.
    local_room: Vec<usize>,
}

impl WorkerParts<'_> {
    /// The worker of plan stream `s`: its actors and their runtimes, its inbox and lanes,
    /// its device stream and the kernel scratch it lends.
    fn worker(
        &self,
        s: usize,
        (actors, runtimes): (Vec<regflow_actors::Actor>, Vec<crate::stream::ActorRuntime>),
        inbox: InboxReceiver,
        lanes: Lanes,
        device: Box<dyn crate::device::DeviceStream>,
        scratch: Option<LentScratch>,
    ) -> StreamWorker {
        let plan = self.plan;
        let device_desc = &plan.devices[plan.streams[s].device.index()];
        let (lent_scratch, scratch) = scratch.map_or((None, StreamScratch::NONE), |(m, lent)| (Some(m), lent));
        let context = StreamContext {
            device: device_desc.kind,
            device_index: self.gpus.kernel_index(device_desc.kind, device_desc.index),
            threads: self.cpu_threads,
            native: device.native(),
            scratch,
        };
        let stream_id =
            actors.first().map(|a| a.id().stream_id()).unwrap_or_else(|| placeholder_stream_id(plan, self.ids, s));
        let actor_count = actors.len();
        StreamWorker {
            index: s,
            label: stream_label(plan, s),
            stream_id,
            actors,
            runtimes,
            local: VecDeque::with_capacity(self.local_room[s]),
            runnable: regflow_actors::RunQueue::new(actor_count),
            inbox,
            lanes,
            router: self.router.clone(),
            device,
            memory: self.memory.clone(),
            shared: self.shared.clone(),
            trace: self.traced.then(|| TraceBuffer::new(s)),
            scratch_inputs: vec![regflow_memory::BufferView::empty(); self.max_arity].into_boxed_slice(),
            scratch_outputs: vec![regflow_memory::BufferView::empty(); self.max_arity].into_boxed_slice(),
            context,
            _lent_scratch: lent_scratch,
        }
    }
}

/// The network of a job that runs one node of `cluster`: its writers' channels, one per
/// peer, and the collectives that span nodes (handed to the job's kernels).
fn net_channels(
    plan: &Plan,
    cluster: &crate::net::Cluster,
    shared: &JobShared,
    kernels: &JobKernels,
) -> Result<NetChannels, RuntimeError> {
    check_cluster(plan, cluster)?;
    let capacities = crate::net::channel_capacities(plan, cluster.rank(), cluster.world());
    let abort = shared.abort_signal.receiver().clone();
    let (out, receivers) = crate::net::NetPlane::channels(cluster, &capacities, abort, shared.send_waits.clone());
    let sink: std::sync::Arc<dyn crate::collective::CollectiveSend> = std::sync::Arc::new(out.clone());
    let groups = crate::collective::NetGroups::new(plan, cluster.rank(), sink)
        .map_err(|message| RuntimeError::Cluster { node: cluster.rank(), world: cluster.world(), message })?;
    let groups = Arc::new(groups);
    kernels.collectives().set_net(groups.clone());
    Ok((out, receivers, groups))
}

/// What [`net_channels`] makes: the writers' sending side, their receiving ends by node,
/// and the collectives across nodes.
type NetChannels = (
    Arc<crate::net::NetOut>,
    Vec<Option<crossbeam_channel::Receiver<crate::net::Outgoing>>>,
    Arc<crate::collective::NetGroups>,
);

/// Stops the stream threads started so far, before a job that could not start all of them
/// returns `error`: left running, they would wait for ever on inboxes they hold the
/// senders of.
fn stop_started(
    threads: Vec<(usize, std::thread::JoinHandle<StreamExit>)>,
    shared: &JobShared,
    router: &Router,
    error: RuntimeError,
) -> RuntimeError {
    shared.abort(RuntimeError::Stopped, router);
    threads.into_iter().for_each(|(_, t)| drop(t.join()));
    error
}

/// Says in the log when a job's cpu stream threads (each with its kernels' helpers)
/// outnumber the cores while cpu collectives run on comm threads of their own: there, each
/// collective wakes a thread that has no core to run on, and compiling for this host's
/// cores (`ParallelOptions::collective_streams`, `Auto` or `ForCores`) runs them on the
/// compute threads instead (BENCHMARKS.md, issue 13, "twenty-first"). A plan compiled with
/// `Auto` on this host has them there already, unless kernel helper threads
/// (`cpu_threads`) are what outnumber the cores. Plans that could not block their compute
/// streams (micro-batches, copies between devices) get no hint.
fn hint_collectives_on_compute(plan: &Plan, started: impl Iterator<Item = usize>, cpu_threads: usize) {
    let started: Vec<usize> = started.collect();
    if let Some(hint) = comm_threads_hint(plan, &started, cpu_threads, crate::activity::cores()) {
        tracing::info!("{hint}");
    }
}

/// [`hint_collectives_on_compute`]'s sentence for a plan whose streams `started` run, with
/// `cpu_threads` threads per cpu compute stream, on `cores` cores; `None` where it has
/// nothing to say.
fn comm_threads_hint(plan: &Plan, started: &[usize], cpu_threads: usize, cores: usize) -> Option<String> {
    let cpu = |s: usize| plan.devices[plan.streams[s].device.index()].kind == DeviceKind::Cpu;
    let comm_collectives = plan.actors.iter().enumerate().any(|(a, actor)| {
        plan.collective_conf(a).is_some()
            && plan.streams[actor.stream.index()].kind == StreamKind::Comm
            && cpu(actor.stream.index())
    });
    let threads: usize = started
        .iter()
        .filter(|&&s| cpu(s))
        .map(|&s| if plan.streams[s].kind == StreamKind::Compute { cpu_threads.max(1) } else { 1 })
        .sum();
    // Only where the compute streams could take them: one micro-batch per step (no repeat
    // or acc actors) and devices that exchange nothing but collectives (no pipeline).
    let micro_batches = plan.actors.iter().any(|a| matches!(a.kind, ActorKind::Repeat { .. } | ActorKind::Acc { .. }));
    let copies_between_devices = plan.regst_descs.iter().any(|desc| {
        let from = plan.device_of(desc.producer);
        desc.consumers.iter().any(|&c| plan.device_of(c) != from)
    });
    (comm_collectives && threads > cores && !micro_batches && !copies_between_devices).then(|| {
        format!(
            "{threads} cpu stream threads on {cores} cores, with collectives on comm threads of their own: \
             compiling with ParallelOptions::collective_streams = CollectiveStreams::ComputeStreams runs them on the \
             compute threads"
        )
    })
}

/// Starts the thread of one stream; its exit notice is sent however the thread ends.
fn spawn_stream(
    worker: StreamWorker,
    shared: &Arc<JobShared>,
    router: &Router,
    exit_notice: ExitNotice,
) -> Result<std::thread::JoinHandle<StreamExit>, RuntimeError> {
    let s = exit_notice.1;
    let name = format!("regflow-s{s}");
    let (shared, router) = (shared.clone(), router.clone());
    std::thread::Builder::new()
        .name(name.clone())
        .spawn(move || {
            // Dropped last, after a panic has been recorded as the job's error.
            let _notice = exit_notice;
            // Kept for a panic's report: the worker is gone by then.
            let label = worker.label.clone();
            run_stream(worker, s, label, shared, router)
        })
        .map_err(|e| RuntimeError::Spawn { thread: name, message: e.to_string() })
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

/// Sent when a stream thread ends, however it ends (dropped last, even on panic).
struct ExitNotice(crossbeam_channel::Sender<usize>, usize);

impl Drop for ExitNotice {
    fn drop(&mut self) {
        let _ = self.0.send(self.1);
    }
}

/// The id of a stream that has no actors (its thread ends at once).
fn placeholder_stream_id(plan: &Plan, ids: &PlanIds, s: usize) -> StreamId {
    let device = plan.streams[s].device;
    let node = plan.devices[device.index()].node;
    regflow_actors::ActorId::new(node, device.0, ids.stream_position[s], 0)
        .map(|id| id.stream_id())
        .unwrap_or_else(|| unreachable!("PlanIds::assign accepted stream {s}, so its id fits"))
}

/// A cluster fits the plan: as many nodes as the plan's devices name.
fn check_cluster(plan: &Plan, cluster: &crate::net::Cluster) -> Result<(), RuntimeError> {
    let nodes = plan.devices.iter().map(|d| d.node).max().map_or(1, |n| n + 1);
    if nodes != cluster.world() {
        return Err(RuntimeError::Cluster {
            node: cluster.rank(),
            world: cluster.world(),
            message: format!("the plan places devices on {nodes} node(s), but the cluster has {}", cluster.world()),
        });
    }
    Ok(())
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::comm_threads_hint;
    use regflow_plan::{ActorKind, DeviceKind, KernelConf, Plan, PlanBuilder, SourcePieces, StreamKind};

    /// Two cpu devices, each a source feeding an all-reduce member on a comm stream, read
    /// by a sink on its compute stream; with `cross`, device 0's source is read on device 1
    /// too, and with `repeat` a repeat hands device 0's source on.
    fn plan(cross: bool, repeat: bool) -> Plan {
        let mut b = PlanBuilder::new();
        let mut sources = Vec::new();
        let mut sinks = Vec::new();
        for rank in 0..2u16 {
            let d = b.device(0, DeviceKind::Cpu, rank);
            let (compute, comm) = (b.stream(d, StreamKind::Compute), b.stream(d, StreamKind::Comm));
            let source =
                b.actor(&format!("source@{rank}"), compute, ActorKind::Source { pieces: SourcePieces::Count(2) });
            let conf = crate::collective::tests::conf(u32::from(rank), &[4]);
            let member = b.actor(
                &format!("allreduce@{rank}"),
                comm,
                ActorKind::Compute { kernel: KernelConf::Collective(conf) },
            );
            let input = b.regst(&format!("source@{rank}.out"), source, 16, 1);
            b.consume(member, input);
            let output = b.regst(&format!("allreduce@{rank}.out"), member, 16, 1);
            let sink = b.actor(&format!("sink@{rank}"), compute, ActorKind::Sink);
            b.consume(sink, output);
            sources.push((source, input, compute));
            sinks.push(sink);
        }
        if cross {
            b.consume(sinks[1], sources[0].1);
        }
        if repeat {
            let r = b.actor("repeat@0", sources[0].2, ActorKind::Repeat { count: 2 });
            b.consume(r, sources[0].1);
            let repeated = b.regst("repeat@0.out", r, 16, 1);
            let sink = b.actor("sink2@0", sources[0].2, ActorKind::Sink);
            b.consume(sink, repeated);
        }
        b.plan_mut().clone()
    }

    #[test]
    fn the_hint_names_threads_and_cores_where_the_compute_streams_could_take_the_collectives() {
        let all: Vec<usize> = (0..4).collect();
        let hint = comm_threads_hint(&plan(false, false), &all, 1, 2).expect("4 threads on 2 cores");
        assert!(hint.starts_with("4 cpu stream threads on 2 cores, with collectives on comm threads"), "{hint}");
        // Helper threads count: 2 × 2 + 2 on 4 cores.
        assert!(comm_threads_hint(&plan(false, false), &all, 2, 4).unwrap().starts_with("6 cpu stream threads"));
        // Enough cores, a plan whose compute streams could not block (copies between
        // devices, micro-batches): nothing to say.
        assert_eq!(comm_threads_hint(&plan(false, false), &all, 1, 4), None);
        assert_eq!(comm_threads_hint(&plan(true, false), &all, 1, 2), None);
        assert_eq!(comm_threads_hint(&plan(false, true), &all, 1, 2), None);
    }
}
