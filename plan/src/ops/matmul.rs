//! Attributes of `matmul` ops.

use serde::{Deserialize, Serialize};

/// `op(a) · op(b)`, where `op` transposes the last two axes of an operand whose flag is set.
///
/// Operands are matrices `[m, k]` or batches of them `[..., m, k]`. Batch dimensions must be
/// equal, or one operand is 2-D and shared across the other's batch (a weight).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct MatMul {
    /// Read `a` as its transpose.
    pub transpose_a: bool,
    /// Read `b` as its transpose.
    pub transpose_b: bool,
}

/// `Σ_i op(a_i) · op(b_i)` over a batch: both operands batched with equal batch dimensions,
/// one 2-D result. It is the gradient of a [`MatMul`] with respect to an operand shared
/// across the batch, computed without materializing one product per batch element.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct MatMulBatchSum {
    /// Read `a` as its transpose.
    pub transpose_a: bool,
    /// Read `b` as its transpose.
    pub transpose_b: bool,
}
