//! Attributes of `binary` ops.

use serde::{Deserialize, Serialize};

/// Which binary op.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum BinaryKind {
    /// a + b
    Add,
    /// a - b
    Sub,
    /// a * b
    Mul,
    /// a / b
    Div,
    /// `a` where `b > 0`, else 0: ReLU's gradient, `a` the output's gradient and `b` the
    /// ReLU's output (PyTorch's `threshold_backward`), in one pass instead of a `step` and
    /// a `mul`.
    ReluGrad,
}

/// An elementwise binary op with broadcasting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Binary(pub BinaryKind);
