//! Attributes of `boxing` ops.

use serde::{Deserialize, Serialize};

/// `B -> S(dim)` on one device: its part `index` of `parts` along `dim`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TakePart {
    /// Dimension to split.
    pub dim: usize,
    /// Number of parts.
    pub parts: usize,
    /// Which part this device keeps.
    pub index: usize,
}

/// `B -> P` on one device: the first device of the axis keeps the value, the others hold zeros.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeepOnFirst {
    /// Whether this device is the first of its axis.
    pub first: bool,
}
