//! Attributes of `cross_entropy` ops.

use serde::{Deserialize, Serialize};

/// `mean_n (ln Σ_c e^logits[n, c] - logits[n, labels[n]])`: logits `[N, C]` (float), labels
/// `[N]` (i64, each in `0..C`), a scalar loss of the logits' dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SparseCrossEntropy;

/// The gradient of [`SparseCrossEntropy`] with respect to the logits, from inputs
/// `(logits, labels, dy)`: `(softmax(logits) - onehot(labels)) · dy / N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SparseCrossEntropyGrad;

/// A device's share of [`SparseCrossEntropy`] (or, with `grad`, of its gradient) when the
/// rows are split: its rows' terms divided by the whole batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartCrossEntropy {
    /// Rows of the logical batch.
    pub batch: usize,
    /// Whether this is the gradient op.
    pub grad: bool,
}
