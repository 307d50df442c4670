//! `sparse_cross_entropy`: the mean negative log-likelihood of integer labels under
//! softmax(logits), computed with a stable log-sum-exp, and the op computing its gradient.

use super::{GradCtx, InputGrads, LocalContext, OpDef};
use crate::sbp::{Sbp, SbpSignature};
use crate::tensor::{HostTensor, HostTensorMut, Real, TensorMeta};
use crate::{DType, GraphError, Tensor};
use std::sync::Arc;

/// `mean_n (ln Σ_c e^logits[n, c] - logits[n, labels[n]])`: logits `[N, C]` (float), labels
/// `[N]` (i64, each in `0..C`), a scalar loss of the logits' dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SparseCrossEntropy;

/// The gradient of [`SparseCrossEntropy`] with respect to the logits, from inputs
/// `(logits, labels, dy)`: `(softmax(logits) - onehot(labels)) · dy / N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SparseCrossEntropyGrad;

/// Checks logits `[N, C]` against labels `[N]`; returns `(N, C)`.
fn check(logits: &TensorMeta, labels: &TensorMeta) -> Result<(usize, usize), String> {
    if !logits.dtype.is_float() {
        return Err(format!("logits must be float, got {}", logits.dtype));
    }
    if labels.dtype != DType::I64 {
        return Err(format!("labels must be i64, got {}", labels.dtype));
    }
    let &[rows, classes] = logits.shape.dims() else {
        return Err(format!("logits must be [N, C], got {}", logits.shape));
    };
    if labels.shape.dims() != [rows] {
        return Err(format!("labels must have shape [{rows}] to match logits {}, got {}", logits.shape, labels.shape));
    }
    Ok((rows, classes))
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
fn log_sum_exp<T: Real>(row: &[T]) -> (T, T) {
    let Some(&first) = row.first() else { return (T::zero(), T::zero()) };
    let max = row.iter().fold(first, |m, &v| m.max(v));
    let sum: T = row.iter().map(|&v| (v - max).exp()).sum();
    (max, sum.ln())
}

/// `batch`: the rows the mean is over (`None`: the rows given; a device holding some of the
/// rows divides by all of them, so that the devices' results sum to the mean).
fn forward_typed<T: Real>(
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

/// `batch` as for [`forward_typed`].
fn backward_typed<T: Real>(
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
            *d = (v - max - log_sum).exp() * scale;
        }
        dx_row[c] = dx_row[c] - scale;
    }
    Ok(())
}

impl OpDef for SparseCrossEntropy {
    fn name(&self) -> &'static str {
        "sparse_cross_entropy"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let [logits, labels] = inputs else { return Err(format!("takes 2 inputs, got {}", inputs.len())) };
        check(logits, labels)?;
        Ok(vec![TensorMeta::new([], logits.dtype)])
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        let (logits, labels, dy) = (ctx.inputs[0], ctx.inputs[1], ctx.grad()?);
        let dlogits = logits.graph().apply1(SparseCrossEntropyGrad, &[logits, labels, dy])?;
        Ok(vec![Some(dlogits), None])
    }

    fn compute(&self, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
        match outputs[0].dtype() {
            DType::F32 => forward_typed::<f32>(None, inputs, &mut outputs[0]),
            DType::F64 => forward_typed::<f64>(None, inputs, &mut outputs[0]),
            DType::I64 => Err("integer logits are not supported".into()),
        }
    }

    /// A split of the rows (logits and labels alike) leaves each device the sum of its
    /// rows' losses divided by the whole batch: summands of the mean.
    fn sbp_signatures(&self, _inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        vec![SbpSignature::new([Sbp::Split(0), Sbp::Split(0)], [Sbp::Partial])]
    }

    /// Divides by the logical batch when the rows are split.
    fn localize(&self, ctx: &LocalContext<'_>) -> Result<Option<Arc<dyn OpDef>>, String> {
        Ok(split_batch(ctx).map(|batch| Arc::new(PartCrossEntropy { batch, grad: false }) as Arc<dyn OpDef>))
    }
}

impl OpDef for SparseCrossEntropyGrad {
    fn name(&self) -> &'static str {
        "sparse_cross_entropy_grad"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let [logits, labels, dy] = inputs else { return Err(format!("takes 3 inputs, got {}", inputs.len())) };
        check(logits, labels)?;
        if dy.dtype != logits.dtype || dy.shape.rank() != 0 {
            return Err(format!("dy must be a {} scalar, got {dy}", logits.dtype));
        }
        Ok(vec![logits.clone()])
    }

    fn grad<'g>(&self, _ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        // Second derivatives of the loss are not needed by any optimizer here.
        Err(GraphError::NoGradient { op: self.name().into(), index: 0 })
    }

    fn compute(&self, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
        match outputs[0].dtype() {
            DType::F32 => backward_typed::<f32>(None, inputs, &mut outputs[0]),
            DType::F64 => backward_typed::<f64>(None, inputs, &mut outputs[0]),
            DType::I64 => Err("integer logits are not supported".into()),
        }
    }

    /// A split of the rows (with `dy` whole) splits the gradient's rows, each scaled by
    /// the whole batch; the gradient is linear in `dy`, so summands of `dy` give summands.
    fn sbp_signatures(&self, _inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let (partial, whole) = (Sbp::Partial, Sbp::Broadcast);
        vec![
            SbpSignature::new([Sbp::Split(0), Sbp::Split(0), whole], [Sbp::Split(0)]),
            SbpSignature::new([whole, whole, partial], [partial]),
        ]
    }

    /// Divides by the logical batch when the rows are split.
    fn localize(&self, ctx: &LocalContext<'_>) -> Result<Option<Arc<dyn OpDef>>, String> {
        Ok(split_batch(ctx).map(|batch| Arc::new(PartCrossEntropy { batch, grad: true }) as Arc<dyn OpDef>))
    }
}

/// The logical batch size when this device holds only some of the rows.
fn split_batch(ctx: &LocalContext<'_>) -> Option<usize> {
    let logical = ctx.logical_inputs.first()?.shape.dims().first().copied()?;
    let local = ctx.local_inputs.first()?.shape.dims().first().copied()?;
    (local != logical).then_some(logical)
}

/// A device's share of [`SparseCrossEntropy`] (or, with `grad`, of its gradient) when the
/// rows are split: its rows' terms divided by the whole batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PartCrossEntropy {
    /// Rows of the logical batch.
    batch: usize,
    /// Whether this is the gradient op.
    grad: bool,
}

impl OpDef for PartCrossEntropy {
    fn name(&self) -> &'static str {
        if self.grad {
            SparseCrossEntropyGrad.name()
        } else {
            SparseCrossEntropy.name()
        }
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        if self.grad {
            SparseCrossEntropyGrad.infer(inputs)
        } else {
            SparseCrossEntropy.infer(inputs)
        }
    }

    fn grad<'g>(&self, _ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        // Gradients are taken of the logical graph, before it is split over devices.
        Err(GraphError::NoGradient { op: format!("{} (one device's part)", self.name()), index: 0 })
    }

    fn compute(&self, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
        let batch = Some(self.batch);
        match (outputs[0].dtype(), self.grad) {
            (DType::F32, false) => forward_typed::<f32>(batch, inputs, &mut outputs[0]),
            (DType::F64, false) => forward_typed::<f64>(batch, inputs, &mut outputs[0]),
            (DType::F32, true) => backward_typed::<f32>(batch, inputs, &mut outputs[0]),
            (DType::F64, true) => backward_typed::<f64>(batch, inputs, &mut outputs[0]),
            (DType::I64, _) => Err("integer logits are not supported".into()),
        }
    }
}

impl<'g> Tensor<'g> {
    /// Mean cross-entropy of integer `labels` (`[N]`, i64) under `softmax(self)` for logits
    /// `[N, C]`: a scalar. Stable for large logits (log-sum-exp); a label outside `0..C`
    /// fails when evaluated.
    pub fn sparse_cross_entropy(&self, labels: &Tensor<'g>) -> Result<Tensor<'g>, GraphError> {
        self.graph().apply1(SparseCrossEntropy, &[*self, *labels])
    }
}
