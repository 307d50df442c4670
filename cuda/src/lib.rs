//! regflow's CUDA backend: the driver probe, devices with their streams and completion
//! callbacks, managed-memory arenas, the NVRTC-compiled kernel sources and the op kernels
//! that launch them.
//!
//! Built without the `cuda` feature, the same modules exist as dummies whose calls answer
//! [`CudaError::NotBuilt`]: the runtime calls [`probe`] and [`Device::open`] without a
//! `cfg` and reports the answer. Built with it, cudarc loads libcuda, NVRTC, cuBLAS and
//! NCCL at run time; each library is probed (`is_culib_present`) before its first call,
//! because cudarc panics on a missing one, so no GPU or no driver is an error naming what
//! is missing.
//!
//! **Why managed memory.** A plan's arena for a `cuda` device is one `cuMemAllocManaged`
//! allocation, preferring the device. Kernels read it at device speed, and everything the
//! host does with registers (feeds, fetches, preloaded variables, checkpoints, in-process
//! collectives, and ops that have no CUDA kernel yet, run by their CPU kernels) works on
//! the same addresses without copy actors. The device must have concurrent managed access
//! (Linux, Pascal or newer), checked when it is opened.

#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

/// One kernel argument: where its value is and how many bytes it has. [`launch`] checks
/// the sizes against the parameters NVRTC compiled for the entry point before anything
/// runs, so an argument list that does not match its kernel is an error naming the entry,
/// not memory corruption on the GPU.
#[derive(Debug, Clone, Copy)]
pub struct Arg {
    /// The value's address, as the driver takes it.
    pub ptr: *mut std::ffi::c_void,
    /// Its size in bytes.
    pub size: usize,
}

impl Arg {
    /// The argument `value`, which must live until the launch call returns.
    pub fn of<T>(value: &T) -> Self {
        Self { ptr: value as *const T as *mut std::ffi::c_void, size: std::mem::size_of::<T>() }
    }
}

/// The kernel arguments of one launch, as [`launch`] takes them: one [`Arg`] per
/// parameter, each pointing to a value that lives until the launch call returns. Built on
/// the stack.
///
/// ```
/// let (x, n) = (0x1000u64, 7u32);
/// let args = regflow_cuda::args![x, n];
/// assert_eq!((args.len(), args[0].size, args[1].size), (2, 8, 4));
/// ```
#[macro_export]
macro_rules! args {
    ($($a:expr),* $(,)?) => {
        [$($crate::Arg::of(&$a)),*]
    };
}

mod error;
pub mod ops;
pub mod ptx_cache;
pub mod sources;

#[cfg_attr(feature = "cuda", path = "driver/real.rs")]
#[cfg_attr(not(feature = "cuda"), path = "driver/dummy.rs")]
pub mod driver;

#[cfg_attr(feature = "cuda", path = "blas/real.rs")]
#[cfg_attr(not(feature = "cuda"), path = "blas/dummy.rs")]
pub mod blas;

#[cfg_attr(feature = "cuda", path = "nccl/real.rs")]
#[cfg_attr(not(feature = "cuda"), path = "nccl/dummy.rs")]
pub mod nccl;

#[cfg_attr(feature = "cuda", path = "nvrtc/real.rs")]
#[cfg_attr(not(feature = "cuda"), path = "nvrtc/dummy.rs")]
pub mod nvrtc;

pub use driver::{
    copy_on_device, copy_to_device_async, copy_to_host, enable_dry_run, launch, probe, synchronize, Device, DeviceInfo,
    Function, Grid, HostCallback, PinnedBuffer, Stream, StreamHandle, StreamTimer,
};
pub use error::CudaError;
pub use ops::{queued_ops, register};

/// `names` without repeats, in their first order (cudarc's candidate library names repeat
/// some; an error message lists each once).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn distinct(mut names: Vec<String>) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    names.retain(|n| seen.insert(n.clone()));
    names
}

/// Whether this build has the CUDA backend (the `cuda` feature).
pub const BUILT: bool = cfg!(feature = "cuda");
