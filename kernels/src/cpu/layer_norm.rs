//! CPU kernels of `layer_norm` ops, rows shared over the device's threads when large.
//!
//! Mixed precision folds its casts into them (`graph/src/compile/fold_casts.rs`): a
//! layer norm may write bf16 or f16 from f32 inputs ([`LayerNorm::out`]), each element
//! computed in f32 as before and rounded by the function a `cast` rounds with; its
//! gradient may read a bf16 or f16 `dy` ([`LayerNormGrad::dy`]), widened a row at a time
//! (exactly, as a `cast` widens) into a buffer of the thread and then computed as an f32
//! `dy`. Both take their 16-bit tensors as they are ([`HostCompute::half_native`]): widened
//! whole by `HostOpKernel`, they would need an f32 buffer the size of the activation for
//! every such op.

use crate::cpu::fast_math;
use crate::cpu::shares::{in_shares, row_shares, rows_in_shares, DisjointParts};
use crate::host::{HostCompute, HostContext};
use half::slice::HalfFloatSliceExt;
use regflow_plan::ops::*;
use regflow_plan::{bf16, f16, DType, Element, HostTensor, HostTensorMut, Real, TensorMeta};
use std::cell::RefCell;

impl HostCompute for LayerNorm {
    fn compute(
        &self,
        context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        let threads = context.threads;
        // `LayerNorm::residual`: the sum first, into the first output; it is then the input.
        let (sum, outputs) = match self.residual {
            Some(_) => {
                let (sum, rest) = outputs.split_at_mut(1);
                add_summand(threads, inputs, &mut sum[0], inputs[1].len())?;
                (Some(&sum[0]), rest)
            }
            None => (None, outputs),
        };
        let x = match sum {
            Some(sum) => sum.view(),
            None => inputs[0],
        };
        let inputs = &[x, inputs[1], inputs[2]];
        let out = &mut outputs[0];
        match (self.out, inputs[0].dtype()) {
            (None, _) => {
                by_float!(out.dtype(), "integer layer norm is not supported", T => forward_typed::<T, T>(self.eps, threads, inputs, out.as_mut_slice::<T>()?, |v| v))
            }
            // The conversions of `cast` (`cpu/cast.rs`), so the bits are cast(layer_norm(x))'s.
            (Some(DType::Bf16), DType::F32) => {
                forward_typed::<f32, bf16>(self.eps, threads, inputs, out.as_mut_slice::<bf16>()?, bf16::from_f32)
            }
            (Some(DType::F16), DType::F32) => {
                forward_typed::<f32, f16>(self.eps, threads, inputs, out.as_mut_slice::<f16>()?, f16::from_f32)
            }
            (Some(to), from) => Err(format!("layer_norm from {from} to {to} is not supported (broken invariant)")),
        }
    }

    /// f32 or f64 inputs (16-bit ones are cast to f32 first: mixed precision's autocast
    /// does), and the rest as [`LayerNorm::check`] says.
    fn check(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Result<(), String> {
        self.check(inputs, outputs)?;
        check_input_and_parameters(self.eps, &inputs[0], &[&inputs[1], &inputs[2]])
    }

    /// A bf16 or f16 output or summand is taken as it is (module docs); otherwise every
    /// tensor is f32 or f64, so nothing would be widened anyway.
    fn half_native(&self) -> bool {
        self.out.is_some() || self.residual.is_some_and(DType::is_half)
    }
}

impl HostCompute for LayerNormGrad {
    fn compute(
        &self,
        context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        let threads = context.threads;
        let (outputs, narrow) = outputs.split_at_mut(3.min(outputs.len()));
        match (self.dy, inputs[0].dtype()) {
            (None, _) => {
                by_float!(outputs[0].dtype(), "integer layer norm is not supported", T => backward_typed::<T, T>(self.eps, threads, inputs, outputs))
            }
            (Some(DType::Bf16), DType::F32) => backward_typed::<f32, bf16>(self.eps, threads, inputs, outputs),
            (Some(DType::F16), DType::F32) => backward_typed::<f32, f16>(self.eps, threads, inputs, outputs),
            (Some(dy), x) => Err(format!("layer_norm_grad of {x} with a {dy} dy is not supported (broken invariant)")),
        }?;
        // `LayerNormGrad::dx_narrow`: dx rounded as a `cast` rounds (`cpu/cast.rs`).
        if let [narrow] = narrow {
            let (dx, features): (&[f32], usize) =
                (outputs[0].as_mut_slice::<f32>()?, inputs[1].as_slice::<f32>()?.len());
            match narrow.dtype() {
                DType::Bf16 => narrow_rows(threads, dx, features, narrow.as_mut_slice::<bf16>()?),
                DType::F16 => narrow_rows(threads, dx, features, narrow.as_mut_slice::<f16>()?),
                other => return Err(format!("layer_norm_grad's narrow dx is {other} (broken invariant)")),
            }
        }
        Ok(())
    }

    /// f32 or f64 `x` and `gamma` as for [`LayerNorm`], and the rest as
    /// [`LayerNormGrad::check`] says.
    fn check(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Result<(), String> {
        self.check(inputs, outputs)?;
        check_input_and_parameters(self.eps, &inputs[0], &[&inputs[1]])
    }

    /// A bf16 or f16 `dy` is read as it is, a row at a time (module docs), and a narrow
    /// `dx` written as it is.
    fn half_native(&self) -> bool {
        self.dy.is_some() || self.dx_narrow.is_some()
    }
}

/// The sum of [`LayerNorm::residual`]: `sum = inputs[0] + inputs[3]` element by element, as
/// a `binary` add computes it (`cpu/binary.rs`: a 16-bit `b` widened exactly, one addition
/// in the sum's dtype), with [`LayerNorm::summand_bias`] `inputs[4]` added to `b` first as
/// a `binary` add of the two computes it (in f32 for 16-bit ones, rounded once), in shares
/// of rows of `features` over `threads`.
fn add_summand(
    threads: usize,
    inputs: &[HostTensor<'_>],
    sum: &mut HostTensorMut<'_>,
    features: usize,
) -> Result<(), String> {
    fn add<T: Real, B: Summand<T>>(
        threads: usize,
        (a, b, bias): (&[T], &[B], Option<&[B]>),
        sum: &mut [T],
        features: usize,
    ) {
        if features == 0 {
            return;
        }
        rows_in_shares(threads, sum, features, |rows, sum| {
            let span = rows.start * features..rows.end * features;
            let rows = sum.chunks_exact_mut(features).zip(a[span.clone()].chunks_exact(features));
            for ((sum, a), b) in rows.zip(b[span].chunks_exact(features)) {
                match bias {
                    Some(bias) => {
                        for (((s, &a), &b), &c) in sum.iter_mut().zip(a).zip(b).zip(bias) {
                            *s = a + B::biased(b, c).widen();
                        }
                    }
                    None => {
                        for ((s, &a), &b) in sum.iter_mut().zip(a).zip(b) {
                            *s = a + b.widen();
                        }
                    }
                }
            }
        });
    }
    let (a, b, bias) = (inputs[0], inputs[3], inputs.get(4));
    macro_rules! summed {
        ($t:ty, $b:ty) => {
            add::<$t, $b>(
                threads,
                (a.as_slice()?, b.as_slice()?, bias.map(|c| c.as_slice()).transpose()?),
                sum.as_mut_slice()?,
                features,
            )
        };
    }
    match (sum.dtype(), b.dtype()) {
        (DType::F32, DType::F32) => summed!(f32, f32),
        (DType::F64, DType::F64) => summed!(f64, f64),
        (DType::F32, DType::Bf16) => summed!(f32, bf16),
        (DType::F32, DType::F16) => summed!(f32, f16),
        (x, b) => return Err(format!("layer_norm of {x} with a {b} summand is not supported (broken invariant)")),
    }
    Ok(())
}

/// A summand's element type beside sums of `T`: widened exactly, and a bias added as a
/// `binary` add adds it.
trait Summand<T>: Element {
    /// The value as `T` (exact).
    fn widen(self) -> T;
    /// `self + bias` as a `binary` add of two of these computes it.
    fn biased(self, bias: Self) -> Self;
}

impl<T: Real> Summand<T> for T {
    fn widen(self) -> T {
        self
    }
    fn biased(self, bias: T) -> T {
        self + bias
    }
}

impl Summand<f32> for bf16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
    // The 16-bit binary ops compute in f32 and round once, as a cast rounds.
    fn biased(self, bias: bf16) -> bf16 {
        bf16::from_f32(self.to_f32() + bias.to_f32())
    }
}

impl Summand<f32> for f16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
    fn biased(self, bias: f16) -> f16 {
        f16::from_f32(self.to_f32() + bias.to_f32())
    }
}

/// `wide` rounded to nearest even into `narrow` as the register kernels round a 16-bit
/// output (`host.rs`, the slice conversion a `cast` rounds like), over rows of `features`,
/// in shares of rows over `threads` when they are many.
fn narrow_rows<H: Element + Send>(threads: usize, wide: &[f32], features: usize, narrow: &mut [H])
where
    [H]: HalfFloatSliceExt,
{
    if features == 0 {
        return;
    }
    rows_in_shares(threads, narrow, features, |rows, narrow| {
        narrow.convert_from_f32_slice(&wide[rows.start * features..rows.end * features]);
    });
}

/// Checks that `x` is f32 or f64 (the dtypes these kernels compute in) and fits its
/// `parameters` and `eps` as the op's shape rule says ([`layer_norm_features`]).
fn check_input_and_parameters(eps: f64, x: &TensorMeta, parameters: &[&TensorMeta]) -> Result<(), String> {
    if !matches!(x.dtype, DType::F32 | DType::F64) {
        return Err(format!(
            "computes in f32 or f64, got a {} input (mixed precision casts 16-bit inputs to f32 first)",
            x.dtype
        ));
    }
    layer_norm_features(eps, x, parameters).map(|_| ())
}

/// How `dy`'s elements (of `Self`) reach the gradient's arithmetic in `T`: as they are
/// (`T` itself), or (bf16, f16 with f32) a row at a time widened into a buffer of the
/// calling thread, kept from firing to firing so a firing allocates nothing once it has
/// grown to a row.
trait WideRows<T>: Element {
    /// `f` of `row` as `T`.
    fn with_wide<R>(row: &[Self], f: impl FnOnce(&[T]) -> R) -> R;
}

impl<T: Real> WideRows<T> for T {
    #[inline(always)]
    fn with_wide<R>(row: &[T], f: impl FnOnce(&[T]) -> R) -> R {
        f(row)
    }
}

thread_local! {
    /// One row of a 16-bit `dy` widened to f32 ([`WideRows`]).
    static WIDE_ROW: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `f` of `row` widened into this thread's [`WIDE_ROW`]. Widening a bf16 or f16 to f32 is
/// exact, so the values are those of a `cast` to f32.
#[inline(always)]
fn with_widened<H, R>(row: &[H], f: impl FnOnce(&[f32]) -> R) -> R
where
    [H]: HalfFloatSliceExt,
{
    WIDE_ROW.with(|buffer| {
        // Rows are widened one after another, never inside one another: the buffer is free.
        let mut wide = buffer.borrow_mut();
        if wide.len() < row.len() {
            wide.resize(row.len(), 0.0);
        }
        let wide = &mut wide[..row.len()];
        row.convert_to_f32_slice(wide);
        f(wide)
    })
}

impl WideRows<f32> for bf16 {
    #[inline(always)]
    fn with_wide<R>(row: &[bf16], f: impl FnOnce(&[f32]) -> R) -> R {
        with_widened(row, f)
    }
}

impl WideRows<f32> for f16 {
    #[inline(always)]
    fn with_wide<R>(row: &[f16], f: impl FnOnce(&[f32]) -> R) -> R {
        with_widened(row, f)
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
fn backward_typed<T: Real, D: WideRows<T>>(
    eps: f64,
    threads: usize,
    inputs: &[HostTensor<'_>],
    outputs: &mut [HostTensorMut<'_>],
) -> Result<(), String> {
    let (x, gamma, dy) = (inputs[0].as_slice::<T>()?, inputs[1].as_slice::<T>()?, inputs[2].as_slice::<D>()?);
    // `LayerNormGrad::base`: added to each element of dx as it is written.
    let base = inputs.get(3).map(|b| b.as_slice::<T>()).transpose()?;
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
            || input_gradient_rows(eps, (x, gamma, dy, base), dx, Some((dgamma, dbeta)), None),
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
        let base = base.map(|b| &b[span.clone()]);
        let (x, dy, dx) = (&x[span.clone()], &dy[span.clone()], &mut dx[span]);
        let stats = DisjointParts::new(&mut row_stats[..end - first]);
        rows_in_shares(threads, dx, features, |rows, dx| {
            // SAFETY: shares are disjoint row ranges of the block.
            let stats = unsafe { stats.part(rows.clone()) };
            let span = rows.start * features..rows.end * features;
            fast_math::vectorized(
                #[inline(always)]
                || {
                    let base = base.map(|b| &b[span.clone()]);
                    input_gradient_rows(eps, (&x[span.clone()], gamma, &dy[span.clone()], base), dx, None, Some(stats))
                },
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
                        // Inlined, as everything inside `vectorized` must be to get its
                        // vector width (a closure left out of line is compiled without it).
                        D::with_wide(
                            &dy[at.clone()],
                            #[inline(always)]
                            |dy| {
                                for (((dg, db), &d), &v) in dgamma.iter_mut().zip(dbeta.iter_mut()).zip(dy).zip(&x[at])
                                {
                                    let x_hat = (v - mean) * rstd;
                                    *dg += d * x_hat;
                                    *db += d;
                                }
                            },
                        )
                    }
                },
            )
        });
    }
    Ok(())
}

/// What the input gradient of some rows reads: their `x`, `gamma`, their `dy`, and the
/// base added to `dx` where there is one (`LayerNormGrad::base`).
type GradientRows<'a, T, D> = (&'a [T], &'a [T], &'a [D], Option<&'a [T]>);

/// `dx` of the rows of `x` (and `dy`), plus `base`'s rows where given (each element of `dx`
/// computed, then one addition, as an `add` after the op would), adding each row's share
/// of `dgamma` and `dbeta` in row order when `parameters` is given.
#[inline(always)]
fn input_gradient_rows<T: Real, D: WideRows<T>>(
    eps: f64,
    (x, gamma, dy, base): GradientRows<'_, T, D>,
    dx: &mut [T],
    mut parameters: Option<(&mut [T], &mut [T])>,
    mut row_stats: Option<&mut [(T, T)]>,
) {
    let features = gamma.len();
    let count = T::from_f64(features as f64);
    let rows = x.chunks_exact(features).zip(dy.chunks_exact(features)).zip(dx.chunks_exact_mut(features));
    for (index, ((row, dy_row), dx_row)) in rows.enumerate() {
        // Inlined, as everything inside `vectorized` must be to get its vector width.
        D::with_wide(
            dy_row,
            #[inline(always)]
            |dy_row| {
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
                if let Some(base) = base {
                    for (d, &b) in dx_row.iter_mut().zip(&base[index * features..(index + 1) * features]) {
                        *d = b + *d;
                    }
                }
            },
        )
    }
}

/// `y` of every row, each element computed in `T` and stored as `round` of it: `T` itself,
/// or bf16 or f16 rounded from f32 as a `cast` rounds.
fn forward_typed<T: Real, O: Element>(
    eps: f64,
    threads: usize,
    inputs: &[HostTensor<'_>],
    out: &mut [O],
    round: impl Fn(T) -> O + Sync,
) -> Result<(), String> {
    let (x, gamma, beta) = (inputs[0].as_slice::<T>()?, inputs[1].as_slice::<T>()?, inputs[2].as_slice::<T>()?);
    let features = gamma.len();
    if features == 0 {
        return Ok(());
    }
    rows_in_shares(threads, out, features, |rows, y| {
        fast_math::vectorized(
            #[inline(always)]
            || {
                let x = &x[rows.start * features..rows.end * features];
                for (row, y_row) in x.chunks_exact(features).zip(y.chunks_exact_mut(features)) {
                    let (mean, rstd) = stats(row, eps);
                    for (((o, &v), &g), &b) in y_row.iter_mut().zip(row).zip(gamma).zip(beta) {
                        *o = round((v - mean) * rstd * g + b);
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
