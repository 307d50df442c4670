//! `fill`: a tensor of one value (the seed of backward passes, zeros, constants), and
//! `causal_mask`, attention's mask made on the device.

use super::{GradCtx, InputGrads, LocalContext, OpDef};
use crate::plan::{DType, TensorMeta};
use crate::sbp::{Sbp, SbpSignature};
use crate::{Graph, GraphError, Tensor};
pub use regflow_plan::ops::{CausalMask, Fill};
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

impl OpDef for CausalMask {
    fn name(&self) -> &'static str {
        "causal_mask"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        if !inputs.is_empty() {
            return Err(format!("takes no inputs, got {}", inputs.len()));
        }
        let square = matches!(self.meta.shape.dims(), [rows, cols] if rows == cols);
        if !square || !self.meta.dtype.is_float() {
            return Err(format!("makes a square float [len, len] mask, not {}", self.meta));
        }
        if !self.masked.is_finite() || self.masked >= 0.0 {
            return Err(format!(
                "the masked value must be a finite negative number (a softmax's exp of it is 0), got {}",
                self.masked
            ));
        }
        Ok(vec![self.meta.clone()])
    }

    fn grad<'g>(&self, _ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        Ok(Vec::new())
    }

    /// Every device makes the whole mask.
    fn sbp_signatures(&self, _inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        vec![SbpSignature::new([], [Sbp::Broadcast])]
    }

    fn autocast(&self) -> super::Autocast {
        super::Autocast::Keep
    }
}

impl Graph {
    /// A causal attention mask `[len, len]` for [`Tensor::masked_softmax`]: 0 where query
    /// `i` may attend key `j <= i`, -1e9 above the diagonal (finite, so a fast exp needs no
    /// infinity case, and far enough below any score to give it a probability of 0). Made
    /// on the device each step instead of fed from the host: a GPT-2 step's `[1024, 1024]`
    /// f32 mask took 2 ms to copy over PCIe from pageable memory.
    pub fn causal_mask(&self, len: usize, dtype: DType) -> Result<Tensor<'_>, GraphError> {
        self.apply1(CausalMask { masked: -1e9, meta: TensorMeta::new([len, len], dtype) }, &[])
    }

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
