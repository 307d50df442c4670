//! CPU kernels of `cross_entropy` ops.

use crate::cpu::fast_math::{self, FastMath};
use crate::cpu::shares::{in_shares, rows_in_shares, DisjointParts, ROWS_PARALLEL_MIN_ELEMENTS};
use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::*;
use regflow_plan::{HostTensor, HostTensorMut};

impl HostCompute for SparseCrossEntropy {
    fn compute(
        &self,
        context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        by_float!(outputs[0].dtype(), "integer logits are not supported", T => forward_typed::<T>(None, self.classes, context.threads, inputs, &mut outputs[0]))
    }
}

impl HostCompute for SparseCrossEntropyGrad {
    fn compute(
        &self,
        context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        by_float!(outputs[0].dtype(), "integer logits are not supported", T => backward_typed::<T>(None, self.classes, context.threads, inputs, &mut outputs[0]))
    }
}

impl HostCompute for PartCrossEntropy {
    fn compute(
        &self,
        context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        let (batch, classes) = (Some(self.batch), self.classes);
        by_float!(outputs[0].dtype(), "integer logits are not supported", T => if self.grad {
            backward_typed::<T>(batch, classes, context.threads, inputs, &mut outputs[0])
        } else {
            forward_typed::<T>(batch, classes, context.threads, inputs, &mut outputs[0])
        })
    }
}

/// `batch` and `padded` as for [`forward_typed`]; padding columns get a zero gradient.
/// Labels are checked first, so that row shares (over `threads`, when large) cannot fail.
fn backward_typed<T: FastMath>(
    batch: Option<usize>,
    padded: Option<usize>,
    threads: usize,
    inputs: &[HostTensor<'_>],
    out: &mut HostTensorMut<'_>,
) -> Result<(), String> {
    let (logits, labels) = (inputs[0].as_slice::<T>()?, inputs[1].as_slice::<i64>()?);
    let dy = inputs[2].as_slice::<T>()?[0];
    let (width, classes) = columns(&inputs[0], padded)?;
    let rows = labels.len();
    for n in 0..rows {
        class(labels, n, classes)?;
    }
    let scale = dy / T::from_f64(batch.unwrap_or(rows) as f64);
    rows_in_shares(threads, out.as_mut_slice::<T>()?, width, |share, dx| {
        fast_math::vectorized(
            #[inline(always)]
            || {
                for (n, dx_row) in share.zip(dx.chunks_exact_mut(width.max(1))) {
                    let row = &logits[n * width..n * width + classes];
                    let (max, log_sum) = log_sum_exp(row);
                    let (dx_row, padding) = dx_row.split_at_mut(classes);
                    padding.fill(T::zero());
                    for (d, &v) in dx_row.iter_mut().zip(row) {
                        *d = (v - max - log_sum).fast_exp() * scale;
                    }
                    // Checked above, so in range.
                    let c = labels[n] as usize;
                    dx_row[c] = dx_row[c] - scale;
                }
            },
        )
    });
    Ok(())
}

/// The mean of `−ln softmax(logits)[label]` over `batch` rows (`None`: the rows given; a
/// device holding some of the rows divides by all of them, so that the devices' results sum
/// to the mean), over the first `padded` columns of each row when set (the rest padding),
/// row losses summed in row order in f64. From [`ROWS_PARALLEL_MIN_ELEMENTS`] logits on
/// several threads, the row losses of each block of [`LOSS_BLOCK`] rows are computed in
/// shares into a stack buffer and then summed in row order: the same terms in the same
/// order, so the same bits on any thread count. Labels are checked first, in row order, so
/// the error names the first bad row either way.
fn forward_typed<T: FastMath>(
    batch: Option<usize>,
    padded: Option<usize>,
    threads: usize,
    inputs: &[HostTensor<'_>],
    out: &mut HostTensorMut<'_>,
) -> Result<(), String> {
    let (logits, labels) = (inputs[0].as_slice::<T>()?, inputs[1].as_slice::<i64>()?);
    let (width, classes) = columns(&inputs[0], padded)?;
    let rows = labels.len();
    for n in 0..rows {
        class(labels, n, classes)?;
    }
    let row_loss = |n: usize| -> f64 {
        let row = &logits[n * width..n * width + classes];
        // Checked above.
        let c = labels[n] as usize;
        let (max, log_sum) = log_sum_exp(row);
        // Subtracting in the shifted domain keeps it exact for huge logits.
        (log_sum - (row[c] - max)).to_f64()
    };
    let mut total = 0.0f64;
    if threads <= 1 || logits.len() < ROWS_PARALLEL_MIN_ELEMENTS {
        fast_math::vectorized(
            #[inline(always)]
            || {
                for n in 0..rows {
                    total += row_loss(n);
                }
            },
        );
    } else {
        let mut losses = [0.0f64; LOSS_BLOCK];
        for first in (0..rows).step_by(LOSS_BLOCK) {
            let block = &mut losses[..LOSS_BLOCK.min(rows - first)];
            let len = block.len();
            let parts = DisjointParts::new(block);
            in_shares(threads, len, |share| {
                // SAFETY: shares are disjoint ranges of the block.
                let part = unsafe { parts.part(share.clone()) };
                fast_math::vectorized(
                    #[inline(always)]
                    || {
                        for (loss, n) in part.iter_mut().zip(share.clone()) {
                            *loss = row_loss(first + n);
                        }
                    },
                );
            });
            for &loss in &losses[..len] {
                total += loss;
            }
        }
    }
    out.as_mut_slice::<T>()?[0] = T::from_f64(total / batch.unwrap_or(rows) as f64);
    Ok(())
}

/// The logits' columns per row and, of those, the classes: the first `padded` when set
/// (at most all of them: checked when the op was applied, and again here for a plan).
fn columns(logits: &HostTensor<'_>, padded: Option<usize>) -> Result<(usize, usize), String> {
    let width =
        logits.shape.dims().get(1).copied().ok_or_else(|| format!("logits must be [N, C], got {}", logits.shape))?;
    match padded {
        None => Ok((width, width)),
        Some(classes) if (1..=width).contains(&classes) => Ok((width, classes)),
        Some(classes) => Err(format!("takes the first {classes} columns as classes, but the logits have {width}")),
    }
}

/// Rows whose losses one step of the shared forward computes into its stack buffer (4 KiB).
const LOSS_BLOCK: usize = 512;

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
