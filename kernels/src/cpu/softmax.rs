//! CPU kernels of `softmax` ops.

use crate::cpu::binary::for_each_broadcast_run;
use crate::cpu::fast_math::{self, FastMath};
use crate::cpu::shares::rows_in_shares;
use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::*;
use regflow_plan::{DType, HostTensor, HostTensorMut, Real, Shape, TensorMeta};

impl HostCompute for Softmax {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        forward(self.axis, false, inputs, outputs)
    }
}

impl HostCompute for LogSoftmax {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        forward(self.axis, true, inputs, outputs)
    }
}

impl HostCompute for SoftmaxGrad {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        by_float!(outputs[0].dtype(), "integer softmax is not supported", T => fast_math::vectorized(#[inline(always)] || backward_typed::<T>(self.axis, self.log, inputs, &mut outputs[0])))
    }
}

#[inline(always)]
fn backward_typed<T: Real>(
    axis: isize,
    log: bool,
    inputs: &[HostTensor<'_>],
    out: &mut HostTensorMut<'_>,
) -> Result<(), String> {
    let lanes = Lanes::new(inputs[0].shape, axis)?;
    let (y, dy) = (inputs[0].as_slice::<T>()?, inputs[1].as_slice::<T>()?);
    let dx = out.as_mut_slice::<T>()?;
    for lane in lanes.lanes() {
        if log {
            let sum: T = lane.clone().map(|i| dy[i]).sum();
            for i in lane {
                dx[i] = dy[i] - y[i].exp() * sum;
            }
        } else {
            let sum: T = lane.clone().map(|i| dy[i] * y[i]).sum();
            for i in lane {
                dx[i] = y[i] * (dy[i] - sum);
            }
        }
    }
    Ok(())
}

fn forward(axis: isize, log: bool, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
    by_float!(outputs[0].dtype(), "integer softmax is not supported", T => fast_math::vectorized(#[inline(always)] || forward_typed::<T>(axis, log, &inputs[0], &mut outputs[0])))
}

/// A tensor seen as `[outer, len, inner]` around one axis.
#[derive(Debug, Clone, Copy)]
pub struct Lanes {
    outer: usize,
    len: usize,
    inner: usize,
}

impl Lanes {
    /// The lanes of a tensor of `shape` along `axis`, or why the axis does not exist.
    pub fn new(shape: &Shape, axis: isize) -> Result<Self, String> {
        let a = shape.axis(axis).ok_or_else(|| format!("axis {axis} is out of range for rank {}", shape.rank()))?;
        let dims = shape.dims();
        Ok(Self { outer: dims[..a].iter().product(), len: dims[a], inner: dims[a + 1..].iter().product() })
    }

    /// Element indices of every lane along the axis, one iterator per lane.
    fn lanes(self) -> impl Iterator<Item = impl Iterator<Item = usize> + Clone> {
        (0..self.outer).flat_map(move |o| {
            (0..self.inner).map(move |i| {
                let start = o * self.len * self.inner + i;
                (0..self.len).map(move |j| start + j * self.inner)
            })
        })
    }
}

#[inline(always)]
fn forward_typed<T: FastMath>(
    axis: isize,
    log: bool,
    input: &HostTensor<'_>,
    out: &mut HostTensorMut<'_>,
) -> Result<(), String> {
    let lanes = Lanes::new(input.shape, axis)?;
    let x = input.as_slice::<T>()?;
    let y = out.as_mut_slice::<T>()?;
    if lanes.inner == 1 && !log {
        // The last axis: each lane a contiguous row.
        for (row, y_row) in x.chunks_exact(lanes.len.max(1)).zip(y.chunks_exact_mut(lanes.len.max(1))) {
            y_row.copy_from_slice(row);
            normalize_row(y_row);
        }
        return Ok(());
    }
    for lane in lanes.lanes() {
        let Some(first) = lane.clone().next() else { continue };
        let max = lane.clone().fold(x[first], |m, i| m.max(x[i]));
        let sum: T = lane.clone().map(|i| (x[i] - max).fast_exp()).sum();
        if log {
            let log_sum = sum.ln();
            for i in lane {
                y[i] = x[i] - max - log_sum;
            }
        } else {
            for i in lane {
                y[i] = (x[i] - max).fast_exp() / sum;
            }
        }
    }
    Ok(())
}

/// Replaces a row of logits by their softmax: `e^(z - max) / Σ e^(z - max)`.
#[inline(always)]
fn normalize_row<T: FastMath>(row: &mut [T]) {
    let Some(max) = fast_math::max(row) else { return };
    for v in row.iter_mut() {
        *v = (*v - max).fast_exp();
    }
    let inverse = T::one() / fast_math::sum(row);
    for v in row.iter_mut() {
        *v = *v * inverse;
    }
}

impl HostCompute for MaskedSoftmax {
    fn compute(
        &self,
        context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        by_float!(outputs[0].dtype(), "integer softmax is not supported", T => masked_forward::<T>(self.scale, context.threads, inputs, &mut outputs[0]))
    }

    fn check(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Result<(), String> {
        let ([x, mask], [out]) = (inputs, outputs) else {
            return Err(crate::cpu::not_n_to_one(2, (inputs, outputs)));
        };
        let dtype = check_masked(x, mask)?;
        if out.shape != x.shape || out.dtype != dtype {
            return Err(format!("the output must be the scores' shape {} in {dtype}, got {out}", x.shape));
        }
        Ok(())
    }
}

/// Whether `mask` fits the scores `x`: float dtypes, rank >= 1, and a shape that
/// broadcasts to `x`'s (shared by the graph's shape rule); returns the dtype of the
/// output, which [`masked_dtype`] gives.
pub fn check_masked(x: &TensorMeta, mask: &TensorMeta) -> Result<DType, String> {
    let dtype = masked_dtype(x, mask)?;
    if x.shape.rank() == 0 {
        return Err("the scores must have rank >= 1, got a scalar".into());
    }
    if Shape::broadcast(&x.shape, &mask.shape).as_ref() != Some(&x.shape) {
        return Err(format!("the mask {} does not broadcast to the scores {}", mask.shape, x.shape));
    }
    Ok(dtype)
}

/// The dtype of `masked_softmax`'s probabilities for scores `x` and `mask`: the scores'.
/// The two are one float dtype, or bf16 (or f16) scores meet an f32 mask (a 16-bit mask
/// with f32 scores is f32 too). Mixed precision's bf16 scores are read as they are, each element
/// widened as it loads (as the cross-entropy reads bf16 logits); the softmax is computed
/// in f32 and each probability rounded to bf16 once as it is stored: the f32 softmax of
/// the widened scores cast to bf16, bit for bit, with no f32 copy of either.
pub fn masked_dtype(x: &TensorMeta, mask: &TensorMeta) -> Result<DType, String> {
    match (x.dtype, mask.dtype) {
        (a, b) if a == b && a.is_float() => Ok(a),
        (DType::Bf16, DType::F32) => Ok(DType::Bf16),
        (DType::F16, DType::F32) => Ok(DType::F16),
        (DType::F32, DType::Bf16 | DType::F16) => Ok(DType::F32),
        _ => Err(format!("the scores {x} and the mask {mask} must be one float dtype, or bf16 or f16 and f32")),
    }
}

fn masked_forward<T: FastMath>(
    scale: f64,
    threads: usize,
    inputs: &[HostTensor<'_>],
    out: &mut HostTensorMut<'_>,
) -> Result<(), String> {
    let (x, mask) = (inputs[0].as_slice::<T>()?, inputs[1].as_slice::<T>()?);
    let (dims, mask_dims) = (inputs[0].shape.dims(), inputs[1].shape.dims());
    let scale = T::from_f64(scale);
    let len = dims.last().copied().unwrap_or(1).max(1);
    rows_in_shares(threads, out.as_mut_slice::<T>()?, len, |rows, y| {
        let (first, end) = (rows.start * len, rows.end * len);
        fast_math::vectorized(
            #[inline(always)]
            || {
                // A run is one or more whole rows (all of them when the mask has the scores'
                // shape); the mask's part of a row is contiguous or one value. A share takes
                // the rows of each run that are its own.
                for_each_broadcast_run(
                    dims,
                    dims,
                    mask_dims,
                    #[inline(always)]
                    |run| {
                        let (from, to) = (run.out.max(first), (run.out + run.len).min(end));
                        for at in (from..to).step_by(len) {
                            let start = at - run.out;
                            let (row, y_row) = (&x[at..][..len], &mut y[at - first..][..len]);
                            if run.b_step == 1 {
                                for ((o, &v), &m) in y_row.iter_mut().zip(row).zip(&mask[run.b + start..][..len]) {
                                    *o = scale * v + m;
                                }
                            } else {
                                let m = mask[run.b];
                                for (o, &v) in y_row.iter_mut().zip(row) {
                                    *o = scale * v + m;
                                }
                            }
                            normalize_row(y_row);
                        }
                    },
                );
            },
        )
    });
    Ok(())
}

impl HostCompute for MaskedSoftmaxGrad {
    fn compute(
        &self,
        context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        by_float!(outputs[0].dtype(), "integer softmax is not supported", T => masked_backward::<T>(self.scale, context.threads, inputs, &mut outputs[0]))
    }

    fn check(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Result<(), String> {
        let ([y, dy], [dx]) = (inputs, outputs) else {
            return Err(crate::cpu::not_n_to_one(2, (inputs, outputs)));
        };
        if dy != y || !y.dtype.is_float() {
            return Err(format!("y {y} and dy {dy} must be one float tensor's metas"));
        }
        if dx != y {
            return Err(format!("the gradient must be y's shape and dtype {y}, got {dx}"));
        }
        Ok(())
    }
}

fn masked_backward<T: Real>(
    scale: f64,
    threads: usize,
    inputs: &[HostTensor<'_>],
    out: &mut HostTensorMut<'_>,
) -> Result<(), String> {
    let (y, dy) = (inputs[0].as_slice::<T>()?, inputs[1].as_slice::<T>()?);
    let len = inputs[0].shape.dims().last().copied().unwrap_or(1).max(1);
    let scale = T::from_f64(scale);
    rows_in_shares(threads, out.as_mut_slice::<T>()?, len, |rows, dx| {
        let span = rows.start * len..rows.end * len;
        fast_math::vectorized(
            #[inline(always)]
            || {
                let (y, dy) = (&y[span.clone()], &dy[span]);
                for ((y_row, dy_row), dx_row) in
                    y.chunks_exact(len).zip(dy.chunks_exact(len)).zip(dx.chunks_exact_mut(len))
                {
                    let dot = fast_math::dot(y_row, dy_row);
                    for ((d, &a), &b) in dx_row.iter_mut().zip(y_row).zip(dy_row) {
                        *d = scale * a * (b - dot);
                    }
                }
            },
        )
    });
    Ok(())
}
