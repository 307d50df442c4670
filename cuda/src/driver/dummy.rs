//! The driver without CUDA: every type of the real module, and every call answers
//! [`CudaError::NotBuilt`], so callers need no `cfg`.

include!("api.rs");

use crate::CudaError;
use regflow_memory::ArenaMemory;

/// The devices of this machine: none without the `cuda` feature.
pub fn probe() -> Result<Vec<DeviceInfo>, CudaError> {
    Err(CudaError::NotBuilt)
}

/// A device with its context (not in this build).
#[derive(Debug, Clone)]
pub struct Device {
    info: DeviceInfo,
}

impl Device {
    /// Opens device `ordinal`: [`CudaError::NotBuilt`] in this build.
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        let _ = ordinal;
        Err(CudaError::NotBuilt)
    }

    /// What the driver says about the device.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Whether this is a dry-run device (never, in this build).
    pub fn is_dry(&self) -> bool {
        false
    }

    /// Free device memory in bytes.
    pub fn free_bytes(&self) -> Result<u64, CudaError> {
        Err(CudaError::NotBuilt)
    }

    /// Makes the device's context current on the calling thread.
    pub fn bind(&self) -> Result<(), CudaError> {
        Err(CudaError::NotBuilt)
    }

    /// A new stream of the device.
    pub fn stream(&self) -> Result<Stream, CudaError> {
        Err(CudaError::NotBuilt)
    }

    /// `bytes` of managed memory for an arena.
    pub fn managed(&self, label: &str, bytes: u64) -> Result<Box<dyn ArenaMemory>, CudaError> {
        let _ = (label, bytes);
        Err(CudaError::NotBuilt)
    }

    /// The kernel `entry` of the built-in sources, compiled for this device.
    pub fn function(&self, entry: &str) -> Result<Function, CudaError> {
        let _ = entry;
        Err(CudaError::NotBuilt)
    }
}

/// A stream of a device (not in this build).
#[derive(Debug)]
pub struct Stream {
    _private: (),
}

impl Stream {
    /// The native handle kernels launch onto.
    pub fn handle(&self) -> StreamHandle {
        StreamHandle(0)
    }

    /// Waits until everything enqueued so far has run.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        Err(CudaError::NotBuilt)
    }

    /// Enqueues `callback(arg)`.
    ///
    /// # Safety
    ///
    /// `arg` must stay valid until the callback has run.
    pub unsafe fn call_back(&self, callback: HostCallback, arg: *mut std::ffi::c_void) -> Result<(), CudaError> {
        let _ = (callback, arg);
        Err(CudaError::NotBuilt)
    }
}

/// Timing marks of one stream (not in this build).
#[derive(Debug)]
pub struct StreamTimer {
    _private: (),
}

impl Stream {
    /// A timer of `capacity` marks per batch: [`CudaError::NotBuilt`] in this build.
    pub fn timer(&self, capacity: usize) -> Result<StreamTimer, CudaError> {
        let _ = capacity;
        Err(CudaError::NotBuilt)
    }
}

impl StreamTimer {
    /// Marks this batch can still record.
    pub fn room(&self) -> usize {
        0
    }

    /// Records the next mark on `stream`.
    pub fn mark(&mut self, stream: &Stream) -> Result<usize, CudaError> {
        let _ = stream;
        Err(CudaError::NotBuilt)
    }

    /// Waits for `stream` and appends every mark's host instant to `out`.
    pub fn resolve(&mut self, stream: &Stream, out: &mut Vec<std::time::Instant>) -> Result<(), CudaError> {
        let _ = (stream, out);
        Err(CudaError::NotBuilt)
    }
}

/// Queues a copy of `bytes` from `src` to `dst` on `stream`.
///
/// # Safety
///
/// `src` and `dst` must be valid for `bytes` bytes until the copy ran.
pub unsafe fn copy_on_device(stream: StreamHandle, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError> {
    let _ = (stream, dst, src, bytes);
    Err(CudaError::NotBuilt)
}

/// Waits until everything queued on `stream` so far has run.
pub fn synchronize(stream: StreamHandle) -> Result<(), CudaError> {
    let _ = stream;
    Err(CudaError::NotBuilt)
}

/// Page-locked host memory for staging copies (not in this build).
#[derive(Debug)]
pub struct PinnedBuffer {
    _private: (),
}

impl PinnedBuffer {
    /// `len` bytes of page-locked memory: [`CudaError::NotBuilt`] in this build.
    pub fn new(device: &Device, len: usize) -> Result<Self, CudaError> {
        let _ = (device, len);
        Err(CudaError::NotBuilt)
    }
}

// SAFETY: never made in this build; an empty placeholder otherwise.
unsafe impl ArenaMemory for PinnedBuffer {
    fn base(&self) -> std::ptr::NonNull<u8> {
        std::ptr::NonNull::dangling()
    }

    fn len(&self) -> usize {
        0
    }
}

/// Queues a copy from page-locked memory to the device: not in this build.
///
/// # Safety
///
/// `dst` must be valid for `bytes` bytes (nothing is written in this build).
pub unsafe fn copy_to_device_async(stream: StreamHandle, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError> {
    let _ = (stream, dst, src, bytes);
    Err(CudaError::NotBuilt)
}

/// Copies device bytes to the host and waits: not in this build.
///
/// # Safety
///
/// `src` must be valid for `dst.len()` bytes (nothing is read in this build).
pub unsafe fn copy_to_host(stream: StreamHandle, dst: &mut [u8], src: u64) -> Result<(), CudaError> {
    let _ = (stream, dst, src);
    Err(CudaError::NotBuilt)
}

/// Dry runs need NVRTC: not in this build.
pub fn enable_dry_run(arch: &str) -> Result<(), CudaError> {
    let _ = arch;
    Err(CudaError::NotBuilt)
}

/// A compiled kernel of one device (not in this build).
#[derive(Debug, Clone, Copy)]
pub struct Function {
    _private: (),
}

/// Enqueues `function` on `stream`.
///
/// # Safety
///
/// `args` must match the kernel's parameters in number and type.
pub unsafe fn launch(
    stream: StreamHandle,
    function: Function,
    grid: Grid,
    args: &mut [crate::Arg],
) -> Result<(), CudaError> {
    let _ = (stream, function, grid, args);
    Err(CudaError::NotBuilt)
}
