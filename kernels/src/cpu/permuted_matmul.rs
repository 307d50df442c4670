//! CPU kernel of `permuted_matmul`: a batched product reading its operands and writing its
//! result through axis orders, as strides handed to `gemm` (no copy of a permuted operand).
//! Kept apart from `matmul.rs` so that the two products change independently.

use crate::cpu::axes::{self, AxisVec};
use crate::cpu::shares::Operands;
use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::PermutedMatMul;
use regflow_plan::{HostTensor, HostTensorMut, Real, Shape, TensorMeta};

/// How a permuted product lines up: sizes and, per logical axis, each tensor's strides.
#[derive(Debug)]
pub struct PermutedLayout {
    /// Logical batch dimensions.
    pub batch: AxisVec<usize>,
    /// Rows of the logical `a` and of the product.
    pub m: usize,
    /// Columns of the logical `a`, rows of the logical `b`.
    pub k: usize,
    /// Columns of the logical `b` and of the product.
    pub n: usize,
    /// Strides of the logical `a`, per logical axis, in elements.
    pub a_strides: AxisVec<usize>,
    /// Strides of the logical `b`.
    pub b_strides: AxisVec<usize>,
    /// Strides of the logical product in the stored output.
    pub out_strides: AxisVec<usize>,
    /// The stored output's dimensions.
    pub out_dims: AxisVec<usize>,
}

/// Whether `axes` is a permutation of `0..rank`, or why not.
fn check_axes(name: &str, axes: &[usize], rank: usize) -> Result<(), String> {
    let mut seen: AxisVec<bool> = smallvec::smallvec![false; rank];
    let valid = axes.len() == rank && axes.iter().all(|&a| a < rank && !std::mem::replace(&mut seen[a], true));
    if valid {
        Ok(())
    } else {
        Err(format!("{name} {axes:?} is not an order of the {rank} axes of its tensor"))
    }
}

/// The layout of `op` on operands of shapes `a` and `b` (shared with the graph's shape
/// rule), or why they do not fit.
pub fn permuted_layout(op: &PermutedMatMul, a: &Shape, b: &Shape) -> Result<PermutedLayout, String> {
    let rank = a.rank();
    if rank < 2 || b.rank() != rank {
        return Err(format!("operands must have one rank >= 2, got {a} and {b}"));
    }
    check_axes("a_axes", &op.a_axes, rank)?;
    check_axes("b_axes", &op.b_axes, rank)?;
    check_axes("out_axes", &op.out_axes, rank)?;
    let (a_stored, b_stored) = (axes::strides(a.dims()), axes::strides(b.dims()));
    let a_dims: AxisVec<usize> = op.a_axes.iter().map(|&i| a.dims()[i]).collect();
    let b_dims: AxisVec<usize> = op.b_axes.iter().map(|&i| b.dims()[i]).collect();
    let describe = || format!("{a} read as {:?} x {b} read as {:?}", a_dims.as_slice(), b_dims.as_slice());
    if a_dims[..rank - 2] != b_dims[..rank - 2] {
        return Err(format!("batch dimensions differ: {}", describe()));
    }
    let (m, k, k_b, n) = (a_dims[rank - 2], a_dims[rank - 1], b_dims[rank - 2], b_dims[rank - 1]);
    if k != k_b {
        return Err(format!("inner dimensions differ: {} ({k} vs {k_b})", describe()));
    }
    let mut logical: AxisVec<usize> = a_dims[..rank - 2].iter().copied().collect();
    logical.extend([m, n]);
    let out_dims: AxisVec<usize> = op.out_axes.iter().map(|&i| logical[i]).collect();
    let out_stored = axes::strides(&out_dims);
    let mut out_strides: AxisVec<usize> = smallvec::smallvec![0; rank];
    for (j, &i) in op.out_axes.iter().enumerate() {
        out_strides[i] = out_stored[j];
    }
    Ok(PermutedLayout {
        batch: logical[..rank - 2].iter().copied().collect(),
        m,
        k,
        n,
        a_strides: op.a_axes.iter().map(|&i| a_stored[i]).collect(),
        b_strides: op.b_axes.iter().map(|&i| b_stored[i]).collect(),
        out_strides,
        out_dims,
    })
}

impl HostCompute for PermutedMatMul {
    fn compute(
        &self,
        context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        let layout = permuted_layout(self, inputs[0].shape, inputs[1].shape)?;
        by_float!(outputs[0].dtype(), "integer matrix products are not supported", T => permuted_gemm::<T>(&layout, context.threads, inputs, &mut outputs[0]))
    }

    fn check(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Result<(), String> {
        let ([a, b], [out]) = (inputs, outputs) else {
            return Err(crate::cpu::not_n_to_one(2, (inputs, outputs)));
        };
        if a.dtype != b.dtype || a.dtype != out.dtype {
            return Err(format!("operands {a} x {b} give {out}: all three must have one dtype"));
        }
        let layout = permuted_layout(self, &a.shape, &b.shape)?;
        if out.shape.dims() != layout.out_dims.as_slice() {
            return Err(format!("the product is {:?}, but the output is {}", layout.out_dims.as_slice(), out.shape));
        }
        Ok(())
    }
}

/// Computes every product of the batch into `out`, each one `gemm` call on strided views;
/// with `threads > 1` the batch is shared among the threads.
fn permuted_gemm<T: Real>(
    layout: &PermutedLayout,
    threads: usize,
    inputs: &[HostTensor<'_>],
    out: &mut HostTensorMut<'_>,
) -> Result<(), String> {
    let (a, b) = (inputs[0].as_slice::<T>()?, inputs[1].as_slice::<T>()?);
    let out = out.as_mut_slice::<T>()?;
    // Applies REGFLOW_CPU_ISA before the first product (later calls: one atomic load).
    super::isa::from_environment()?;
    let PermutedLayout { m, k, n, .. } = *layout;
    let count: usize = layout.batch.iter().product();
    // The pointer arithmetic below is sound only for these lengths.
    if a.len() != count * m * k || b.len() != count * k * n || out.len() != count * m * n {
        return Err(format!(
            "operand lengths {}, {} -> {} do not fit {count} products of [{m}, {k}] x [{k}, {n}] (broken invariant)",
            a.len(),
            b.len(),
            out.len()
        ));
    }
    // An empty batch (a part of no elements) has nothing to compute.
    if m == 0 || n == 0 || k == 0 || count == 0 {
        out.fill(T::zero());
        return Ok(());
    }
    let operands = Operands { a: a.as_ptr(), b: b.as_ptr(), out: out.as_mut_ptr() };
    // Many small products (attention's, one per sequence and head): each thread takes a
    // share of the batch, one single-threaded product at a time, instead of every product
    // being split over the threads.
    super::shares::in_shares(threads, count, |batch| {
        // SAFETY: the lengths were checked above against the layout; the shares write the
        // outputs of disjoint batch elements.
        unsafe { gemm_batch::<T>(layout, batch, operands) }
    });
    Ok(())
}

/// Computes the products of the batch elements `batch` (flat indices over the logical
/// batch axes) one single-threaded `gemm` call each.
///
/// # Safety
/// `operands` must address whole tensors of the lengths `layout` implies (checked by the
/// caller), and no other thread may write the outputs of `batch` meanwhile.
unsafe fn gemm_batch<T: Real>(layout: &PermutedLayout, batch: std::ops::Range<usize>, operands: Operands<T>) {
    let PermutedLayout { m, k, n, .. } = *layout;
    let axes = layout.batch.len();
    let stride = |strides: &AxisVec<usize>, axis: usize| strides[axis] as isize;
    // The odometer's start: the first element's index and offsets.
    let mut index: AxisVec<usize> = smallvec::smallvec![0; axes];
    let (mut a_offset, mut b_offset, mut out_offset) = (0usize, 0usize, 0usize);
    let mut rest = batch.start;
    for d in (0..axes).rev() {
        index[d] = rest % layout.batch[d];
        rest /= layout.batch[d];
        a_offset += index[d] * layout.a_strides[d];
        b_offset += index[d] * layout.b_strides[d];
        out_offset += index[d] * layout.out_strides[d];
    }
    for _ in batch {
        // SAFETY: the offsets and strides address, for this batch element, the `m x k`,
        // `k x n` and `m x n` elements of permutations of whole tensors whose lengths the
        // caller checked, so every read and write stays inside them; the output elements
        // of distinct batch elements are distinct (a permutation is a bijection). `T` is
        // f32 or f64, types `gemm` supports.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                operands.out.add(out_offset),
                stride(&layout.out_strides, axes + 1),
                stride(&layout.out_strides, axes),
                false,
                operands.a.add(a_offset),
                stride(&layout.a_strides, axes + 1),
                stride(&layout.a_strides, axes),
                operands.b.add(b_offset),
                stride(&layout.b_strides, axes + 1),
                stride(&layout.b_strides, axes),
                T::one(),
                T::one(),
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
        // The next batch element: an odometer over the logical batch axes.
        for d in (0..axes).rev() {
            index[d] += 1;
            a_offset += layout.a_strides[d];
            b_offset += layout.b_strides[d];
            out_offset += layout.out_strides[d];
            if index[d] < layout.batch[d] {
                break;
            }
            a_offset -= layout.a_strides[d] * layout.batch[d];
            b_offset -= layout.b_strides[d] * layout.batch[d];
            out_offset -= layout.out_strides[d] * layout.batch[d];
            index[d] = 0;
        }
    }
}
