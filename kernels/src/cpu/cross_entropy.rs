//! CPU kernels of `cross_entropy` ops.

use crate::cpu::fast_math::{self, FastMath};
use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::*;
use regflow_plan::{HostTensor, HostTensorMut};

impl HostCompute for SparseCrossEntropy {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        fast_math::vectorized(
            || by_float!(outputs[0].dtype(), "integer logits are not supported", T => forward_typed::<T>(None, inputs, &mut outputs[0])),
        )
    }
}

impl HostCompute for SparseCrossEntropyGrad {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        fast_math::vectorized(
            || by_float!(outputs[0].dtype(), "integer logits are not supported", T => backward_typed::<T>(None, inputs, &mut outputs[0])),
        )
    }
}

impl HostCompute for PartCrossEntropy {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        let batch = Some(self.batch);
        fast_math::vectorized(
            #[inline(always)]
            || {
                by_float!(outputs[0].dtype(), "integer logits are not supported", T => if self.grad {
                    backward_typed::<T>(batch, inputs, &mut outputs[0])
                } else {
                    forward_typed::<T>(batch, inputs, &mut outputs[0])
                })
            },
        )
    }
}

/// `batch` as for [`forward_typed`].
#[inline(always)]
fn backward_typed<T: FastMath>(
    batch: Option<usize>,
    inputs: &[HostTensor<'_>],
    out: &mut HostTensorMut<'_>,
) -> Result<(), String> {
    let (logits, labels) = (inputs[0].as_slice::<T>()?, inputs[1].as_slice::<i64>()?);
    let dy = inputs[2].as_slice::<T>()?[0];
    let classes = inputs[0].shape.dims()[1];
    let rows = labels.len();
    let scale = dy / T::from_f64(batch.unwrap_or(rows) as f64);
    let dx = out.as_mut_slice::<T>()?;
    for n in 0..rows {
        let row = &logits[n * classes..(n + 1) * classes];
        let c = class(labels, n, classes)?;
        let (max, log_sum) = log_sum_exp(row);
        let dx_row = &mut dx[n * classes..(n + 1) * classes];
        for (d, &v) in dx_row.iter_mut().zip(row) {
            *d = (v - max - log_sum).fast_exp() * scale;
        }
        dx_row[c] = dx_row[c] - scale;
    }
    Ok(())
}

/// `batch`: the rows the mean is over (`None`: the rows given; a device holding some of the
/// rows divides by all of them, so that the devices' results sum to the mean).
#[inline(always)]
fn forward_typed<T: FastMath>(
    batch: Option<usize>,
    inputs: &[HostTensor<'_>],
    out: &mut HostTensorMut<'_>,
) -> Result<(), String> {
    let (logits, labels) = (inputs[0].as_slice::<T>()?, inputs[1].as_slice::<i64>()?);
    let classes = inputs[0].shape.dims()[1];
    let rows = labels.len();
    let mut total = 0.0f64;
    for n in 0..rows {
        let row = &logits[n * classes..(n + 1) * classes];
        let c = class(labels, n, classes)?;
        let (max, log_sum) = log_sum_exp(row);
        // Subtracting in the shifted domain keeps it exact for huge logits.
        total += (log_sum - (row[c] - max)).to_f64();
    }
    out.as_mut_slice::<T>()?[0] = T::from_f64(total / batch.unwrap_or(rows) as f64);
    Ok(())
}

/// The label of row `n` as a class index, or an error naming it.
fn class(labels: &[i64], n: usize, classes: usize) -> Result<usize, String> {
    let label = labels[n];
    usize::try_from(label)
        .ok()
        .filter(|&c| c < classes)
        .ok_or_else(|| format!("label {label} out of range for {classes} classes"))
}

/// `(max, ln Σ e^(x - max))` of one row.
#[inline(always)]
fn log_sum_exp<T: FastMath>(row: &[T]) -> (T, T) {
    let Some(&first) = row.first() else { return (T::zero(), T::zero()) };
    let max = fast_math::max(row).unwrap_or(first);
    let sum = fast_math::lane_reduce(row.len(), |j| (row[j] - max).fast_exp());
    (max, sum.ln())
}
