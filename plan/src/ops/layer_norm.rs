//! Attributes of `layer_norm` ops.

use serde::{Deserialize, Serialize};

/// `(x - mean) / √(var + eps) · gamma + beta` over the last axis of `x` (`[..., D]`), with
/// `gamma` and `beta` of shape `[D]`; the variance is the biased (population) one.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LayerNorm {
    /// Added to the variance before the square root.
    pub eps: f64,
}

/// The gradients of [`LayerNorm`] from inputs `(x, gamma, dy)`: three outputs, `dx`,
/// `dgamma` and `dbeta`, computed in one pass (the statistics are recomputed, not stored).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LayerNormGrad {
    /// The forward op's `eps`.
    pub eps: f64,
}
