//! Attributes of `softmax` ops.

use serde::{Deserialize, Serialize};

/// `e^x / Σ e^x` along `axis` (negative: from the end).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Softmax {
    /// The axis normalized over.
    pub axis: isize,
}

/// `x - ln Σ e^x` along `axis` (negative: from the end).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogSoftmax {
    /// The axis normalized over.
    pub axis: isize,
}

/// The input gradient of [`Softmax`] or [`LogSoftmax`] from its output `y` and output
/// gradient `dy`: `y·(dy - Σ dy·y)` for softmax, `dy - e^y·Σ dy` for log-softmax (whose
/// `e^y` is the softmax), sums along `axis`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SoftmaxGrad {
    /// The axis normalized over.
    pub axis: isize,
    /// Whether the forward op was [`LogSoftmax`].
    pub log: bool,
}
