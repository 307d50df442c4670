//! CPU kernels of `layer_norm` ops.

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
        by_float!(outputs[0].dtype(), "integer layer norm is not supported", T => forward_typed::<T>(self.eps, inputs, &mut outputs[0]))
    }
}

impl HostCompute for LayerNormGrad {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        by_float!(outputs[0].dtype(), "integer layer norm is not supported", T => backward_typed::<T>(self.eps, inputs, outputs))
    }
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
fn stats<T: Real>(row: &[T], eps: f64) -> (T, T) {
    let count = T::from_f64(row.len() as f64);
    let mean = row.iter().copied().sum::<T>() / count;
    let var = row.iter().map(|&v| (v - mean) * (v - mean)).sum::<T>() / count;
    (mean, T::one() / (var + T::from_f64(eps)).sqrt())
}
