//! The parallel compiler: lowers one step of a logical graph onto its placements. Layouts
//! come from pins and signature choice (`layout`); boxing is inserted wherever a consumer
//! needs another layout than its producer made (`boxing`); every op becomes one compute
//! actor per device of its mesh running its op on local shapes, and every collective one
//! actor per member on a comm stream of its device (`lower`).
//!
//! Data, tensor and ZeRO-style parallelism are all layouts of the same graph: inputs
//! `S(0)` and weights `B` give data parallelism (the weight gradients come out `P` and are
//! all-reduced); weights `S(0)` with their optimizer state give ZeRO (all-gather before
//! use, reduce-scatter of gradients); column- then row-split weights give Megatron.
//! Pipeline parallelism is placement: a tensor moved to another mesh crosses a stage edge
//! (copy actors), micro-batches are pieces, and register counts per stage give 1F1B.
//!
//! Collectives block their comm stream until the whole group has arrived, as NCCL does, so
//! every device must issue a stream's collectives in one order. The compiler orders them by
//! when their input is produced (the producing op's position in the graph, then creation)
//! and chains each stream's collectives in that order with zero-byte registers closed by a
//! preloaded token; `Plan::check_collective_order` verifies any plan.
//!
//! Memory reuse across lifetimes works as in the one-device compiler, with one ordering
//! chain per device's compute stream, for plans of one micro-batch per step.

pub(crate) mod boxing;
mod layout;
mod lower;

use crate::compile::{Accumulate, CompiledGraph, DatasetInputs};
use crate::dsl::{Graph, Tensor, TensorId};
use crate::ops::{GradCtx, InputGrads, OpDef};
use crate::sbp::{Mesh, NdSbp, Sbp, SbpSignature};
use crate::tensor::TensorMeta;
use crate::{GraphError, TrainStep};
pub use boxing::{KeepOnFirst, TakePart};
pub use regflow_plan::ops::ToGlobal;

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
    /// the fetch's own layout ([`ParallelInfo::fetch_parts`]).
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
        }
    }

    /// Splits each step into `micro_batches` pieces (see [`ParallelOptions::accumulate`]).
    pub fn micro_batches(mut self, step: &TrainStep<'_>, micro_batches: u32) -> Self {
        self.accumulate = Some(step.accumulate(micro_batches));
        self
    }

    /// Gradients and optimizer state of `step` follow their parameters' layouts.
    pub fn train(mut self, step: &TrainStep<'_>) -> Self {
        self.follow.extend(step.params.iter().zip(&step.raw_grads).map(|(p, g)| (g.id(), p.id())));
        self.follow.extend(step.states.iter().map(|(s, p)| (s.id(), p.id())));
        self
    }
}

/// What a parallel plan adds to a [`CompiledGraph`].
#[derive(Debug, Clone)]
pub struct ParallelInfo {
    /// The default mesh (of tensors without a placement of their own).
    pub mesh: Mesh,
    /// Each fed input: its mesh, its layout and, by rank, its source actor and local shape.
    pub inputs: Vec<ParallelInput>,
    /// Each fetch's layout (as the fetch sinks see it before it is made `Broadcast`).
    pub fetch_layouts: Vec<NdSbp>,
    /// With [`ParallelOptions::fetch_parts`]: for each fetch, by rank, the sink reading the
    /// device's local value.
    pub fetch_parts: Vec<Vec<String>>,
    /// Layout of every tensor of the step, by name.
    pub layouts: Vec<(String, NdSbp)>,
    /// Collective groups in the global order: each comm stream issues its own in this order.
    pub collectives: Vec<String>,
}

/// A fed input of a parallel plan.
#[derive(Debug, Clone)]
pub struct ParallelInput {
    /// The input's name.
    pub name: String,
    /// Its mesh.
    pub mesh: Mesh,
    /// Its layout.
    pub layout: NdSbp,
    /// By rank: the source actor and the local shape it takes.
    pub parts: Vec<(String, TensorMeta)>,
}

impl OpDef for ToGlobal {
    fn name(&self) -> &'static str {
        "to_global"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        match inputs {
            [x] => Ok(vec![x.clone()]),
            _ => Err(format!("takes 1 input, got {}", inputs.len())),
        }
    }

    /// The gradient goes back where the input lives (a stage edge backwards).
    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        let g = ctx.grad()?;
        let graph = g.graph();
        let (input, output) = (ctx.inputs[0].id(), ctx.outputs[0].id());
        match (graph.placement(input), graph.placement(output)) {
            (Some(from), Some(to)) if from != to => {
                let back = graph.apply1(ToGlobal, &[g])?;
                graph.place(back.id(), from);
                Ok(vec![Some(back)])
            }
            _ => Ok(vec![Some(g)]),
        }
    }

    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let rank = inputs.first().map_or(0, |m| m.shape.rank());
        let mut s: Vec<SbpSignature> = (0..rank).map(|d| SbpSignature::new([Sbp::Split(d)], [Sbp::Split(d)])).collect();
        s.push(SbpSignature::new([Sbp::Partial], [Sbp::Partial]));
        s
    }
}

impl<'g> Tensor<'g> {
    /// This tensor with the layout `layout` on `mesh`: the compiler inserts the boxing
    /// (collectives or local slices) that converts it. On another placement than this
    /// tensor's, it is a pipeline stage edge: copy actors move it device by device, and its
    /// gradient moves back the same way.
    pub fn to_global(&self, mesh: &Mesh, layout: NdSbp) -> Result<Tensor<'g>, GraphError> {
        layout.check(mesh, &self.shape()).map_err(|message| GraphError::Op {
            op: "to_global".into(),
            inputs: vec![format!("'{}': {}", self.name(), self.meta())],
            message,
        })?;
        let y = self.to_placement(mesh)?;
        self.graph().set_layout(y, mesh, layout)?;
        Ok(y)
    }

    /// This tensor moved to `mesh`, keeping its layout (the compiler's choice): a pipeline
    /// stage edge.
    pub fn to_placement(&self, mesh: &Mesh) -> Result<Tensor<'g>, GraphError> {
        let graph = self.graph();
        let y = graph.apply1(ToGlobal, &[*self])?;
        graph.place(y.id(), std::sync::Arc::new(mesh.clone()));
        Ok(y)
    }
}

impl Graph {
    /// Lowers one step (`fetch`, plus `updates` as `(variable, next value)`) onto the
    /// devices of every placement it uses (`options.mesh` for tensors without one).
    /// Fetches are delivered whole (made `Broadcast`) by sinks on the first device of
    /// their mesh; with micro-batches, once per micro-batch.
    pub fn compile_parallel(
        &self,
        fetch: &[Tensor<'_>],
        updates: &[(Tensor<'_>, Tensor<'_>)],
        options: &ParallelOptions,
    ) -> Result<CompiledGraph, GraphError> {
        lower::compile(self, fetch, updates, options)
    }
}
