//! `matmul`: matrix and batched matrix products on the `gemm` crate, with transposes
//! expressed as strides so that gradients read operands transposed instead of copying them.

use super::{GradCtx, InputGrads, OpDef};
use crate::sbp::{Sbp, SbpSignature};
use crate::tensor::{HostTensor, HostTensorMut, Real, Shape, TensorMeta};
use crate::{DType, GraphError, Tensor};

/// `op(a) · op(b)`, where `op` transposes the last two axes of an operand whose flag is set.
///
/// Operands are matrices `[m, k]` or batches of them `[..., m, k]`. Batch dimensions must be
/// equal, or one operand is 2-D and shared across the other's batch (a weight).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MatMul {
    /// Read `a` as its transpose.
    pub transpose_a: bool,
    /// Read `b` as its transpose.
    pub transpose_b: bool,
}

/// `Σ_i op(a_i) · op(b_i)` over a batch: both operands batched with equal batch dimensions,
/// one 2-D result. It is the gradient of a [`MatMul`] with respect to an operand shared
/// across the batch, computed without materializing one product per batch element.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MatMulBatchSum {
    /// Read `a` as its transpose.
    pub transpose_a: bool,
    /// Read `b` as its transpose.
    pub transpose_b: bool,
}

/// How two operands line up: sizes, batch, and the strides of `op(a)` and `op(b)`.
#[derive(Debug)]
struct Layout {
    /// Batch dimensions of the result (empty for a plain matrix product).
    batch: Vec<usize>,
    /// Whether both operands carry the batch (rather than one being shared).
    both_batched: bool,
    m: usize,
    k: usize,
    n: usize,
    /// Elements between consecutive batch elements of `a` (0: shared).
    a_step: usize,
    b_step: usize,
    /// Row and column strides of `op(a)` (`m x k`) and `op(b)` (`k x n`).
    a_strides: (isize, isize),
    b_strides: (isize, isize),
}

fn describe(shape: &Shape, transposed: bool) -> String {
    if transposed {
        format!("{shape}ᵀ")
    } else {
        shape.to_string()
    }
}

/// Rows, columns and (row, column) strides of `op(x)` for a row-major `x`.
fn matrix(shape: &Shape, transposed: bool) -> (usize, usize, (isize, isize)) {
    let dims = shape.dims();
    let (rows, cols) = (dims[dims.len() - 2], dims[dims.len() - 1]);
    if transposed {
        (cols, rows, (1, cols as isize))
    } else {
        (rows, cols, (cols as isize, 1))
    }
}

fn layout(a: &Shape, transpose_a: bool, b: &Shape, transpose_b: bool) -> Result<Layout, String> {
    let pair = || format!("{} x {}", describe(a, transpose_a), describe(b, transpose_b));
    if a.rank() < 2 || b.rank() < 2 {
        return Err(format!("operands must have rank >= 2, got {}", pair()));
    }
    let (m, k, a_strides) = matrix(a, transpose_a);
    let (k_b, n, b_strides) = matrix(b, transpose_b);
    if k != k_b {
        return Err(format!("inner dimensions differ: {} ({k} vs {k_b})", pair()));
    }
    let batch_a = &a.dims()[..a.rank() - 2];
    let batch_b = &b.dims()[..b.rank() - 2];
    let batch = if batch_a == batch_b || batch_b.is_empty() {
        batch_a
    } else if batch_a.is_empty() {
        batch_b
    } else {
        return Err(format!(
            "batch dimensions differ: {} ({} vs {})",
            pair(),
            Shape::from(batch_a),
            Shape::from(batch_b)
        ));
    };
    Ok(Layout {
        batch: batch.to_vec(),
        both_batched: !batch_a.is_empty() && !batch_b.is_empty(),
        m,
        k,
        n,
        a_step: if batch_a.is_empty() { 0 } else { m * k },
        b_step: if batch_b.is_empty() { 0 } else { k * n },
        a_strides,
        b_strides,
    })
}

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

/// Computes the products into `out`: one per batch element, or their sum if `sum_batch`.
fn gemm_typed<T: Real>(
    layout: &Layout,
    sum_batch: bool,
    inputs: &[HostTensor<'_>],
    out: &mut HostTensorMut<'_>,
) -> Result<(), String> {
    let (a, b) = (inputs[0].as_slice::<T>()?, inputs[1].as_slice::<T>()?);
    let out = out.as_mut_slice::<T>()?;
    let Layout { m, k, n, a_step, b_step, .. } = *layout;
    let count: usize = layout.batch.iter().product();
    let out_step = if sum_batch { 0 } else { m * n };
    // The pointer arithmetic below is sound only for these lengths.
    let expected = |step: usize, size: usize| if step == 0 { size } else { count * size };
    if a.len() != expected(a_step, m * k)
        || b.len() != expected(b_step, k * n)
        || out.len() != expected(out_step, m * n)
    {
        return Err(format!(
            "operand lengths {}, {} -> {} do not fit {count} products of [{m}, {k}] x [{k}, {n}] (broken invariant)",
            a.len(),
            b.len(),
            out.len()
        ));
    }
    out.fill(T::zero());
    if m == 0 || n == 0 || k == 0 {
        return Ok(());
    }
    for i in 0..count {
        let dst = out[i * out_step..].as_mut_ptr();
        let lhs = a[i * a_step..].as_ptr();
        let rhs = b[i * b_step..].as_ptr();
        // Summing a batch accumulates into the result of the previous element.
        let read_dst = sum_batch && i > 0;
        // SAFETY: `dst` points to `m * n` writable elements (row stride `n`), `lhs` to the
        // `m * k` elements of `op(a_i)` and `rhs` to the `k * n` of `op(b_i)`; the strides
        // stay inside those ranges and the lengths were checked above. `T` is f32 or f64,
        // types `gemm` supports.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                dst,
                1,
                n as isize,
                read_dst,
                lhs,
                layout.a_strides.1,
                layout.a_strides.0,
                rhs,
                layout.b_strides.1,
                layout.b_strides.0,
                T::one(),
                T::one(),
                false,
                false,
                false,
                // Split by output tiles: every element is still one thread's sum in a
                // fixed order, so results do not depend on scheduling.
                match crate::cpu_threads() {
                    0 | 1 => gemm::Parallelism::None,
                    n => gemm::Parallelism::Rayon(n),
                },
            );
        }
    }
    Ok(())
}

fn compute_layout(
    layout: &Layout,
    sum_batch: bool,
    inputs: &[HostTensor<'_>],
    outputs: &mut [HostTensorMut<'_>],
) -> Result<(), String> {
    match outputs[0].dtype() {
        DType::F32 => gemm_typed::<f32>(layout, sum_batch, inputs, &mut outputs[0]),
        DType::F64 => gemm_typed::<f64>(layout, sum_batch, inputs, &mut outputs[0]),
        DType::I64 => Err("integer matrix products are not supported".into()),
    }
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
        [a, b] => layout(&a.shape, transpose_a, &b.shape, transpose_b)
            .map_or(0.0, |l| 2.0 * l.batch.iter().product::<usize>() as f64 * (l.m * l.n * l.k) as f64),
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

    fn compute(&self, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
        let layout = layout(inputs[0].shape, self.transpose_a, inputs[1].shape, self.transpose_b)?;
        compute_layout(&layout, false, inputs, outputs)
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

    fn compute(&self, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
        let layout = layout(inputs[0].shape, self.transpose_a, inputs[1].shape, self.transpose_b)?;
        compute_layout(&layout, true, inputs, outputs)
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
