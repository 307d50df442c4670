//! `permuted_matmul`: a batched product that reads its operands and writes its result
//! through axis orders (strides), so attention's head split `[B, T, H, d]` ↔ `[B, H, T, d]`
//! needs no permute copies, forward or backward.

use super::{GradCtx, InputGrads, OpDef};
use crate::plan::{Shape, TensorMeta};
use crate::sbp::{Sbp, SbpSignature};
use crate::{GraphError, Tensor};
use regflow_kernels::cpu::permuted_matmul::permuted_layout;
pub use regflow_plan::ops::PermutedMatMul;

/// The inverse of the axis order `axes`.
fn inverse(axes: &[usize]) -> Vec<usize> {
    let mut inverse = vec![0; axes.len()];
    for (j, &i) in axes.iter().enumerate() {
        inverse[i] = j;
    }
    inverse
}

/// `axes` with its last two entries swapped: the transpose of what it reads.
fn transposed(axes: &[usize]) -> Vec<usize> {
    let mut axes = axes.to_vec();
    let rank = axes.len();
    axes.swap(rank - 2, rank - 1);
    axes
}

impl OpDef for PermutedMatMul {
    fn name(&self) -> &'static str {
        "permuted_matmul"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let [a, b] = inputs else { return Err(format!("takes 2 inputs, got {}", inputs.len())) };
        if a.dtype != b.dtype {
            return Err(format!("dtype mismatch: {} vs {}", a.dtype, b.dtype));
        }
        if !a.dtype.is_float() {
            return Err(format!("needs float inputs, got {}", a.dtype));
        }
        let layout = permuted_layout(self, &a.shape, &b.shape)?;
        Ok(vec![TensorMeta::new(Shape::new(layout.out_dims.to_vec()), a.dtype)])
    }

    /// With `A`, `B`, `C` the logical operands and product: `dA = dC · Bᵀ` and
    /// `dB = Aᵀ · dC`, each one permuted product reading `dy` through the inverse of the
    /// output's order and storing in its operand's layout.
    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        let (a, b, dy) = (ctx.inputs[0], ctx.inputs[1], ctx.grad()?);
        let dy_axes = inverse(&self.out_axes);
        let da = dy.matmul_permuted(&b, &dy_axes, &transposed(&self.b_axes), &inverse(&self.a_axes))?;
        let db = a.matmul_permuted(&dy, &transposed(&self.a_axes), &dy_axes, &inverse(&self.b_axes))?;
        Ok(vec![Some(da), Some(db)])
    }

    /// Splits of a batch axis (on both operands), of `m` or `n` (the other operand whole)
    /// split the product where it stores that axis; a `k` split on both operands, or
    /// summands on one side, give summands.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let [a, b] = inputs else { return Vec::new() };
        if permuted_layout(self, &a.shape, &b.shape).is_err() {
            return Vec::new();
        }
        let rank = self.a_axes.len();
        let stored_out = inverse(&self.out_axes);
        let (a_axes, b_axes) = (&self.a_axes, &self.b_axes);
        let (partial, whole) = (Sbp::Partial, Sbp::Broadcast);
        let mut signatures: Vec<SbpSignature> = (0..rank - 2)
            .map(|i| SbpSignature::new([Sbp::Split(a_axes[i]), Sbp::Split(b_axes[i])], [Sbp::Split(stored_out[i])]))
            .collect();
        signatures.extend([
            SbpSignature::new([Sbp::Split(a_axes[rank - 2]), whole], [Sbp::Split(stored_out[rank - 2])]),
            SbpSignature::new([whole, Sbp::Split(b_axes[rank - 1])], [Sbp::Split(stored_out[rank - 1])]),
            SbpSignature::new([Sbp::Split(a_axes[rank - 1]), Sbp::Split(b_axes[rank - 2])], [partial]),
            SbpSignature::new([partial, whole], [partial]),
            SbpSignature::new([whole, partial], [partial]),
        ]);
        signatures
    }

    fn flops(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> f64 {
        let [a, b] = inputs else { return 0.0 };
        permuted_layout(self, &a.shape, &b.shape).map_or(0.0, |l| {
            2.0 * l.batch.iter().map(|&d| d as f64).product::<f64>() * l.m as f64 * l.n as f64 * l.k as f64
        })
    }

    /// A product: bf16 (or f16) under mixed precision.
    fn autocast(&self) -> super::Autocast {
        super::Autocast::Low
    }
}

impl<'g> Tensor<'g> {
    /// `P(P(self, a_axes) · P(rhs, b_axes), out_axes)`, where `P(x, axes)` is
    /// `x.permute(axes)`: a batched product over the last two axes whose operands are read
    /// and result written through axis orders (strides), never copied. For example
    /// attention scores from `q` and `k` stored `[B, T, H, d]`:
    /// `q.matmul_permuted(&k, &[0, 2, 1, 3], &[0, 2, 3, 1], &[0, 1, 2, 3])` is `[B, H, T, T]`.
    pub fn matmul_permuted(
        &self,
        rhs: &Tensor<'g>,
        a_axes: &[usize],
        b_axes: &[usize],
        out_axes: &[usize],
    ) -> Result<Tensor<'g>, GraphError> {
        let op = PermutedMatMul { a_axes: a_axes.to_vec(), b_axes: b_axes.to_vec(), out_axes: out_axes.to_vec() };
        self.graph().apply1(op, &[*self, *rhs])
    }
}
