// Types shared by the real driver module and its dummy: what the rest of the crate (and the
// runtime) sees of a device, whichever is built.

/// What the driver says about one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device's ordinal (`cuda:N`).
    pub ordinal: usize,
    /// Its marketing name (`NVIDIA H100 80GB HBM3`).
    pub name: String,
    /// Its memory in bytes.
    pub total_bytes: u64,
    /// Compute capability (major, minor): the architecture NVRTC compiles for.
    pub compute_capability: (u32, u32),
    /// Whether host and device may touch managed memory at the same time (Linux, Pascal
    /// and newer); regflow's arenas rely on it.
    pub concurrent_managed_access: bool,
}

impl DeviceInfo {
    /// The virtual architecture NVRTC compiles this device's kernels for (`compute_90`).
    pub fn arch(&self) -> String {
        format!("compute_{}{}", self.compute_capability.0, self.compute_capability.1)
    }
}

/// A stream's native handle (a `CUstream`), as kernels find it in their
/// [`StreamContext`](regflow_kernels::StreamContext); 0 is no stream (a host device).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamHandle(pub u64);

/// Launch geometry of one kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grid {
    /// Blocks in x, y, z.
    pub blocks: (u32, u32, u32),
    /// Threads per block in x, y, z.
    pub threads: (u32, u32, u32),
    /// Dynamic shared memory per block, in bytes.
    pub shared_bytes: u32,
}

/// Threads per block of the elementwise kernels.
pub const LINEAR_THREADS: u32 = 256;

/// Most blocks a grid-stride kernel starts: enough to fill any current GPU several times
/// over; the kernels loop over the rest.
pub const MAX_LINEAR_BLOCKS: u64 = 65_535;

impl Grid {
    /// A one-dimensional grid for `n` elements of a grid-stride kernel (`FOR_EACH` in the
    /// prelude): one thread per element up to [`MAX_LINEAR_BLOCKS`] blocks. At least one
    /// block, so an empty tensor still launches a valid grid.
    pub fn linear(n: u64) -> Self {
        let blocks = n.div_ceil(u64::from(LINEAR_THREADS)).clamp(1, MAX_LINEAR_BLOCKS) as u32;
        Self { blocks: (blocks, 1, 1), threads: (LINEAR_THREADS, 1, 1), shared_bytes: 0 }
    }

    /// One block of `threads` threads per row, for `rows` rows (row-wise reductions:
    /// softmax, layer norm, cross-entropy), with `shared_bytes` of shared memory.
    pub fn rows(rows: u64, threads: u32, shared_bytes: u32) -> Self {
        let x = rows.clamp(1, u64::from(u32::MAX >> 1)) as u32;
        Self { blocks: (x, 1, 1), threads: (threads, 1, 1), shared_bytes }
    }
}

/// A function the driver calls on its own thread when a stream reaches it. It must not call
/// CUDA; regflow's only sends a message.
pub type HostCallback = unsafe extern "C" fn(*mut std::ffi::c_void);
