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

/// A batched product whose operands and result are read and written through axis orders,
/// so that a permute before or after a product (attention's `[B, T, H, d]` ↔ `[B, H, T, d]`)
/// costs nothing: with `P(x, axes)` the tensor whose dimension `i` is `x`'s dimension
/// `axes[i]` (as `Permute`), the stored output is `P(P(a, a_axes) · P(b, b_axes), out_axes)`,
/// the product over the last two axes, batched over the others (equal on both operands).
/// A transpose is a swap of the last two entries of an operand's axes.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PermutedMatMul {
    /// How `a` is read: logical dimension `i` is stored dimension `a_axes[i]`.
    pub a_axes: Vec<usize>,
    /// How `b` is read.
    pub b_axes: Vec<usize>,
    /// How the logical product is stored: stored dimension `j` is logical dimension
    /// `out_axes[j]`.
    pub out_axes: Vec<usize>,
}
