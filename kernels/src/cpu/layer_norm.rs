//! CPU kernels of `layer_norm` ops, rows shared over the device's threads when large.

use crate::cpu::fast_math;
use crate::cpu::shares::{in_shares, row_shares, rows_in_shares, DisjointParts};
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

/// Rows per block of the shared gradient: the statistics of a block's rows (two values a
/// row, 8 KiB in f32) wait on the stack between its two passes.
const GRAD_BLOCK_ROWS: usize = 512;

/// `dx`, and `dgamma`/`dbeta` summed over the rows in row order. On one share of rows all
/// three come from one pass. Over several, each block of [`GRAD_BLOCK_ROWS`] rows takes two:
/// `dx` by row shares, which keep each row's statistics, then the parameter gradients by
/// column shares, each column summed over the block's rows in row order with the same
/// operations as the one pass: the same bits on any thread count.
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
    if row_shares(threads, dx.len(), features) <= 1 {
        fast_math::vectorized(
            #[inline(always)]
            || input_gradient_rows(eps, (x, gamma, dy), dx, Some((dgamma, dbeta)), None),
        );
        return Ok(());
    }
    // Blocks of rows: their statistics wait in a stack buffer between the rows' pass (row
    // shares) and the parameters' pass (column shares, each column over the rows in order).
    let rows = dx.len() / features;
    let mut row_stats = [(T::zero(), T::zero()); GRAD_BLOCK_ROWS];
    for first in (0..rows).step_by(GRAD_BLOCK_ROWS) {
        let end = (first + GRAD_BLOCK_ROWS).min(rows);
        let span = first * features..end * features;
        let (x, dy, dx) = (&x[span.clone()], &dy[span.clone()], &mut dx[span]);
        let stats = DisjointParts::new(&mut row_stats[..end - first]);
        rows_in_shares(threads, dx, features, |rows, dx| {
            // SAFETY: shares are disjoint row ranges of the block.
            let stats = unsafe { stats.part(rows.clone()) };
            let span = rows.start * features..rows.end * features;
            fast_math::vectorized(
                #[inline(always)]
                || input_gradient_rows(eps, (&x[span.clone()], gamma, &dy[span]), dx, None, Some(stats)),
            )
        });
        let stats_of_block = &row_stats[..end - first];
        let (dgamma_parts, dbeta_parts) = (DisjointParts::new(&mut *dgamma), DisjointParts::new(&mut *dbeta));
        in_shares(threads, features, |columns| {
            // SAFETY: shares are disjoint column ranges of `dgamma` and `dbeta`.
            let (dgamma, dbeta) = unsafe { (dgamma_parts.part(columns.clone()), dbeta_parts.part(columns.clone())) };
            fast_math::vectorized(
                #[inline(always)]
                || {
                    for (row, &(mean, rstd)) in stats_of_block.iter().enumerate() {
                        let at = row * features + columns.start..row * features + columns.end;
                        for (((dg, db), &d), &v) in
                            dgamma.iter_mut().zip(dbeta.iter_mut()).zip(&dy[at.clone()]).zip(&x[at])
                        {
                            let x_hat = (v - mean) * rstd;
                            *dg += d * x_hat;
                            *db += d;
                        }
                    }
                },
            )
        });
    }
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
    mut row_stats: Option<&mut [(T, T)]>,
) {
    let features = gamma.len();
    let count = T::from_f64(features as f64);
    let rows = x.chunks_exact(features).zip(dy.chunks_exact(features)).zip(dx.chunks_exact_mut(features));
    for (index, ((row, dy_row), dx_row)) in rows.enumerate() {
        let (mean, rstd) = stats(row, eps);
        if let Some(row_stats) = row_stats.as_mut() {
            row_stats[index] = (mean, rstd);
        }
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
