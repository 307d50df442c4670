//! Which library computes the CPU matrix products: the `gemm` crate (built in, the
//! default), or the system's OpenBLAS through CBLAS, loaded at run time when
//! `REGFLOW_CPU_GEMM=blas` asks for it; chosen once per process.
//!
//! Why two: on the AVX2 machines here OpenBLAS's hand-written kernels ran the MLP's
//! 128×1024×1024 products at 68–80 GFLOP/s where gemm 0.19 ran them at 48–50
//! (BENCHMARKS.md, issue 13, "Per shape"), and a product is most of a training step. On
//! AVX-512 machines gemm's x86-v4 kernels are the faster ones on every shape measured, so
//! the `blas` backend sends each product where it ran fastest
//! ([`prefers_blas`](super::matmul::prefers_blas)): to OpenBLAS only below AVX-512, and
//! skinny products to gemm everywhere. gemm stays the default, even where OpenBLAS is
//! installed: its results never change with the thread count (below), a fresh machine may
//! lack OpenBLAS (Debian: `libopenblas0`), and it is the backend of the instruction-set
//! tests ([`isa`](super::isa)), whose levels cap gemm's own dispatch. OpenBLAS is loaded,
//! not linked (`libopenblas.so.0`, or `REGFLOW_OPENBLAS`): every build can use it, and
//! asking for it where it is missing is an error that says how to get it. OpenBLAS picks
//! its kernels at run time itself (Debian builds it with `DYNAMIC_ARCH`);
//! `OPENBLAS_CORETYPE` forces one.
//!
//! Threads: OpenBLAS is told once to use one thread per call; a product big enough to pay
//! for a second thread is split here into contiguous blocks of output rows (or columns),
//! one per share of the device's `threads`, so every output element is one call's sum in
//! that call's order whatever the scheduling: a result does not change from run to run.
//! It may change in the last bits with the thread count, unlike gemm's: OpenBLAS blocks a
//! product by its sizes, so an element of a share can land in another register tile (with
//! another summation order) than in the whole product. Where bits must not depend on the
//! thread count, choose `gemm`.

use super::shares::Operands;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

/// The environment variable read at the first matrix product: `gemm`, `blas`, or `auto`
/// (the same as unset: gemm).
pub const BACKEND_VARIABLE: &str = "REGFLOW_CPU_GEMM";

/// A library that computes matrix products on the CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmBackend {
    /// The `gemm` crate (pure Rust; AVX-512, AVX2 or scalar by run-time dispatch).
    Gemm,
    /// The system's OpenBLAS through CBLAS, loaded at run time.
    Blas,
}

impl GemmBackend {
    /// The `REGFLOW_CPU_GEMM` spelling: `gemm` or `blas`.
    pub fn name(self) -> &'static str {
        match self {
            GemmBackend::Gemm => "gemm",
            GemmBackend::Blas => "blas",
        }
    }

    /// The backend named `name` (`gemm`, `blas`), `None` for `auto`, or why not.
    pub fn parse(name: &str) -> Result<Option<GemmBackend>, String> {
        match name.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(None),
            "gemm" => Ok(Some(GemmBackend::Gemm)),
            "blas" | "openblas" => Ok(Some(GemmBackend::Blas)),
            other => Err(format!("{BACKEND_VARIABLE}={other:?}: expected auto, gemm or blas")),
        }
    }

    /// Whether this process can use the backend (for `blas`: loads OpenBLAS, once).
    pub fn is_available(self) -> bool {
        self.availability().is_ok()
    }

    /// `Ok` where this process can use the backend, else why not and how to get it.
    pub fn availability(self) -> Result<(), String> {
        match self {
            GemmBackend::Gemm => Ok(()),
            GemmBackend::Blas => blas::loaded()
                .map(|_| ())
                .map_err(|e| format!("the CPU matrix product backend `blas` was asked for, but {e}; or use `gemm`")),
        }
    }

    fn code(self) -> u8 {
        match self {
            GemmBackend::Gemm => 1,
            GemmBackend::Blas => 2,
        }
    }
}

impl std::fmt::Display for GemmBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The backend every matrix product uses, once settled (0: not yet).
static CHOSEN: AtomicU8 = AtomicU8::new(0);

/// The default (`auto`): gemm, whose results never depend on the thread count.
const DEFAULT_BACKEND: GemmBackend = GemmBackend::Gemm;

/// Where OpenBLAS was loaded from, or why it could not be: loads it once, if it is not yet.
pub fn openblas_library() -> Result<String, String> {
    blas::loaded().map(|library| library.name.clone())
}

/// The environment variable naming the OpenBLAS library to load (a path, or a file name the
/// dynamic loader finds) instead of `libopenblas.so.0`.
pub const OPENBLAS_VARIABLE: &str = "REGFLOW_OPENBLAS";

/// Reads `REGFLOW_CPU_GEMM` the first time it is called (later calls: the same answer).
fn from_environment() -> Result<(), String> {
    static APPLIED: OnceLock<Result<(), String>> = OnceLock::new();
    APPLIED
        .get_or_init(|| {
            let chosen = match std::env::var(BACKEND_VARIABLE) {
                Ok(value) => GemmBackend::parse(&value)?.unwrap_or(DEFAULT_BACKEND),
                Err(_) => DEFAULT_BACKEND,
            };
            chosen.availability().map_err(|e| format!("{BACKEND_VARIABLE}={}: {e}", chosen.name()))?;
            // Only the first settles it: `force_backend` may have run before.
            let _ = CHOSEN.compare_exchange(0, chosen.code(), Ordering::Relaxed, Ordering::Relaxed);
            Ok(())
        })
        .clone()
}

/// Makes every later matrix product of the process use `backend` (`None`: the default,
/// gemm). Overrides `REGFLOW_CPU_GEMM`; an error if the process cannot use it (OpenBLAS
/// not found).
pub fn force_backend(backend: Option<GemmBackend>) -> Result<(), String> {
    let backend = backend.unwrap_or(DEFAULT_BACKEND);
    backend.availability()?;
    // Settle the variable first, so that it cannot override this later.
    let _ = from_environment();
    CHOSEN.store(backend.code(), Ordering::Relaxed);
    Ok(())
}

/// The backend the next matrix product runs on (after `REGFLOW_CPU_GEMM`), or why the
/// variable's value cannot be used.
pub fn backend_in_use() -> Result<GemmBackend, String> {
    from_environment()?;
    Ok(match CHOSEN.load(Ordering::Relaxed) {
        2 => GemmBackend::Blas,
        _ => GemmBackend::Gemm,
    })
}

/// One matrix product `c = a·b (+ c if accumulate)` (by gemm or OpenBLAS), over raw strided operands:
/// `a` is `m x k` with (row, column) strides `a_strides`, `b` is `k x n`, `c` is `m x n`
/// with row stride `ldc` and column stride 1.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Product {
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub a_strides: (isize, isize),
    pub b_strides: (isize, isize),
    pub ldc: usize,
    pub accumulate: bool,
}

/// The arguments of one row-major `cblas_?gemm` call with alpha 1, each within `i32`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CblasCall {
    trans_a: bool,
    trans_b: bool,
    m: i32,
    n: i32,
    k: i32,
    lda: i32,
    ldb: i32,
    ldc: i32,
    /// Whether the product adds to `c` (beta 1) or overwrites it (beta 0).
    accumulate: bool,
}

impl Product {
    /// Whether [`Product::in_blocks`] cuts the output's rows (the longer side, rows when
    /// there are at least as many rows as columns) rather than its columns.
    fn cuts_rows(&self) -> bool {
        self.m >= self.n
    }

    /// The side of the output [`Product::in_blocks`] cuts ([`Product::cuts_rows`]), and the
    /// other.
    pub(crate) fn split_sides(&self) -> (usize, usize) {
        if self.cuts_rows() {
            (self.m, self.n)
        } else {
            (self.n, self.m)
        }
    }

    /// Runs `block(number, part, a, b, c)` for each of the `min(blocks, len)` equal blocks of
    /// output rows or columns (the longer side, `len` long) that `self` is cut into, on this
    /// thread and up to `threads − 1` helpers of it ([`team`](super::team)): `number` the
    /// block's (`0..blocks`, the same block of the same product every time), `part` the
    /// block's product (its rows or columns), `a`, `b` and `c` its operands' first
    /// elements. Blocks write disjoint parts of `c`.
    ///
    /// # Safety
    /// `a`, `b` and `c` must point to operands laid out as `self` says, valid for the call,
    /// `c` not overlapping the others; `block` gets the same promise for its part.
    pub(crate) unsafe fn in_blocks<T>(
        self,
        operands: (*const T, *const T, *mut T),
        threads: usize,
        blocks: usize,
        block: impl Fn(usize, Product, *const T, *const T, *mut T) + Sync,
    ) {
        let len = self.split_sides().0;
        let blocks = blocks.min(len);
        let start = |number: usize| super::shares::share_start(number, len, blocks);
        // SAFETY: forwarded; the starts rise from 0 to `len`.
        unsafe { self.in_blocks_from(operands, threads, blocks, &start, block) };
    }

    /// [`Product::in_blocks`] with `blocks` blocks (on up to `threads` threads) where block
    /// `number` starts at row or column `start(number)` and ends where the next starts.
    ///
    /// # Safety
    /// As [`Product::in_blocks`]; moreover `start` must rise from `start(0) == 0` to
    /// `start(blocks)`, the length of the side cut ([`Product::split_sides`]).
    pub(crate) unsafe fn in_blocks_from<T>(
        self,
        (a, b, c): (*const T, *const T, *mut T),
        threads: usize,
        blocks: usize,
        start: &(dyn Fn(usize) -> usize + Sync),
        block: impl Fn(usize, Product, *const T, *const T, *mut T) + Sync,
    ) {
        let Product { a_strides, b_strides, ldc, .. } = self;
        let by_rows = self.cuts_rows();
        let operands = Operands { a, b, out: c };
        let run = |number: usize| {
            // Borrowed whole first, so the closure captures the `Sync` struct, not its pointers.
            let operands = &operands;
            let Operands { a, b, out: c } = *operands;
            let (first, end) = (start(number), start(number + 1));
            let (first, len) = (first as isize, end - first);
            // SAFETY: a block of rows starts `first` rows into `op(a)` and `c`; a block of
            // columns `first` columns into `op(b)` and `c`; both stay inside the operands
            // the caller vouched for.
            let (part, a, b, c) = unsafe {
                if by_rows {
                    (Product { m: len, ..self }, a.offset(first * a_strides.0), b, c.offset(first * ldc as isize))
                } else {
                    (Product { n: len, ..self }, a, b.offset(first * b_strides.1), c.offset(first))
                }
            };
            block(number, part, a, b, c);
        };
        if blocks <= 1 {
            run(0);
        } else {
            super::team::for_each_share(threads, blocks, &run);
        }
    }

    /// The CBLAS call that computes it, or `None` when CBLAS cannot read an operand (neither
    /// of its strides is 1) or a size does not fit `i32`.
    fn cblas_call(&self) -> Option<CblasCall> {
        // (transposed, leading dimension) of an operand of `rows x cols`.
        let operand = |rows: usize, cols: usize, (row, col): (isize, isize)| {
            if col == 1 && row >= cols.max(1) as isize {
                Some((false, row as usize))
            } else if row == 1 && col >= rows.max(1) as isize {
                Some((true, col as usize))
            } else {
                None
            }
        };
        let (trans_a, lda) = operand(self.m, self.k, self.a_strides)?;
        let (trans_b, ldb) = operand(self.k, self.n, self.b_strides)?;
        let int = |x: usize| i32::try_from(x).ok();
        Some(CblasCall {
            trans_a,
            trans_b,
            m: int(self.m)?,
            n: int(self.n)?,
            k: int(self.k)?,
            lda: int(lda)?,
            ldb: int(ldb)?,
            ldc: int(self.ldc)?,
            accumulate: self.accumulate,
        })
    }
}

/// Computes `product` by OpenBLAS, split over `threads` blocks of output rows or columns
/// (the longer side) when `split` is set; false (nothing done) when CBLAS cannot read its
/// operands.
///
/// # Safety
/// `a`, `b` and `c` must point to operands laid out as `product` says, valid for the call,
/// `c` not overlapping the others.
pub(crate) unsafe fn blas_product<T: blas::Scalar>(
    product: Product,
    a: *const T,
    b: *const T,
    c: *mut T,
    threads: usize,
    split: bool,
) -> bool {
    let Some(call) = product.cblas_call() else { return false };
    // The backend is chosen only once the library has loaded (`is_available`).
    let Ok(library) = blas::loaded() else { return false };
    let block = |_, part: Product, a, b, c| {
        // A block's sizes fit `i32`: they are at most the product's.
        let part = CblasCall { m: part.m as i32, n: part.n as i32, ..call };
        // SAFETY: `in_blocks` hands out the block's operands (its contract).
        unsafe { blas::call(library, &part, a, b, c) };
    };
    let blocks = if split { threads } else { 1 };
    // SAFETY: forwarded to the caller.
    unsafe { product.in_blocks((a, b, c), threads, blocks, block) };
    true
}

/// The CBLAS binding, loaded from the system's OpenBLAS at run time.
///
/// Loaded rather than linked, as cudarc loads CUDA: one binary runs with or without the
/// library (the machine decides, not a cargo feature), and a build never needs it. That
/// also let CI test this backend with the binaries it already built for every other test,
/// where a `blas` feature rebuilt the kernels crate and everything above it (about three
/// minutes of a fresh CI run).
mod blas {
    use super::{CblasCall, OPENBLAS_VARIABLE};
    use std::ffi::c_int;
    use std::sync::OnceLock;

    /// The names tried, in order, when `REGFLOW_OPENBLAS` is unset: Debian's runtime package
    /// (`libopenblas0`) has only the versioned name.
    const LIBRARY_NAMES: [&str; 3] = ["libopenblas.so.0", "libopenblas.so", "libopenblas.dylib"];

    const ROW_MAJOR: c_int = 101;
    const NO_TRANS: c_int = 111;
    const TRANS: c_int = 112;

    /// `cblas_?gemm`'s signature for element type `T`.
    type CblasGemm<T> = unsafe extern "C" fn(
        order: c_int,
        trans_a: c_int,
        trans_b: c_int,
        m: c_int,
        n: c_int,
        k: c_int,
        alpha: T,
        a: *const T,
        lda: c_int,
        b: *const T,
        ldb: c_int,
        beta: T,
        c: *mut T,
        ldc: c_int,
    );

    /// The loaded library and the entry points regflow calls.
    pub(crate) struct OpenBlas {
        /// Where it was loaded from (as given to the loader).
        pub(crate) name: String,
        sgemm: CblasGemm<f32>,
        dgemm: CblasGemm<f64>,
        /// Keeps the entry points mapped for the life of the process.
        _library: libloading::Library,
    }

    /// Loads OpenBLAS the first time it is asked for (later calls: the same answer), and
    /// tells it once to run each call on the calling thread: its own pool would fight the
    /// device's threads.
    pub(crate) fn loaded() -> Result<&'static OpenBlas, String> {
        static LOADED: OnceLock<Result<OpenBlas, String>> = OnceLock::new();
        LOADED
            .get_or_init(|| match std::env::var(OPENBLAS_VARIABLE) {
                Ok(name) if !name.trim().is_empty() => open(name.trim()).map_err(|e| {
                    format!(
                        "{OPENBLAS_VARIABLE}={name:?} could not be loaded ({e}); point it at the system's \
                         OpenBLAS (Debian: apt-get install libopenblas0, then libopenblas.so.0)"
                    )
                }),
                _ => {
                    let mut tried = Vec::new();
                    for name in LIBRARY_NAMES {
                        match open(name) {
                            Ok(library) => return Ok(library),
                            Err(e) => tried.push(e),
                        }
                    }
                    Err(format!(
                        "the system's OpenBLAS could not be loaded ({}); install it (Debian: apt-get \
                         install libopenblas0) or set {OPENBLAS_VARIABLE} to its path",
                        tried.join("; ")
                    ))
                }
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Opens the library `name` and finds its entry points, or says which is missing.
    fn open(name: &str) -> Result<OpenBlas, String> {
        // SAFETY: loading runs the library's initializers; OpenBLAS's only set up its
        // tables and thread pool.
        let library = unsafe { libloading::Library::new(name) }.map_err(|e| format!("{name}: {e}"))?;
        // SAFETY: each symbol is declared with its CBLAS (or OpenBLAS) C signature.
        unsafe {
            let symbol_error = |symbol: &str, e: libloading::Error| format!("{name} has no `{symbol}`: {e}");
            let sgemm = *library.get::<CblasGemm<f32>>(b"cblas_sgemm\0").map_err(|e| symbol_error("cblas_sgemm", e))?;
            let dgemm = *library.get::<CblasGemm<f64>>(b"cblas_dgemm\0").map_err(|e| symbol_error("cblas_dgemm", e))?;
            let set_threads = *library
                .get::<unsafe extern "C" fn(c_int)>(b"openblas_set_num_threads\0")
                .map_err(|e| symbol_error("openblas_set_num_threads", e))?;
            set_threads(1);
            Ok(OpenBlas { name: name.to_string(), sgemm, dgemm, _library: library })
        }
    }

    /// A type CBLAS multiplies: f32 (`sgemm`) or f64 (`dgemm`).
    pub(crate) trait Scalar: Copy {
        /// This type's `cblas_?gemm` in `library`.
        fn gemm(library: &OpenBlas) -> CblasGemm<Self>;
        /// 0 and 1.
        const ZERO_ONE: (Self, Self);
    }

    impl Scalar for f32 {
        fn gemm(library: &OpenBlas) -> CblasGemm<f32> {
            library.sgemm
        }
        const ZERO_ONE: (f32, f32) = (0.0, 1.0);
    }

    impl Scalar for f64 {
        fn gemm(library: &OpenBlas) -> CblasGemm<f64> {
            library.dgemm
        }
        const ZERO_ONE: (f64, f64) = (0.0, 1.0);
    }

    /// Runs one product on this thread.
    ///
    /// # Safety
    /// As [`super::blas_product`].
    pub(super) unsafe fn call<T: Scalar>(library: &OpenBlas, call: &CblasCall, a: *const T, b: *const T, c: *mut T) {
        let CblasCall { trans_a, trans_b, m, n, k, lda, ldb, ldc, accumulate } = *call;
        let flag = |t: bool| if t { TRANS } else { NO_TRANS };
        let (zero, one) = T::ZERO_ONE;
        let beta = if accumulate { one } else { zero };
        // SAFETY: forwarded from the caller; the entry point has this signature.
        unsafe { T::gemm(library)(ROW_MAJOR, flag(trans_a), flag(trans_b), m, n, k, one, a, lda, b, ldb, beta, c, ldc) }
    }
}
