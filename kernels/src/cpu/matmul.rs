//! CPU kernels of `matmul` ops.

use super::gemm_backend::{blas_product, GemmBackend, Product};
use crate::host::{HostCompute, HostContext};
use crate::io::{view, view_mut};
use crate::{Kernel, KernelError, KernelIo};
use gemm_common::packed_lhs::{with_packed_lhs, PackedLhs};
use regflow_plan::ops::*;
use regflow_plan::{DType, HostTensor, HostTensorMut, Real, Shape, TensorMeta};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub use super::balance::pin_stream_thread_share;

impl HostCompute for MatMul {
    fn compute(
        &self,
        context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        let layout = layout(inputs[0].shape, self.transpose_a, inputs[1].shape, self.transpose_b)?;
        compute_layout(&layout, false, context.threads, inputs, outputs)
    }

    fn check(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Result<(), String> {
        check_product(inputs, outputs, self.transpose_a, self.transpose_b, false)
    }
}

/// A product whose right operand `b` holds the same values for `every` consecutive pieces
/// (a weight a repeat hands to every micro-batch of a step,
/// [`KernelSpec::input_repeats`](crate::KernelSpec)): gemm packs `b` into panels once per
/// `every` firings instead of at every one (issue 13: "pack weights once per step"), and
/// its blocks' panels stay with the kernel between firings. Packing only moves values, so
/// the results are bitwise those of [`MatMul`]'s host kernel. f32 and f64 only (16-bit
/// operands are widened into scratch by the host kernel, which packs that).
#[derive(Debug)]
pub(crate) struct HeldWeightMatMul {
    op: MatMul,
    /// `a`, `b` and the output.
    metas: [TensorMeta; 3],
    /// The actor inputs of `a` and `b`.
    inputs: [usize; 2],
    every: u64,
    /// One cache of `b`'s panels per block of the product ([`HeldOperand::panels`]).
    panels: Vec<PackedLhs>,
}

impl HeldWeightMatMul {
    /// The kernel of `op` configured by `conf`, whose `b` holds for `every` pieces; `None`
    /// where it does not apply (`every` 1, 16-bit operands, a conf that is not `[a, b] ->
    /// out`): the plain host kernel serves those.
    pub(crate) fn new(op: MatMul, conf: &regflow_plan::OpConf, every: u64) -> Option<Self> {
        let ([a, b], [out], &[ia, ib]) = (conf.inputs.as_slice(), conf.outputs.as_slice(), conf.input_map.as_slice())
        else {
            return None;
        };
        let float = matches!(out.dtype, DType::F32 | DType::F64);
        (every > 1 && float).then(|| Self {
            op,
            metas: [a.clone(), b.clone(), out.clone()],
            inputs: [ia, ib],
            every,
            panels: Vec::new(),
        })
    }
}

impl Kernel for HeldWeightMatMul {
    fn held_bytes(&self) -> u64 {
        self.panels.iter().map(|p| p.bytes() as u64).sum()
    }

    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let fail = |m: String| KernelError(format!("matmul: {m}"));
        let [a_meta, b_meta, out_meta] = &self.metas;
        let a = view(a_meta, io.input(self.inputs[0])).map_err(fail)?;
        let b = view(b_meta, io.input(self.inputs[1])).map_err(fail)?;
        let mut out = view_mut(out_meta, io.output_detached(0)).map_err(fail)?;
        let layout = layout(a.shape, self.op.transpose_a, b.shape, self.op.transpose_b).map_err(fail)?;
        let held = HeldOperand { stamp: io.piece() / self.every, panels: &mut self.panels };
        let threads = io.context().threads;
        let inputs = [a, b];
        by_float!(out_meta.dtype, "integer matrix products are not supported", T => {
            gemm_typed_held::<T>(&layout, false, threads, &inputs, &mut out, Some(held))
        })
        .map_err(fail)
    }
}

impl HostCompute for MatMulBatchSum {
    fn compute(
        &self,
        context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        let layout = layout(inputs[0].shape, self.transpose_a, inputs[1].shape, self.transpose_b)?;
        compute_layout(&layout, true, context.threads, inputs, outputs)
    }

    fn check(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Result<(), String> {
        check_product(inputs, outputs, self.transpose_a, self.transpose_b, true)
    }
}

/// Whether metas fit a product (summed over the batch if `sum_batch`): two operands of
/// one dtype whose shapes line up, and the output the product's shape.
fn check_product(
    inputs: &[TensorMeta],
    outputs: &[TensorMeta],
    transpose_a: bool,
    transpose_b: bool,
    sum_batch: bool,
) -> Result<(), String> {
    let ([a, b], [out]) = (inputs, outputs) else {
        return Err(crate::cpu::not_n_to_one(2, (inputs, outputs)));
    };
    let pair = || format!("{} x {}", describe(&a.shape, transpose_a), describe(&b.shape, transpose_b));
    if a.dtype != b.dtype || a.dtype != out.dtype {
        return Err(format!("operands {} x {} give {out}: all three must have one dtype", a, b));
    }
    let layout = layout(&a.shape, transpose_a, &b.shape, transpose_b)?;
    if sum_batch && !layout.both_batched {
        return Err(format!("both operands must be batched, got {}", pair()));
    }
    let mut dims: Vec<usize> = if sum_batch { Vec::new() } else { layout.batch.into() };
    dims.extend([layout.m, layout.n]);
    let expected = Shape::new(dims);
    if out.shape != expected {
        return Err(format!("{} gives {expected}, but the output is {}", pair(), out.shape));
    }
    Ok(())
}

/// Computes the products `layout` describes with up to `threads` threads.
pub fn compute_layout(
    layout: &Layout,
    sum_batch: bool,
    threads: usize,
    inputs: &[HostTensor<'_>],
    outputs: &mut [HostTensorMut<'_>],
) -> Result<(), String> {
    by_float!(outputs[0].dtype(), "integer matrix products are not supported", T => gemm_typed::<T>(layout, sum_batch, threads, inputs, &mut outputs[0]))
}

/// How `op(a) · op(b)` lines up (the matmul shape rule, shared with the graph's `infer`),
/// or why the operands do not fit.
pub fn layout(a: &Shape, transpose_a: bool, b: &Shape, transpose_b: bool) -> Result<Layout, String> {
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
        batch: BatchDims(batch.iter().copied().collect()),
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

/// How two operands line up: sizes, batch, and the strides of `op(a)` and `op(b)`.
#[derive(Debug)]
pub struct Layout {
    /// Batch dimensions of the result (empty for a plain matrix product).
    pub batch: BatchDims,
    /// Whether both operands carry the batch (rather than one being shared).
    pub both_batched: bool,
    /// Rows of `op(a)` and of the result.
    pub m: usize,
    /// Columns of `op(a)`, rows of `op(b)`.
    pub k: usize,
    /// Columns of `op(b)` and of the result.
    pub n: usize,
    /// Elements between consecutive batch elements of `a` (0: shared).
    pub a_step: usize,
    /// Elements between consecutive batch elements of `b` (0: shared).
    pub b_step: usize,
    /// Row and column strides of `op(a)` (`m x k`) and `op(b)` (`k x n`).
    pub a_strides: (isize, isize),
    /// Row and column strides of `op(b)`.
    pub b_strides: (isize, isize),
}

/// The batch dimensions of a product, on the stack up to rank
/// [`INLINE_RANK`](crate::cpu::axes::INLINE_RANK) (so that a firing's layout allocates
/// nothing); read as a slice, extended like a `Vec` and turned into one.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BatchDims(crate::cpu::axes::AxisVec<usize>);

impl std::ops::Deref for BatchDims {
    type Target = [usize];

    fn deref(&self) -> &[usize] {
        &self.0
    }
}

impl Extend<usize> for BatchDims {
    fn extend<I: IntoIterator<Item = usize>>(&mut self, dims: I) {
        self.0.extend(dims);
    }
}

impl From<BatchDims> for Vec<usize> {
    fn from(dims: BatchDims) -> Self {
        dims.0.into_vec()
    }
}

/// `shape`, marked `ᵀ` when the operand is read transposed (for errors).
pub fn describe(shape: &Shape, transposed: bool) -> String {
    if transposed {
        format!("{shape}ᵀ")
    } else {
        shape.to_string()
    }
}

/// Computes the products into `out`: one per batch element, or their sum if `sum_batch`.
pub fn gemm_typed<T: Real>(
    layout: &Layout,
    sum_batch: bool,
    threads: usize,
    inputs: &[HostTensor<'_>],
    out: &mut HostTensorMut<'_>,
) -> Result<(), String> {
    gemm_typed_held::<T>(layout, sum_batch, threads, inputs, out, None)
}

/// What a product may keep of its right operand `b` between firings: gemm's packed panels
/// of it (one cache per block of the product a thread computes), valid while `b`'s
/// values are those of `stamp` ([`HeldWeightMatMul`]).
pub(crate) struct HeldOperand<'p> {
    /// Names `b`'s current values: equal stamps, equal values.
    pub(crate) stamp: u64,
    /// One cache per block ([`Product::in_blocks`]); grown to the thread count on first use.
    pub(crate) panels: &'p mut Vec<PackedLhs>,
}

/// [`gemm_typed`], reusing `held`'s packed panels of `b` where its stamp says they are
/// still `b`'s (gemm's own products only: OpenBLAS packs inside its calls).
pub(crate) fn gemm_typed_held<T: Real>(
    layout: &Layout,
    sum_batch: bool,
    threads: usize,
    inputs: &[HostTensor<'_>],
    out: &mut HostTensorMut<'_>,
    mut held: Option<HeldOperand<'_>>,
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
    // Applies REGFLOW_CPU_ISA before the first product (later calls: one atomic load).
    let isa = super::isa::isa_in_use()?;
    if m == 0 || n == 0 || k == 0 {
        out.fill(T::zero());
        return Ok(());
    }
    let backend = super::gemm_backend::backend_in_use()?;
    // Where each product goes: OpenBLAS or gemm.
    let to_blas = backend == GemmBackend::Blas && prefers_blas(m, k, n, isa);
    // Split by blocks of output rows or columns: every element is still one thread's sum in
    // a fixed order, so results do not depend on scheduling. A small product stays on one
    // thread: handing out its shares costs more than it saves.
    let parallel = threads > 1 && m * n * k >= PARALLEL_MIN_MULTIPLY_ADDS;
    // One `b` for every product (a weight shared across the batch), or the caches would
    // hold each product's `b` in turn.
    if layout.b_step != 0 && count > 1 {
        held = None;
    }
    // Otherwise every product overwrites its output (`read_dst` is false for the first).
    for i in 0..count {
        let dst = out[i * out_step..].as_mut_ptr();
        let lhs = a[i * a_step..].as_ptr();
        let rhs = b[i * b_step..].as_ptr();
        // Summing a batch accumulates into the result of the previous element.
        let read_dst = sum_batch && i > 0;
        let product =
            Product { m, k, n, a_strides: layout.a_strides, b_strides: layout.b_strides, ldc: n, accumulate: read_dst };
        // SAFETY: `dst` points to `m * n` writable elements (row stride `n`), `lhs` to the
        // `m * k` elements of `op(a_i)` and `rhs` to the `k * n` of `op(b_i)`; the strides
        // stay inside those ranges and the lengths were checked above. `T` is f32 or f64,
        // types `gemm` supports.
        unsafe {
            if to_blas && by_blas(product, (lhs, rhs, dst), threads, parallel) {
                continue;
            }
            gemm_product(product, (lhs, rhs, dst), if parallel { threads } else { 1 }, held.as_mut());
        }
    }
    Ok(())
}

/// Computes `product` by `gemm`, split over up to `threads` blocks of output rows or
/// columns (the longer side), each block one single-threaded `gemm` call on this thread or
/// a helper of it (`cpu/team.rs`); on two threads cut where the two threads' measured
/// speeds say they finish together ([`balance`](super::balance)). Every output element is
/// still the sum of the same terms in the same order (`gemm` blocks the depth by its length
/// alone, not by the block's rows or columns, as long as no block takes gemm's path for
/// small products unless the whole does: [`GEMM_SMALL_SIDE`]), so neither the thread count
/// nor the cut changes a result (`tests/matmul_threads.rs`).
///
/// # Safety
/// `lhs`, `rhs` and `dst` must address operands laid out as `product` says (`dst` with
/// row stride `product.ldc`, column stride 1), valid for the call, `dst` not overlapping
/// the others; `T` is f32 or f64.
///
/// With `held`, each block multiplies with its own cache of `b`'s packed panels lent
/// ([`with_packed_lhs`]): gemm computes a row-major product as its transpose, so `b` is
/// the left-hand operand it packs, except for an output one column wide (`ldc` 1), which it
/// does not transpose and which gets no cache.
unsafe fn gemm_product<T: Real>(
    product: Product,
    operands: (*const T, *const T, *mut T),
    threads: usize,
    held: Option<&mut HeldOperand<'_>>,
) {
    let (len, other) = product.split_sides();
    let blocks = gemm_blocks(threads, len, other);
    // Kept panels belong to a block's rows or columns: a cut that moved would pack them again.
    let keeps_panels = held.is_some();
    // The caches, one per block; each block touches only its own.
    let held = held.filter(|_| product.ldc > 1).map(|held| {
        if held.panels.len() < blocks.max(1) {
            held.panels.resize_with(blocks.max(1), PackedLhs::new);
        }
        (super::shares::DisjointParts::new(&mut held.panels[..]), held.stamp)
    });
    let block = |number: usize, part: Product, a: *const T, b: *const T, c: *mut T| {
        let Product { m, k, n, a_strides, b_strides, ldc, accumulate } = part;
        // SAFETY: `in_blocks` hands out the block's operands (its contract); `T` is f32 or
        // f64, types gemm supports.
        let multiply = || unsafe {
            gemm::gemm(
                m,
                n,
                k,
                c,
                1,
                ldc as isize,
                accumulate,
                a,
                a_strides.1,
                a_strides.0,
                b,
                b_strides.1,
                b_strides.0,
                T::one(),
                T::one(),
                false,
                false,
                false,
                gemm::Parallelism::None,
            )
        };
        match &held {
            Some((caches, stamp)) => {
                // SAFETY: `in_blocks` numbers the blocks `0..blocks`, one each: no other
                // block uses cache `number` during this product.
                let cache = unsafe { &mut caches.part(number..number + 1)[0] };
                with_packed_lhs(cache, *stamp, multiply)
            }
            None => multiply(),
        }
    };
    // Two threads: one cut, where the threads' recent speeds put it. Only where the side
    // not cut is wider than gemm's small path, so that a narrow block cannot take it, and
    // where no block keeps its panels between firings.
    let cut = (threads == 2 && blocks == 2 && other > GEMM_SMALL_SIDE && !keeps_panels)
        .then(|| super::balance::cut(len, super::balance::stream_thread_share()))
        .flatten();
    let Some(cut) = cut else {
        // SAFETY: forwarded to the caller.
        unsafe { product.in_blocks(operands, threads, blocks, block) };
        return;
    };
    // Each block's time and whether a helper ran it, for the next cut.
    let took = [AtomicU64::new(0), AtomicU64::new(0)];
    let by_helper = [AtomicBool::new(false), AtomicBool::new(false)];
    let timed = |number: usize, part: Product, a: *const T, b: *const T, c: *mut T| {
        let started = Instant::now();
        block(number, part, a, b, c);
        took[number].store(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        by_helper[number].store(super::team::on_helper(), Ordering::Relaxed);
    };
    let bounds = [0, cut, len];
    // SAFETY: forwarded to the caller; the bounds rise from 0 to `len`.
    unsafe { product.in_blocks_from(operands, threads, 2, &|number| bounds[number], timed) };
    // `for_each_share` returned after both blocks: their stores are visible.
    let [first, second] = by_helper.map(|flag| flag.into_inner());
    if first != second {
        let time = |number: usize| Duration::from_nanos(took[number].load(Ordering::Relaxed));
        let (mine, theirs) = if first { (1, 0) } else { (0, 1) };
        let size = |number: usize| bounds[number + 1] - bounds[number];
        super::balance::learn(size(mine), time(mine), size(theirs), time(theirs));
    }
}

/// gemm computes a product whose output is at most this many rows and columns (in its
/// column-major view) by another path, which blocks the depth by `min(k, 512)` rather than
/// as its general path does: a block of a split product must not take it unless the whole
/// product does, or its elements would sum the same terms in other groups than on one
/// thread (a 100×784×50 product changed 4 474 of its 5 000 elements' last bits on two
/// threads before [`gemm_blocks`] kept its blocks out of that path).
pub const GEMM_SMALL_SIDE: usize = gemm_common::gemm::SMALL_PRODUCT_SIDE;

/// gemm computes a product of at most this many output elements, where its operands' rows
/// (or columns) lie along the depth, as dot products (its "horizontal" kernels, summing the
/// depth in blocks of 1 024 and then across a vector's lanes): a block must not take that
/// path unless the whole product does (a 1×4096×1024 product cut in four blocks of 256
/// changed 905 of its 1 024 elements' last bits before [`gemm_blocks`] kept them out).
pub const GEMM_HORIZONTAL_MAX_ELEMENTS: usize = gemm_common::gemm::HORIZONTAL_MAX_ELEMENTS;

/// How many blocks gemm's products of a side `len` long (the side cut) and another `other`
/// long are cut into on `threads` threads: one per thread, but never so many that a block
/// takes another of gemm's paths than the whole product (the dot products of
/// [`GEMM_HORIZONTAL_MAX_ELEMENTS`], the small products of [`GEMM_SMALL_SIDE`]), which
/// would sum its elements' terms in other groups than one thread does.
pub fn gemm_blocks(threads: usize, len: usize, other: usize) -> usize {
    let mut least = 1;
    if len.saturating_mul(other) > GEMM_HORIZONTAL_MAX_ELEMENTS {
        least = least.max(GEMM_HORIZONTAL_MAX_ELEMENTS / other.max(1) + 1);
    }
    if other <= GEMM_SMALL_SIDE && len > GEMM_SMALL_SIDE {
        least = least.max(GEMM_SMALL_SIDE + 1);
    }
    threads.min(len / least).max(1)
}

/// Turns the software prefetch of gemm's microkernel on (the default) or off, process-wide,
/// from the next product on. The vendored gemm-common's AVX2 kernels ask for the output
/// tile's cache lines before their loop over `k` and for the packed operands' lines a few
/// steps ahead (vendor/gemm-common/REGFLOW.md, section 5); off, they are upstream's. A
/// prefetch moves no value, so results are the same bits either way: this is for
/// benchmarks that time the difference (`bench_gemm` with `REGFLOW_BENCH_PREFETCH=ab`) and
/// for tests. It does not reach OpenBLAS.
pub fn set_microkernel_prefetch(on: bool) {
    gemm_common::microkernel::set_prefetch(on);
}

/// A product goes to OpenBLAS only if all three of its sizes are at least this. Skinnier
/// ones, such as a transformer head's 64 or a classifier's 10 columns, ran 34–60 % faster on
/// gemm, and squarer ones 10–62 % faster on OpenBLAS (`bench_gemm` with shapes as its third
/// argument, AVX2 Zen 3; BENCHMARKS.md, issue 13, "Per shape").
pub const BLAS_MIN_SIDE: usize = 96;

/// Whether OpenBLAS, rather than gemm, computes a product of these sizes at
/// instruction-set level `isa`. Skinny products stay on gemm ([`BLAS_MIN_SIDE`]); below
/// AVX-512 the rest go to OpenBLAS. At AVX-512 none do: gemm's x86-v4 kernels ran the MLP's
/// products 5–12 % faster than OpenBLAS where they read the right operand as stored
/// (`nn`, `tn`), and, since the patched gemm-common packs an operand read transposed in
/// blocks (vendor/gemm-common/REGFLOW.md, 3), 4–11 % faster where they read it transposed
/// (`nt`, a layer's input gradient `dy · wᵀ`: 103 against 93 GFLOP/s at 256×1024×1024 on
/// one thread; `bench_gemm`, BENCHMARKS.md, issue 13, "twelfth").
pub fn prefers_blas(m: usize, k: usize, n: usize, isa: super::isa::Isa) -> bool {
    m.min(k).min(n) >= BLAS_MIN_SIDE && isa != super::isa::Isa::Avx512
}

/// Computes `product` by OpenBLAS if `T` and the strides fit; false (nothing done)
/// otherwise. Whether OpenBLAS should is [`prefers_blas`]'s to say.
///
/// # Safety
/// As [`blas_product`]'s.
unsafe fn by_blas<T: Real>(
    product: Product,
    (a, b, c): (*const T, *const T, *mut T),
    threads: usize,
    split: bool,
) -> bool {
    // SAFETY: `T` is the type its dtype names, so the casts change nothing; the rest is the
    // caller's promise.
    unsafe {
        match T::DTYPE {
            DType::F32 => blas_product(product, a.cast::<f32>(), b.cast::<f32>(), c.cast::<f32>(), threads, split),
            DType::F64 => blas_product(product, a.cast::<f64>(), b.cast::<f64>(), c.cast::<f64>(), threads, split),
            _ => false,
        }
    }
}

/// Products of fewer multiply-adds than this run on one thread whatever `threads` says:
/// about 20 µs of one AVX-512 core. Above it a product's blocks go to the stream thread
/// and its spinning helpers (`cpu/team.rs`) for a few microseconds of hand-out: a
/// transformer's `[1024, 64] x [64, 64]` projection (2^22) ran at 112 GFLOP/s on one thread
/// and 220 on two (`bench_gemm 9 2 1024x64x64`; BENCHMARKS.md, issue 13, fourteenth). Under
/// rayon, which woke its pool for every product, the threshold was 2^24 and such products
/// ran slower on two threads than on one.
pub const PARALLEL_MIN_MULTIPLY_ADDS: usize = 1 << 21;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::isa::Isa;

    #[test]
    fn gemm_blocks_keep_out_of_the_small_product_path_unless_the_whole_takes_it() {
        // Wide on both sides: one block per thread.
        assert_eq!(gemm_blocks(2, 1024, 256), 2);
        assert_eq!(gemm_blocks(3, 1024, 65), 3);
        assert_eq!(gemm_blocks(4, 3, 3), 3);
        // 64 or fewer on the other side: blocks of more than 64, or none.
        assert_eq!(gemm_blocks(2, 100, 50), 1);
        assert_eq!(gemm_blocks(2, 130, 64), 2);
        assert_eq!(gemm_blocks(3, 130, 64), 2);
        assert_eq!(gemm_blocks(8, 1000, 10), 8);
        // Small on both sides: the whole takes the small path too.
        assert_eq!(gemm_blocks(2, 64, 64), 2);
        assert_eq!(gemm_blocks(1, 1024, 10), 1);
        // Blocks of more than 256 elements where the whole has more.
        assert_eq!(gemm_blocks(4, 1024, 1), 3);
        assert_eq!(gemm_blocks(2, 1024, 1), 2);
        assert_eq!(gemm_blocks(2, 64, 5), 1);
        assert_eq!(gemm_blocks(4, 16, 16), 4);
    }

    /// How a test's operands of element type `T` are seen as tensors.
    type Views<T> =
        (for<'x> fn(&'x [T]) -> regflow_plan::HostSlice<'x>, for<'x> fn(&'x mut [T]) -> regflow_plan::HostSliceMut<'x>);

    const F32: Views<f32> = (|x| regflow_plan::HostSlice::F32(x), |x| regflow_plan::HostSliceMut::F32(x));
    const F64: Views<f64> = (|x| regflow_plan::HostSlice::F64(x), |x| regflow_plan::HostSliceMut::F64(x));

    /// `op(a) · op(b)` through the kernel's entry (`gemm_typed`), `batch` products summed
    /// when `batch` is 2.
    fn product<T: Real>(
        (a, ta): (&[T], bool),
        (b, tb): (&[T], bool),
        (m, k, n): (usize, usize, usize),
        (batch, threads): (usize, usize),
        (view, view_mut): Views<T>,
    ) -> Vec<T> {
        let dims = |r: usize, c: usize, t: bool| {
            let (r, c) = if t { (c, r) } else { (r, c) };
            if batch > 1 {
                Shape::from([batch, r, c])
            } else {
                Shape::from([r, c])
            }
        };
        let (a_shape, b_shape) = (dims(m, k, ta), dims(k, n, tb));
        let layout = layout(&a_shape, ta, &b_shape, tb).unwrap();
        let a_tensor = HostTensor { shape: &a_shape, data: view(a) };
        let b_tensor = HostTensor { shape: &b_shape, data: view(b) };
        let mut out = vec![T::zero(); m * n];
        let out_shape = Shape::from([m, n]);
        let mut out_tensor = HostTensorMut { shape: &out_shape, data: view_mut(&mut out) };
        gemm_typed::<T>(&layout, batch > 1, threads, &[a_tensor, b_tensor], &mut out_tensor).unwrap();
        out
    }

    /// f64 operands read transposed (packed in blocks through 4 × 4 tiles where the CPU has
    /// AVX, else from rows 1 KiB apart) give the bits of upstream's packing: a few sizes
    /// around the panel widths and tiles, both operands transposed, plain and
    /// batch-summed, on two threads.
    #[test]
    fn blocked_packing_of_f64_operands_gives_the_bits_of_upstreams_packing() {
        let mut rng = regflow_plan::SplitMix64::new(11);
        for (m, k, n) in [(7, 128, 9), (24, 200, 25), (49, 131, 97), (130, 256, 3), (13, 6, 31), (64, 37, 65)] {
            for batch in [1, 2] {
                let a: Vec<f64> = (0..batch * m * k).map(|_| rng.next_f64() - 0.5).collect();
                let b: Vec<f64> = (0..batch * k * n).map(|_| rng.next_f64() - 0.5).collect();
                let run = || product((&a, true), (&b, true), (m, k, n), (batch, 2), F64);
                gemm_common::pack_operands::set_blocked_packing(false);
                let upstream = run();
                gemm_common::pack_operands::set_blocked_packing(true);
                assert_eq!(run(), upstream, "{m}x{k}x{n}, batch {batch}");
            }
        }
    }

    /// Products with the microkernel's prefetch off (upstream's kernel) and on give the same
    /// bits: f32 and f64, sizes around the AVX2 and AVX-512 tiles (a partial tile's output
    /// columns and rows included), operands read as stored and transposed, on one and two
    /// threads. A prefetch moves no value; this holds the patch to that (and runs it over
    /// addresses past an operand's end, which a prefetch must not fault on).
    #[test]
    fn the_microkernels_prefetch_changes_no_bit() {
        let mut rng = regflow_plan::SplitMix64::new(5);
        for (m, k, n) in [(1, 1, 1), (7, 33, 5), (16, 512, 6), (17, 513, 7), (48, 100, 13), (130, 700, 97)] {
            for (ta, tb) in [(false, false), (true, false), (false, true)] {
                for threads in [1, 2] {
                    let a: Vec<f32> = (0..m * k).map(|_| rng.next_f64() as f32 - 0.5).collect();
                    let b: Vec<f32> = (0..k * n).map(|_| rng.next_f64() as f32 - 0.5).collect();
                    let a64: Vec<f64> = a.iter().map(|&x| f64::from(x)).collect();
                    let b64: Vec<f64> = b.iter().map(|&x| f64::from(x)).collect();
                    // Process-wide, but harmless to products of other tests: it changes no result.
                    set_microkernel_prefetch(false);
                    let upstream = product((&a, ta), (&b, tb), (m, k, n), (1, threads), F32);
                    let upstream64 = product((&a64, ta), (&b64, tb), (m, k, n), (1, threads), F64);
                    set_microkernel_prefetch(true);
                    let what = format!("{m}x{k}x{n}, transposed {ta}/{tb}, {threads} thread(s)");
                    assert_eq!(product((&a, ta), (&b, tb), (m, k, n), (1, threads), F32), upstream, "f32 {what}");
                    assert_eq!(product((&a64, ta), (&b64, tb), (m, k, n), (1, threads), F64), upstream64, "f64 {what}");
                }
            }
        }
    }

    /// Whether gemm multiplies `m x k x n` with the backend in use: OpenBLAS packs its own
    /// way (`prefers_blas`), so only there is gemm's packing at stake.
    fn gemm_packs(m: usize, k: usize, n: usize) -> bool {
        let isa = crate::cpu::isa::isa_in_use().unwrap();
        crate::cpu::gemm_backend::backend_in_use().unwrap() == GemmBackend::Gemm || !prefers_blas(m, k, n, isa)
    }

    /// `batch` products' operands `a` and `b` of `m x k x n`, uniform in [-0.5, 0.5).
    fn random_operands((m, k, n): (usize, usize, usize), batch: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
        let mut rng = regflow_plan::SplitMix64::new(seed);
        let a = (0..batch * m * k).map(|_| rng.next_f64() as f32 - 0.5).collect();
        let b = (0..batch * k * n).map(|_| rng.next_f64() as f32 - 0.5).collect();
        (a, b)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(32))]
        /// Products of operands read transposed, which the patched gemm-common packs by
        /// blocks, through SIMD tiles where it has them (vendor/gemm-common/REGFLOW.md, 3),
        /// of any panel width and depth (rows close together and 1 KiB or more apart), on
        /// any thread count, through the kernel's entry (plain and batch-summed): the bits of
        /// upstream's packing. Packing only moves values, so a misplaced element of a packed
        /// panel would show.
        #[test]
        fn blocked_packing_gives_the_bits_of_upstreams_packing(
            m in 1usize..300, k in 1usize..330, n in 1usize..300, ta in proptest::bool::ANY,
            tb in proptest::bool::ANY, threads in 1usize..4, sum in proptest::bool::ANY, seed in 0u64..1000,
        ) {
            proptest::prop_assume!(gemm_packs(m, k, n));
            let batch = if sum { 2 } else { 1 };
            let (a, b) = random_operands((m, k, n), batch, seed);
            // Process-wide, but harmless to products of other tests: it changes no result.
            gemm_common::pack_operands::set_blocked_packing(false);
            let upstream = product((&a, ta), (&b, tb), (m, k, n), (batch, threads), F32);
            gemm_common::pack_operands::set_blocked_packing(true);
            let blocked = product((&a, ta), (&b, tb), (m, k, n), (batch, threads), F32);
            proptest::prop_assert_eq!(blocked, upstream);
        }

        /// Products whose packed operand lies along its panels' rows (`b` as stored: gemm
        /// packs `bᵀ`'s panels from `b`'s rows), which the patched gemm-common packs a whole
        /// row chunk at a time, row by row (vendor/gemm-common/REGFLOW.md, 8): the bits of
        /// packing panel by panel, over sizes across the panel width, the row chunks and the
        /// depth blocks, f32 and f64, plain and batch-summed, on any thread count. Packing
        /// only moves values, so a misplaced element of a packed panel would show.
        #[test]
        fn row_packing_gives_the_bits_of_packing_panel_by_panel(
            m in 1usize..300, k in 1usize..1100, n in 1usize..300, ta in proptest::bool::ANY,
            threads in 1usize..4, sum in proptest::bool::ANY, seed in 0u64..1000,
        ) {
            proptest::prop_assume!(gemm_packs(m, k, n));
            let batch = if sum { 2 } else { 1 };
            let (a, b) = random_operands((m, k, n), batch, seed);
            let a64: Vec<f64> = a.iter().map(|&x| f64::from(x)).collect();
            let b64: Vec<f64> = b.iter().map(|&x| f64::from(x)).collect();
            // Process-wide, but harmless to products of other tests: it changes no result.
            gemm_common::pack_operands::set_row_packing(false);
            let by_panels = product((&a, ta), (&b, false), (m, k, n), (batch, threads), F32);
            let by_panels64 = product((&a64, ta), (&b64, false), (m, k, n), (batch, threads), F64);
            gemm_common::pack_operands::set_row_packing(true);
            let by_rows = product((&a, ta), (&b, false), (m, k, n), (batch, threads), F32);
            let by_rows64 = product((&a64, ta), (&b64, false), (m, k, n), (batch, threads), F64);
            proptest::prop_assert_eq!(by_rows, by_panels);
            proptest::prop_assert_eq!(by_rows64, by_panels64);
        }
    }

    #[test]
    fn openblas_takes_the_squarer_products_below_avx512_only() {
        // The MLP's forward product and input gradient (`dy · wᵀ`, the same sizes), and its
        // weight gradient.
        for (m, k, n) in [(256, 1024, 1024), (1024, 256, 1024)] {
            assert!(!prefers_blas(m, k, n, Isa::Avx512));
            assert!(prefers_blas(m, k, n, Isa::Avx2) && prefers_blas(m, k, n, Isa::Scalar));
        }
        // Skinny products stay on gemm at every level.
        for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512] {
            assert!(!prefers_blas(1024, 64, 1024, isa), "{isa}");
            assert!(!prefers_blas(256, 1024, 10, isa), "{isa}");
        }
    }
}
