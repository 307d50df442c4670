//! CPU kernels of `layer_norm` ops.

use crate::cpu::fast_math;
use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::*;
use regflow_plan::{HostTensor, HostTensorMut, Real};

impl HostCompute for LayerNorm {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        fast_math::vectorized(
            || by_float!(outputs[0].dtype(), "integer layer norm is not supported", T => forward_typed::<T>(self.eps, inputs, &mut outputs[0])),
        )
    }
}

impl HostCompute for LayerNormGrad {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        fast_math::vectorized(
            || by_float!(outputs[0].dtype(), "integer layer norm is not supported", T => backward_typed::<T>(self.eps, inputs, outputs)),
        )
    }
}

#[inline(always)]
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
        // dx holds x̂ = (x - mean)·rstd until it is overwritten; with g = dy·gamma:
        // dx = rstd·(g - mean(g) - x̂·mean(g·x̂)). Every loop is elementwise or a
        // lane-split reduction, so each vectorizes.
        for (x_hat, &v) in dx_row.iter_mut().zip(row) {
            *x_hat = (v - mean) * rstd;
        }
        for (((dg, db), &d), &x_hat) in dgamma.iter_mut().zip(dbeta.iter_mut()).zip(dy_row).zip(&*dx_row) {
            *dg += d * x_hat;
            *db += d;
        }
        let g_mean = fast_math::dot(dy_row, gamma) / count;
        let gx_mean = fast_math::lane_reduce(features, |j| dy_row[j] * gamma[j] * dx_row[j]) / count;
        for ((d, &dy), &g) in dx_row.iter_mut().zip(dy_row).zip(gamma) {
            *d = rstd * (dy * g - g_mean - *d * gx_mean);
        }
    }
    Ok(())
}

#[inline(always)]
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

/// Mean and `1 / √(var + eps)` of one row.
#[inline(always)]
fn stats<T: Real>(row: &[T], eps: f64) -> (T, T) {
    let count = T::from_f64(row.len() as f64);
    let mean = fast_math::sum(row) / count;
    let var = fast_math::lane_reduce(row.len(), |j| (row[j] - mean) * (row[j] - mean)) / count;
    (mean, T::one() / (var + T::from_f64(eps)).sqrt())
}
