//! `slice`: a half-open range of one axis, and `slice_grad`, its gradient, which puts a
//! slice back into zeros of the full shape.

use super::{GradCtx, InputGrads, OpDef};
use crate::plan::TensorMeta;
use crate::sbp::{Sbp, SbpSignature};
use crate::{GraphError, Tensor};
pub use regflow_plan::ops::{Slice, SliceGrad};

impl OpDef for Slice {
    fn name(&self) -> &'static str {
        "slice"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let [x] = inputs else { return Err(format!("takes 1 input, got {}", inputs.len())) };
        let (axis, _) = self.resolve(&x.shape)?;
        let mut shape = x.shape.clone();
        shape.0[axis] = self.end - self.start;
        Ok(vec![TensorMeta { shape, dtype: x.dtype }])
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        let (axis, size) = self
            .resolve(&ctx.inputs[0].shape())
            .map_err(|message| GraphError::Kernel { op: self.name().into(), message })?;
        let dy = ctx.grad()?;
        let op = SliceGrad { axis: axis as isize, start: self.start, size };
        Ok(vec![Some(dy.graph().apply1(op, &[dy])?)])
    }

    /// Any axis but the sliced one may be split; summands slice to summands.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let [x] = inputs else { return Vec::new() };
        let Ok((axis, _)) = self.resolve(&x.shape) else { return Vec::new() };
        splits_but(axis, x)
    }

    /// Moves elements: any dtype as it is.
    fn autocast(&self) -> super::Autocast {
        super::Autocast::Keep
    }
}

/// Splits of every axis of `x` but `axis`, and summands to summands.
fn splits_but(axis: usize, x: &TensorMeta) -> Vec<SbpSignature> {
    let mut signatures: Vec<SbpSignature> = (0..x.shape.rank())
        .filter(|&d| d != axis)
        .map(|d| SbpSignature::new([Sbp::Split(d)], [Sbp::Split(d)]))
        .collect();
    signatures.push(SbpSignature::new([Sbp::Partial], [Sbp::Partial]));
    signatures
}

impl OpDef for SliceGrad {
    fn name(&self) -> &'static str {
        "slice_grad"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let [dy] = inputs else { return Err(format!("takes 1 input, got {}", inputs.len())) };
        let (axis, _) = self.resolve(&dy.shape)?;
        let mut shape = dy.shape.clone();
        shape.0[axis] = self.size;
        Ok(vec![TensorMeta { shape, dtype: dy.dtype }])
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        let (_, len) = self
            .resolve(&ctx.inputs[0].shape())
            .map_err(|message| GraphError::Kernel { op: self.name().into(), message })?;
        Ok(vec![Some(ctx.grad()?.slice(self.axis, self.start, self.start + len)?)])
    }

    /// Any axis but the padded one may be split; summands pad to summands.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let [dy] = inputs else { return Vec::new() };
        let Ok((axis, _)) = self.resolve(&dy.shape) else { return Vec::new() };
        splits_but(axis, dy)
    }

    /// Moves elements: any dtype as it is.
    fn autocast(&self) -> super::Autocast {
        super::Autocast::Keep
    }
}

impl<'g> Tensor<'g> {
    /// Indices `start..end` (half-open) of axis `axis`; needs `start < end` and `end` at
    /// most the axis' size.
    pub fn slice(&self, axis: isize, start: usize, end: usize) -> Result<Tensor<'g>, GraphError> {
        self.graph().apply1(Slice { axis, start, end }, &[*self])
    }
}
