//! `softmax` and `log_softmax` along one axis, numerically stable (the maximum is
//! subtracted before exponentiating), and the ops that compute their gradients.

use super::{GradCtx, InputGrads, OpDef};
use crate::plan::TensorMeta;
use crate::sbp::{Sbp, SbpSignature};
use crate::{GraphError, Tensor};
use regflow_kernels::cpu::softmax::Lanes;
pub use regflow_plan::ops::{LogSoftmax, Softmax, SoftmaxGrad};

fn check_float(inputs: &[TensorMeta], count: usize, axis: isize) -> Result<TensorMeta, String> {
    if inputs.len() != count {
        return Err(format!("takes {count} input(s), got {}", inputs.len()));
    }
    let x = &inputs[0];
    if let Some(other) = inputs.iter().find(|m| m.dtype != x.dtype || m.shape != x.shape) {
        return Err(format!("input mismatch: {x} vs {other}"));
    }
    if !x.dtype.is_float() {
        return Err(format!("needs a float input, got {}", x.dtype));
    }
    Lanes::new(&x.shape, axis)?;
    Ok(x.clone())
}

/// Splits of every dimension but the normalized one, on all `inputs` and the output.
fn lane_splits(axis: isize, inputs: &[TensorMeta]) -> Vec<SbpSignature> {
    let Some(x) = inputs.first() else { return Vec::new() };
    let Some(axis) = x.shape.axis(axis) else { return Vec::new() };
    (0..x.shape.rank())
        .filter(|&d| d != axis)
        .map(|d| SbpSignature::new(vec![Sbp::Split(d); inputs.len()], [Sbp::Split(d)]))
        .collect()
}

impl OpDef for Softmax {
    fn name(&self) -> &'static str {
        "softmax"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        Ok(vec![check_float(inputs, 1, self.axis)?])
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        let (y, dy) = (ctx.outputs[0], ctx.grad()?);
        Ok(vec![Some(y.graph().apply1(SoftmaxGrad { axis: self.axis, log: false }, &[y, dy])?)])
    }

    /// Lanes are independent: any dimension but the normalized one may be split.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        lane_splits(self.axis, inputs)
    }
}

impl OpDef for LogSoftmax {
    fn name(&self) -> &'static str {
        "log_softmax"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        Ok(vec![check_float(inputs, 1, self.axis)?])
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        let (y, dy) = (ctx.outputs[0], ctx.grad()?);
        Ok(vec![Some(y.graph().apply1(SoftmaxGrad { axis: self.axis, log: true }, &[y, dy])?)])
    }

    /// Lanes are independent: any dimension but the normalized one may be split.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        lane_splits(self.axis, inputs)
    }
}

impl OpDef for SoftmaxGrad {
    fn name(&self) -> &'static str {
        if self.log {
            "log_softmax_grad"
        } else {
            "softmax_grad"
        }
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        Ok(vec![check_float(inputs, 2, self.axis)?])
    }

    fn grad<'g>(&self, _ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        // Second derivatives of softmax are not needed by any optimizer here.
        Err(GraphError::NoGradient { op: self.name().into(), index: 0 })
    }

    /// Lanes are independent: any dimension but the normalized one may be split. With `y`
    /// whole, the gradient is linear in `dy`, so summands of `dy` give summands.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let mut signatures = lane_splits(self.axis, inputs);
        signatures.push(SbpSignature::new([Sbp::Broadcast, Sbp::Partial], [Sbp::Partial]));
        signatures
    }
}

impl<'g> Tensor<'g> {
    /// Softmax along `axis` (negative: from the end): `e^x / Σ e^x`, computed as
    /// `e^(x - max) / Σ e^(x - max)` so large logits do not overflow.
    pub fn softmax(&self, axis: isize) -> Result<Tensor<'g>, GraphError> {
        self.graph().apply1(Softmax { axis }, &[*self])
    }

    /// Log-softmax along `axis` (negative: from the end): `x - max - ln Σ e^(x - max)`.
    pub fn log_softmax(&self, axis: isize) -> Result<Tensor<'g>, GraphError> {
        self.graph().apply1(LogSoftmax { axis }, &[*self])
    }
}
