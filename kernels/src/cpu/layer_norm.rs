//! CPU kernels of `layer_norm` ops, rows shared over the device's threads when large.

use crate::cpu::fast_math;
use crate::cpu::shares::{row_shares, rows_in_shares};
use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::*;
use regflow_plan::{HostTensor, HostTensorMut, Real};

impl HostCompute for LayerNorm {
    fn compute(
        &self,
        context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        by_float!(outputs[0].dtype(), "integer layer norm is not supported", T => forward_typed::<T>(self.eps, context.threads, inputs, &mut outputs[0]))
    }
}

impl HostCompute for LayerNormGrad {
    fn compute(
        &self,
        context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        by_float!(outputs[0].dtype(), "integer layer norm is not supported", T => backward_typed::<T>(self.eps, context.threads, inputs, outputs))
    }
}

/// Elements below which the gradient stays on one thread, above the other row-wise
/// kernels' threshold: in shares it needs a second, serial pass for the parameters'
/// gradients, which on two threads cost more than the shares saved on the character GPT's
/// `[1024, 64]` (0.11 ms per firing on one thread, 0.15 on two).
const GRAD_PARALLEL_MIN_ELEMENTS: usize = 1 << 18;

/// `dx`, and `dgamma`/`dbeta` summed over the rows in row order. On one share of rows all
/// three come from one pass; over several, `dx` is computed by row shares in parallel, then
/// the parameter gradients by one pass that recomputes each `x̂` with the same operations,
/// so their sums (and bits) do not depend on the thread count.
fn backward_typed<T: Real>(
    eps: f64,
    threads: usize,
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
    let threads = if dx.len() < GRAD_PARALLEL_MIN_ELEMENTS { 1 } else { threads };
    if row_shares(threads, dx.len(), features) <= 1 {
        fast_math::vectorized(
            #[inline(always)]
            || input_gradient_rows(eps, (x, gamma, dy), dx, Some((dgamma, dbeta))),
        );
        return Ok(());
    }
    rows_in_shares(threads, dx, features, |rows, dx| {
        let span = rows.start * features..rows.end * features;
        fast_math::vectorized(
            #[inline(always)]
            || input_gradient_rows(eps, (&x[span.clone()], gamma, &dy[span]), dx, None),
        )
    });
    fast_math::vectorized(
        #[inline(always)]
        || {
            for (row, dy_row) in x.chunks_exact(features).zip(dy.chunks_exact(features)) {
                let (mean, rstd) = stats(row, eps);
                for (((dg, db), &d), &v) in dgamma.iter_mut().zip(dbeta.iter_mut()).zip(dy_row).zip(row) {
                    let x_hat = (v - mean) * rstd;
                    *dg += d * x_hat;
                    *db += d;
                }
            }
        },
    );
    Ok(())
}

/// `dx` of the rows of `x` (and `dy`), adding each row's share of `dgamma` and `dbeta` in
/// row order when `parameters` is given.
#[inline(always)]
fn input_gradient_rows<T: Real>(
    eps: f64,
    (x, gamma, dy): (&[T], &[T], &[T]),
    dx: &mut [T],
    mut parameters: Option<(&mut [T], &mut [T])>,
) {
    let features = gamma.len();
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
        if let Some((dgamma, dbeta)) = parameters.as_mut() {
            for (((dg, db), &d), &x_hat) in dgamma.iter_mut().zip(dbeta.iter_mut()).zip(dy_row).zip(&*dx_row) {
                *dg += d * x_hat;
                *db += d;
            }
        }
        let g_mean = fast_math::dot(dy_row, gamma) / count;
        let gx_mean = fast_math::lane_reduce(features, |j| dy_row[j] * gamma[j] * dx_row[j]) / count;
        for ((d, &dy), &g) in dx_row.iter_mut().zip(dy_row).zip(gamma) {
            *d = rstd * (dy * g - g_mean - *d * gx_mean);
        }
    }
}

fn forward_typed<T: Real>(
    eps: f64,
    threads: usize,
    inputs: &[HostTensor<'_>],
    out: &mut HostTensorMut<'_>,
) -> Result<(), String> {
    let (x, gamma, beta) = (inputs[0].as_slice::<T>()?, inputs[1].as_slice::<T>()?, inputs[2].as_slice::<T>()?);
    let features = gamma.len();
    if features == 0 {
        return Ok(());
    }
    rows_in_shares(threads, out.as_mut_slice::<T>()?, features, |rows, y| {
        fast_math::vectorized(
            #[inline(always)]
            || {
                let x = &x[rows.start * features..rows.end * features];
                for (row, y_row) in x.chunks_exact(features).zip(y.chunks_exact_mut(features)) {
                    let (mean, rstd) = stats(row, eps);
                    for (((o, &v), &g), &b) in y_row.iter_mut().zip(row).zip(gamma).zip(beta) {
                        *o = (v - mean) * rstd * g + b;
                    }
                }
            },
        )
    });
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
