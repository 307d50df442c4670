//! Errors of the CUDA backend, as sentences naming the device, call or kernel involved.

/// Why the CUDA backend cannot do what was asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    /// This build has no CUDA backend.
    #[error("this build of regflow has no CUDA backend: rebuild with `--features cuda` to run on NVIDIA GPUs")]
    NotBuilt,
    /// A shared library the backend loads at run time is not on this machine.
    #[error("the CUDA library {library} was not found (looked for {searched}); {hint}")]
    MissingLibrary {
        /// The library (`libcuda`, `libnvrtc`, `libcublas`, `libnccl`).
        library: &'static str,
        /// The file names tried.
        searched: String,
        /// What to install or set.
        hint: &'static str,
    },
    /// The driver works but has no device with this ordinal.
    #[error("there is no CUDA device cuda:{ordinal}: the driver reports {count} device(s)")]
    NoDevice {
        /// The device asked for.
        ordinal: usize,
        /// How many the driver has.
        count: usize,
    },
    /// A driver, cuBLAS or NCCL call failed.
    #[error("{call} failed on cuda:{ordinal}: {message}")]
    Call {
        /// The call, e.g. `cuMemAllocManaged(4096 bytes)`.
        call: String,
        /// The device.
        ordinal: usize,
        /// The library's own description of the failure.
        message: String,
    },
    /// NVRTC rejected a kernel source.
    #[error("NVRTC could not compile the CUDA kernel source '{source_name}' for {arch}:\n{log}")]
    Compile {
        /// The source's name in [`crate::sources::SOURCES`].
        source_name: &'static str,
        /// The virtual architecture it was compiled for (`compute_90`).
        arch: String,
        /// NVRTC's log.
        log: String,
    },
    /// `REGFLOW_CUDA_DEFINES` ([`crate::sources::DEFINES_VARIABLE`]) is not a list of macro
    /// definitions.
    #[error(
        "REGFLOW_CUDA_DEFINES is {value:?}, but {why}: it takes comma-separated macro definitions NAME or \
         NAME=VALUE (NAME a C identifier, VALUE letters, digits, '_', '.', '+' and '-'), which every CUDA kernel \
         source is compiled with"
    )]
    Defines {
        /// The variable's value.
        value: String,
        /// What is wrong with it.
        why: String,
    },
    /// No kernel source defines this entry point.
    #[error("no CUDA kernel source defines the entry point '{entry}'{nearest}")]
    UnknownEntry {
        /// The name asked for.
        entry: String,
        /// ", did you mean 'x'?" or nothing.
        nearest: String,
    },
    /// The device cannot serve regflow's register model.
    #[error("cuda:{ordinal} ({name}) cannot be used: {why}")]
    Unsuitable {
        /// The device.
        ordinal: usize,
        /// Its name.
        name: String,
        /// What it lacks.
        why: String,
    },
}

impl From<CudaError> for regflow_kernels::KernelError {
    fn from(e: CudaError) -> Self {
        regflow_kernels::KernelError(e.to_string())
    }
}
