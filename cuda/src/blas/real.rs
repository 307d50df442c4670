//! cuBLAS over cudarc's raw `sys` layer: strided-batched GEMM for f32, f64 and bf16 on a
//! stream's native handle. Each stream thread has its own cuBLAS handle per device, made on
//! that thread's first product and bound to the firing's stream at each call, so the hot
//! path takes no lock (a cuBLAS handle must not be used by two threads at once, and
//! `cublasSetStream` is a field store).

include!("api.rs");

use crate::driver::{Device, StreamHandle};
use crate::CudaError;
use cudarc::cublas::sys;
use regflow_plan::DType;
use std::cell::RefCell;
use std::ffi::c_void;
use std::sync::OnceLock;

/// Whether cuBLAS (`libcublas`) can be loaded; cudarc panics on its first call otherwise.
/// Probed once per process.
pub fn available() -> Result<(), CudaError> {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to open the library by its candidate names.
    if *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() }) {
        return Ok(());
    }
    Err(CudaError::MissingLibrary {
        library: "libcublas (cuBLAS)",
        searched: cudarc::get_lib_name_candidates("cublas").join(", "),
        hint: "install the CUDA toolkit or `pip install nvidia-cublas`, and add the folder holding \
               libcublas.so.13 (and libcublasLt.so.13) to LD_LIBRARY_PATH",
    })
}

/// The library error of `call` as a [`CudaError::Call`].
fn failed(call: &str, ordinal: usize, status: sys::cublasStatus_t) -> CudaError {
    CudaError::Call { call: call.to_string(), ordinal, message: format!("{status:?}") }
}

/// One cuBLAS handle of the current thread, for one device; destroyed when the thread
/// ends.
struct Handle {
    raw: sys::cublasHandle_t,
    ordinal: usize,
    /// The stream last set, so that a thread firing on one stream sets it once.
    stream: Option<u64>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: created by `cublasCreate` on this thread and destroyed once; a failure
        // at thread exit (the driver already shut down) is nothing to act on.
        let _ = unsafe { sys::cublasDestroy_v2(self.raw) };
    }
}

thread_local! {
    /// This thread's handles, one per device it has run products on (almost always one).
    static HANDLES: RefCell<Vec<Handle>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with this thread's handle of device `ordinal` bound to `stream`, making the
/// handle on the thread's first product there.
fn with_handle<R>(
    ordinal: usize,
    stream: StreamHandle,
    f: impl FnOnce(sys::cublasHandle_t) -> Result<R, CudaError>,
) -> Result<R, CudaError> {
    HANDLES.with(|handles| {
        // Never re-entered: `f` only calls cuBLAS.
        let mut handles = handles.borrow_mut();
        let at = match handles.iter().position(|h| h.ordinal == ordinal) {
            Some(at) => at,
            None => {
                // cublasCreate binds the handle to the current context's device.
                Device::open(ordinal)?.bind()?;
                let mut raw = std::ptr::null_mut();
                // SAFETY: writes a new handle to `raw`.
                unsafe { sys::cublasCreate_v2(&mut raw) }.result().map_err(|e| failed("cublasCreate", ordinal, e.0))?;
                let handle = Handle { raw, ordinal, stream: None };
                // The default math mode: no TF32 tensor-op rounding of f32 products, so
                // results match the CPU's to 1e-5.
                // SAFETY: a live handle.
                unsafe { sys::cublasSetMathMode(handle.raw, sys::cublasMath_t::CUBLAS_DEFAULT_MATH) }
                    .result()
                    .map_err(|e| failed("cublasSetMathMode", ordinal, e.0))?;
                handles.push(handle);
                handles.len() - 1
            }
        };
        let handle = &mut handles[at];
        if handle.stream != Some(stream.0) {
            // SAFETY: a live handle and a live stream of its device.
            unsafe { sys::cublasSetStream_v2(handle.raw, stream.0 as usize as sys::cudaStream_t) }
                .result()
                .map_err(|e| failed("cublasSetStream", ordinal, e.0))?;
            handle.stream = Some(stream.0);
        }
        f(handle.raw)
    })
}

/// cuBLAS on one device: what an op kernel keeps to queue products.
#[derive(Debug, Clone, Copy)]
pub struct Blas {
    ordinal: usize,
    /// On a dry-run device: products are checked ([`Gemm::check`]), not run.
    dry: bool,
}

impl Blas {
    /// cuBLAS for device `ordinal`, after checking the library loads and the device opens
    /// (at job build, so a missing library is an error then, not at the first firing).
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        if Device::open(ordinal)?.is_dry() {
            return Ok(Self { ordinal, dry: true });
        }
        available()?;
        Ok(Self { ordinal, dry: false })
    }

    /// Queues `gemm` on `stream`: `c = alpha · a·b + beta · c` per batch element, with `a`,
    /// `b`, `c` device addresses of `dtype` elements (f32, f64, bf16 or f16), or `c` of f32
    /// elements when `wide_output` (16-bit operands summed into an f32 accumulator).
    /// Allocates nothing.
    ///
    /// # Safety
    ///
    /// The addresses must hold the elements `gemm`'s sizes, leading dimensions and batch
    /// strides reach, valid until the stream has run the product; `stream` must be a live
    /// stream of this device, whose context is current on the calling thread.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm(
        &self,
        stream: StreamHandle,
        dtype: DType,
        gemm: &Gemm,
        (a, b, c): (u64, u64, u64),
        (alpha, beta): (f64, f64),
        wide_output: bool,
    ) -> Result<(), CudaError> {
        let ordinal = self.ordinal;
        gemm.check().map_err(|message| CudaError::Call { call: "cuBLAS GEMM".into(), ordinal, message })?;
        if self.dry {
            return Ok(());
        }
        let op = |t: bool| if t { sys::cublasOperation_t::CUBLAS_OP_T } else { sys::cublasOperation_t::CUBLAS_OP_N };
        let (first, second) = if gemm.swapped { (b, a) } else { (a, b) };
        let g = *gemm;
        use sys::cublasComputeType_t::{CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_64F};
        use sys::cudaDataType::{CUDA_R_16BF, CUDA_R_16F, CUDA_R_32F, CUDA_R_64F};
        // One call for every dtype: f32, bf16 and f16 operands accumulate in f32 (never TF32:
        // that is CUBLAS_COMPUTE_32F_FAST_TF32), so f32 matches the CPU to 1e-5 and a 16-bit
        // result is rounded once, as the CPU's 16-bit products; f64 in f64.
        let (data, compute) = match dtype {
            DType::F32 => (CUDA_R_32F, CUBLAS_COMPUTE_32F),
            DType::F64 => (CUDA_R_64F, CUBLAS_COMPUTE_64F),
            DType::Bf16 => (CUDA_R_16BF, CUBLAS_COMPUTE_32F),
            DType::F16 => (CUDA_R_16F, CUBLAS_COMPUTE_32F),
            DType::I64 => {
                let message = "cuBLAS has no integer product".into();
                return Err(CudaError::Call { call: "cuBLAS GEMM".into(), ordinal, message });
            }
        };
        let c_data = if wide_output && matches!(dtype, DType::Bf16 | DType::F16) { CUDA_R_32F } else { data };
        // alpha and beta are host values (the default pointer mode) of the compute type.
        let (alpha32, beta32) = (alpha as f32, beta as f32);
        let (alpha, beta) = match compute {
            CUBLAS_COMPUTE_64F => (&alpha as *const f64 as *const c_void, &beta as *const f64 as *const c_void),
            _ => (&alpha32 as *const f32 as *const c_void, &beta32 as *const f32 as *const c_void),
        };
        with_handle(ordinal, stream, |handle| {
            // SAFETY: forwarded to the caller; alpha and beta live across the call.
            unsafe {
                sys::cublasGemmStridedBatchedEx(
                    handle,
                    op(g.transa),
                    op(g.transb),
                    g.m,
                    g.n,
                    g.k,
                    alpha,
                    first as usize as *const c_void,
                    data,
                    g.lda,
                    g.stride_a,
                    second as usize as *const c_void,
                    data,
                    g.ldb,
                    g.stride_b,
                    beta,
                    c as usize as *mut c_void,
                    c_data,
                    g.ldc,
                    g.stride_c,
                    g.batch,
                    compute,
                    sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
                )
            }
            .result()
            .map_err(|e| failed(&format!("cublasGemmStridedBatchedEx({dtype})"), ordinal, e.0))
        })
    }
}
