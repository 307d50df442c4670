//! `softmax` and `log_softmax` along one axis, numerically stable (the maximum is
//! subtracted before exponentiating), the fused scaled and masked softmax of attention, and
//! the ops that compute their gradients.

use super::{GradCtx, InputGrads, OpDef};
use crate::plan::TensorMeta;
use crate::sbp::{Sbp, SbpSignature};
use crate::{GraphError, Tensor};
use regflow_kernels::cpu::softmax::{check_masked, Lanes};
pub use regflow_plan::ops::{LogSoftmax, MaskedSoftmax, MaskedSoftmaxGrad, Softmax, SoftmaxGrad};

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

/// The masked softmax's signatures: splits of any axis of the scores but the normalized
/// last one, the mask split along the same axis where it has it (broadcast where it is 1
/// or missing, so each device reads it whole).
fn masked_splits(inputs: &[TensorMeta]) -> Vec<SbpSignature> {
    let [x, mask] = inputs else { return Vec::new() };
    let (rank, mask_rank) = (x.shape.rank(), mask.shape.rank());
    (0..rank.saturating_sub(1))
        .map(|d| {
            let mask_sbp = (d + mask_rank)
                .checked_sub(rank)
                .filter(|&m| mask.shape.dims()[m] == x.shape.dims()[d])
                .map_or(Sbp::Broadcast, Sbp::Split);
            SbpSignature::new([Sbp::Split(d), mask_sbp], [Sbp::Split(d)])
        })
        .collect()
}

impl OpDef for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "masked_softmax"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        if !self.scale.is_finite() {
            return Err(format!("scale must be finite, got {}", self.scale));
        }
        let [x, mask] = inputs else { return Err(format!("takes 2 inputs (scores, mask), got {}", inputs.len())) };
        let dtype = check_masked(x, mask)?;
        Ok(vec![TensorMeta::new(x.shape.clone(), dtype)])
    }

    /// Reads bf16 scores as they are, in f32 arithmetic, with an f32 mask (a bf16 mask
    /// is cast: see [`Autocast::Widen`](super::Autocast::Widen)); the probabilities are
    /// stored in bf16, rounded once, as the cast before the next product would store
    /// them, and their gradient and the scores' are bf16 too: no f32 copy of the scores,
    /// the probabilities or either gradient.
    fn autocast(&self) -> super::Autocast {
        super::Autocast::Widen
    }

    /// `dz = y·(dy - Σ dy·y)` for `z = scale·x + mask`: `dx = scale·dz` in one op, and the
    /// mask's gradient `dz` summed to its shape (built only if something needs it), in
    /// the mask's dtype.
    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        let (mask, y, dy) = (ctx.inputs[1], ctx.outputs[0], ctx.grad()?);
        let dx = y.graph().apply1(MaskedSoftmaxGrad { scale: self.scale }, &[y, dy])?;
        // dz is the same rule with a scale of 1 (in y's dtype: bf16 under mixed precision,
        // summed to the mask's shape before its cast, so no full-size f32 copy is made).
        let dz = y.graph().apply1(MaskedSoftmaxGrad { scale: 1.0 }, &[y, dy])?;
        Ok(vec![Some(dx), Some(dz.sum_to(&mask.shape())?.cast(mask.dtype())?)])
    }

    /// Rows are independent: any axis but the last may be split (see `masked_splits`).
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        masked_splits(inputs)
    }
}

impl OpDef for MaskedSoftmaxGrad {
    fn name(&self) -> &'static str {
        "masked_softmax_grad"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        if !self.scale.is_finite() {
            return Err(format!("scale must be finite, got {}", self.scale));
        }
        Ok(vec![check_float(inputs, 2, -1)?])
    }

    /// Reads y and dy as they are: bf16 probabilities (mixed precision) and their
    /// gradient are computed in f32 as they load, with no f32 copy.
    fn autocast(&self) -> super::Autocast {
        super::Autocast::Keep
    }

    fn grad<'g>(&self, _ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        // Second derivatives of softmax are not needed by any optimizer here.
        Err(GraphError::NoGradient { op: self.name().into(), index: 0 })
    }

    /// As [`SoftmaxGrad`]: lanes split anywhere but the last axis; linear in `dy`.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let mut signatures = lane_splits(-1, inputs);
        signatures.push(SbpSignature::new([Sbp::Broadcast, Sbp::Partial], [Sbp::Partial]));
        signatures
    }
}

impl<'g> Tensor<'g> {
    /// `softmax(scale·self + mask)` along the last axis in one kernel, forward and
    /// backward: attention scores scaled by `1/√d` with an additive mask (0 where a
    /// position may be attended, a large negative number where not) that broadcasts to
    /// `self`, e.g. a causal `[T, T]` mask over `[B, H, T, T]` scores.
    pub fn masked_softmax(&self, mask: &Tensor<'g>, scale: f64) -> Result<Tensor<'g>, GraphError> {
        self.graph().apply1(MaskedSoftmax { scale }, &[*self, *mask])
    }
}
