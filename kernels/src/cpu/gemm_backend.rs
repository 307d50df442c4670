//! Which library computes the CPU matrix products: the `gemm` crate (always built in), or
//! the system's OpenBLAS through CBLAS (the `blas` cargo feature), chosen once per process.
//!
//! Why two: on the AVX2 machines here OpenBLAS's hand-written kernels ran the MLP's
//! 128×1024×1024 products at 68–80 GFLOP/s where gemm 0.19 ran them at 48–50
//! (BENCHMARKS.md, issue 13, "Per shape"), and a product is most of a training step. On
//! AVX-512 machines gemm's x86-v4 kernels are the faster ones on every shape measured, so
//! the `blas` backend sends each product where it ran fastest
//! ([`prefers_blas`](super::matmul::prefers_blas)): to OpenBLAS only below AVX-512, and
//! skinny products to gemm everywhere. gemm stays the default of a plain build, because
//! OpenBLAS is a system library (Debian: `libopenblas-dev`) that a fresh machine may not
//! have, and it stays the backend of the instruction-set tests ([`isa`](super::isa)), whose
//! levels cap gemm's own dispatch. OpenBLAS picks its kernels at run time itself (Debian
//! builds it with `DYNAMIC_ARCH`); `OPENBLAS_CORETYPE` forces one.
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
/// (unset: OpenBLAS where the build has it, else gemm).
pub const BACKEND_VARIABLE: &str = "REGFLOW_CPU_GEMM";

/// A library that computes matrix products on the CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmBackend {
    /// The `gemm` crate (pure Rust; AVX-512, AVX2 or scalar by run-time dispatch).
    Gemm,
    /// The system's OpenBLAS through CBLAS (built with the `blas` feature).
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

    /// Whether this build can use the backend.
    pub fn is_built(self) -> bool {
        match self {
            GemmBackend::Gemm => true,
            GemmBackend::Blas => blas::BUILT,
        }
    }

    /// What a build without the backend says when it is asked for.
    fn not_built(self) -> String {
        format!(
            "the CPU matrix product backend `{}` was asked for, but this build has no OpenBLAS: \
             build with `--features regflow/blas` (needs the system's libopenblas, Debian: \
             libopenblas-dev), or use `gemm`",
            self.name()
        )
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

/// The default: OpenBLAS where the build has it.
fn widest_built() -> GemmBackend {
    if blas::BUILT {
        GemmBackend::Blas
    } else {
        GemmBackend::Gemm
    }
}

/// Reads `REGFLOW_CPU_GEMM` the first time it is called (later calls: the same answer).
fn from_environment() -> Result<(), String> {
    static APPLIED: OnceLock<Result<(), String>> = OnceLock::new();
    APPLIED
        .get_or_init(|| {
            let chosen = match std::env::var(BACKEND_VARIABLE) {
                Ok(value) => GemmBackend::parse(&value)?.unwrap_or_else(widest_built),
                Err(_) => widest_built(),
            };
            if !chosen.is_built() {
                return Err(format!("{BACKEND_VARIABLE}: {}", chosen.not_built()));
            }
            // Only the first settles it: `force_backend` may have run before.
            let _ = CHOSEN.compare_exchange(0, chosen.code(), Ordering::Relaxed, Ordering::Relaxed);
            Ok(())
        })
        .clone()
}

/// Makes every later matrix product of the process use `backend` (`None`: the default,
/// OpenBLAS where built). Overrides `REGFLOW_CPU_GEMM`; an error if the build lacks it.
pub fn force_backend(backend: Option<GemmBackend>) -> Result<(), String> {
    let backend = backend.unwrap_or_else(widest_built);
    if !backend.is_built() {
        return Err(backend.not_built());
    }
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
// Read by the OpenBLAS binding only.
#[cfg_attr(not(feature = "blas"), allow(dead_code))]
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
    /// Runs `block(number, part, a, b, c)` for each of `threads` blocks of output rows or
    /// columns (the longer side) that `self` is cut into, on this thread and its helpers
    /// ([`team`](super::team)): `number` the block's (`0..threads`, the same block of the
    /// same product every time), `part` the block's product (its rows or columns), `a`, `b`
    /// and `c` its operands' first elements. Blocks write disjoint parts of `c`.
    ///
    /// # Safety
    /// `a`, `b` and `c` must point to operands laid out as `self` says, valid for the call,
    /// `c` not overlapping the others; `block` gets the same promise for its part.
    pub(crate) unsafe fn in_blocks<T>(
        self,
        (a, b, c): (*const T, *const T, *mut T),
        threads: usize,
        block: impl Fn(usize, Product, *const T, *const T, *mut T) + Sync,
    ) {
        let Product { m, n, a_strides, b_strides, ldc, .. } = self;
        let by_rows = m >= n;
        let operands = Operands { a, b, out: c };
        super::shares::in_numbered_shares(threads, if by_rows { m } else { n }, |number, range| {
            // Borrowed whole first, so the closure captures the `Sync` struct, not its pointers.
            let operands = &operands;
            let Operands { a, b, out: c } = *operands;
            let (start, len) = (range.start as isize, range.end - range.start);
            // SAFETY: a block of rows starts `start` rows into `op(a)` and `c`; a block of
            // columns `start` columns into `op(b)` and `c`; both stay inside the operands
            // the caller vouched for.
            let (part, a, b, c) = unsafe {
                if by_rows {
                    (Product { m: len, ..self }, a.offset(start * a_strides.0), b, c.offset(start * ldc as isize))
                } else {
                    (Product { n: len, ..self }, a, b.offset(start * b_strides.1), c.offset(start))
                }
            };
            block(number, part, a, b, c);
        });
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
    let block = |_, part: Product, a, b, c| {
        // A block's sizes fit `i32`: they are at most the product's.
        let part = CblasCall { m: part.m as i32, n: part.n as i32, ..call };
        // SAFETY: `in_blocks` hands out the block's operands (its contract).
        unsafe { blas::call(&part, a, b, c) };
    };
    // SAFETY: forwarded to the caller.
    unsafe { product.in_blocks((a, b, c), if split { threads } else { 1 }, block) };
    true
}

/// The CBLAS binding (with the `blas` feature) or its stand-in (without).
#[cfg(feature = "blas")]
mod blas {
    use super::CblasCall;
    use std::ffi::c_int;
    use std::sync::Once;

    /// This build has OpenBLAS.
    pub(super) const BUILT: bool = true;

    const ROW_MAJOR: c_int = 101;
    const NO_TRANS: c_int = 111;
    const TRANS: c_int = 112;

    #[link(name = "openblas")]
    extern "C" {
        fn openblas_set_num_threads(threads: c_int);
    }

    /// A type CBLAS multiplies: f32 (`sgemm`) or f64 (`dgemm`).
    pub(crate) trait Scalar: Copy {
        /// # Safety
        /// As `cblas_?gemm` with these arguments.
        unsafe fn gemm(call: &CblasCall, a: *const Self, b: *const Self, c: *mut Self);
    }

    /// Declares `cblas_?gemm` for one type and makes the type a [`Scalar`] through it.
    macro_rules! cblas_gemm {
        ($t:ty, $name:ident) => {
            #[link(name = "openblas")]
            extern "C" {
                fn $name(
                    order: c_int,
                    trans_a: c_int,
                    trans_b: c_int,
                    m: c_int,
                    n: c_int,
                    k: c_int,
                    alpha: $t,
                    a: *const $t,
                    lda: c_int,
                    b: *const $t,
                    ldb: c_int,
                    beta: $t,
                    c: *mut $t,
                    ldc: c_int,
                );
            }

            impl Scalar for $t {
                unsafe fn gemm(call: &CblasCall, a: *const $t, b: *const $t, c: *mut $t) {
                    let CblasCall { trans_a, trans_b, m, n, k, lda, ldb, ldc, accumulate } = *call;
                    let flag = |t: bool| if t { TRANS } else { NO_TRANS };
                    let beta = if accumulate { 1.0 } else { 0.0 };
                    // SAFETY: forwarded from the caller.
                    unsafe {
                        $name(ROW_MAJOR, flag(trans_a), flag(trans_b), m, n, k, 1.0, a, lda, b, ldb, beta, c, ldc)
                    }
                }
            }
        };
    }
    cblas_gemm!(f32, cblas_sgemm);
    cblas_gemm!(f64, cblas_dgemm);

    /// Runs one product on this thread.
    ///
    /// # Safety
    /// As [`super::blas_product`].
    pub(super) unsafe fn call<T: Scalar>(call: &CblasCall, a: *const T, b: *const T, c: *mut T) {
        // OpenBLAS's own pool would fight the device's threads: calls run where they are made.
        static ONE_THREAD: Once = Once::new();
        // SAFETY: a plain setter of OpenBLAS's thread count.
        ONE_THREAD.call_once(|| unsafe { openblas_set_num_threads(1) });
        // SAFETY: forwarded from the caller.
        unsafe { T::gemm(call, a, b, c) }
    }
}

/// Stand-in for a build without OpenBLAS: [`GemmBackend::Blas`] is never chosen there.
#[cfg(not(feature = "blas"))]
mod blas {
    use super::CblasCall;

    /// This build has no OpenBLAS.
    pub(super) const BUILT: bool = false;

    /// The types the real binding multiplies.
    pub(crate) trait Scalar: Copy {}
    impl Scalar for f32 {}
    impl Scalar for f64 {}

    /// Never called: the backend cannot be chosen in this build.
    ///
    /// # Safety
    /// Trivially safe; `unsafe` to match the real binding.
    pub(super) unsafe fn call<T: Scalar>(_: &CblasCall, _: *const T, _: *const T, _: *mut T) {
        unreachable!("the blas backend is not built, so it is never chosen");
    }
}
