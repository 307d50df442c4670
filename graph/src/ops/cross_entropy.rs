//! `sparse_cross_entropy`: the mean negative log-likelihood of integer labels under
//! softmax(logits), computed with a stable log-sum-exp, and the op computing its gradient.

use super::{GradCtx, InputGrads, LocalContext, OpDef};
use crate::plan::TensorMeta;
use crate::sbp::{Sbp, SbpSignature};
use crate::{DType, GraphError, Tensor};
use regflow_plan::ops::PartCrossEntropy;
pub use regflow_plan::ops::{SparseCrossEntropy, SparseCrossEntropyGrad};
use std::sync::Arc;

/// Checks logits `[N, C]` against labels `[N]`, and `classes` (when set) against `C`;
/// returns `(N, C)`.
fn check(logits: &TensorMeta, labels: &TensorMeta, padded: Option<usize>) -> Result<(usize, usize), String> {
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
    match padded {
        Some(0) => Err(format!("takes at least 1 class of the logits' {classes} columns, got 0")),
        Some(first) if first > classes => {
            Err(format!("takes the first {first} columns as classes, but the logits {} have {classes}", logits.shape))
        }
        _ => Ok((rows, classes)),
    }
}

/// The dtype of the loss over logits of `logits`: f32 for bf16 or f16 logits (a loss is
/// summed in f32 at least), else the logits' own.
fn loss_dtype(logits: DType) -> DType {
    if logits.is_half() {
        DType::F32
    } else {
        logits
    }
}

impl OpDef for SparseCrossEntropy {
    fn name(&self) -> &'static str {
        "sparse_cross_entropy"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let [logits, labels] = inputs else { return Err(format!("takes 2 inputs, got {}", inputs.len())) };
        check(logits, labels, self.classes)?;
        Ok(vec![TensorMeta::new([], loss_dtype(logits.dtype))])
    }

    /// Reads bf16 (or f16) logits as they are, in f32 arithmetic; the loss is f32.
    fn autocast(&self) -> super::Autocast {
        super::Autocast::Widen
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        let (logits, labels, dy) = (ctx.inputs[0], ctx.inputs[1], ctx.grad()?);
        let grad = SparseCrossEntropyGrad { classes: self.classes };
        let dlogits = logits.graph().apply1(grad, &[logits, labels, dy])?;
        Ok(vec![Some(dlogits), None])
    }

    /// A split of the rows (logits and labels alike) leaves each device the sum of its
    /// rows' losses divided by the whole batch: summands of the mean.
    fn sbp_signatures(&self, _inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        vec![SbpSignature::new([Sbp::Split(0), Sbp::Split(0)], [Sbp::Partial])]
    }

    /// Divides by the logical batch when the rows are split.
    fn localize(&self, ctx: &LocalContext<'_>) -> Result<Option<Arc<dyn OpDef>>, String> {
        let classes = self.classes;
        Ok(split_batch(ctx).map(|batch| Arc::new(PartCrossEntropy { batch, grad: false, classes }) as Arc<dyn OpDef>))
    }
}

impl OpDef for SparseCrossEntropyGrad {
    fn name(&self) -> &'static str {
        "sparse_cross_entropy_grad"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let [logits, labels, dy] = inputs else { return Err(format!("takes 3 inputs, got {}", inputs.len())) };
        check(logits, labels, self.classes)?;
        let loss = loss_dtype(logits.dtype);
        if dy.dtype != loss || dy.shape.rank() != 0 {
            return Err(format!("dy must be a {loss} scalar (the loss's dtype), got {dy}"));
        }
        Ok(vec![logits.clone()])
    }

    /// Reads bf16 (or f16) logits as they are; the gradient comes out in the logits' dtype.
    fn autocast(&self) -> super::Autocast {
        super::Autocast::Widen
    }

    fn grad<'g>(&self, _ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        // Second derivatives of the loss are not needed by any optimizer here.
        Err(GraphError::NoGradient { op: self.name().into(), index: 0 })
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
        let classes = self.classes;
        Ok(split_batch(ctx).map(|batch| Arc::new(PartCrossEntropy { batch, grad: true, classes }) as Arc<dyn OpDef>))
    }
}

/// The logical batch size when this device holds only some of the rows.
fn split_batch(ctx: &LocalContext<'_>) -> Option<usize> {
    let logical = ctx.logical_inputs.first()?.shape.dims().first().copied()?;
    let local = ctx.local_inputs.first()?.shape.dims().first().copied()?;
    (local != logical).then_some(logical)
}

impl OpDef for PartCrossEntropy {
    fn name(&self) -> &'static str {
        if self.grad {
            SparseCrossEntropyGrad::default().name()
        } else {
            SparseCrossEntropy::default().name()
        }
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let classes = self.classes;
        if self.grad {
            SparseCrossEntropyGrad { classes }.infer(inputs)
        } else {
            SparseCrossEntropy { classes }.infer(inputs)
        }
    }

    fn grad<'g>(&self, _ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        // Gradients are taken of the logical graph, before it is split over devices.
        Err(GraphError::NoGradient { op: format!("{} (one device's part)", self.name()), index: 0 })
    }
}

impl<'g> Tensor<'g> {
    /// Mean cross-entropy of integer `labels` (`[N]`, i64) under `softmax(self)` for logits
    /// `[N, C]`: a scalar. Stable for large logits (log-sum-exp); a label outside `0..C`
    /// fails when evaluated.
    pub fn sparse_cross_entropy(&self, labels: &Tensor<'g>) -> Result<Tensor<'g>, GraphError> {
        self.graph().apply1(SparseCrossEntropy { classes: None }, &[*self, *labels])
    }

    /// [`sparse_cross_entropy`](Self::sparse_cross_entropy) over the first `classes`
    /// columns of logits `[N, C]`: the others are padding that takes no part in the loss
    /// and gets a zero gradient. A vocabulary padded to a multiple of 64 columns (as GPT-2
    /// implementations pad 50257 to 50304) lets the products that make and read the logits
    /// run on aligned tensor-core kernels, with the loss and every real gradient those of
    /// the unpadded model. `classes` must be in `1..=C`.
    pub fn sparse_cross_entropy_of_first(&self, labels: &Tensor<'g>, classes: usize) -> Result<Tensor<'g>, GraphError> {
        self.graph().apply1(SparseCrossEntropy { classes: Some(classes) }, &[*self, *labels])
    }
}
