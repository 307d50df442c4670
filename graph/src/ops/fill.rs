//! `fill`: a tensor of one value (the seed of backward passes, zeros, constants).

use super::{GradCtx, InputGrads, LocalContext, OpDef};
use crate::plan::{DType, TensorMeta};
use crate::sbp::{Sbp, SbpSignature};
use crate::{Graph, GraphError, Tensor};
pub use regflow_plan::ops::Fill;
use std::sync::Arc;

impl OpDef for Fill {
    fn name(&self) -> &'static str {
        "fill"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        if !inputs.is_empty() {
            return Err(format!("takes no inputs, got {}", inputs.len()));
        }
        Ok(vec![self.meta.clone()])
    }

    fn grad<'g>(&self, _ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        Ok(Vec::new())
    }

    /// Every device can fill its own part of any split; zeros are also a valid set of
    /// summands (of zero), so a zero fill may come out `Partial`.
    fn sbp_signatures(&self, _inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let rank = outputs.first().map_or(0, |y| y.shape.rank());
        let mut signatures: Vec<SbpSignature> = (0..rank).map(|d| SbpSignature::new([], [Sbp::Split(d)])).collect();
        if self.value == 0.0 {
            signatures.push(SbpSignature::new([], [Sbp::Partial]));
        }
        signatures
    }

    /// The fill of this device's part: the local output shape.
    fn localize(&self, ctx: &LocalContext<'_>) -> Result<Option<Arc<dyn OpDef>>, String> {
        match ctx.local_outputs {
            [local] if *local != self.meta => Ok(Some(Arc::new(Fill::new(self.value, local.clone())))),
            _ => Ok(None),
        }
    }

    /// Moves elements: any dtype as it is.
    fn autocast(&self) -> super::Autocast {
        super::Autocast::Keep
    }
}

impl Graph {
    /// A constant tensor.
    pub fn constant(&self, value: f64, shape: impl Into<crate::Shape>, dtype: DType) -> Result<Tensor<'_>, GraphError> {
        self.apply1(Fill::new(value, TensorMeta::new(shape, dtype)), &[])
    }
}

impl<'g> Tensor<'g> {
    /// Zeros shaped like this tensor.
    pub fn zeros_like(&self) -> Result<Tensor<'g>, GraphError> {
        self.graph().apply1(Fill::new(0.0, self.meta()), &[])
    }

    /// Ones shaped like this tensor.
    pub fn ones_like(&self) -> Result<Tensor<'g>, GraphError> {
        self.graph().apply1(Fill::new(1.0, self.meta()), &[])
    }
}
