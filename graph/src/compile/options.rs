//! What a compile is asked for: [`CompileOptions`] (one device) and [`ParallelOptions`]
//! (a mesh and the graph's placements). The one-device options are the parallel ones on a
//! mesh of one device ([`CompileOptions::on_one_device`]), so both go through one pipeline.

use super::error::CompileError;
use crate::dsl::TensorId;
use crate::plan::{DeviceKind, SourcePieces};
use crate::sbp::{Mesh, MeshDevice};
use crate::TrainStep;
use std::collections::HashMap;

/// Options of the one-device compiler.
#[derive(Debug, Clone)]
pub struct CompileOptions {
    /// The device kind of the plan.
    pub device: DeviceKind,
    /// Slots of the registers of fed inputs (how many steps may be pushed ahead).
    pub input_register_num: u32,
    /// Slots of the other registers.
    pub activation_register_num: u32,
    /// Inputs read by one dataset source actor instead of being fed.
    pub dataset: Option<DatasetInputs>,
    /// Let activation registers whose lifetimes do not overlap share memory (the compute
    /// actors then run in one fixed order, one step at a time). Not combined with
    /// `accumulate`, whose actors run at two rates.
    pub reuse_memory: bool,
    /// Gradient accumulation: the loss and gradients run once per micro-batch, the rest of
    /// the step (clipping, schedule, updates) once per `micro_batches` pieces of input.
    pub accumulate: Option<Accumulate>,
    /// Anomaly checking: every op's float outputs are scanned after each firing and the
    /// job stops at the first NaN or infinity, naming the op, the step, the micro-batch and
    /// the device ([`Plan::check_finite`](crate::plan::Plan::check_finite)). Costs one read
    /// of every output; cheap enough to leave on in tests.
    pub check_finite: bool,
    /// Fuse each device's optimizer updates into one `update_group` actor per set of
    /// gradients that are ready together (`compile/fuse_updates.rs`): one firing and one
    /// pass over all their elements, on all the device's threads (a CUDA device: one
    /// multi-tensor launch per 32 parameters), as PyTorch's `fused=True` AdamW. Results
    /// are bitwise those of one update per parameter. Default on.
    pub fuse_updates: bool,
    /// Fuse each device's part of the global gradient norm (gradient clipping, loss
    /// scaling's overflow check): a chain of `sum_squares` and scalar `add`s becomes one
    /// `sum_squares_group` actor (`compile/fuse_norms.rs`), one firing and, on CUDA, a
    /// multi-tensor launch pair per 64 gradients instead of two launches per gradient.
    /// Results are bitwise the chain's on the CPU. Default on.
    pub fuse_norms: bool,
    /// Fuse each device's mixed-precision casts that are ready together (its weights, cast
    /// to bf16 or f16 at a step's start) or awaited together (its gradients, cast back to
    /// f32 for the fused update) into one `cast_group` actor (`compile/fuse_casts.rs`): on
    /// CUDA one multi-tensor launch per 32 casts instead of a launch each. Results are
    /// bitwise the lone casts'. Default on.
    pub fuse_casts: bool,
    /// Fold mixed precision's lone casts into the ops beside them (`compile/fold_casts.rs`):
    /// a layer norm's f32 output cast to bf16 or f16 is written narrow by the layer norm
    /// itself ([`LayerNorm::out`](crate::plan::ops::LayerNorm::out)), and a 16-bit tensor
    /// cast to f32 for one reader is read as it is by that reader: a layer norm gradient's
    /// `dy` ([`LayerNormGrad::dy`](crate::plan::ops::LayerNormGrad::dy)) or an operand of
    /// an f32 `binary` op (the residual stream's adds), and an f32 `binary` op's result
    /// cast to bf16 or f16 is written narrow as its second output (the sums of residual
    /// gradients): per transformer block four lone casts (on CUDA four launches and a pass
    /// over an activation each) fewer. Results are bitwise the casts'. Default on.
    pub fold_casts: bool,
    /// Fold a tied table's two gradients into one kernel (`compile/fold_table_grads.rs`):
    /// the `add` of an `embedding_grad` and the table's other gradient (a language model's
    /// output projection) is done by the embedding gradient, which reads the other as its
    /// base ([`EmbeddingGrad::base`](crate::plan::ops::EmbeddingGrad::base)), through a
    /// slice of its first rows (a padded vocabulary) and a cast from bf16 or f16. Results
    /// are bitwise the add's. Default on.
    pub fold_table_grads: bool,
    /// Fold a pre-norm block's residual gradient sum into its layer norm's gradient
    /// (`compile/fold_norm_grads.rs`): the `add` of the gradient from above and the layer
    /// norm gradient's `dx` (and the sum's 16-bit copy) is done by the layer norm gradient,
    /// which reads the other gradient as its base
    /// ([`LayerNormGrad::base`](crate::plan::ops::LayerNormGrad::base)). Results are
    /// bitwise the add's. Default on.
    pub fold_norm_grads: bool,
    /// Fold a pre-norm block's residual add into the layer norm that reads its sum
    /// (`compile/fold_norm_inputs.rs`): the norm adds the two summands itself
    /// ([`LayerNorm::residual`](crate::plan::ops::LayerNorm::residual)), writes the sum as
    /// its first output and normalizes it, instead of reading it back. Results are bitwise
    /// the add's. Default on.
    pub fold_norm_inputs: bool,
}

/// Gradient accumulation over micro-batches (see [`crate::TrainStep::accumulate`]).
#[derive(Debug, Clone)]
pub struct Accumulate {
    /// Micro-batches per optimizer step.
    pub micro_batches: u32,
    /// The raw gradients: where the micro-batch part of the step ends.
    pub gradients: Vec<TensorId>,
}

/// Inputs a dataset source produces: one source actor with one output register per
/// input, in this order.
#[derive(Debug, Clone)]
pub struct DatasetInputs {
    /// Where the pieces come from: a dataset file the plan names
    /// ([`SourcePieces::Dataset`], so the plan runs by itself) or a kernel the program
    /// registers ([`SourcePieces::Custom`]).
    pub source: SourcePieces,
    /// The graph inputs it produces, in output order.
    pub inputs: Vec<String>,
}

impl Default for CompileOptions {
    fn default() -> Self {
        Self {
            device: DeviceKind::Cpu,
            input_register_num: 2,
            activation_register_num: 1,
            dataset: None,
            reuse_memory: true,
            accumulate: None,
            check_finite: false,
            fuse_updates: true,
            fuse_norms: true,
            fuse_casts: true,
            fold_casts: true,
            fold_table_grads: true,
            fold_norm_grads: true,
            fold_norm_inputs: true,
        }
    }
}

impl CompileOptions {
    /// The same options for the parallel compiler, on a mesh of one device of `device`'s
    /// kind (node 0, index 0).
    pub(crate) fn on_one_device(&self) -> Result<ParallelOptions, CompileError> {
        let mesh = Mesh::of_kind(self.device, &[1], &["device"]).map_err(CompileError::invariant)?;
        Ok(ParallelOptions {
            input_register_num: self.input_register_num,
            activation_register_num: self.activation_register_num,
            dataset: self.dataset.clone(),
            accumulate: self.accumulate.clone(),
            reuse_memory: self.reuse_memory,
            check_finite: self.check_finite,
            fuse_updates: self.fuse_updates,
            fuse_norms: self.fuse_norms,
            fuse_casts: self.fuse_casts,
            fold_casts: self.fold_casts,
            fold_table_grads: self.fold_table_grads,
            fold_norm_grads: self.fold_norm_grads,
            fold_norm_inputs: self.fold_norm_inputs,
            ..ParallelOptions::new(mesh)
        })
    }
}

/// Options of the parallel compiler.
#[derive(Debug, Clone)]
pub struct ParallelOptions {
    /// The devices every tensor of the step lives on.
    pub mesh: Mesh,
    /// Slots of the registers of fed inputs.
    pub input_register_num: u32,
    /// Slots of the other registers.
    pub activation_register_num: u32,
    /// Inputs read by a dataset source on every device (each reads whole batches and cuts
    /// its part locally, so the kernel must give every device the same batches).
    pub dataset: Option<DatasetInputs>,
    /// `(tensor, like)`: `tensor` takes `like`'s layout: a variable's pin, or, for an op
    /// output, the layout its consumers see (it is boxed there right after it is made).
    /// Gradients follow their parameters (that boxing *is* the data-parallel all-reduce or
    /// the ZeRO reduce-scatter) and optimizer state follows its parameter.
    pub follow: Vec<(TensorId, TensorId)>,
    /// Also add one sink per device for every fetch, reading the device's local value in
    /// the fetch's own layout ([`ParallelInfo::fetch_parts`](crate::ParallelInfo::fetch_parts)).
    pub fetch_parts: bool,
    /// Micro-batches: each fed piece is one micro-batch; the loss and the gradients run
    /// per micro-batch, the gradients are averaged over `micro_batches` pieces and the rest
    /// of the step (clipping, schedule, updates) runs once ([`TrainStep::accumulate`]).
    /// Across pipeline stages this is what keeps every stage busy.
    pub accumulate: Option<Accumulate>,
    /// How pipeline stages order forward and backward micro-batches.
    pub schedule: PipelineSchedule,
    /// Let one-slot registers of a device whose lifetimes do not overlap share memory: each
    /// device's compute actors then run in one fixed order (collectives and copies, on
    /// their own streams, still overlap). Applies to plans of one micro-batch per step;
    /// pipelines keep several micro-batches' activations, which one order cannot serve.
    pub reuse_memory: bool,
    /// Anomaly checking: every op's float outputs are scanned after each firing and the
    /// job stops at the first NaN or infinity, naming the op, the step, the micro-batch and
    /// the device ([`Plan::check_finite`](crate::plan::Plan::check_finite)). Costs one read
    /// of every output; cheap enough to leave on in tests.
    pub check_finite: bool,
    /// Buckets: data-parallel all-reduces of weight gradients, and ZeRO's reduce-scatters
    /// of gradients and all-gathers of updated weights along dimension 0, of at most this
    /// many bytes per device are merged, in the order they are made, into buckets of at
    /// most this many bytes, one collective each (as PyTorch DDP's `bucket_cap_mb` and
    /// DeepSpeed's `reduce_bucket_size` and `allgather_bucket_size`, except that larger
    /// tensors keep a collective of their own instead of being copied into a bucket).
    /// 0 turns bucketing off. Default 1 MiB.
    pub bucket_bytes: u64,
    /// Shard optimizer state in process: an optimizer state whose layout is left to the
    /// compiler (not pinned), of a parameter replicated over a one-axis mesh of cpu
    /// devices of one node, is split `S(0)` over it (ZeRO stage 1), where every device's
    /// rows start on a 64-byte boundary and the parameter is not fetched, in a step of one
    /// micro-batch that reuses memory. Each device then updates its rows of the parameter
    /// (a reduce-scatter of the gradient instead of an all-reduce), and the gathered
    /// parameter is held once for the process (`RegstDesc::home`), its all-gather copying
    /// nothing. On such devices a replicated update is bound by memory: every device
    /// reads and writes all of the parameters and their state, each step, at the same
    /// moment (BENCHMARKS.md, issue 13, "twenty-sixth"). Fetches and checkpoints see whole
    /// states as with replicated state, and the values are its bits (the update is
    /// elementwise, the reduce-scatter sums in rank order as the all-reduce does) except
    /// with a gradient scale: clipping's and loss scaling's global norm then sums each
    /// device's rows first, as under ZeRO, which may change its last bits. Pin a state
    /// `Broadcast`, or turn this off, to keep a copy per device. Default on.
    pub shard_states_in_process: bool,
    /// Fuse each device's optimizer updates into one `update_group` actor per set of
    /// gradients that are ready together (`compile/fuse_updates.rs`): one firing and one
    /// pass over all their elements, on all the device's threads (a CUDA device: one
    /// multi-tensor launch per 32 parameters), as PyTorch's `fused=True` AdamW. Results
    /// are bitwise those of one update per parameter. Default on.
    pub fuse_updates: bool,
    /// Fuse each device's part of the global gradient norm (gradient clipping, loss
    /// scaling's overflow check): a chain of `sum_squares` and scalar `add`s becomes one
    /// `sum_squares_group` actor (`compile/fuse_norms.rs`), one firing and, on CUDA, a
    /// multi-tensor launch pair per 64 gradients instead of two launches per gradient.
    /// Results are bitwise the chain's on the CPU. Default on.
    pub fuse_norms: bool,
    /// Fuse each device's mixed-precision casts that are ready together (its weights, cast
    /// to bf16 or f16 at a step's start) or awaited together (its gradients, cast back to
    /// f32 for the fused update) into one `cast_group` actor (`compile/fuse_casts.rs`): on
    /// CUDA one multi-tensor launch per 32 casts instead of a launch each. Results are
    /// bitwise the lone casts'. Default on.
    pub fuse_casts: bool,
    /// Fold mixed precision's lone casts into the ops beside them (`compile/fold_casts.rs`):
    /// a layer norm's f32 output cast to bf16 or f16 is written narrow by the layer norm
    /// itself ([`LayerNorm::out`](crate::plan::ops::LayerNorm::out)), and a 16-bit tensor
    /// cast to f32 for one reader is read as it is by that reader: a layer norm gradient's
    /// `dy` ([`LayerNormGrad::dy`](crate::plan::ops::LayerNormGrad::dy)) or an operand of
    /// an f32 `binary` op (the residual stream's adds), and an f32 `binary` op's result
    /// cast to bf16 or f16 is written narrow as its second output (the sums of residual
    /// gradients): per transformer block four lone casts (on CUDA four launches and a pass
    /// over an activation each) fewer. Results are bitwise the casts'. Default on.
    pub fold_casts: bool,
    /// Fold a tied table's two gradients into one kernel (`compile/fold_table_grads.rs`):
    /// the `add` of an `embedding_grad` and the table's other gradient (a language model's
    /// output projection) is done by the embedding gradient, which reads the other as its
    /// base ([`EmbeddingGrad::base`](crate::plan::ops::EmbeddingGrad::base)), through a
    /// slice of its first rows (a padded vocabulary) and a cast from bf16 or f16. Results
    /// are bitwise the add's. Default on.
    pub fold_table_grads: bool,
    /// Fold a pre-norm block's residual gradient sum into its layer norm's gradient
    /// (`compile/fold_norm_grads.rs`): the `add` of the gradient from above and the layer
    /// norm gradient's `dx` (and the sum's 16-bit copy) is done by the layer norm gradient,
    /// which reads the other gradient as its base
    /// ([`LayerNormGrad::base`](crate::plan::ops::LayerNormGrad::base)). Results are
    /// bitwise the add's. Default on.
    pub fold_norm_grads: bool,
    /// Fold a pre-norm block's residual add into the layer norm that reads its sum
    /// (`compile/fold_norm_inputs.rs`): the norm adds the two summands itself
    /// ([`LayerNorm::residual`](crate::plan::ops::LayerNorm::residual)), writes the sum as
    /// its first output and normalizes it, instead of reading it back. Results are bitwise
    /// the add's. Default on.
    pub fold_norm_inputs: bool,
    /// Which streams run the cpu devices' collectives: comm streams of their own, the
    /// compute streams, or (the default) whichever suits the compiling host
    /// ([`CollectiveStreams`]).
    pub collective_streams: CollectiveStreams,
    /// Which stream of a cpu device runs the copies it receives from other devices (a
    /// pipeline stage's activations, a tensor moving to another mesh): a copy stream of
    /// its own, its compute stream, or (the default) whichever suits the compiling host
    /// ([`CopyStreams`]).
    pub copy_streams: CopyStreams,
}

/// Which streams run a cpu device's collectives.
///
/// A collective blocks the thread that runs it until every member has arrived. On comm
/// streams of their own (a thread each) the collectives overlap the products, but only
/// where a core is spare: where a host has about one core per device (two cpu devices on
/// two cores) the comm threads only add wake-ups and preemptions, and running the same
/// collectives, in the same order and with the same results, on the compute streams is
/// up to twice as fast (the tiny GPT with `tp2` on two cores: 2.0 against 0.9 ms per
/// step; BENCHMARKS.md, issue 13, "twenty-first" and "twenty-second").
///
/// On the compute streams, plan validation checks that nothing can wait on a blocked
/// compute thread (the devices of one node exchange nothing but collectives), and the
/// step must have one micro-batch. Devices of other kinds keep their comm streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CollectiveStreams {
    /// [`CollectiveStreams::ForCores`] the compiling host's cores
    /// (`std::thread::available_parallelism`). The plan is then made for the host that
    /// compiles it: give the cores of the host that will run a plan file made elsewhere.
    #[default]
    Auto,
    /// The compute streams where they can be (a step of one micro-batch and one pipeline
    /// stage over two or more cpu devices of one node) and a host of this many cores
    /// cannot give every cpu device a compute and a comm thread (fewer than twice as many
    /// cores as cpu devices), else comm streams.
    ForCores(usize),
    /// Comm streams of their own (a thread per device and phase).
    CommStreams,
    /// Each cpu device's compute stream (one micro-batch per step only).
    ComputeStreams,
}

impl CollectiveStreams {
    /// Whether a step of `micro_batches` over `devices` in `stages` pipeline stages could
    /// run its collectives on the compute streams: one micro-batch, no pipeline (whose
    /// stages exchange activations, not collectives), cpu devices of one node, at least
    /// two of them (one device has no collectives).
    pub(crate) fn inline_possible(devices: &[MeshDevice], stages: usize, micro_batches: u32) -> bool {
        micro_batches == 1
            && stages <= 1
            && devices.len() >= 2
            && devices.iter().all(|d| d.kind == DeviceKind::Cpu && d.node == devices[0].node)
    }

    /// Whether the cpu devices' collectives run on their compute streams.
    pub(crate) fn on_compute(self, devices: &[MeshDevice], stages: usize, micro_batches: u32) -> bool {
        match self {
            Self::CommStreams => false,
            Self::ComputeStreams => true,
            Self::Auto => Self::ForCores(host_cores()).on_compute(devices, stages, micro_batches),
            Self::ForCores(cores) => {
                Self::inline_possible(devices, stages, micro_batches) && short_of_cores(devices, cores)
            }
        }
    }

    /// Whether the choice was the compiler's (so a plan that cannot block its compute
    /// streams keeps its comm streams instead of being refused).
    pub(crate) fn chosen_by_compiler(self) -> bool {
        matches!(self, Self::Auto | Self::ForCores(_))
    }
}

/// Where a cpu device runs the copies it receives from other devices. A copy never blocks
/// its thread (it fires once its input has arrived and its output has room), so unlike a
/// collective it may run on the compute stream at any micro-batch count; on a copy stream
/// of its own it overlaps the device's products, but only where a core is spare. With two
/// pipeline stages on two cores each stage's copy thread only added wake-ups and
/// preemptions: the tiny GPT's `pp2` and `pp4` steps took 8 % longer than with the copies
/// on the compute streams (BENCHMARKS.md, issue 13, "twenty-fifth"). Copies into `cuda`
/// and `sim` devices keep their copy streams (asynchronous copies, modeled times).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CopyStreams {
    /// [`CopyStreams::ForCores`] the compiling host's cores
    /// (`std::thread::available_parallelism`): give the cores of the host that will run
    /// a plan file made elsewhere.
    #[default]
    Auto,
    /// The compute streams where a host of this many cores cannot give every cpu device
    /// of a node a compute and a copy thread (fewer than twice as many cores as the node
    /// with the most cpu devices has of them), else copy streams.
    ForCores(usize),
    /// A copy stream (a thread) per receiving device.
    CopyStreams,
    /// The receiving cpu device's compute stream.
    ComputeStreams,
}

impl CopyStreams {
    /// Whether copies into the cpu devices among `devices` run on their compute streams.
    pub(crate) fn on_compute(self, devices: &[MeshDevice]) -> bool {
        match self {
            Self::CopyStreams => false,
            Self::ComputeStreams => true,
            Self::Auto => Self::ForCores(host_cores()).on_compute(devices),
            Self::ForCores(cores) => short_of_cores(devices, cores),
        }
    }
}

/// Whether a host of `cores` cores cannot give every cpu device of a node a second thread
/// beside its compute thread (a comm or a copy thread): it has fewer than twice as many
/// cores as the node with the most cpu devices has of them.
fn short_of_cores(devices: &[MeshDevice], cores: usize) -> bool {
    let mut per_node: HashMap<u16, usize> = HashMap::new();
    for d in devices.iter().filter(|d| d.kind == DeviceKind::Cpu) {
        *per_node.entry(d.node).or_default() += 1;
    }
    2 * per_node.values().copied().max().unwrap_or(0) > cores
}

/// The cores this process may run on (1 where the host will not say).
fn host_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// How pipeline stages order their micro-batches. Neither is schedule code: both are
/// register counts (and, for GPipe, one gate per stage).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PipelineSchedule {
    /// Stage `s` of `p` keeps `p - s` micro-batches' activations: it runs forwards until
    /// its registers are full, then one backward frees one slot for one forward, which is
    /// the 1F1B pattern, with live activations bounded by the number of stages.
    #[default]
    OneForwardOneBackward,
    /// Every forward of a step, then every backward (activations of all micro-batches live
    /// at once): a stage's backward actors wait for a gate that opens after its last
    /// forward actor has run for every micro-batch. For comparison.
    GPipe,
}

impl ParallelOptions {
    /// Options for `mesh` with the one-device defaults.
    pub fn new(mesh: Mesh) -> Self {
        Self {
            mesh,
            input_register_num: 2,
            activation_register_num: 1,
            dataset: None,
            follow: Vec::new(),
            fetch_parts: false,
            accumulate: None,
            schedule: PipelineSchedule::default(),
            reuse_memory: true,
            check_finite: false,
            bucket_bytes: 1 << 20,
            shard_states_in_process: true,
            fuse_updates: true,
            fuse_norms: true,
            fuse_casts: true,
            fold_casts: true,
            fold_table_grads: true,
            fold_norm_grads: true,
            fold_norm_inputs: true,
            collective_streams: CollectiveStreams::Auto,
            copy_streams: CopyStreams::Auto,
        }
    }

    /// Splits each step into `micro_batches` pieces (see [`ParallelOptions::accumulate`]).
    pub fn micro_batches(mut self, step: &TrainStep<'_>, micro_batches: u32) -> Self {
        self.accumulate = Some(step.accumulate(micro_batches));
        self
    }

    /// Optimizer state of `step` follows its parameters' layouts (unless pinned), and each
    /// gradient the layout its parameter is updated in: its state's, or the parameter's
    /// where it has none. With the state split and the parameter replicated (sharded
    /// optimizer state, ZeRO stage 1) a gradient is then reduce-scattered to the rows
    /// each device updates, instead of all-reduced whole and cut.
    pub fn train(mut self, step: &TrainStep<'_>) -> Self {
        let updated_like =
            |param: TensorId| step.states.iter().find(|(_, p)| p.id() == param).map_or(param, |(state, _)| state.id());
        self.follow.extend(step.params.iter().zip(&step.raw_grads).map(|(p, g)| (g.id(), updated_like(p.id()))));
        self.follow.extend(step.states.iter().map(|(s, p)| (s.id(), p.id())));
        self
    }

    /// Micro-batches per step (1 without accumulation).
    pub(crate) fn micro_batch_count(&self) -> u32 {
        self.accumulate.as_ref().map_or(1, |a| a.micro_batches)
    }

    /// Refuses values that mean nothing, naming the option and the value.
    pub(crate) fn check(&self) -> Result<(), CompileError> {
        let positive = [
            ("input_register_num", self.input_register_num),
            ("activation_register_num", self.activation_register_num),
            ("micro_batches", self.micro_batch_count()),
        ];
        if self.collective_streams == CollectiveStreams::ForCores(0) {
            return Err(CompileError::BadOption {
                option: "collective_streams",
                value: "ForCores(0)".into(),
                expected: "the cores of the host the plan is for, at least 1 (or Auto: this host's)",
            });
        }
        if self.copy_streams == CopyStreams::ForCores(0) {
            return Err(CompileError::BadOption {
                option: "copy_streams",
                value: "ForCores(0)".into(),
                expected: "the cores of the host the plan is for, at least 1 (or Auto: this host's)",
            });
        }
        if self.collective_streams == CollectiveStreams::ComputeStreams && self.micro_batch_count() > 1 {
            return Err(CompileError::BadOption {
                option: "collective_streams",
                value: format!("ComputeStreams with {} micro-batches", self.micro_batch_count()),
                expected: "one micro-batch per step: a collective of every micro-batch and one of the averaged \
                           gradients would block one stream at different rates (CommStreams or Auto keep them \
                           apart)",
            });
        }
        for (option, value) in positive {
            if value == 0 {
                let expected = match option {
                    "micro_batches" => "a step needs at least one micro-batch (1 means no accumulation)",
                    _ => "a register needs at least one slot",
                };
                return Err(CompileError::BadOption { option, value: value.to_string(), expected });
            }
        }
        Ok(())
    }
}

/// Where a step goes: `OneDevice` puts every tensor on the options' one-device mesh and
/// ignores the graph's placements and pinned layouts (what [`crate::Graph::compile`]
/// promises); `Placements` honours them ([`crate::Graph::compile_parallel`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scope {
    OneDevice,
    Placements,
}
