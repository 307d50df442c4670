//! CPU kernels of `matmul` ops.

use super::gemm_backend::{blas_product, GemmBackend, Product};
use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::*;
use regflow_plan::{DType, HostTensor, HostTensorMut, Real, Shape, TensorMeta};

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
    // Where each product goes: OpenBLAS, gemm on a row-major copy of b, or gemm as it is.
    let rhs_transposed = layout.b_strides.0 == 1 && n > 1;
    let to_blas = backend == GemmBackend::Blas && prefers_blas(m, k, n, rhs_transposed, isa);
    let copy_rhs = copies_transposed_rhs(m, k, n, rhs_transposed, isa);
    // Split by output tiles: every element is still one thread's sum in a fixed order, so
    // results do not depend on scheduling. A small product stays on one thread: waking the
    // pool costs more than it saves.
    let parallel = threads > 1 && m * n * k >= PARALLEL_MIN_MULTIPLY_ADDS;
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
            // gemm on `rhs` read with (row, column) strides `b`.
            let by_gemm = |rhs: *const T, b: (isize, isize)| {
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
                    b.1,
                    b.0,
                    T::one(),
                    T::one(),
                    false,
                    false,
                    false,
                    if parallel { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None },
                )
            };
            if copy_rhs {
                with_rhs_as_stored(rhs, k, n, if parallel { threads } else { 1 }, |copy| {
                    by_gemm(copy, (n as isize, 1))
                });
            } else {
                by_gemm(rhs, layout.b_strides);
            }
        }
    }
    Ok(())
}

/// Whether gemm computes a product whose right operand is read transposed (`op(b)` with a
/// row stride of 1) from a copy of that operand as stored row-major instead, at
/// instruction-set level `isa`. gemm's AVX-512 kernels handle a transposed right operand
/// slowly: `dy · wᵀ` of 256×1024×1024 ran at 65 GFLOP/s (46 at 128 rows) against 100 for
/// the same product read as stored, while the copy of `w` (4 MB) takes a few hundred
/// microseconds. Its AVX2 kernels do not (95 GFLOP/s, 84 at 128 rows, where the copy made
/// them 8–12 % slower), so only AVX-512 copies (`bench_gemm`, `REGFLOW_CPU_ISA=avx2` for
/// the other level, on one AVX-512 host; BENCHMARKS.md, issue 13, "eleventh"). Worth it
/// only where the product is large against the copy: at least [`BLAS_MIN_SIDE`] on k and
/// n and 64 rows.
pub fn copies_transposed_rhs(m: usize, k: usize, n: usize, rhs_transposed: bool, isa: super::isa::Isa) -> bool {
    isa == super::isa::Isa::Avx512 && rhs_transposed && m >= 64 && k.min(n) >= BLAS_MIN_SIDE
}

thread_local! {
    /// The row-major copy of a transposed right operand ([`copies_transposed_rhs`]): one
    /// buffer per thread that grows to the largest operand once, so a firing allocates
    /// nothing in the steady state. f64 elements keep it aligned for f32 and f64.
    static RHS_COPY: std::cell::RefCell<Vec<f64>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `product` on a row-major `[k, n]` copy of the right operand that `rhs` holds
/// transposed (row-major `[n, k]`), in this thread's buffer, copied over `threads`.
///
/// # Safety
/// `rhs` must point to `k * n` readable elements.
unsafe fn with_rhs_as_stored<T: Real + Send + Sync>(
    rhs: *const T,
    k: usize,
    n: usize,
    threads: usize,
    product: impl FnOnce(*const T),
) {
    RHS_COPY.with(|buffer| {
        let mut buffer = buffer.borrow_mut();
        let words = (k * n * std::mem::size_of::<T>()).div_ceil(std::mem::size_of::<f64>());
        if buffer.len() < words {
            buffer.resize(words, 0.0);
        }
        let copy = buffer.as_mut_ptr().cast::<T>();
        // SAFETY: the buffer holds at least `k * n` elements of `T` (f64-aligned, so aligned
        // for f32 and f64), and the caller vouches for `rhs`.
        let (source, target) =
            unsafe { (std::slice::from_raw_parts(rhs, k * n), std::slice::from_raw_parts_mut(copy, k * n)) };
        transpose_into(source, n, k, target, threads);
        product(copy);
    });
}

/// `target` (row-major `[cols, rows]`) = the transpose of `source` (row-major `[rows,
/// cols]`), target rows shared over `threads`, in square tiles so that both sides stay in
/// cache; each tile is written a target row at a time (contiguous stores). Tiles of 8: with
/// power-of-two strides larger tiles thrash the cache's sets (a 1024 × 1024 f32 copy took
/// 0.47 ms in tiles of 8, 0.84 in 16, 2.1 in 32, on one thread).
fn transpose_into<T: Copy + Send + Sync>(source: &[T], rows: usize, cols: usize, target: &mut [T], threads: usize) {
    const TILE: usize = 8;
    assert!(source.len() >= rows * cols && target.len() >= rows * cols, "transpose operands (broken invariant)");
    // Addresses, so the shares can share them; each share writes only its own target rows.
    let (source, target) = (source.as_ptr() as usize, target.as_mut_ptr() as usize);
    let tiles = cols.div_ceil(TILE);
    super::shares::in_shares(threads, tiles, |share| {
        let (source, target) = (source as *const T, target as *mut T);
        let columns = share.start * TILE..(share.end * TILE).min(cols);
        for r0 in (0..rows).step_by(TILE) {
            let r1 = (r0 + TILE).min(rows);
            for c0 in columns.clone().step_by(TILE) {
                for c in c0..(c0 + TILE).min(columns.end) {
                    for r in r0..r1 {
                        // SAFETY: r < rows and c < cols, both slices hold rows * cols
                        // elements (asserted above), and shares write disjoint target rows c.
                        unsafe { *target.add(c * rows + r) = *source.add(r * cols + c) };
                    }
                }
            }
        }
    });
}

/// A product goes to OpenBLAS only if all three of its sizes are at least this. Skinnier
/// ones, such as a transformer head's 64 or a classifier's 10 columns, ran 34–60 % faster on
/// gemm, and squarer ones 10–62 % faster on OpenBLAS (`bench_gemm` with shapes as its third
/// argument, AVX2 Zen 3; BENCHMARKS.md, issue 13, "Per shape").
pub const BLAS_MIN_SIDE: usize = 96;

/// Whether OpenBLAS, rather than gemm, computes a product of these sizes whose right
/// operand is read transposed or not, at instruction-set level `isa`. Skinny products stay on
/// gemm ([`BLAS_MIN_SIDE`]). At AVX2 the rest go to OpenBLAS. At AVX-512, gemm's x86-v4
/// kernels ran the MLP's products that read the right operand as stored (`nn`, `tn`) 5–12 %
/// faster than OpenBLAS, at one thread and two, but those reading it transposed (`nt`, as
/// a layer's input gradient `dy · wᵀ`) 30–50 % slower (67 against 90 GFLOP/s at
/// 256×1024×1024): only those go to OpenBLAS (`bench_gemm`, BENCHMARKS.md, issue 13,
/// "eleventh").
pub fn prefers_blas(m: usize, k: usize, n: usize, rhs_transposed: bool, isa: super::isa::Isa) -> bool {
    m.min(k).min(n) >= BLAS_MIN_SIDE && (isa != super::isa::Isa::Avx512 || rhs_transposed)
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
/// about 0.2 ms of one core at AVX2 speed, against the 10–30 µs it takes to wake rayon's
/// threads on a loaded machine (a transformer's [1024, 64] x [64, 64] projections ran
/// slower on two threads than on one).
pub const PARALLEL_MIN_MULTIPLY_ADDS: usize = 1 << 24;

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

    /// gemm reading a transposed right operand directly, and from its row-major copy,
    /// gives the same bits: the copy changes where the values come from, not the sums.
    #[test]
    fn a_product_from_the_copy_of_a_transposed_operand_has_the_bits_of_the_direct_one() {
        let (m, k, n) = (100, 97, 130);
        assert!(copies_transposed_rhs(m, k, n, true, Isa::Avx512));
        assert!(!copies_transposed_rhs(m, k, n, true, Isa::Avx2), "AVX2 reads it well");
        assert!(!copies_transposed_rhs(m, k, n, false, Isa::Avx512), "b read as stored");
        assert!(!copies_transposed_rhs(63, k, n, true, Isa::Avx512), "too few rows to pay for the copy");
        let mut rng = regflow_plan::SplitMix64::new(7);
        let a: Vec<f32> = (0..m * k).map(|_| rng.next_f64() as f32 - 0.5).collect();
        let b: Vec<f32> = (0..n * k).map(|_| rng.next_f64() as f32 - 0.5).collect();
        for threads in [1, 3] {
            let (mut direct, mut copied) = (vec![0f32; m * n], vec![0f32; m * n]);
            let parallelism = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
            // a [m, k] times `rhs` read with (row, column) strides `b`, into `out` [m, n].
            let product = |out: &mut [f32], rhs: *const f32, b: (isize, isize)| {
                // SAFETY: a is [m, k] and out [m, n], row-major; `rhs` holds k * n values
                // that the strides `b` keep inside.
                unsafe {
                    gemm::gemm(
                        m,
                        n,
                        k,
                        out.as_mut_ptr(),
                        1,
                        n as isize,
                        false,
                        a.as_ptr(),
                        1,
                        k as isize,
                        rhs,
                        b.1,
                        b.0,
                        1.0,
                        1.0,
                        false,
                        false,
                        false,
                        parallelism,
                    )
                }
            };
            // b is [n, k]: read transposed directly, then from its row-major copy.
            product(&mut direct, b.as_ptr(), (1, k as isize));
            // SAFETY: b holds k * n values.
            unsafe {
                with_rhs_as_stored(b.as_ptr(), k, n, threads, |copy| product(&mut copied, copy, (n as isize, 1)))
            };
            assert_eq!(direct, copied, "{threads} threads");
        }
        // The copy itself, on odd sizes and share counts.
        for (rows, cols, threads) in [(1, 1, 1), (9, 17, 2), (33, 8, 3), (130, 97, 4)] {
            let source: Vec<u32> = (0..rows * cols).map(|i| i as u32).collect();
            let mut target = vec![0; rows * cols];
            transpose_into(&source, rows, cols, &mut target, threads);
            for r in 0..rows {
                for c in 0..cols {
                    assert_eq!(target[c * rows + r], source[r * cols + c], "{rows}x{cols}, {threads} threads");
                }
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]
        /// Any product the copy applies to, on any thread count, through the kernel's own
        /// entry (`gemm_typed`, plain and batch-summed): the bits of gemm reading b
        /// transposed directly.
        #[test]
        fn the_transposed_operands_copy_never_changes_a_bit(
            m in 64usize..160, k in 96usize..160, n in 96usize..160, threads in 1usize..4, sum in proptest::bool::ANY,
            seed in 0u64..1000,
        ) {
            // In a `blas` build OpenBLAS may take the product instead (`prefers_blas`).
            let isa = crate::cpu::isa::isa_in_use().unwrap();
            let backend = crate::cpu::gemm_backend::backend_in_use().unwrap();
            proptest::prop_assume!(backend == GemmBackend::Gemm || !prefers_blas(m, k, n, true, isa));
            let batch = if sum { 2 } else { 1 };
            let mut rng = regflow_plan::SplitMix64::new(seed);
            let a: Vec<f32> = (0..batch * m * k).map(|_| rng.next_f64() as f32 - 0.5).collect();
            let b: Vec<f32> = (0..batch * n * k).map(|_| rng.next_f64() as f32 - 0.5).collect();
            let dims = |r: usize, c: usize| if sum { Shape::from([batch, r, c]) } else { Shape::from([r, c]) };
            let (a_shape, b_shape) = (dims(m, k), dims(n, k));
            let layout = layout(&a_shape, false, &b_shape, true).unwrap();
            let a_tensor = HostTensor { shape: &a_shape, data: regflow_plan::HostSlice::F32(&a) };
            let b_tensor = HostTensor { shape: &b_shape, data: regflow_plan::HostSlice::F32(&b) };
            let mut got = vec![0f32; m * n];
            let out_shape = Shape::from([m, n]);
            let mut out_tensor = HostTensorMut { shape: &out_shape, data: regflow_plan::HostSliceMut::F32(&mut got) };
            gemm_typed::<f32>(&layout, sum, threads, &[a_tensor, b_tensor], &mut out_tensor).unwrap();
            // The same sums by gemm reading b transposed, element by element of the batch.
            let mut direct = vec![0f32; m * n];
            for i in 0..batch {
                // SAFETY: a_i is [m, k], b_i [n, k] read transposed, direct [m, n].
                unsafe {
                    gemm::gemm(
                        m, n, k, direct.as_mut_ptr(), 1, n as isize, i > 0, a[i * m * k..].as_ptr(), 1, k as isize,
                        b[i * n * k..].as_ptr(), k as isize, 1, 1.0, 1.0, false, false, false,
                        if threads > 1 && m * n * k >= PARALLEL_MIN_MULTIPLY_ADDS {
                            gemm::Parallelism::Rayon(threads)
                        } else {
                            gemm::Parallelism::None
                        },
                    )
                };
            }
            proptest::prop_assert_eq!(got, direct);
        }
    }

    #[test]
    fn at_avx512_only_products_reading_the_right_operand_transposed_go_to_openblas() {
        // The MLP's forward product, its input gradient (`dy · wᵀ`) and weight gradient.
        let (forward, input_grad, weight_grad) =
            ((256, 1024, 1024, false), (256, 1024, 1024, true), (1024, 256, 1024, false));
        for (m, k, n, t) in [forward, weight_grad] {
            assert!(!prefers_blas(m, k, n, t, Isa::Avx512));
            assert!(prefers_blas(m, k, n, t, Isa::Avx2));
        }
        let (m, k, n, t) = input_grad;
        assert!(prefers_blas(m, k, n, t, Isa::Avx512) && prefers_blas(m, k, n, t, Isa::Avx2));
        // Skinny products stay on gemm at every level.
        for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512] {
            assert!(!prefers_blas(1024, 64, 1024, true, isa), "{isa}");
            assert!(!prefers_blas(256, 1024, 10, true, isa), "{isa}");
        }
    }
}
