//! Attributes of `cross_entropy` ops.

use serde::{Deserialize, Serialize};

/// `mean_n (ln Σ_c e^logits[n, c] - logits[n, labels[n]])`: logits `[N, C]` (float), labels
/// `[N]` (i64, each in `0..C`), a scalar loss of the logits' dtype.
///
/// With `classes`, only the first `classes` columns of each row are classes (labels in
/// `0..classes`), the rest padding that takes no part: a vocabulary padded to a multiple
/// of 64 columns, so the products that make and read the logits run on aligned
/// tensor-core kernels. Without (`null` attributes, as plans had before), every column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(from = "Option<Classes>", into = "Option<Classes>")]
pub struct SparseCrossEntropy {
    /// Classes among the columns, from the first; `None`: all of them.
    pub classes: Option<usize>,
}

/// The gradient of [`SparseCrossEntropy`] with respect to the logits, from inputs
/// `(logits, labels, dy)`: `(softmax(logits) - onehot(labels)) · dy / N` over the classes,
/// zero in padding columns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(from = "Option<Classes>", into = "Option<Classes>")]
pub struct SparseCrossEntropyGrad {
    /// As [`SparseCrossEntropy::classes`].
    pub classes: Option<usize>,
}

/// The attributes of a cross-entropy over the first `classes` columns (see
/// [`SparseCrossEntropy`]); a plan writes `null` for all columns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Classes {
    /// Classes among the columns, from the first.
    pub classes: usize,
}

/// The conversions serde goes through for ops whose only attribute is `classes`.
macro_rules! classes_attributes {
    ($($op:ident),*) => {$(
        impl From<Option<Classes>> for $op {
            fn from(attrs: Option<Classes>) -> Self {
                Self { classes: attrs.map(|a| a.classes) }
            }
        }

        impl From<$op> for Option<Classes> {
            fn from(op: $op) -> Self {
                op.classes.map(|classes| Classes { classes })
            }
        }
    )*};
}

classes_attributes!(SparseCrossEntropy, SparseCrossEntropyGrad);

/// A device's share of [`SparseCrossEntropy`] (or, with `grad`, of its gradient) when the
/// rows are split: its rows' terms divided by the whole batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartCrossEntropy {
    /// Rows of the logical batch.
    pub batch: usize,
    /// Whether this is the gradient op.
    pub grad: bool,
    /// As [`SparseCrossEntropy::classes`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub classes: Option<usize>,
}
