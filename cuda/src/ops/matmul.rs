//! `matmul`, `matmul_batch_sum` and `permuted_matmul` on CUDA: cuBLAS strided-batched
//! GEMMs (f32 and f64), transposes and axis orders expressed as cuBLAS's op flags, leading
//! dimensions and batch strides, never as copies (see [`crate::blas`] for the row-major to
//! column-major mapping). Every call's arguments are worked out when the actor is made;
//! a firing only queues them.
//!
//! **Aligned staging.** cuBLAS's fast tensor-core kernels for 16-bit operands want every
//! leading dimension a multiple of 8 elements (16 bytes), and the dimensions too. GPT-2's
//! vocabulary of 50257 breaks both in the logits' three products: `[tokens, 50257]` logits
//! and their gradient have an odd leading dimension, and 50257 is `m`, `k` or `n` of the
//! product. cuBLAS then picks kernels at 96–148 TFLOP/s where the model's other products
//! reach 500 (H100, `bench_cuda_gemm`). Such a product runs in bands of the unaligned
//! matrix's stored rows, through scratch its stream lends (at most 64 MiB, [`Staging`]) with
//! a padded leading dimension: each band is copied in (an operand) or out (the output) by a
//! device copy kernel, and cuBLAS sees aligned matrices whose odd dimension is cut into
//! chunks of a multiple of 8 (all but the last). A band along `m` or `n` leaves every output
//! element one sum over all of `k`; a band along `k` sums its partial products into an f32
//! accumulator, rounded to the output's dtype once at the end, as the unstaged product
//! rounds ([`staged_steps`]). A first version that cut the output into column chunks and
//! left the odd dimension whole was slower than no staging (8.8 against 6.6 ms for the
//! logits): the odd dimension, not only the leading one, sends cuBLAS to its slow kernels.

use super::{function, op_conf, queued, stream, suffix, Entry};
use crate::blas::{Blas, Gemm, MatrixLayout};
use crate::driver::{launch, Function, Grid};
use regflow_kernels::cpu::matmul::{layout, Layout};
use regflow_kernels::cpu::permuted_matmul::{permuted_layout, PermutedLayout};
use regflow_kernels::{HostCompute, HostOpKernel, Kernel, KernelError, KernelIo, KernelSpec};
use regflow_plan::ops::{MatMul, MatMulBatchSum, PermutedMatMul};
use regflow_plan::{DType, OpConf};
use std::sync::Arc;

/// f32, f64, and bf16 (cuBLAS with f32 accumulation, rounded once to bf16, as the CPU's
/// bf16 products).
const FLOAT: &[DType] = &[DType::F32, DType::F64, DType::Bf16, DType::F16];

pub(super) const ENTRIES: &[Entry] = &[
    ("matmul", FLOAT, || Arc::new(make_matmul)),
    ("matmul_batch_sum", FLOAT, || Arc::new(make_batch_sum)),
    ("permuted_matmul", FLOAT, || Arc::new(make_permuted)),
];

/// One queued cuBLAS call: its arguments, where its operands start (bytes from the
/// registers' bases) and its `beta` (1 accumulates into the output).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Call {
    pub(crate) gemm: Gemm,
    pub(crate) offsets: (u64, u64, u64),
    pub(crate) beta: f64,
}

/// One of a product's three matrices, in regflow's terms: the inputs `a` and `b`, the output
/// `c`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Matrix {
    A,
    B,
    C,
}

/// One queued step of a product kernel.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Step {
    /// A cuBLAS call; `staged` names the matrix it reads or writes in the stream's scratch
    /// (from its start) instead of in the matrix's register; `accumulate` sends the output
    /// to the f32 accumulator of the scratch instead.
    Gemm { call: Call, staged: Option<Matrix>, accumulate: bool },
    /// `count` runs of `len` elements between `matrix`'s register (from `offset` bytes,
    /// runs `ld` elements apart) and the scratch (runs `scratch_ld` apart from its start):
    /// into the scratch or out of it.
    Copy { matrix: Matrix, into_scratch: bool, offset: u64, ld: u64, scratch_ld: u64, len: u64, count: u64 },
    /// The f32 accumulator's first `count` values rounded into the output from `offset`
    /// bytes.
    Narrow { offset: u64, count: u64 },
}

/// What a staged product's scratch holds: a band of the staged matrix from its start,
/// `band` bytes, and, for products cut along `k`, an f32 accumulator of the output,
/// `accumulator` bytes, after it. Several staged calls of one kernel run one after another
/// and share the scratch, which is then as large as the largest of each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct ScratchLayout {
    pub(crate) band: u64,
    pub(crate) accumulator: u64,
}

impl ScratchLayout {
    /// Where the accumulator starts: after the band, 256-byte aligned.
    pub(crate) fn accumulator_offset(&self) -> u64 {
        self.band.div_ceil(256) * 256
    }

    /// The scratch's bytes.
    pub(crate) fn bytes(&self) -> u64 {
        if self.accumulator == 0 {
            self.band
        } else {
            self.accumulator_offset() + self.accumulator
        }
    }

    /// A scratch for the calls of both `self` and `other`.
    fn cover(self, other: ScratchLayout) -> ScratchLayout {
        ScratchLayout { band: self.band.max(other.band), accumulator: self.accumulator.max(other.accumulator) }
    }
}

/// The multiple of elements a 16-bit leading dimension must be for cuBLAS's tensor-core
/// kernels (16 bytes).
const LD_MULTIPLE: u64 = 8;

/// When a product is staged and in how large chunks (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Staging {
    /// Most bytes of scratch a staged product keeps.
    pub(crate) max_bytes: u64,
    /// Fewest multiply-adds a staged product has: below, the unaligned kernel costs little.
    pub(crate) min_macs: u64,
    /// Least reuse of the staged matrix (the product's dimension it is not indexed by):
    /// below, copying it costs about what the product does.
    pub(crate) min_reuse: u64,
}

impl Staging {
    /// What the kernels use: 64 MiB of scratch at most, products of 2^24 multiply-adds and
    /// a reuse of 64 at least.
    pub(crate) const DEFAULT: Staging = Staging { max_bytes: 64 << 20, min_macs: 1 << 24, min_reuse: 64 };
}

/// A product kernel: its steps, in order, and a zero fill for an empty inner dimension
/// (cuBLAS is not asked to compute a product of no terms).
#[derive(Debug)]
struct ProductKernel {
    blas: Blas,
    dtype: DType,
    /// The actor inputs holding `a` and `b`.
    inputs: (usize, usize),
    steps: Vec<Step>,
    /// The fill kernel and the output's element count, when the output is all zeros.
    zero: Option<(Function, u64)>,
    /// What staged steps use, when some step is staged.
    staging: Option<StagingKernels>,
}

/// A staged product's scratch and device kernels.
#[derive(Debug)]
struct StagingKernels {
    /// What the steps keep in the stream's scratch, and where.
    layout: ScratchLayout,
    /// Moves runs of 16-bit elements (`regflow_copy_runs_u16`).
    copy: Function,
    /// Rounds f32 values to the output's dtype (`regflow_cast_f32_*`).
    narrow: Function,
}

impl Kernel for ProductKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let (a, b, c) = (io.input_addr(self.inputs.0), io.input_addr(self.inputs.1), io.output_addr(0));
        let base = |m: Matrix| match m {
            Matrix::A => a,
            Matrix::B => b,
            Matrix::C => c,
        };
        let stream = stream(io);
        if let Some((fill, n)) = self.zero {
            // SAFETY: the output holds `n` elements of the dtype; the fill kernel takes
            // (pointer, value of the dtype, count).
            unsafe {
                match self.dtype {
                    DType::F64 => launch(stream, fill, Grid::linear(n), &mut args![c, 0.0f64, n]),
                    DType::Bf16 | DType::F16 => launch(stream, fill, Grid::linear(n), &mut args![c, 0u16, n]),
                    _ => launch(stream, fill, Grid::linear(n), &mut args![c, 0.0f32, n]),
                }
            }?;
        }
        let (scratch, accumulator) = match &self.staging {
            Some(k) => {
                let scratch = io.scratch(k.layout.bytes())?;
                (scratch, scratch + k.layout.accumulator_offset())
            }
            None => (0, 0),
        };
        let staging = || {
            self.staging
                .as_ref()
                .ok_or_else(|| KernelError("a staged product without its scratch (broken invariant)".into()))
        };
        for step in &self.steps {
            match *step {
                Step::Gemm { call, staged, accumulate } => {
                    let (oa, ob, oc) = call.offsets;
                    let at = |m: Matrix, offset: u64| if staged == Some(m) { scratch } else { base(m) + offset };
                    let c = if accumulate { accumulator } else { at(Matrix::C, oc) };
                    let operands = (at(Matrix::A, oa), at(Matrix::B, ob), c);
                    // SAFETY: the calls were planned from the registers' metas (checked at
                    // build): every element they reach lies inside the input and output
                    // registers, which the actor protocol keeps alive and unwritten by
                    // others until the stream has run them, or inside the stream's scratch,
                    // which this firing's steps alone use, in stream order.
                    unsafe { self.blas.gemm(stream, self.dtype, &call.gemm, operands, (1.0, call.beta), accumulate) }?;
                }
                Step::Copy { matrix, into_scratch, offset, ld, scratch_ld, len, count } => {
                    let register = base(matrix) + offset;
                    let (src, dst, src_ld, dst_ld) = if into_scratch {
                        (register, scratch, ld, scratch_ld)
                    } else {
                        (scratch, register, scratch_ld, ld)
                    };
                    let grid = Grid {
                        blocks: (len.div_ceil(256).clamp(1, 1 << 16) as u32, count.clamp(1, 65_535) as u32, 1),
                        threads: (256, 1, 1),
                        shared_bytes: 0,
                    };
                    // SAFETY: `regflow_copy_runs_u16` takes (src, dst, count, len, src_ld,
                    // dst_ld); the runs lie inside the matrix's register (planned from its
                    // meta) and inside the scratch (sized for the largest band).
                    unsafe { launch(stream, staging()?.copy, grid, &mut args![src, dst, count, len, src_ld, dst_ld]) }?;
                }
                Step::Narrow { offset, count } => {
                    let out = c + offset;
                    // SAFETY: `regflow_cast_f32_*` takes (x, out, n); the accumulator holds
                    // `count` f32 values and the output register `count` elements from
                    // `offset` (a dense output, checked when planned).
                    unsafe {
                        launch(stream, staging()?.narrow, Grid::linear(count), &mut args![accumulator, out, count])
                    }?;
                }
            }
        }
        Ok(())
    }

    fn scratch_bytes(&self) -> u64 {
        self.staging.as_ref().map_or(0, |k| k.layout.bytes())
    }
}

/// Checks the conf's metas by the CPU kernel's rules for `op` (errors name the actor).
fn checked<T: HostCompute>(spec: &KernelSpec<'_>, conf: &OpConf, op: &T) -> Result<(), KernelError> {
    op.check(&conf.inputs, &conf.outputs)
        .map_err(|m| KernelError(format!("actor '{}': op '{}': {m}", spec.actor, conf.op_type)))
}

/// The kernel of `conf` queuing `calls`, with a zero fill when `zero` (an empty inner
/// dimension or batch sum). A 16-bit call with one unaligned matrix is staged (module
/// docs), unless `REGFLOW_CUDA_STAGING=0` (read when the kernel is made: the benchmarks
/// time both ways in one run).
fn product(spec: &KernelSpec<'_>, conf: &OpConf, calls: Vec<Call>, zero: bool) -> Result<Box<dyn Kernel>, KernelError> {
    let dtype = conf.outputs[0].dtype;
    let fail = |e: crate::CudaError| KernelError(format!("actor '{}': {e}", spec.actor));
    let zero = if zero {
        Some((function(spec, &format!("regflow_fill_{}", suffix(dtype)))?, conf.outputs[0].shape.numel() as u64))
    } else {
        None
    };
    let stage = matches!(dtype, DType::Bf16 | DType::F16) && staging_enabled(spec)?;
    let (mut steps, mut layout) = (Vec::new(), ScratchLayout::default());
    for call in calls {
        match stage.then(|| staged_steps(&call, dtype.size() as u64, Staging::DEFAULT)).flatten() {
            Some((staged, needs)) => {
                steps.extend(staged);
                layout = layout.cover(needs);
            }
            None => steps.push(Step::Gemm { call, staged: None, accumulate: false }),
        }
    }
    let staging = if layout.bytes() > 0 {
        Some(StagingKernels {
            layout,
            copy: function(spec, "regflow_copy_runs_u16")?,
            narrow: function(spec, &format!("regflow_cast_f32_{}", suffix(dtype)))?,
        })
    } else {
        None
    };
    Ok(queued(ProductKernel {
        blas: Blas::open(usize::from(spec.device_index)).map_err(fail)?,
        dtype,
        inputs: (conf.input_map[0], conf.input_map[1]),
        steps,
        zero,
        staging,
    }))
}

/// Whether `REGFLOW_CUDA_STAGING` leaves aligned staging on for the actor's kernel.
fn staging_enabled(spec: &KernelSpec<'_>) -> Result<bool, KernelError> {
    staging_setting(std::env::var("REGFLOW_CUDA_STAGING"), spec.actor)
}

/// `REGFLOW_CUDA_STAGING`'s meaning: unset or `1` on (the default), `0` off; any other
/// value is an error naming it, not a silent default.
fn staging_setting(value: Result<String, std::env::VarError>, actor: &str) -> Result<bool, KernelError> {
    match value {
        Err(std::env::VarError::NotPresent) => Ok(true),
        Ok(v) if v == "1" => Ok(true),
        Ok(v) if v == "0" => Ok(false),
        other => Err(KernelError(format!(
            "actor '{actor}': REGFLOW_CUDA_STAGING is {:?}, but it takes 0 (16-bit products run as they are) or 1 \
             (aligned staging, the default)",
            other.unwrap_or_else(|e| e.to_string())
        ))),
    }
}

/// The steps replacing `call` (elements of `size` bytes) when exactly one of its matrices
/// has a leading dimension cuBLAS's 16-bit tensor-core kernels cannot read, and the scratch
/// they use (its staging area at most `limits.max_bytes`, and about a quarter of the staged
/// matrix, so even a small staged product runs in several bands); `None` when the call runs
/// as it is.
///
/// In cuBLAS's column-major terms (`C = op(A)·op(B)`, `m x n`, inner `k`) the staged
/// matrix is cut into bands of its stored rows, which its leading dimension counts: rows of
/// `C` or of `A` read as is are `m`, rows of `B` read transposed are `n`, rows of `A` read
/// transposed or of `B` read as is are `k`. Each band is a chunk of that dimension, a
/// multiple of 8 wide (all but the last), and the other matrices are offset to the same
/// rows or columns. Along `k` the bands' products are summed into an f32 accumulator
/// (`beta` 1 after the first) and rounded into the output at the end; that needs a dense
/// output written whole (`ldc == m`, `beta` 0), as staging the output does.
pub(crate) fn staged_steps(call: &Call, size: u64, limits: Staging) -> Option<(Vec<Step>, ScratchLayout)> {
    #[derive(Clone, Copy, PartialEq)]
    enum Cu {
        A,
        B,
        C,
    }
    #[derive(Clone, Copy, PartialEq)]
    enum Dim {
        M,
        N,
        K,
    }
    let g = call.gemm;
    if g.batch != 1 || g.is_empty() {
        return None;
    }
    let (m, n, k) = (g.m as u64, g.n as u64, g.k as u64);
    let (lda, ldb, ldc) = (g.lda as u64, g.ldb as u64, g.ldc as u64);
    let mut unaligned = [(Cu::A, lda), (Cu::B, ldb), (Cu::C, ldc)].into_iter().filter(|(_, ld)| ld % LD_MULTIPLE != 0);
    let (which, ld) = unaligned.next()?;
    let (oa, ob, oc) = call.offsets;
    let (off_a, off_b) = if g.swapped { (ob, oa) } else { (oa, ob) };
    // The dimension the staged matrix's stored rows count, and its stored columns.
    let (dim, cols) = match which {
        Cu::A if !g.transa => (Dim::M, k),
        Cu::A => (Dim::K, m),
        Cu::B if !g.transb => (Dim::K, n),
        Cu::B => (Dim::N, k),
        Cu::C => (Dim::M, n),
    };
    let reuse = match which {
        Cu::A => n,
        Cu::B => m,
        Cu::C => k,
    };
    // `beta` 0: the output is written whole (a staged output is copied over it, an
    // accumulator rounded into it).
    if unaligned.next().is_some()
        || [off_a, off_b, oc].iter().any(|o| o % (LD_MULTIPLE * size) != 0)
        || m * n * k < limits.min_macs
        || reuse < limits.min_reuse
        || call.beta != 0.0
        || (dim == Dim::K && ldc != m)
    {
        return None;
    }
    let pad = |x: u64| x.div_ceil(LD_MULTIPLE) * LD_MULTIPLE;
    let rows = match dim {
        Dim::M => m,
        Dim::N => n,
        Dim::K => k,
    };
    let unit_bytes = cols * size;
    let budget = limits.max_bytes.min((rows * unit_bytes).div_ceil(4));
    let width = (budget / unit_bytes / LD_MULTIPLE * LD_MULTIPLE).max(LD_MULTIPLE).min(pad(rows));
    let layout =
        ScratchLayout { band: pad(width) * cols * size, accumulator: if dim == Dim::K { m * n * 4 } else { 0 } };
    // cuBLAS's A and B as regflow's matrices.
    let (matrix_a, matrix_b) = if g.swapped { (Matrix::B, Matrix::A) } else { (Matrix::A, Matrix::B) };
    let (staged_matrix, staged_offset) = match which {
        Cu::A => (matrix_a, off_a),
        Cu::B => (matrix_b, off_b),
        Cu::C => (Matrix::C, oc),
    };
    let mut steps = Vec::new();
    let mut start = 0;
    while start < rows {
        let w = width.min(rows - start);
        let scratch_ld = pad(w);
        let band = |into_scratch| Step::Copy {
            matrix: staged_matrix,
            into_scratch,
            offset: staged_offset + start * size,
            ld,
            scratch_ld,
            len: w,
            count: cols,
        };
        // The band's product: the chunk of `dim`, and the other matrices offset to it
        // (elements; the staged matrix is read from the scratch).
        let (mut gemm, (mut a, mut b, mut c)) = (g, (0u64, 0u64, 0u64));
        match dim {
            Dim::M => {
                gemm.m = w as i32;
                a = if g.transa { start * lda } else { start };
                c = start;
            }
            Dim::N => {
                // Only `B` read transposed has stored rows along `n`: it is the band.
                gemm.n = w as i32;
                c = start * ldc;
            }
            Dim::K => {
                gemm.k = w as i32;
                a = if g.transa { start } else { start * lda };
                b = if g.transb { start * ldb } else { start };
            }
        }
        match which {
            Cu::A => gemm.lda = scratch_ld as i32,
            Cu::B => gemm.ldb = scratch_ld as i32,
            Cu::C => gemm.ldc = scratch_ld as i32,
        }
        let (a, b, c) = (off_a + a * size, off_b + b * size, oc + c * size);
        let offsets = if g.swapped { (b, a, c) } else { (a, b, c) };
        let beta = if dim == Dim::K && start > 0 { 1.0 } else { 0.0 };
        let product =
            Step::Gemm { call: Call { gemm, offsets, beta }, staged: Some(staged_matrix), accumulate: dim == Dim::K };
        if which == Cu::C {
            steps.extend([product, band(false)]);
        } else {
            steps.extend([band(true), product]);
        }
        start += w;
    }
    if dim == Dim::K {
        steps.push(Step::Narrow { offset: oc, count: m * n });
    }
    Some((steps, layout))
}

/// Why cuBLAS cannot take a product the CPU rules accept, as an actor's error.
fn unplannable(spec: &KernelSpec<'_>, conf: &OpConf, why: String) -> KernelError {
    KernelError(format!("actor '{}': op '{}' cannot be queued on cuBLAS: {why}", spec.actor, conf.op_type))
}

fn make_matmul(spec: &KernelSpec<'_>) -> Result<Box<dyn Kernel>, KernelError> {
    let conf = op_conf(spec)?;
    let op: MatMul = conf.parse_attrs().map_err(KernelError)?;
    checked(spec, conf, &op)?;
    let l =
        layout(&conf.inputs[0].shape, op.transpose_a, &conf.inputs[1].shape, op.transpose_b).map_err(KernelError)?;
    let (calls, zero) = matmul_calls(&l, op.transpose_a, op.transpose_b).map_err(|why| unplannable(spec, conf, why))?;
    product(spec, conf, calls, zero)
}

fn make_batch_sum(spec: &KernelSpec<'_>) -> Result<Box<dyn Kernel>, KernelError> {
    let conf = op_conf(spec)?;
    let op: MatMulBatchSum = conf.parse_attrs().map_err(KernelError)?;
    checked(spec, conf, &op)?;
    let l =
        layout(&conf.inputs[0].shape, op.transpose_a, &conf.inputs[1].shape, op.transpose_b).map_err(KernelError)?;
    let (calls, zero) = batch_sum_calls(&l, op.transpose_a, op.transpose_b, conf.outputs[0].dtype.size() as u64)
        .map_err(|why| unplannable(spec, conf, why))?;
    product(spec, conf, calls, zero)
}

/// A permuted product whose matrices cuBLAS can read (one unit stride each) queues
/// strided-batched GEMMs; one it cannot (an operand whose last two logical axes are both
/// strided, e.g. read through `[.., k, batch, m]`) runs its CPU kernel on the host over the
/// same managed registers, rather than failing a plan the CPU runs.
fn make_permuted(spec: &KernelSpec<'_>) -> Result<Box<dyn Kernel>, KernelError> {
    let conf = op_conf(spec)?;
    let op: PermutedMatMul = conf.parse_attrs().map_err(KernelError)?;
    checked(spec, conf, &op)?;
    let l = permuted_layout(&op, &conf.inputs[0].shape, &conf.inputs[1].shape).map_err(KernelError)?;
    match permuted_calls(&l, conf.outputs[0].dtype.size() as u64) {
        Ok((calls, zero)) => product(spec, conf, calls, zero),
        Err(_) => Ok(Box::new(HostOpKernel::new(op, conf))),
    }
}

/// The calls of a `matmul`: one strided-batched GEMM over the whole batch (a shared operand
/// has batch stride 0), and whether the output is zero-filled instead (`k == 0`).
pub(crate) fn matmul_calls(l: &Layout, ta: bool, tb: bool) -> Result<(Vec<Call>, bool), String> {
    let count: usize = l.batch.iter().product();
    if count == 0 || l.m == 0 || l.n == 0 {
        return Ok((Vec::new(), false));
    }
    if l.k == 0 {
        return Ok((Vec::new(), true));
    }
    let (a, b, c) = (
        MatrixLayout::row_major(l.m, l.k, ta),
        MatrixLayout::row_major(l.k, l.n, tb),
        MatrixLayout::row_major(l.m, l.n, false),
    );
    let gemm = Gemm::plan(a, b, c, count, (l.a_step, l.b_step, l.m * l.n))?;
    Ok((vec![Call { gemm, offsets: (0, 0, 0), beta: 0.0 }], false))
}

/// The calls of a `matmul_batch_sum` (`c = Σ_i op(a_i)·op(b_i)`). When the batch continues
/// both operands' inner dimension (`a_i` stored `[k, m]` read transposed and `b_i` stored
/// `[k, n]`, the weight gradient of a batched layer), the batch is folded into the inner
/// dimension: one GEMM with `k' = batch · k`. Otherwise one GEMM per batch element, each
/// but the first accumulating (`beta = 1`) in batch order, deterministically.
pub(crate) fn batch_sum_calls(l: &Layout, ta: bool, tb: bool, size: u64) -> Result<(Vec<Call>, bool), String> {
    let count: usize = l.batch.iter().product();
    if l.m == 0 || l.n == 0 {
        return Ok((Vec::new(), false));
    }
    if count == 0 || l.k == 0 {
        return Ok((Vec::new(), true));
    }
    let (a, b, c) = (
        MatrixLayout::row_major(l.m, l.k, ta),
        MatrixLayout::row_major(l.k, l.n, tb),
        MatrixLayout::row_major(l.m, l.n, false),
    );
    if l.a_step == l.k * a.col_stride && l.b_step == l.k * b.row_stride {
        let wide = l.k * count;
        let gemm = Gemm::plan(MatrixLayout { cols: wide, ..a }, MatrixLayout { rows: wide, ..b }, c, 1, (0, 0, 0))?;
        return Ok((vec![Call { gemm, offsets: (0, 0, 0), beta: 0.0 }], false));
    }
    let gemm = Gemm::plan(a, b, c, 1, (0, 0, 0))?;
    let calls = (0..count)
        .map(|i| Call {
            gemm,
            offsets: ((i * l.a_step) as u64 * size, (i * l.b_step) as u64 * size, 0),
            beta: if i == 0 { 0.0 } else { 1.0 },
        })
        .collect();
    Ok((calls, false))
}

/// One logical batch axis of a permuted product: its extent and the three tensors'
/// strides along it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BatchAxis {
    len: usize,
    a: usize,
    b: usize,
    out: usize,
}

/// The logical batch axes, without axes of one element and with neighbours merged where
/// all three tensors step over them as one (`stride[d] == stride[d + 1] · len[d + 1]`).
fn merged_batch(l: &PermutedLayout) -> Vec<BatchAxis> {
    let mut axes: Vec<BatchAxis> = Vec::new();
    for d in 0..l.batch.len() {
        let axis = BatchAxis { len: l.batch[d], a: l.a_strides[d], b: l.b_strides[d], out: l.out_strides[d] };
        if axis.len == 1 {
            continue;
        }
        match axes.last_mut() {
            Some(p) if p.a == axis.a * axis.len && p.b == axis.b * axis.len && p.out == axis.out * axis.len => {
                *p = BatchAxis { len: p.len * axis.len, ..axis };
            }
            _ => axes.push(axis),
        }
    }
    axes
}

/// The calls of a `permuted_matmul`. Each operand's matrix is read through its last two
/// logical axes' strides (one must be 1: a matrix stored row- or column-major). The batch
/// is the logical batch axes, merged where contiguous; cuBLAS's strided batch takes one
/// stride per operand, so the longest merged axis becomes cuBLAS's batch and any other
/// axes (attention's `[batch, heads]` when heads are not adjacent in every tensor) are
/// looped over: one strided-batched call per outer index, their offsets listed here.
pub(crate) fn permuted_calls(l: &PermutedLayout, size: u64) -> Result<(Vec<Call>, bool), String> {
    let r = l.batch.len();
    let count: usize = l.batch.iter().product();
    if count == 0 || l.m == 0 || l.n == 0 {
        return Ok((Vec::new(), false));
    }
    if l.k == 0 {
        return Ok((Vec::new(), true));
    }
    let matrix = |rows, cols, s: &[usize]| MatrixLayout { rows, cols, row_stride: s[r], col_stride: s[r + 1] };
    let (a, b, c) = (matrix(l.m, l.k, &l.a_strides), matrix(l.k, l.n, &l.b_strides), matrix(l.m, l.n, &l.out_strides));
    let mut axes = merged_batch(l);
    let inner = axes.iter().enumerate().max_by_key(|(_, x)| x.len).map(|(i, _)| i);
    let inner = inner.map(|i| axes.remove(i)).unwrap_or(BatchAxis { len: 1, a: 0, b: 0, out: 0 });
    let gemm = Gemm::plan(a, b, c, inner.len, (inner.a, inner.b, inner.out))?;
    // An odometer over the outer axes, in order.
    let outer: usize = axes.iter().map(|x| x.len).product();
    let mut calls = Vec::with_capacity(outer);
    let mut index = vec![0usize; axes.len()];
    for _ in 0..outer {
        let offset =
            |f: fn(&BatchAxis) -> usize| axes.iter().zip(&index).map(|(x, &i)| i * f(x)).sum::<usize>() as u64 * size;
        calls.push(Call { gemm, offsets: (offset(|x| x.a), offset(|x| x.b), offset(|x| x.out)), beta: 0.0 });
        for d in (0..axes.len()).rev() {
            index[d] += 1;
            if index[d] < axes[d].len {
                break;
            }
            index[d] = 0;
        }
    }
    Ok((calls, false))
}

#[cfg(test)]
mod tests {
    use super::*;
    use regflow_plan::Shape;

    /// Evaluates `calls` on the host as cuBLAS would (f64, element offsets), into `out`.
    fn evaluate(calls: &[Call], zero: bool, a: &[f64], b: &[f64], out: &mut [f64]) {
        if zero {
            out.fill(0.0);
        }
        for call in calls {
            let (oa, ob, oc) = (call.offsets.0 as usize / 8, call.offsets.1 as usize / 8, call.offsets.2 as usize / 8);
            call.gemm.reference(&a[oa..], &b[ob..], &mut out[oc..], 1.0, call.beta);
        }
    }

    /// The one call of the plain product `[m, k] · [k, n]`, each operand stored transposed
    /// where asked.
    fn plain_call(m: usize, k: usize, n: usize, ta: bool, tb: bool) -> Call {
        let a = Shape::from(if ta { [k, m] } else { [m, k] });
        let b = Shape::from(if tb { [n, k] } else { [k, n] });
        let (calls, _) = matmul_calls(&layout(&a, ta, &b, tb).unwrap(), ta, tb).unwrap();
        calls[0]
    }

    /// Evaluates staged `steps` on the host as the kernel queues them, with the scratch
    /// `layout` (NaN at first, so a band read before it is written shows).
    fn evaluate_steps(steps: &[Step], layout: ScratchLayout, a: &[f64], b: &[f64], out: &mut [f64]) {
        let mut band = vec![f64::NAN; layout.band as usize / 8];
        let mut accumulator = vec![f64::NAN; layout.accumulator as usize / 4];
        for step in steps {
            match *step {
                Step::Gemm { call, staged, accumulate } => {
                    let (oa, ob, oc) =
                        (call.offsets.0 as usize / 8, call.offsets.1 as usize / 8, call.offsets.2 as usize / 8);
                    let (beta, g) = (call.beta, &call.gemm);
                    match (staged, accumulate) {
                        (Some(Matrix::A), true) => g.reference(&band, &b[ob..], &mut accumulator, 1.0, beta),
                        (Some(Matrix::B), true) => g.reference(&a[oa..], &band, &mut accumulator, 1.0, beta),
                        (Some(Matrix::A), false) => g.reference(&band, &b[ob..], &mut out[oc..], 1.0, beta),
                        (Some(Matrix::B), false) => g.reference(&a[oa..], &band, &mut out[oc..], 1.0, beta),
                        (Some(Matrix::C), _) => g.reference(&a[oa..], &b[ob..], &mut band, 1.0, beta),
                        (None, _) => g.reference(&a[oa..], &b[ob..], &mut out[oc..], 1.0, beta),
                    }
                }
                Step::Copy { matrix, into_scratch, offset, ld, scratch_ld, len, count } => {
                    let start = offset as usize / 8;
                    for col in 0..count as usize {
                        for i in 0..len as usize {
                            let (r, s) = (start + col * ld as usize + i, col * scratch_ld as usize + i);
                            match (matrix, into_scratch) {
                                (Matrix::A, true) => band[s] = a[r],
                                (Matrix::B, true) => band[s] = b[r],
                                (Matrix::C, false) => out[r] = band[s],
                                _ => panic!("{matrix:?} copied {}", if into_scratch { "in" } else { "out" }),
                            }
                        }
                    }
                }
                Step::Narrow { offset, count } => {
                    let start = offset as usize / 8;
                    out[start..start + count as usize].copy_from_slice(&accumulator[..count as usize]);
                }
            }
        }
    }

    #[test]
    fn staged_products_compute_the_unstaged_result_in_chunks() {
        let limits = Staging { max_bytes: 4096, min_macs: 1, min_reuse: 1 };
        // (m, k, n, transpose_a, transpose_b, staged, summed over bands of k), regflow's
        // terms: GPT-2's three logits products in miniature (vocabulary 37), then each
        // transpose with one odd leading dimension.
        let cases = [
            (40, 16, 37, false, true, Some(Matrix::C), false), // logits = x · tableᵀ: bands of the vocabulary
            (40, 37, 16, false, false, Some(Matrix::A), true), // dx = dlogits · table: bands of k
            (37, 40, 16, true, false, Some(Matrix::A), false), // dtable = dlogitsᵀ · x
            (24, 16, 37, true, true, Some(Matrix::C), false),
            (16, 37, 24, false, false, Some(Matrix::A), true),
            (16, 24, 37, true, true, Some(Matrix::C), false),
            (37, 40, 16, true, true, Some(Matrix::A), false),
            (16, 37, 24, true, true, Some(Matrix::B), true),
            (16, 40, 16, false, false, None, false), // all aligned
            (24, 37, 16, true, false, None, false),  // an odd inner dimension alone
            (37, 16, 24, false, false, None, false), // an odd row count alone
            (37, 37, 16, false, true, None, false),  // two unaligned
        ];
        for (m, k, n, ta, tb, want_staged, want_accumulated) in cases {
            let calls = [plain_call(m, k, n, ta, tb)];
            let what = format!("{m}x{k}x{n} ({ta}, {tb})");
            let staged = staged_steps(&calls[0], 8, limits);
            let Some((steps, layout)) = staged else {
                assert_eq!(want_staged, None, "{what}: not staged");
                continue;
            };
            let gemms: Vec<_> = steps
                .iter()
                .filter_map(|s| {
                    if let Step::Gemm { staged, accumulate, .. } = s {
                        Some((*staged, *accumulate))
                    } else {
                        None
                    }
                })
                .collect();
            assert_eq!(gemms[0].0, want_staged, "{what}: the staged matrix");
            assert_eq!(gemms[0].1, want_accumulated, "{what}: summed over bands of k");
            assert!(gemms.len() > 1, "{what}: several bands ({} steps)", steps.len());
            let band = layout.band;
            assert!(band <= limits.max_bytes, "{what}: {band} bytes of band");
            for step in &steps {
                if let Step::Gemm { call, .. } = step {
                    call.gemm.check().unwrap();
                    let (a, b, c) = (call.gemm.lda, call.gemm.ldb, call.gemm.ldc);
                    assert!([a, b, c].iter().all(|ld| ld % 8 == 0), "{what}: leading dimensions {a}, {b}, {c}");
                }
            }
            let (a, b) = (values(m * k, 1), values(k * n, 2));
            let mut want = vec![f64::NAN; m * n];
            evaluate(&calls, false, &a, &b, &mut want);
            let mut got = vec![f64::NAN; m * n];
            evaluate_steps(&steps, layout, &a, &b, &mut got);
            assert_eq!(got, want, "{what}");
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
        /// Any product, any transposes, any band budget: staged exactly when one leading
        /// dimension is unaligned, and then the same result as the unstaged call, with
        /// every cuBLAS call aligned.
        #[test]
        fn any_product_with_one_unaligned_matrix_stages_to_the_same_result(
            m in 1usize..40, k in 1usize..40, n in 1usize..40,
            ta: bool, tb: bool, max_bytes in 8u64..4096,
        ) {
            let calls = [plain_call(m, k, n, ta, tb)];
            let g = calls[0].gemm;
            let unaligned = [g.lda, g.ldb, g.ldc].iter().filter(|&&ld| ld % 8 != 0).count();
            let limits = Staging { max_bytes, min_macs: 1, min_reuse: 1 };
            let staged = staged_steps(&calls[0], 8, limits);
            proptest::prop_assert_eq!(staged.is_some(), unaligned == 1, "{:?}", g);
            let Some((steps, layout)) = staged else { return Ok(()) };
            for step in &steps {
                if let Step::Gemm { call, .. } = step {
                    call.gemm.check().unwrap();
                    proptest::prop_assert!([call.gemm.lda, call.gemm.ldb, call.gemm.ldc].iter().all(|ld| ld % 8 == 0));
                }
            }
            let (a, b) = (values(m * k, 3), values(k * n, 4));
            let mut want = vec![f64::NAN; m * n];
            evaluate(&calls, false, &a, &b, &mut want);
            let mut got = vec![f64::NAN; m * n];
            evaluate_steps(&steps, layout, &a, &b, &mut got);
            proptest::prop_assert_eq!(got, want);
        }
    }

    #[test]
    fn a_scratch_for_two_staged_calls_keeps_each_accumulator_clear_of_either_band() {
        let cut_along_k = ScratchLayout { band: 1000, accumulator: 64 };
        let wider_band = ScratchLayout { band: 5000, accumulator: 0 };
        let both = cut_along_k.cover(wider_band);
        assert_eq!(both.accumulator_offset(), 5120, "after the wider band, 256-byte aligned");
        assert_eq!(both.bytes(), 5120 + 64);
        assert_eq!(wider_band.bytes(), 5000);
        assert_eq!(cut_along_k.bytes(), 1024 + 64);
    }

    #[test]
    fn the_staging_switch_takes_0_or_1_and_names_anything_else() {
        use std::env::VarError;
        assert!(staging_setting(Err(VarError::NotPresent), "matmul:3").unwrap());
        assert!(staging_setting(Ok("1".into()), "matmul:3").unwrap());
        assert!(!staging_setting(Ok("0".into()), "matmul:3").unwrap());
        let error = staging_setting(Ok("off".into()), "matmul:3").unwrap_err();
        assert_eq!(
            error.0,
            "actor 'matmul:3': REGFLOW_CUDA_STAGING is \"off\", but it takes 0 (16-bit products run as they are) or 1 \
             (aligned staging, the default)"
        );
    }

    #[test]
    fn small_batched_or_offset_products_are_not_staged() {
        let l = layout(&Shape::from([40, 16]), false, &Shape::from([37, 16]), true).unwrap();
        let (calls, _) = matmul_calls(&l, false, true).unwrap();
        assert!(staged_steps(&calls[0], 2, Staging::DEFAULT).is_none(), "40·16·37 multiply-adds");
        let big = Staging { min_macs: 1, ..Staging::DEFAULT };
        assert!(staged_steps(&calls[0], 2, big).is_none(), "a reuse of 16");
        let any = Staging { min_macs: 1, min_reuse: 1, ..Staging::DEFAULT };
        assert!(staged_steps(&calls[0], 2, any).is_some());
        let batched = Call { gemm: Gemm { batch: 2, ..calls[0].gemm }, ..calls[0] };
        assert!(staged_steps(&batched, 2, any).is_none(), "a batch");
        let unaligned = Call { offsets: (2, 0, 0), ..calls[0] };
        assert!(staged_steps(&unaligned, 2, any).is_none(), "an operand 2 bytes into its register");
    }

    fn values(n: usize, seed: usize) -> Vec<f64> {
        (0..n).map(|i| ((i * 7919 + seed * 31) % 23) as f64 - 11.0).collect()
    }

    /// The CPU kernel's result for `op` on `a` and `b`.
    fn cpu(
        op: &dyn regflow_kernels::HostCompute,
        a: &regflow_plan::HostArray,
        b: &regflow_plan::HostArray,
        out: &Shape,
    ) -> Vec<f64> {
        let mut o = regflow_plan::HostArray::zeros(&regflow_plan::TensorMeta::new(out.dims().to_vec(), DType::F64));
        op.compute(&Default::default(), &[a.view(), b.view()], &mut [o.view_mut()]).unwrap();
        o.to_f64_vec()
    }

    fn array(dims: &[usize], seed: usize) -> regflow_plan::HostArray {
        let n = dims.iter().product();
        regflow_plan::HostArray::f64(dims.to_vec(), values(n, seed)).unwrap()
    }

    #[test]
    fn matmul_calls_reproduce_the_cpu_kernel() {
        let cases: &[(&[usize], &[usize], bool, bool)] = &[
            (&[3, 4], &[4, 5], false, false),
            (&[4, 3], &[4, 5], true, false),
            (&[3, 4], &[5, 4], false, true),
            (&[4, 3], &[5, 4], true, true),
            (&[2, 3, 1, 4], &[2, 3, 4, 7], false, false),
            (&[2, 3, 4], &[4, 7], false, false),
            (&[3, 4], &[2, 7, 4], false, true),
            (&[1, 1], &[1, 1], false, false),
            (&[2, 3, 0], &[0, 4], false, false),
        ];
        for &(ad, bd, ta, tb) in cases {
            let op = MatMul { transpose_a: ta, transpose_b: tb };
            let l = layout(&Shape::from(ad), ta, &Shape::from(bd), tb).unwrap();
            let mut od: Vec<usize> = l.batch.to_vec();
            od.extend([l.m, l.n]);
            let (a, b) = (array(ad, 1), array(bd, 2));
            let want = cpu(&op, &a, &b, &Shape::from(od.as_slice()));
            let (calls, zero) = matmul_calls(&l, ta, tb).unwrap();
            assert!(calls.len() <= 1, "one strided-batched call per matmul");
            let mut got = vec![f64::NAN; want.len()];
            evaluate(&calls, zero, &a.to_f64_vec(), &b.to_f64_vec(), &mut got);
            assert_eq!(got, want, "{ad:?} x {bd:?} ({ta}, {tb})");
        }
    }

    #[test]
    fn batch_sums_fold_the_batch_into_k_when_they_can() {
        for (ad, bd, ta, tb, folded) in [
            (&[3, 5, 4][..], &[3, 5, 2][..], true, false, true),
            (&[3, 4, 5], &[3, 5, 2], false, false, false),
            (&[3, 4, 5], &[3, 2, 5], false, true, false),
            (&[2, 3, 1, 5], &[2, 3, 5, 2], false, false, true),
            (&[2, 5, 4], &[2, 2, 5], true, true, false),
        ] {
            let op = MatMulBatchSum { transpose_a: ta, transpose_b: tb };
            let l = layout(&Shape::from(ad), ta, &Shape::from(bd), tb).unwrap();
            let (a, b) = (array(ad, 3), array(bd, 4));
            let want = cpu(&op, &a, &b, &Shape::new(vec![l.m, l.n]));
            let (calls, zero) = batch_sum_calls(&l, ta, tb, 8).unwrap();
            assert_eq!(calls.len() == 1, folded, "{ad:?} x {bd:?}");
            let mut got = vec![f64::NAN; want.len()];
            evaluate(&calls, zero, &a.to_f64_vec(), &b.to_f64_vec(), &mut got);
            assert_eq!(got, want, "{ad:?} x {bd:?} ({ta}, {tb})");
        }
    }

    #[test]
    fn permuted_calls_reproduce_the_cpu_kernel_or_refuse() {
        // (a dims, b dims, a_axes, b_axes, out_axes, expressible)
        type Case<'a> = (&'a [usize], &'a [usize], &'a [usize], &'a [usize], &'a [usize], bool);
        let cases: &[Case] = &[
            // Attention's scores: q [b, t, h, d] read as [b, h, t, d], k read as [b, h, d, t].
            (&[2, 5, 3, 4], &[2, 5, 3, 4], &[0, 2, 1, 3], &[0, 2, 3, 1], &[0, 1, 2, 3], true),
            // ... and its output written back as [b, t, h, d].
            (&[2, 3, 5, 5], &[2, 5, 3, 4], &[0, 1, 2, 3], &[0, 2, 1, 3], &[0, 2, 1, 3], true),
            // Plain batched product, batch axes merged into one call.
            (&[2, 3, 4, 5], &[2, 3, 5, 6], &[0, 1, 2, 3], &[0, 1, 2, 3], &[0, 1, 2, 3], true),
            // A column-major output (its rows contiguous).
            (&[3, 4, 5], &[3, 5, 2], &[0, 1, 2], &[0, 1, 2], &[0, 2, 1], true),
            // Batch axis innermost in `a`: neither matrix stride of `a` is 1.
            (&[4, 5, 3], &[3, 5, 2], &[2, 0, 1], &[0, 1, 2], &[0, 1, 2], false),
        ];
        for &(ad, bd, aa, ba, oa, ok) in cases {
            let op = PermutedMatMul { a_axes: aa.to_vec(), b_axes: ba.to_vec(), out_axes: oa.to_vec() };
            let l = permuted_layout(&op, &Shape::from(ad), &Shape::from(bd)).unwrap();
            let result = permuted_calls(&l, 8);
            assert_eq!(result.is_ok(), ok, "{ad:?} {aa:?} x {bd:?} {ba:?}: {result:?}");
            let Ok((calls, zero)) = result else { continue };
            let (a, b) = (array(ad, 5), array(bd, 6));
            let want = cpu(&op, &a, &b, &Shape::from(l.out_dims.as_slice()));
            let mut got = vec![f64::NAN; want.len()];
            evaluate(&calls, zero, &a.to_f64_vec(), &b.to_f64_vec(), &mut got);
            assert_eq!(got, want, "{ad:?} {aa:?} x {bd:?} {ba:?} -> {oa:?}");
        }
    }

    #[test]
    fn attention_batches_loop_over_the_outer_axis() {
        // q [b=2, t=5, h=3, d=4] as [b, h, t, d]: b and h cannot merge (h's stride 4 is
        // not t·d·... of b's), so one call per b with h as cuBLAS's batch, or vice versa.
        let op = PermutedMatMul { a_axes: vec![0, 2, 1, 3], b_axes: vec![0, 2, 3, 1], out_axes: vec![0, 1, 2, 3] };
        let l = permuted_layout(&op, &Shape::from([2, 5, 3, 4]), &Shape::from([2, 5, 3, 4])).unwrap();
        let (calls, _) = permuted_calls(&l, 4).unwrap();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].gemm.batch, 3);
    }
}
