//! cuBLAS without CUDA: the argument mapping (plain host arithmetic) as in the real
//! module, and every call answers [`CudaError::NotBuilt`].

include!("api.rs");

use crate::driver::StreamHandle;
use crate::CudaError;
use regflow_plan::DType;

/// Whether cuBLAS can be loaded: not in this build.
pub fn available() -> Result<(), CudaError> {
    Err(CudaError::NotBuilt)
}

/// cuBLAS on one device (not in this build).
#[derive(Debug, Clone, Copy)]
pub struct Blas {
    _private: (),
}

impl Blas {
    /// cuBLAS for device `ordinal`: [`CudaError::NotBuilt`] in this build.
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        let _ = ordinal;
        Err(CudaError::NotBuilt)
    }

    /// Queues `gemm` on `stream`.
    ///
    /// # Safety
    ///
    /// As the real module's: the addresses must hold what `gemm` reaches.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm(
        &self,
        stream: StreamHandle,
        dtype: DType,
        gemm: &Gemm,
        operands: (u64, u64, u64),
        scales: (f64, f64),
        wide_output: bool,
    ) -> Result<(), CudaError> {
        let _ = (stream, dtype, gemm, operands, scales, wide_output);
        Err(CudaError::NotBuilt)
    }
}
