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

/// `softmax(scale·x + mask)` along the last axis, in one pass: the scaled dot-product
/// attention scores with an additive mask (0 where a position may be attended, a large
/// negative number where not) that broadcasts to `x` (a causal `[T, T]` mask over a
/// `[B, H, T, T]` batch of scores).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MaskedSoftmax {
    /// What the scores are multiplied by before the mask is added.
    pub scale: f64,
}

/// The gradient of [`MaskedSoftmax`] with respect to `x`, from its output `y` and output
/// gradient `dy`: `scale · y·(dy - Σ dy·y)`, sums along the last axis.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MaskedSoftmaxGrad {
    /// The forward op's scale.
    pub scale: f64,
}
