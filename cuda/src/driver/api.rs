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

/// Threads of a column-reduction block in x (consecutive outputs) and in y (slices of each
/// output's reduced range): `COLUMN_THREADS` in the kernel prelude, whose shared array of
/// partials is this square.
pub const COLUMN_THREADS: u32 = 32;

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

    /// A grid for an elementwise kernel that steps eight elements per thread where its
    /// pointers are aligned (`EIGHT` in the prelude): one thread per eight of `n` elements
    /// (at least one block). Its grid-stride loops cover all `n` on any grid, so the
    /// one-element loop that takes the rest needs no other.
    pub fn eights(n: u64) -> Self {
        Self::linear(n.div_ceil(8))
    }

    /// A column reduction (`FOR_EACH_COLUMN` in the prelude) of `outputs` outputs, each the
    /// combination of `reduced` elements: blocks of 32 outputs × 32 slices of the reduced
    /// range, up to [`MAX_LINEAR_BLOCKS`] blocks (the kernels loop over the rest). Fewer
    /// than 32 elements per output get one thread per output, the [`Grid::linear`] shape,
    /// where most of a block's slices would have nothing to add. The slicing depends on
    /// `reduced` alone, so a reduction's order (and its result) does not depend on `outputs`.
    pub fn columns(outputs: u64, reduced: u64) -> Self {
        if reduced < u64::from(COLUMN_THREADS) {
            return Self::linear(outputs);
        }
        let blocks = outputs.div_ceil(u64::from(COLUMN_THREADS)).clamp(1, MAX_LINEAR_BLOCKS) as u32;
        Self { blocks: (blocks, 1, 1), threads: (COLUMN_THREADS, COLUMN_THREADS, 1), shared_bytes: 0 }
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

#[cfg(test)]
mod grid_tests {
    use super::*;

    #[test]
    fn column_grids_slice_long_reductions_only() {
        // A GPT-2 bias gradient: 768 outputs of 8192 rows, 24 blocks of 32 × 32.
        let grid = Grid::columns(768, 8192);
        assert_eq!((grid.blocks, grid.threads), ((24, 1, 1), (32, 32, 1)));
        assert_eq!(Grid::columns(33, 32).blocks.0, 2);
        // Short ranges: one thread per output, as a grid-stride kernel.
        assert_eq!(Grid::columns(768, 31), Grid::linear(768));
        // At least one block; at most MAX_LINEAR_BLOCKS, the kernels looping over the rest.
        assert_eq!(Grid::columns(0, 1000).blocks.0, 1);
        assert_eq!(u64::from(Grid::columns(u64::MAX / 2, 1000).blocks.0), MAX_LINEAR_BLOCKS);
    }

    #[test]
    fn eight_element_grids_have_a_thread_per_eight_elements() {
        // 3 blocks of 256 threads for 3 · 256 · 8 elements, one more for one more element.
        assert_eq!(Grid::eights(3 * 256 * 8).blocks, (3, 1, 1));
        assert_eq!(Grid::eights(3 * 256 * 8 + 1).blocks, (4, 1, 1));
        assert_eq!(Grid::eights(0), Grid::linear(0));
        assert_eq!(u64::from(Grid::eights(u64::MAX / 2).blocks.0), MAX_LINEAR_BLOCKS);
    }
}
