//! `matmul`: matrix and batched matrix products on the `gemm` crate, with transposes
//! expressed as strides so that gradients read operands transposed instead of copying them.

use super::{GradCtx, InputGrads, OpDef};
use crate::plan::{Shape, TensorMeta};
use crate::sbp::{Sbp, SbpSignature};
use crate::{GraphError, Tensor};
use regflow_kernels::cpu::matmul::{describe, layout};
pub use regflow_plan::ops::{MatMul, MatMulBatchSum};

/// Where the dimensions of a product sit in its stored operands, for its SBP signatures.
#[derive(Debug)]
struct ProductDims {
    /// Stored dimension of `a` holding `m`, and of `a` and `b` holding `k`, of `b` holding `n`.
    a_m: usize,
    a_k: usize,
    b_k: usize,
    b_n: usize,
    /// Batch dimensions of the result, and whether each operand carries them.
    batch: usize,
    a_batched: bool,
    b_batched: bool,
}

impl ProductDims {
    fn new(inputs: &[TensorMeta], transpose_a: bool, transpose_b: bool) -> Option<Self> {
        let [a, b] = inputs else { return None };
        let (a_shape, b_shape) = (&a.shape, &b.shape);
        let layout = layout(a_shape, transpose_a, b_shape, transpose_b).ok()?;
        let (ra, rb) = (a_shape.rank(), b_shape.rank());
        // op(a) is [.., m, k]: transposed, m is the stored last axis.
        let (a_m, a_k) = if transpose_a { (ra - 1, ra - 2) } else { (ra - 2, ra - 1) };
        // op(b) is [.., k, n].
        let (b_k, b_n) = if transpose_b { (rb - 1, rb - 2) } else { (rb - 2, rb - 1) };
        Some(Self { a_m, a_k, b_k, b_n, batch: layout.batch.len(), a_batched: ra > 2, b_batched: rb > 2 })
    }

    /// Signatures shared by both products: `m` and `n` splits (the other operand whole)
    /// give `m_out` and `n_out` splits, a `k` split on both gives partial sums, and
    /// summands on either side (the other whole) give summands.
    fn common(&self, m_out: Sbp, n_out: Sbp) -> Vec<SbpSignature> {
        let (partial, whole) = (Sbp::Partial, Sbp::Broadcast);
        vec![
            SbpSignature::new([Sbp::Split(self.a_m), whole], [m_out]),
            SbpSignature::new([whole, Sbp::Split(self.b_n)], [n_out]),
            SbpSignature::new([Sbp::Split(self.a_k), Sbp::Split(self.b_k)], [partial]),
            SbpSignature::new([partial, whole], [partial]),
            SbpSignature::new([whole, partial], [partial]),
        ]
    }

    /// The layouts of the operands for a split of batch dimension `dim`: split where an
    /// operand carries the batch, whole where it is shared across it.
    fn batch_split(&self, dim: usize) -> [Sbp; 2] {
        let side = |batched: bool| if batched { Sbp::Split(dim) } else { Sbp::Broadcast };
        [side(self.a_batched), side(self.b_batched)]
    }
}

fn check_float_pair(inputs: &[TensorMeta]) -> Result<(&TensorMeta, &TensorMeta), String> {
    let [a, b] = inputs else { return Err(format!("takes 2 inputs, got {}", inputs.len())) };
    if a.dtype != b.dtype {
        return Err(format!("dtype mismatch: {} vs {}", a.dtype, b.dtype));
    }
    if !a.dtype.is_float() {
        return Err(format!("needs float inputs, got {}", a.dtype));
    }
    Ok((a, b))
}

/// `op(x) · op(y)` reduced to `target`'s shape: summed over the batch when `target` is a
/// 2-D operand shared across a batch, a plain (batched) product otherwise.
fn product<'g>(
    x: Tensor<'g>,
    transpose_x: bool,
    y: Tensor<'g>,
    transpose_y: bool,
    target: &Shape,
) -> Result<Tensor<'g>, GraphError> {
    let (transpose_a, transpose_b) = (transpose_x, transpose_y);
    if target.rank() == 2 && x.shape().rank() > 2 && y.shape().rank() > 2 {
        x.graph().apply1(MatMulBatchSum { transpose_a, transpose_b }, &[x, y])
    } else {
        x.graph().apply1(MatMul { transpose_a, transpose_b }, &[x, y])
    }
}

/// Gradients of `y = Σ? op(a) · op(b)`: the same rule serves [`MatMul`] and
/// [`MatMulBatchSum`], which differ only in whether `dy` carries the batch.
fn grads<'g>(ctx: &GradCtx<'g>, transpose_a: bool, transpose_b: bool) -> Result<InputGrads<'g>, GraphError> {
    let (a, b, dy) = (ctx.inputs[0], ctx.inputs[1], ctx.grad()?);
    // d op(a) = dy · op(b)ᵀ and d op(b) = op(a)ᵀ · dy, transposed back where the operand
    // was read transposed.
    let da = if transpose_a {
        product(b, transpose_b, dy, true, &a.shape())?
    } else {
        product(dy, false, b, !transpose_b, &a.shape())?
    };
    let db = if transpose_b {
        product(dy, true, a, transpose_a, &b.shape())?
    } else {
        product(a, !transpose_a, dy, false, &b.shape())?
    };
    Ok(vec![Some(da), Some(db)])
}

/// Multiply-adds (×2) of the products of `op(a)` and `op(b)`, one per batch element.
fn product_flops(inputs: &[TensorMeta], transpose_a: bool, transpose_b: bool) -> f64 {
    match inputs {
        [a, b] => layout(&a.shape, transpose_a, &b.shape, transpose_b).map_or(0.0, |l| {
            2.0 * l.batch.iter().map(|&d| d as f64).product::<f64>() * l.m as f64 * l.n as f64 * l.k as f64
        }),
        _ => 0.0,
    }
}

impl OpDef for MatMul {
    fn flops(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> f64 {
        product_flops(inputs, self.transpose_a, self.transpose_b)
    }

    fn name(&self) -> &'static str {
        "matmul"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let (a, b) = check_float_pair(inputs)?;
        let layout = layout(&a.shape, self.transpose_a, &b.shape, self.transpose_b)?;
        let mut dims = layout.batch;
        dims.extend([layout.m, layout.n]);
        Ok(vec![TensorMeta::new(Shape::new(dims), a.dtype)])
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        grads(ctx, self.transpose_a, self.transpose_b)
    }

    /// Splits of `m`, `n` (the other operand whole) and the batch (a shared 2-D operand
    /// whole) split the product; a `k` split on both operands or summands on one side give
    /// summands.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let Some(dims) = ProductDims::new(inputs, self.transpose_a, self.transpose_b) else { return Vec::new() };
        let mut signatures = dims.common(Sbp::Split(dims.batch), Sbp::Split(dims.batch + 1));
        signatures.extend((0..dims.batch).map(|d| SbpSignature::new(dims.batch_split(d), [Sbp::Split(d)])));
        signatures
    }

    /// A product: bf16 (or f16) under mixed precision.
    fn autocast(&self) -> super::Autocast {
        super::Autocast::Low
    }
}

impl OpDef for MatMulBatchSum {
    fn flops(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> f64 {
        product_flops(inputs, self.transpose_a, self.transpose_b)
    }

    fn name(&self) -> &'static str {
        "matmul_batch_sum"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let (a, b) = check_float_pair(inputs)?;
        let layout = layout(&a.shape, self.transpose_a, &b.shape, self.transpose_b)?;
        if !layout.both_batched {
            return Err(format!(
                "both operands must be batched, got {} x {}",
                describe(&a.shape, self.transpose_a),
                describe(&b.shape, self.transpose_b)
            ));
        }
        Ok(vec![TensorMeta::new([layout.m, layout.n], a.dtype)])
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        grads(ctx, self.transpose_a, self.transpose_b)
    }

    /// As [`MatMul`], except that the batch is summed: a batch split on both operands
    /// gives summands.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let Some(dims) = ProductDims::new(inputs, self.transpose_a, self.transpose_b) else { return Vec::new() };
        if !(dims.a_batched && dims.b_batched) {
            return Vec::new();
        }
        let mut signatures = dims.common(Sbp::Split(0), Sbp::Split(1));
        signatures.extend((0..dims.batch).map(|d| SbpSignature::new(dims.batch_split(d), [Sbp::Partial])));
        signatures
    }

    /// A product: bf16 (or f16) under mixed precision.
    fn autocast(&self) -> super::Autocast {
        super::Autocast::Low
    }
}

impl<'g> Tensor<'g> {
    /// Matrix product `self · rhs`: `[m, k] x [k, n] -> [m, n]`, batched over leading
    /// dimensions (`[..., m, k] x [..., k, n]`, equal batches), or with a 2-D `rhs` (or
    /// `self`) shared across the other operand's batch.
    pub fn matmul(&self, rhs: &Tensor<'g>) -> Result<Tensor<'g>, GraphError> {
        self.matmul_transposed(rhs, false, false)
    }

    /// `op(self) · op(rhs)`, where `op` transposes the last two axes of an operand whose
    /// flag is set (read with swapped strides, not copied).
    pub fn matmul_transposed(
        &self,
        rhs: &Tensor<'g>,
        transpose_a: bool,
        transpose_b: bool,
    ) -> Result<Tensor<'g>, GraphError> {
        self.graph().apply1(MatMul { transpose_a, transpose_b }, &[*self, *rhs])
    }
}
