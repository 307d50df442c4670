//! Making one actor of a job: its state machine and its kernel — from the registry, a
//! dataset, a feeder or fetcher it creates for the program, or a sink callback.

use super::setup::{feed_depth, fetch_depth};
use super::start::JobBuilder;
use super::UserWaits;
use crate::device::staging::{StagedSink, StagedSource};
use crate::inbox::InboxSender;
use crate::io::{CallbackSinkKernel, ChannelSinkKernel, CountSourceKernel, FedSourceKernel, Feeder, Fetcher};
use crate::kernel::{Kernel, KernelSpec};
use crate::stream::{ActorRuntime, JobShared};
use crate::sync::Arc;
use crate::RuntimeError;
use regflow_actors::{Actor, PlanIds};
use regflow_kernels::Execution;
use regflow_plan::{ActorIndex, ActorKind, PlanIndex, SourcePieces};
use std::collections::{HashMap, VecDeque};
use std::time::Duration;

/// What feeders, fetchers and sink kernels share with the job: the user-side record, each
/// actor's index in it, and the job's state (a waiting push watches for an abort).
pub(super) struct UserEnds<'a> {
    pub(super) user: &'a std::sync::Arc<UserWaits>,
    pub(super) records: &'a [Option<usize>],
    pub(super) shared: &'a Arc<JobShared>,
    /// Feeders and fetchers made so far, by actor name.
    pub(super) feeders: HashMap<String, Feeder>,
    pub(super) fetchers: HashMap<String, Fetcher>,
}

impl UserEnds<'_> {
    /// The record of actor `index`, made by `user_records` for every fed source and
    /// channel sink this job hosts.
    fn record(&self, index: ActorIndex) -> usize {
        self.records[index.index()]
            .unwrap_or_else(|| panic!("actor {index:?} has no user-side record (broken invariant)"))
    }
}

/// One actor of the job and what its stream runs it with.
pub(super) struct MadeActor {
    pub(super) actor: Actor,
    pub(super) runtime: ActorRuntime,
    /// It gets `Start` when the job starts (a source, or an actor with preloaded outputs).
    pub(super) starts: bool,
    /// For an op on a GPU device whose kernel runs on the host (no device kernel for its
    /// op and dtype): the actor, its op and its dtype, as `Job::host_kernels` lists them.
    /// (The runtime's own copies, such as a variable's `assign`, are not ops.)
    pub(super) on_host: Option<String>,
    /// Scratch its kernel asks of its stream (`Kernel::scratch_bytes`).
    pub(super) scratch_bytes: u64,
}

/// Makes actor `index`: its state machine and its kernel (from the registry, a dataset, a
/// feeder or a fetcher it creates, a sink callback).
pub(super) fn make_actor(
    builder: &mut JobBuilder,
    indexed: &PlanIndex<'_>,
    ids: &PlanIds,
    per_step: &[u64],
    index: ActorIndex,
    inbox: InboxSender,
    ends: &mut UserEnds<'_>,
) -> Result<MadeActor, RuntimeError> {
    let plan = indexed.plan();
    let desc = &plan.actors[index.index()];
    let stream = desc.stream.index();
    let id = ids.of(index);
    let mut actor = Actor::from_plan(indexed, ids, index);
    let outputs: Vec<u64> = indexed.outputs_of(index).iter().map(|r| plan.regst_descs[r.index()].bytes).collect();
    // What the kernel sees of each input: its window, or the whole register.
    let inputs: Vec<u64> = (0..desc.inputs.len()).map(|i| plan.input_bytes(index, i)).collect();
    let repeats: Vec<u64> = (0..desc.inputs.len()).map(|i| plan.input_repeats(index, i)).collect();
    let setup = |message: String| RuntimeError::KernelSetup { actor: desc.name.clone(), message };
    let device_desc = &plan.devices[plan.streams[stream].device.index()];
    let spec = KernelSpec {
        actor: &desc.name,
        device: device_desc.kind,
        device_index: builder.gpus.kernel_index(device_desc.kind, device_desc.index),
        op: None,
        input_bytes: &inputs,
        output_bytes: &outputs,
        input_repeats: &repeats,
    };
    // Sources start producing, and actors with preloaded outputs hand them out, on Start.
    let starts = matches!(desc.kind, ActorKind::Source { .. })
        || indexed.outputs_of(index).iter().any(|r| plan.regst_descs[r.index()].preloaded > 0);
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
            let depth = feed_depth(indexed, index, per_step[index.index()]) as usize;
            let (data_tx, data_rx) = crossbeam_channel::bounded(depth);
            let (pool_tx, pool_rx) = crossbeam_channel::bounded(depth);
            for _ in 0..depth {
                let _ = pool_tx.send(Vec::with_capacity(bytes as usize));
            }
            ends.feeders.insert(
                desc.name.clone(),
                Feeder {
                    name: desc.name.clone(),
                    source: id,
                    bytes,
                    data: data_tx,
                    pool: pool_rx,
                    inbox,
                    closed: false,
                    reserved: None,
                    waits: ends.user.clone(),
                    record: ends.record(index),
                    shared: ends.shared.clone(),
                },
            );
            Some(Box::new(FedSourceKernel { data: data_rx, pool: pool_tx }))
        }
        ActorKind::Compute { kernel } | ActorKind::Acc { kernel, .. } => Some(
            builder.kernels.make_for(kernel, &spec, indexed, index, per_step[index.index()]).map_err(|e| setup(e.0))?,
        ),
        ActorKind::Discard => {
            Some(builder.kernels.make(&regflow_plan::KernelConf::Noop, &spec).map_err(|e| setup(e.0))?)
        }
        ActorKind::Sink => match builder.sink_callbacks.remove(&desc.name) {
            Some(callback) => Some(Box::new(CallbackSinkKernel(callback))),
            None => {
                let depth = fetch_depth(plan, index, builder.fetch_depth);
                actor.set_sink_credits(depth);
                let (delivery_tx, delivery_rx) = crossbeam_channel::bounded(depth as usize);
                let (pool_tx, pool_rx) = crossbeam_channel::bounded(depth as usize);
                for _ in 0..depth {
                    let parts = inputs.iter().map(|&b| Vec::with_capacity(b as usize)).collect();
                    let _ = pool_tx.send(parts);
                }
                let record = ends.record(index);
                ends.fetchers.insert(
                    desc.name.clone(),
                    Fetcher {
                        sink: id,
                        deliveries: delivery_rx.clone(),
                        pool: pool_tx.clone(),
                        inbox: inbox.clone(),
                        waits: ends.user.clone(),
                        record,
                    },
                );
                Some(Box::new(ChannelSinkKernel {
                    deliveries: delivery_tx,
                    undelivered: delivery_rx,
                    pool: pool_rx,
                    give_back: pool_tx,
                    inbox,
                    sink: id,
                    waits: ends.user.clone(),
                    record,
                }))
            }
        },
        // The hand-off is a no-op launch on the repeat's stream (see the actor).
        ActorKind::Repeat { .. } => {
            Some(builder.kernels.make(&regflow_plan::KernelConf::Noop, &spec).map_err(|e| setup(e.0))?)
        }
    };
    // A host-side source (fed pieces, a dataset's reader, a program's) on a `cuda` device
    // writes page-locked buffers its stream copies into the registers (`device::staging`).
    let staged = matches!(
        desc.kind,
        ActorKind::Source { pieces: SourcePieces::Fed | SourcePieces::Dataset(_) | SourcePieces::Custom { .. } }
    ) && spec.device == regflow_plan::DeviceKind::Cuda
        && desc.inputs.is_empty()
        && kernel.as_ref().is_some_and(|k| k.execution() == Execution::Host);
    // A sink on a `cuda` device reads its inputs through page-locked copies.
    let staged_sink = matches!(desc.kind, ActorKind::Sink) && spec.device == regflow_plan::DeviceKind::Cuda;
    let kernel = match kernel {
        Some(inner) if staged_sink => {
            let sink = StagedSink::new(inner, usize::from(spec.device_index), &inputs).map_err(setup)?;
            Some(Box::new(sink) as Box<dyn Kernel>)
        }
        Some(inner) if staged => {
            let slots = indexed.outputs_of(index).first().map_or(1, |r| plan.regst_descs[r.index()].register_num);
            let source = StagedSource::new(inner, usize::from(spec.device_index), &outputs, slots).map_err(setup)?;
            Some(Box::new(source) as Box<dyn Kernel>)
        }
        other => other,
    };
    // Launches in flight are bounded by the actor's own slots.
    let slots: usize = desc
        .inputs
        .iter()
        .copied()
        .chain(indexed.outputs_of(index).iter().copied())
        .map(|r| plan.regst_descs[r.index()].register_num as usize)
        .sum();
    let runtime = ActorRuntime {
        name: desc.name.clone(),
        kernel,
        modeled: Duration::from_nanos(desc.sim_nanos.unwrap_or(0)),
        plan_index: index.0,
        input_descs: desc.inputs.clone(),
        windows: if desc.windows.is_empty() {
            Box::default()
        } else {
            (0..desc.inputs.len()).map(|i| desc.window(i).map(|w| (w.offset as usize, w.bytes as usize))).collect()
        },
        pending_slices: VecDeque::with_capacity(if builder.trace.is_some() { slots } else { 0 }),
        held_bytes: 0,
    };
    let on_host = match (&desc.kind, &runtime.kernel) {
        (
            ActorKind::Compute { kernel: regflow_plan::KernelConf::Op(op) }
            | ActorKind::Acc { kernel: regflow_plan::KernelConf::Op(op), .. },
            Some(kernel),
        ) if spec.device == regflow_plan::DeviceKind::Cuda && kernel.execution() == Execution::Host => {
            Some(format!("{} ({} {})", desc.name, op.op_type, op.dtype()))
        }
        _ => None,
    };
    let scratch_bytes = runtime.kernel.as_ref().map_or(0, |k| k.scratch_bytes());
    Ok(MadeActor { actor, runtime, starts, on_host, scratch_bytes })
}
