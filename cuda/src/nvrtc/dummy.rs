//! NVRTC without CUDA: every call answers [`CudaError::NotBuilt`].

use crate::sources::KernelSource;
use crate::CudaError;

/// Whether NVRTC can be loaded: not in this build.
pub fn available() -> Result<(), CudaError> {
    Err(CudaError::NotBuilt)
}

/// Compiles every source for `arch`: nothing to do in this build.
pub fn compile_all(arch: &str) {
    let _ = arch;
}

/// Compiles `source` (with the prelude) to PTX for `arch`.
pub fn compile(source: &KernelSource, arch: &str) -> Result<String, CudaError> {
    let _ = (source, arch);
    Err(CudaError::NotBuilt)
}

/// Compiles `source` for `arch` with the macro definitions `defines`.
pub fn compile_variant(source: &KernelSource, arch: &str, defines: &str) -> Result<String, CudaError> {
    let _ = (source, arch, defines);
    Err(CudaError::NotBuilt)
}
