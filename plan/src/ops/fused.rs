//! Attributes of fused elementwise ops: one pass over the elements instead of one per op.

use serde::{Deserialize, Serialize};

/// `gelu(x + bias)` (GELU with the tanh approximation) for `x` of shape `[..., N]` and a
/// `bias` of shape `[N]`: the bias add of a linear layer and its activation in one pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct BiasGelu;

/// The gradient of [`BiasGelu`] with respect to `x` from inputs `(x, bias, dy)`:
/// `dy · gelu'(x + bias)` (the bias's gradient is its sum over the leading axes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct BiasGeluGrad;
