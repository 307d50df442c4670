//! `layer_norm` over the last axis with a learned scale and shift, and the op that computes
//! all three of its gradients in one pass.

use super::{GradCtx, InputGrads, OpDef};
use crate::sbp::{Sbp, SbpSignature};
use crate::tensor::{HostTensor, HostTensorMut, Real, TensorMeta};
use crate::{DType, GraphError, Tensor};

/// `(x - mean) / √(var + eps) · gamma + beta` over the last axis of `x` (`[..., D]`), with
/// `gamma` and `beta` of shape `[D]`; the variance is the biased (population) one.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerNorm {
    /// Added to the variance before the square root.
    pub eps: f64,
}

/// The gradients of [`LayerNorm`] from inputs `(x, gamma, dy)`: three outputs, `dx`,
/// `dgamma` and `dbeta`, computed in one pass (the statistics are recomputed, not stored).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerNormGrad {
    /// The forward op's `eps`.
    pub eps: f64,
}

/// Checks `x [..., D]` and the `[D]` parameters; returns `D`.
fn check(eps: f64, x: &TensorMeta, params: &[&TensorMeta]) -> Result<usize, String> {
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(format!("eps must be finite and >= 0, got {eps}"));
    }
    if !x.dtype.is_float() {
        return Err(format!("needs a float input, got {}", x.dtype));
    }
    let Some(&features) = x.shape.dims().last() else {
        return Err("input must have rank >= 1, got a scalar".into());
    };
    for p in params {
        if p.dtype != x.dtype {
            return Err(format!("dtype mismatch: {} vs {}", x.dtype, p.dtype));
        }
        if p.shape.dims() != [features] {
            return Err(format!("scale and shift must have shape [{features}], got {}", p.shape));
        }
    }
    Ok(features)
}

/// Mean and `1 / √(var + eps)` of one row.
fn stats<T: Real>(row: &[T], eps: f64) -> (T, T) {
    let count = T::from_f64(row.len() as f64);
    let mean = row.iter().copied().sum::<T>() / count;
    let var = row.iter().map(|&v| (v - mean) * (v - mean)).sum::<T>() / count;
    (mean, T::one() / (var + T::from_f64(eps)).sqrt())
}

fn forward_typed<T: Real>(eps: f64, inputs: &[HostTensor<'_>], out: &mut HostTensorMut<'_>) -> Result<(), String> {
    let (x, gamma, beta) = (inputs[0].as_slice::<T>()?, inputs[1].as_slice::<T>()?, inputs[2].as_slice::<T>()?);
    let y = out.as_mut_slice::<T>()?;
    let features = gamma.len();
    if features == 0 {
        return Ok(());
    }
    for (row, y_row) in x.chunks_exact(features).zip(y.chunks_exact_mut(features)) {
        let (mean, rstd) = stats(row, eps);
        for (((o, &v), &g), &b) in y_row.iter_mut().zip(row).zip(gamma).zip(beta) {
            *o = (v - mean) * rstd * g + b;
        }
    }
    Ok(())
}

fn backward_typed<T: Real>(
    eps: f64,
    inputs: &[HostTensor<'_>],
    outputs: &mut [HostTensorMut<'_>],
) -> Result<(), String> {
    let (x, gamma, dy) = (inputs[0].as_slice::<T>()?, inputs[1].as_slice::<T>()?, inputs[2].as_slice::<T>()?);
    let [dx, dgamma, dbeta] = outputs else { return Err(format!("expected 3 outputs, got {}", outputs.len())) };
    let (dx, dgamma, dbeta) = (dx.as_mut_slice::<T>()?, dgamma.as_mut_slice::<T>()?, dbeta.as_mut_slice::<T>()?);
    dgamma.fill(T::zero());
    dbeta.fill(T::zero());
    let features = gamma.len();
    if features == 0 {
        return Ok(());
    }
    let count = T::from_f64(features as f64);
    let rows = x.chunks_exact(features).zip(dy.chunks_exact(features)).zip(dx.chunks_exact_mut(features));
    for ((row, dy_row), dx_row) in rows {
        let (mean, rstd) = stats(row, eps);
        // With x̂ = (x - mean)·rstd and g = dy·gamma:
        // dx = rstd·(g - mean(g) - x̂·mean(g·x̂)).
        let (mut g_sum, mut gx_sum) = (T::zero(), T::zero());
        for j in 0..features {
            let x_hat = (row[j] - mean) * rstd;
            let g = dy_row[j] * gamma[j];
            g_sum += g;
            gx_sum += g * x_hat;
            dgamma[j] += dy_row[j] * x_hat;
            dbeta[j] += dy_row[j];
        }
        let (g_mean, gx_mean) = (g_sum / count, gx_sum / count);
        for j in 0..features {
            let x_hat = (row[j] - mean) * rstd;
            dx_row[j] = rstd * (dy_row[j] * gamma[j] - g_mean - x_hat * gx_mean);
        }
    }
    Ok(())
}

impl OpDef for LayerNorm {
    fn name(&self) -> &'static str {
        "layer_norm"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let [x, gamma, beta] = inputs else { return Err(format!("takes 3 inputs, got {}", inputs.len())) };
        check(self.eps, x, &[gamma, beta])?;
        Ok(vec![x.clone()])
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        let (x, gamma, dy) = (ctx.inputs[0], ctx.inputs[1], ctx.grad()?);
        let grads = x.graph().apply(LayerNormGrad { eps: self.eps }, &[x, gamma, dy])?;
        Ok(grads.into_iter().map(Some).collect())
    }

    fn compute(&self, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
        match outputs[0].dtype() {
            DType::F32 => forward_typed::<f32>(self.eps, inputs, &mut outputs[0]),
            DType::F64 => forward_typed::<f64>(self.eps, inputs, &mut outputs[0]),
            DType::I64 => Err("integer layer norm is not supported".into()),
        }
    }

    /// Rows are independent: any dimension of `x` but the normalized last one may be
    /// split, with the scale and shift whole.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let rank = inputs.first().map_or(0, |x| x.shape.rank());
        let whole = Sbp::Broadcast;
        (0..rank.saturating_sub(1)).map(|d| SbpSignature::new([Sbp::Split(d), whole, whole], [Sbp::Split(d)])).collect()
    }
}

impl OpDef for LayerNormGrad {
    fn name(&self) -> &'static str {
        "layer_norm_grad"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let [x, gamma, dy] = inputs else { return Err(format!("takes 3 inputs, got {}", inputs.len())) };
        check(self.eps, x, &[gamma])?;
        if dy != x {
            return Err(format!("dy must match x: {x} vs {dy}"));
        }
        Ok(vec![x.clone(), gamma.clone(), gamma.clone()])
    }

    fn grad<'g>(&self, _ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        // Second derivatives of layer norm are not needed by any optimizer here.
        Err(GraphError::NoGradient { op: self.name().into(), index: 0 })
    }

    fn compute(&self, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
        match outputs[0].dtype() {
            DType::F32 => backward_typed::<f32>(self.eps, inputs, outputs),
            DType::F64 => backward_typed::<f64>(self.eps, inputs, outputs),
            DType::I64 => Err("integer layer norm is not supported".into()),
        }
    }

    /// A split of the rows of `x` and `dy` splits `dx` and leaves each device partial
    /// sums of `dgamma` and `dbeta`. With `x` and `gamma` whole, all three outputs are
    /// linear in `dy`, so summands of `dy` give summands.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let rank = inputs.first().map_or(0, |x| x.shape.rank());
        let (partial, whole) = (Sbp::Partial, Sbp::Broadcast);
        let mut signatures: Vec<SbpSignature> = (0..rank.saturating_sub(1))
            .map(|d| SbpSignature::new([Sbp::Split(d), whole, Sbp::Split(d)], [Sbp::Split(d), partial, partial]))
            .collect();
        signatures.push(SbpSignature::new([whole, whole, partial], [partial, partial, partial]));
        signatures
    }
}

impl<'g> Tensor<'g> {
    /// Layer normalization over the last axis: `(x - mean) / √(var + eps) · gamma + beta`,
    /// with `gamma` and `beta` of shape `[D]` for `self` of shape `[..., D]`.
    pub fn layer_norm(&self, gamma: &Tensor<'g>, beta: &Tensor<'g>, eps: f64) -> Result<Tensor<'g>, GraphError> {
        self.graph().apply1(LayerNorm { eps }, &[*self, *gamma, *beta])
    }
}
