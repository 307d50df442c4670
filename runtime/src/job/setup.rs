//! The steps of building a job that need no builder: checking the plan's devices, writing
//! the first values of loop registers, sizing the inboxes, starting the watchdog.

use super::make::{make_actor, UserEnds};
use super::start::JobBuilder;
use super::UserWaits;
use crate::activity::StreamThreads;
use crate::arenas::PlanArenas;
use crate::bus::Router;
use crate::device::{CpuStream, CudaStream, DeviceStream, GpuMap, SimStream};
use crate::inbox::{inbox, Envelope, InboxReceiver, InboxSender};
use crate::lane::Lanes;
use crate::send_waits::SendWaits;
use crate::stream::ActorRuntime;
use crate::stream::JobShared;
use crate::sync::Arc;
use crate::watchdog::{watch, Names};
use crate::RuntimeError;
use regflow_actors::{Actor, ActorId, Body, Cmd, Message, PlanIds};
use regflow_kernels::StreamScratch;
use regflow_memory::{ArenaMemory, MemoryReport};
use regflow_plan::{ActorIndex, ActorKind, DeviceKind, Plan, PlanIndex, SourcePieces};
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

/// Refuses a plan whose devices (on the nodes this job runs) cannot run here (a `cuda`
/// device without the backend, the driver or the GPU), naming the device and what is
/// missing, rather than running their kernels somewhere else.
pub(super) fn check_devices(plan: &Plan, node: Option<u16>, gpus: &GpuMap) -> Result<(), RuntimeError> {
    for device in &plan.devices {
        if node.is_some_and(|n| n != device.node) {
            continue;
        }
        if let Some(reason) = crate::device::unavailable(device.kind, device.index, gpus) {
            return Err(RuntimeError::UnsupportedDevice { device: device.label(), reason });
        }
    }
    Ok(())
}

/// Writes every variable's first value, drawn from its initializer and cut to its
/// register's part, into the register's preloaded slots (before any thread runs). A
/// logical value shared by several parts is drawn once.
pub(super) fn write_variables(plan: &Plan, arenas: &PlanArenas) -> Result<(), RuntimeError> {
    let mut drawn: HashMap<String, regflow_plan::HostArray> = HashMap::new();
    let host = regflow_memory::host_memory_bytes();
    for variable in &plan.variables {
        let desc = &plan.regst_descs[variable.regst.index()];
        let fail = |message: String| RuntimeError::Preload { regst: desc.name.clone(), message };
        if arenas.try_view(regflow_actors::RegstRef { desc: variable.regst, slot: 0 }).is_none() {
            continue; // another node's register: that node draws and writes it
        }
        // The whole value is drawn before it is cut: it must fit in host memory even where
        // its part does (an allocation that fails would abort the process).
        let whole_bytes = variable
            .meta
            .shape
            .dims()
            .iter()
            .try_fold(variable.meta.dtype.size() as u64, |bytes, &d| bytes.checked_mul(d as u64));
        match (whole_bytes, host) {
            (Some(bytes), Some(host)) if bytes > host => {
                return Err(RuntimeError::DoesNotFit {
                    device: "host".into(),
                    what: format!(
                        "variable '{}' ({}), drawn whole before it is cut to its parts",
                        variable.name, variable.meta
                    ),
                    bytes,
                    available: format!("{host} bytes of host memory"),
                })
            }
            (None, _) => {
                return Err(fail(format!("variable '{}' ({}) has more bytes than 2^64", variable.name, variable.meta)))
            }
            _ => {}
        }
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
        // A constant variable's every slot holds its value for the whole job.
        let slots = if variable.constant { desc.register_num } else { desc.preloaded };
        for slot in 0..slots {
            // A register of another node (nor mirrored here): that node writes it.
            let Some(view) = arenas.try_view(regflow_actors::RegstRef { desc: variable.regst, slot }) else { break };
            // SAFETY: no stream thread exists yet; nothing else can touch the arena.
            unsafe { view.as_mut_slice() }.copy_from_slice(&part);
        }
    }
    Ok(())
}

/// The register preloads of whole variable values (`JobBuilder::preload_variable`): each
/// value is checked against the variable's logical dtype and shape, then cut into the part
/// every device's register holds.
pub(super) fn variable_preloads(
    plan: &Plan,
    values: &[(String, regflow_plan::HostArray)],
) -> Result<Vec<(String, Vec<u8>)>, RuntimeError> {
    let logical = |name: &str| name.split('@').next().unwrap_or(name).to_string();
    let mut preloads = Vec::new();
    for (name, value) in values {
        let parts: Vec<_> = plan.variables.iter().filter(|v| logical(&v.name) == *name).collect();
        let Some(first) = parts.first() else {
            let mut names: Vec<String> = plan.variables.iter().map(|v| logical(&v.name)).collect();
            names.dedup();
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            return Err(RuntimeError::unknown_name("variable", name, &names));
        };
        let got = value.meta();
        if got != first.meta {
            let same_count = got.dtype == first.meta.dtype && got.shape.numel() == first.meta.shape.numel();
            return Err(RuntimeError::VariableMismatch {
                variable: name.clone(),
                expected: first.meta.to_string(),
                got: got.to_string(),
                hint: if same_count { " (the same number of elements in another shape: transposed?)" } else { "" },
            });
        }
        for part in parts {
            let regst = plan.regst_descs[part.regst.index()].name.clone();
            preloads.push((regst, part.region.cut(value).to_le_bytes()));
        }
    }
    Ok(preloads)
}

/// Writes the initial bytes of preloaded registers into their slots (before any thread runs).
pub(super) fn write_preloads(
    plan: &Plan,
    arenas: &PlanArenas,
    preloads: &[(String, Vec<u8>)],
) -> Result<(), RuntimeError> {
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
        let constant = plan.variables.iter().any(|v| v.constant && v.regst.index() == d);
        if desc.preloaded == 0 && !constant {
            return Err(RuntimeError::Preload { regst: name.clone(), message: "has no preloaded slots".into() });
        }
        if bytes.len() as u64 != desc.bytes {
            return Err(RuntimeError::Preload {
                regst: name.clone(),
                message: format!("got {} bytes, its slots hold {}", bytes.len(), desc.bytes),
            });
        }
        let slots = if constant { desc.register_num } else { desc.preloaded };
        for slot in 0..slots {
            let regst = regflow_actors::RegstRef { desc: regflow_plan::RegstDescId(d as u32), slot };
            // A register of another node (nor mirrored here): that node writes it.
            let Some(view) = arenas.try_view(regst) else { break };
            // SAFETY: no stream thread exists yet; nothing else can touch the arena.
            unsafe { view.as_mut_slice() }.copy_from_slice(bytes);
        }
    }
    Ok(())
}

/// The names the watchdog reports in, for the streams `hosted`.
pub(super) fn watch_names(plan: &Plan, ids: &PlanIds, hosted: &[usize]) -> Names {
    let mut stream_actors = vec![Vec::new(); plan.streams.len()];
    for actor in &plan.actors {
        stream_actors[actor.stream.index()].push(actor.name.clone());
    }
    Names {
        actors: plan.actors.iter().enumerate().map(|(a, d)| (ids.actors[a], d.name.clone())).collect(),
        descs: plan.regst_descs.iter().map(|d| d.name.clone()).collect(),
        streams: (0..plan.streams.len()).map(|s| stream_label(plan, s)).collect(),
        stream_actors,
        hosted: hosted.to_vec(),
    }
}

/// Starts the watchdog thread; the sender stops it.
pub(super) fn start_watchdog(
    names: Names,
    shared: &Arc<JobShared>,
    user: &std::sync::Arc<UserWaits>,
    router: &Router,
    timeout: Duration,
    snapshots: crossbeam_channel::Receiver<(usize, Vec<regflow_actors::ActorSnapshot>)>,
    net: Option<crate::net::WatchNet>,
) -> Result<(crossbeam_channel::Sender<()>, std::thread::JoinHandle<()>), RuntimeError> {
    let (stop_tx, stop_rx) = crossbeam_channel::bounded::<()>(0);
    let (shared, user, router) = (shared.clone(), user.clone(), router.clone());
    let handle = std::thread::Builder::new()
        .name("regflow-watchdog".into())
        .spawn(move || watch(shared, user, router, names, timeout, stop_rx, snapshots, net))
        .map_err(|e| RuntimeError::Spawn { thread: "watchdog".into(), message: e.to_string() })?;
    Ok((stop_tx, handle))
}

/// The user-side record of every fed source and channel sink of the actors `hosted`
/// (indexed by actor), and each one's record index: feeds named by their typed input where
/// the plan's signature has one. Sinks in `callbacks` deliver to no fetcher.
pub(super) fn user_records(
    indexed: &PlanIndex<'_>,
    hosted: impl Fn(ActorIndex) -> bool,
    callbacks: impl Fn(&str) -> bool,
    configured_fetch_depth: Option<u64>,
    per_step: &[u64],
) -> (UserWaits, Vec<Option<usize>>) {
    let plan = indexed.plan();
    let mut inputs: HashMap<u32, &str> = HashMap::new();
    for input in &plan.signature.inputs {
        for part in &input.parts {
            inputs.insert(part.actor.0, input.name.as_str());
        }
    }
    let mut user = UserWaits::new();
    let mut records = vec![None; plan.actors.len()];
    for (a, actor) in plan.actors.iter().enumerate() {
        let index = ActorIndex(a as u32);
        if !hosted(index) {
            continue;
        }
        records[a] = match actor.kind {
            ActorKind::Source { pieces: SourcePieces::Fed } => {
                let input = inputs.get(&index.0).map(|name| name.to_string());
                Some(user.add_feed(&actor.name, input, feed_depth(indexed, index, per_step[a])))
            }
            ActorKind::Sink if !callbacks(&actor.name) => {
                Some(user.add_fetch(&actor.name, fetch_depth(plan, index, configured_fetch_depth)))
            }
            _ => None,
        };
    }
    (user, records)
}

/// Buffers a fed source cycles through: its register count plus a step of its pieces, so a
/// program may push every micro-batch of one input of a step before the next input (with
/// one micro-batch per step: one piece ahead). More than a step ahead waits for the job.
pub(super) fn feed_depth(indexed: &PlanIndex<'_>, source: ActorIndex, per_step: u64) -> u64 {
    let descs = &indexed.plan().regst_descs;
    let register_num = indexed.outputs_of(source).iter().map(|r| descs[r.index()].register_num).min().unwrap_or(1);
    u64::from(register_num) + per_step.max(1)
}

/// Pieces a channel sink may deliver ahead of the user's fetches.
pub(super) fn fetch_depth(plan: &Plan, sink: ActorIndex, configured: Option<u64>) -> u64 {
    let inputs = &plan.actors[sink.index()].inputs;
    let register_num = inputs.iter().map(|r| plan.regst_descs[r.index()].register_num).max().unwrap_or(1);
    configured.unwrap_or(u64::from(register_num).max(4))
}

/// Upper bound of the messages that can be in flight to each stream: every `Ready` holds a
/// slot, every `Ack` answers one, every `ActDone` answers a launch that holds one. One pass
/// over the actors.
fn inbox_capacities(indexed: &PlanIndex<'_>, configured_fetch_depth: Option<u64>, per_step: &[u64]) -> Vec<usize> {
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
            ActorKind::Source { pieces: SourcePieces::Fed } => {
                *capacity += feed_depth(indexed, index, per_step[a]) as usize
            }
            ActorKind::Sink => *capacity += fetch_depth(plan, index, configured_fetch_depth) as usize,
            _ => {}
        }
    }
    capacities
}

/// How messages reach the streams a job hosts, by plan stream index (`None` for the
/// streams of other nodes).
pub(super) struct Deliveries {
    /// Each hosted stream's inbox: its channel's sending end, for the router and the rest.
    pub(super) senders: Vec<Option<InboxSender>>,
    /// Each hosted stream's inbox, to be moved into its thread.
    pub(super) receivers: Vec<Option<InboxReceiver>>,
    /// Each stream's lanes to the streams it shares registers with.
    pub(super) lanes: Vec<Lanes>,
    /// The hosted streams' threads, counted in the process's total until the job ends.
    pub(super) stream_threads: StreamThreads,
}

/// The inboxes of the `hosted` streams, sized by [`inbox_capacities`], and the lanes
/// between those that share registers, sized by [`lane_capacities`], whose sends that
/// find them full say so in `send_waits`. The lanes' senders skip their locked swap when
/// receivers seldom sleep, i.e. when the stream threads of every job of the process,
/// these included, fit on the cores (`crate::lane`); the job holds `stream_threads`,
/// their count in the process's total, until it ends.
pub(super) fn deliveries(
    indexed: &PlanIndex<'_>,
    configured_fetch_depth: Option<u64>,
    per_step: &[u64],
    hosted: &[usize],
    send_waits: &std::sync::Arc<SendWaits>,
) -> Deliveries {
    let plan = indexed.plan();
    let capacities = inbox_capacities(indexed, configured_fetch_depth, per_step);
    let (mut senders, mut receivers): (Vec<_>, Vec<_>) = (0..capacities.len()).map(|_| (None, None)).unzip();
    // Counted first: whether all fit includes these.
    let stream_threads = StreamThreads::claim(hosted.len());
    let asymmetric = crate::activity::all_stream_threads_fit();
    for &s in hosted {
        let (tx, mut rx) = inbox(capacities[s]);
        if asymmetric {
            rx.use_asymmetric_barrier();
        }
        (senders[s], receivers[s]) = (Some(tx), Some(rx));
    }
    let mut lanes: Vec<Lanes> = (0..plan.streams.len()).map(|_| Lanes::new(plan.streams.len())).collect();
    for ((from, to), capacity) in lane_capacities(plan, |s| receivers[s].is_some()) {
        // A test's lanes may be made too small, to see a send wait for room.
        #[cfg(test)]
        let capacity = tests::LANE_ROOM.with(std::cell::Cell::get).unwrap_or(capacity);
        if let (Some(receiver), Some(wake)) = (receivers[to].as_mut(), senders[to].clone()) {
            lanes[from].insert(to, receiver.lane(capacity, wake, send_waits.clone(), (from, to)));
        }
    }
    Deliveries { senders, receivers, lanes, stream_threads }
}

/// Room for each lane (`crate::lane`), keyed by (sending stream, receiving stream): for
/// every register whose producer and a consumer run on two different streams that
/// `hosted` holds, the consumer's `Ready`s (one per slot, and the `Eord`) one way and its
/// `Ack`s the other, counted twice with the slack of [`inbox_capacities`]. Pairs of
/// streams that share no register get no lane.
fn lane_capacities(plan: &Plan, hosted: impl Fn(usize) -> bool) -> BTreeMap<(usize, usize), usize> {
    let mut capacities = BTreeMap::new();
    for desc in &plan.regst_descs {
        let Some(producer) = plan.actors.get(desc.producer.index()) else { continue };
        let from = producer.stream.index();
        for consumer in &desc.consumers {
            let Some(consumer) = plan.actors.get(consumer.index()) else { continue };
            let to = consumer.stream.index();
            if from == to || !hosted(from) || !hosted(to) {
                continue;
            }
            let slots = desc.register_num as usize + 1;
            *capacities.entry((from, to)).or_insert(4) += 2 * slots;
            *capacities.entry((to, from)).or_insert(4) += 2 * slots;
        }
    }
    capacities
}

pub(super) fn stream_label(plan: &Plan, s: usize) -> String {
    let stream = &plan.streams[s];
    format!("{}/{:?}#{s}", plan.devices[stream.device.index()].label(), stream.kind)
}

/// The actors of a job, made.
pub(super) struct MadeActors {
    /// Per stream, its actors and their runtimes (kernels, feeders and fetchers made on
    /// the way).
    pub(super) per_stream: Vec<(Vec<Actor>, Vec<ActorRuntime>)>,
    /// The actors to start (sources, and actors with preloaded outputs).
    pub(super) sources: Vec<ActorId>,
    /// The ops on GPU devices whose kernels run on the host (`Job::host_kernels`).
    pub(super) on_host: Vec<String>,
    /// Scratch each stream lends its kernels, per plan stream: the most any of its kernels
    /// asks (`Kernel::scratch_bytes`), since a stream runs its kernels one at a time.
    pub(super) stream_scratch: Vec<u64>,
    /// The actor asking the most scratch, per device label, and its bytes.
    pub(super) largest_scratch: HashMap<String, (String, u64)>,
}

/// The scratch the streams lend their kernels, summed per device and listed for the devices
/// the memory report lists (`Job::kernel_memory`), after checking that each device holds it
/// beside its registers; `largest` names the kernel asking the most, per device, for the
/// error.
pub(super) fn kernel_memory(
    plan: &Plan,
    stream_scratch: &[u64],
    largest: &HashMap<String, (String, u64)>,
    arenas: &PlanArenas,
) -> Result<MemoryReport, RuntimeError> {
    let mut device_scratch = vec![0u64; plan.devices.len()];
    for (stream, bytes) in plan.streams.iter().zip(stream_scratch) {
        device_scratch[stream.device.index()] += bytes;
    }
    let report = MemoryReport {
        devices: plan
            .devices
            .iter()
            .zip(&device_scratch)
            .map(|(device, &bytes)| (device.label(), bytes))
            .filter(|(label, _)| arenas.report().bytes_of(label).is_some())
            .collect(),
    };
    arenas.check_with_kernels(&report, largest)?;
    Ok(report)
}

/// A stream's scratch: its memory (kept as long as the stream's kernels) and what the
/// kernels see of it.
pub(super) type LentScratch = (Box<dyn ArenaMemory>, StreamScratch);

/// The scratch of each stream this job hosts (`hosted`), made once like the registers and
/// all before any stream thread starts, so a failure leaves none running: its memory and
/// what its kernels see of it, `None` where no kernel of the stream asks for any.
pub(super) fn lend_scratches(
    plan: &Plan,
    stream_scratch: &[u64],
    hosted: impl Fn(usize) -> bool,
    gpus: &GpuMap,
) -> Result<Vec<Option<LentScratch>>, RuntimeError> {
    (0..plan.streams.len())
        .map(|s| {
            if !hosted(s) {
                return Ok(None);
            }
            let bytes = stream_scratch[s];
            let memory = crate::arenas::stream_scratch(plan, s, gpus, bytes)?;
            Ok(memory.map(|m| {
                let lent = StreamScratch { address: m.base().as_ptr() as u64, bytes };
                (m, lent)
            }))
        })
        .collect()
}

/// Makes every actor this job hosts.
pub(super) fn make_actors(
    builder: &mut JobBuilder,
    indexed: &PlanIndex<'_>,
    ids: &PlanIds,
    per_step: &[u64],
    senders: &[Option<InboxSender>],
    ends: &mut UserEnds<'_>,
) -> Result<MadeActors, RuntimeError> {
    let plan = indexed.plan();
    let per_stream = (0..plan.streams.len()).map(|_| (Vec::new(), Vec::new())).collect();
    let mut made_actors = MadeActors {
        per_stream,
        sources: Vec::new(),
        on_host: Vec::new(),
        stream_scratch: vec![0; plan.streams.len()],
        largest_scratch: HashMap::new(),
    };
    for (a, desc) in plan.actors.iter().enumerate() {
        let stream = desc.stream.index();
        let Some(inbox) = senders[stream].clone() else { continue };
        let made = make_actor(builder, indexed, ids, per_step, ActorIndex(a as u32), inbox, ends)?;
        if made.starts {
            made_actors.sources.push(made.actor.id());
        }
        made_actors.on_host.extend(made.on_host);
        let device = plan.streams[stream].device.index();
        let lent = &mut made_actors.stream_scratch[stream];
        *lent = (*lent).max(made.scratch_bytes);
        if made.scratch_bytes > 0 {
            let largest = made_actors.largest_scratch.entry(plan.devices[device].label()).or_default();
            if made.scratch_bytes > largest.1 {
                *largest = (desc.name.clone(), made.scratch_bytes);
            }
        }
        made_actors.per_stream[stream].0.push(made.actor);
        made_actors.per_stream[stream].1.push(made.runtime);
    }
    Ok(made_actors)
}

/// The most registers one firing reads or writes (the streams' scratch capacity).
pub(crate) fn max_arity(indexed: &PlanIndex<'_>) -> usize {
    let plan = indexed.plan();
    (0..plan.actors.len())
        .map(|a| plan.actors[a].inputs.len().max(indexed.outputs_of(ActorIndex(a as u32)).len()))
        .max()
        .unwrap_or(0)
}

/// Per stream, room for every message its local queue can hold at once, so that it never
/// grows while the job runs: a message is a register slot ready for one consumer or acked
/// by it (never both at once for one slot and consumer), so there are at most
/// `register_num × consumers` of them per register, each on its receiver's stream (a
/// consumer's for readiness, the producer's for acks), plus a command per
/// actor and a batch from the inbox. The queue used to start with a fixed 256, which a
/// fused optimizer update (acking a hundred registers and more in one firing) can pass:
/// it then grew at whatever moment the scheduling first let that many pile up, once in a
/// CI run of the steady-state allocation test.
pub(crate) fn local_queue_capacities(plan: &Plan) -> Vec<usize> {
    // One pass over the registers and actors for all streams (plans run to 10^5 actors).
    let stream_of = |a: ActorIndex| plan.actors[a.index()].stream.index();
    let mut room = vec![crate::stream::INBOX_BATCH; plan.streams.len()];
    for d in &plan.regst_descs {
        let slots = d.register_num as usize;
        for &c in &d.consumers {
            room[stream_of(c)] += slots;
        }
        room[stream_of(d.producer)] += slots * d.consumers.len();
    }
    for a in &plan.actors {
        room[a.stream.index()] += 1;
    }
    room.into_iter().map(|r| r.max(256)).collect()
}

/// Go: every source (and actor with preloaded outputs) gets `Start`.
pub(super) fn start_sources(router: &Router, sources: Vec<ActorId>) {
    for source in sources {
        let msg = Message { dst: source, src: source, body: Body::Cmd(Cmd::Start) };
        if let Some(inbox) = router.inbox_of(source) {
            let _ = inbox.send(Envelope::Actor(msg));
        }
    }
}

/// Every `on_sink` callback names a sink of the plan.
pub(super) fn check_sink_callbacks(builder: &JobBuilder, indexed: &PlanIndex<'_>) -> Result<(), RuntimeError> {
    let plan = indexed.plan();
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
    Ok(())
}

/// How many launches a sim stream may have pending: every launch holds a slot of a
/// register until it completes, so the plan's slots bound them.
pub(super) fn sim_capacity(plan: &Plan) -> usize {
    plan.regst_descs.iter().map(|r| r.register_num as usize).sum::<usize>() + 1
}

/// How stream `s` launches kernels on its device; `None` for a sim or cuda stream this job
/// has no inbox for. A sim stream has room for `sim_room` pending launches ([`sim_capacity`]).
pub(super) fn stream_device(
    plan: &Plan,
    s: usize,
    inbox: Option<&InboxSender>,
    gpus: &GpuMap,
    sim_room: usize,
) -> Result<Option<Box<dyn DeviceStream>>, RuntimeError> {
    let device = &plan.devices[plan.streams[s].device.index()];
    match device.kind {
        DeviceKind::Sim => Ok(inbox.map(|_| Box::new(SimStream::new(sim_room)) as Box<dyn DeviceStream>)),
        DeviceKind::Cpu => Ok(Some(Box::new(CpuStream))),
        DeviceKind::Cuda => {
            let Some(inbox) = inbox else { return Ok(None) };
            let refused = |reason: String| RuntimeError::UnsupportedDevice { device: device.label(), reason };
            let ordinal = gpus.ordinal(device.index).map_err(refused)?;
            let stream = CudaStream::new(ordinal, device.label(), inbox.clone()).map_err(|e| refused(e.to_string()))?;
            Ok(Some(Box::new(stream)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use regflow_plan::{KernelConf, PlanBuilder, StreamKind};
    use std::sync::atomic::Ordering;

    thread_local! {
        /// Room for every lane of the jobs this thread builds, instead of the plan's.
        pub(super) static LANE_ROOM: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
    }

    /// Holds its first piece until `release` is set (the test sets it once the watchdog
    /// has aborted the job, however long the watchdog took on a loaded machine), or for
    /// 60 s at most, so that a test that never sets it still ends.
    struct Hold(std::sync::Arc<std::sync::atomic::AtomicBool>);

    impl crate::Kernel for Hold {
        fn run(&mut self, io: &mut crate::KernelIo<'_>) -> Result<(), crate::KernelError> {
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            while io.piece() == 0 && !self.0.load(Ordering::Acquire) && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            Ok(())
        }
    }

    #[test]
    fn a_stream_waiting_for_room_in_a_lane_is_reported_with_the_stream_it_waits_on() {
        // src (stream 0) -> r0 (256 slots) -> hold (stream 1) -> sink. Stream 1 takes at
        // most a batch of Readys before it fires `hold` on the first and stays in its
        // kernel; with lanes of 2 envelopes, src then waits for room in its lane.
        let mut b = PlanBuilder::new();
        let d = b.device(0, DeviceKind::Cpu, 0);
        let (s0, s1) = (b.stream(d, StreamKind::Compute), b.stream(d, StreamKind::Compute));
        let src = b.actor("src", s0, ActorKind::Source { pieces: SourcePieces::Count(256) });
        let hold = b.actor("hold", s1, ActorKind::Compute { kernel: KernelConf::Custom { name: "hold".into() } });
        let sink = b.actor("sink", s1, ActorKind::Sink);
        let r0 = b.regst("r0", src, 8, 256);
        b.consume(hold, r0);
        let r1 = b.regst("r1", hold, 8, 1);
        b.consume(sink, r1);
        let plan = b.build().unwrap();
        let (stream0, stream1) = (stream_label(&plan, 0), stream_label(&plan, 1));
        LANE_ROOM.with(|room| room.set(Some(2)));
        let release = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let held = release.clone();
        let job = crate::Job::builder(plan)
            .kernel("hold", move |_| Ok(Box::new(Hold(held.clone()))))
            .watchdog(Duration::from_millis(200))
            .build();
        LANE_ROOM.with(|room| room.set(None));
        let job = job.expect("the job builds");
        // `hold` keeps stream 1 in its kernel until the watchdog has aborted the job.
        let shared = job.shared.clone();
        let waiter = std::thread::spawn(move || job.wait());
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !shared.aborting.load(Ordering::Acquire) {
            assert!(std::time::Instant::now() < deadline, "the watchdog did not abort the stalled job within 30 s");
            std::thread::sleep(Duration::from_millis(5));
        }
        release.store(true, Ordering::Release);
        let error = waiter.join().expect("wait does not panic").expect_err("the job stalls");
        // Released, stream 1 acks what it holds into its own lane of 2 to stream 0, which
        // is not reading while it waits for room: both wait on each other unless the abort
        // ends their waits. Then `wait` gives up on them after its grace, and they outlive
        // the job.
        for s in [0, 1] {
            assert!(shared.probes[s].exited.load(Ordering::Acquire), "stream {s} did not end after the abort");
        }
        let RuntimeError::Stalled { graph, .. } = &error else { panic!("not a stall: {error}") };
        assert_eq!(
            graph.full_lanes,
            vec![crate::FullLane {
                stream: stream0.clone(),
                waits_on: crate::RoomFrom::Stream(stream1.clone()),
                actors: vec!["src".into()]
            }],
            "{graph}"
        );
        assert!(
            graph.silent_streams.contains(&format!("{stream0} (waiting for room in its lane to {stream1})")),
            "{graph}"
        );
        assert!(graph.silent_streams.contains(&format!("{stream1} (busy in the kernel of 'hold')")), "{graph}");
        let text = graph.to_string();
        assert!(text.contains(&format!("stream {stream0} waits for room in its lane to stream {stream1}")), "{text}");
        assert_eq!(graph.cycle, None, "stream 1 is in a kernel, not waiting on stream 0: {graph}");
        assert!(
            graph.edges().contains(&("src".into(), crate::FullLane::node(&stream0), "its thread".into())),
            "{:?}",
            graph.edges()
        );
    }

    #[test]
    fn lanes_join_the_hosted_streams_that_share_a_register_with_room_for_its_slots() {
        // src (stream 0) -> r0 (2 slots) -> copy (stream 1) -> r1 (3 slots) -> sinks on
        // streams 1 and 0; stream 2 shares nothing.
        let mut b = PlanBuilder::new();
        let d = b.device(0, DeviceKind::Cpu, 0);
        let (s0, s1, s2) =
            (b.stream(d, StreamKind::Compute), b.stream(d, StreamKind::Comm), b.stream(d, StreamKind::Comm));
        let src = b.actor("src", s0, ActorKind::Source { pieces: SourcePieces::Count(1) });
        let copy = b.actor("copy", s1, ActorKind::Compute { kernel: KernelConf::Copy });
        let lone = b.actor("lone", s2, ActorKind::Source { pieces: SourcePieces::Count(1) });
        let lone_sink = b.actor("lone_sink", s2, ActorKind::Sink);
        let r0 = b.regst("r0", src, 8, 2);
        b.consume(copy, r0);
        let r1 = b.regst("r1", copy, 8, 3);
        for sink in [b.actor("k1", s1, ActorKind::Sink), b.actor("k0", s0, ActorKind::Sink)] {
            b.consume(sink, r1);
        }
        let r2 = b.regst("r2", lone, 8, 1);
        b.consume(lone_sink, r2);
        let plan = b.build().unwrap();
        let lanes = lane_capacities(&plan, |_| true);
        // Each way: r0's 2 slots and r1's 3 (for k0), each counted (slots + 1) x 2, plus 4.
        let room = 4 + 2 * (2 + 1) + 2 * (3 + 1);
        assert_eq!(lanes.into_iter().collect::<Vec<_>>(), vec![((0, 1), room), ((1, 0), room)]);
        // A stream of another node gets none.
        assert!(lane_capacities(&plan, |s| s != 1).is_empty());
    }

    #[test]
    fn a_job_built_while_other_jobs_threads_fill_the_cores_swaps_its_doorbells() {
        if !crate::lane::Doorbell::asymmetric().is_asymmetric() || crate::activity::cores() < 2 {
            eprintln!("skipped: this host offers no membarrier or has one core, so no job skips its fences");
            return;
        }
        // src (stream 0) -> r0 -> sink (stream 1): two hosted streams with a lane each way.
        let mut b = PlanBuilder::new();
        let d = b.device(0, DeviceKind::Cpu, 0);
        let (s0, s1) = (b.stream(d, StreamKind::Compute), b.stream(d, StreamKind::Compute));
        let src = b.actor("src", s0, ActorKind::Source { pieces: SourcePieces::Count(1) });
        let sink = b.actor("sink", s1, ActorKind::Sink);
        let r0 = b.regst("r0", src, 8, 2);
        b.consume(sink, r0);
        let plan = b.build().unwrap();
        let indexed = PlanIndex::new(&plan);
        let per_step = vec![1; plan.actors.len()];
        let build = || deliveries(&indexed, None, &per_step, &[0, 1], &Default::default());
        // Other jobs of the process (whatever the tests beside this one run) hold every core.
        let others = crate::activity::StreamThreads::claim(crate::activity::cores());
        let job = build();
        let asymmetric: Vec<bool> = job.receivers.iter().flatten().map(InboxReceiver::asymmetric_barrier).collect();
        assert_eq!(asymmetric, [false, false], "with the cores taken, both sides swap the doorbell");
        drop((job, others));
    }

    #[test]
    fn a_local_queue_has_room_for_every_slot_and_consumer_its_stream_receives() {
        // src (stream 0) -> r0 (2 slots) -> copy (stream 1) -> r1 (3 slots) -> two sinks on
        // stream 1 and one on stream 0.
        let mut b = PlanBuilder::new();
        let d = b.device(0, DeviceKind::Cpu, 0);
        let (s0, s1) = (b.stream(d, StreamKind::Compute), b.stream(d, StreamKind::Comm));
        let src = b.actor("src", s0, ActorKind::Source { pieces: SourcePieces::Count(1) });
        let copy = b.actor("copy", s1, ActorKind::Compute { kernel: KernelConf::Copy });
        let sinks = [(s1, "k1"), (s1, "k2"), (s0, "k0")].map(|(s, name)| b.actor(name, s, ActorKind::Sink));
        let r0 = b.regst("r0", src, 8, 2);
        b.consume(copy, r0);
        let r1 = b.regst("r1", copy, 8, 3);
        for sink in sinks {
            b.consume(sink, r1);
        }
        let plan = b.build().unwrap();
        // Small counts get the floor of 256.
        assert_eq!(local_queue_capacities(&plan)[0], 256);
        assert_eq!(local_queue_capacities(&plan)[1], 256);
        // With 100 times the slots, above it. Stream 0: r0's acks (slots x 1 consumer) and
        // r1's readiness for k0 (slots x 1), 2 actors. Stream 1: r0's readiness (slots x 1),
        // r1's for k1 and k2 (slots x 2) and r1's acks (slots x 3), 3 actors. Each plus a
        // batch from the inbox.
        let mut many = plan.clone();
        many.regst_descs.iter_mut().for_each(|d| d.register_num *= 100);
        assert_eq!(local_queue_capacities(&many)[0], 100 * (2 + 3) + 2 + crate::stream::INBOX_BATCH);
        assert_eq!(local_queue_capacities(&many)[1], 100 * (2 + 6 + 9) + 3 + crate::stream::INBOX_BATCH);
    }
}
