//! Parallelism in the graph: meshes, layouts and stage edges. A tensor moved with
//! [`Tensor::to_global`] or [`Tensor::to_placement`] gets a layout or a placement of its
//! own; [`Graph::compile_parallel`](crate::Graph::compile_parallel) lowers the step onto
//! every placement it uses, inserting the boxing (collectives, local slices) and the stage
//! copies that convert between them. The options and what the compiler returns are
//! re-exported here from the compiler.

pub use crate::compile::boxing::{KeepOnFirst, TakePart};
pub use crate::compile::{
    Accumulate, CollectiveStreams, CopyStreams, DatasetInputs, ParallelInfo, ParallelInput, ParallelOptions,
    PipelineSchedule,
};
use crate::dsl::Tensor;
use crate::ops::{GradCtx, InputGrads, OpDef};
use crate::plan::TensorMeta;
use crate::sbp::{Mesh, NdSbp, Sbp, SbpSignature};
use crate::GraphError;
pub use regflow_plan::ops::ToGlobal;

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

    /// Moves elements: any dtype as it is.
    fn autocast(&self) -> crate::ops::Autocast {
        crate::ops::Autocast::Keep
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
