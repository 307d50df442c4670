//! Gradient buckets: one collective round for several tensors, packed end to end.
//!
//! The compiler merges small all-reduces of independent gradients into one
//! [`CollectiveOp::AllReduceBucket`](regflow_plan::CollectiveOp::AllReduceBucket) member per
//! device (see `regflow_graph`'s `compile/bucket.rs`): data inputs and outputs `0..parts`.
//! The kernel packs the inputs into a flat buffer, runs the group's all-reduce kernel (in
//! process or across nodes, whichever the group is) once on it, and unpacks the sums. The
//! two buffers are allocated once, when the kernel is made; a round allocates nothing. The
//! copies cost two passes over a bucket's bytes, which is why only small tensors are
//! bucketed: for them one rendezvous (thread wake-ups, or a network round trip) costs more
//! than the copy.

use crate::kernel::{Kernel, KernelError, KernelIo};
use regflow_memory::{Arena, BufferView, MemoryKind};

/// Wraps the flat all-reduce kernel of a bucket of `parts.len()` tensors.
pub(super) struct BucketKernel {
    flat: Box<dyn Kernel>,
    /// Byte range of each part in the flat buffers.
    parts: Vec<std::ops::Range<usize>>,
    /// The packed inputs and the flat sum, side by side; kept alive for the views.
    _buffers: Arena,
    packed: [BufferView; 1],
    summed: [BufferView; 1],
}

impl BucketKernel {
    /// A bucket of parts of `part_bytes` bytes each around `flat`, the all-reduce of their
    /// concatenation; `actor` names the buffers.
    pub(super) fn new(actor: &str, flat: Box<dyn Kernel>, part_bytes: &[u64]) -> Result<Self, String> {
        let mut parts = Vec::with_capacity(part_bytes.len());
        let mut total = 0usize;
        for &bytes in part_bytes {
            let bytes =
                usize::try_from(bytes).map_err(|_| format!("a part of {bytes} bytes does not fit in memory"))?;
            parts.push(total..total + bytes);
            total += bytes;
        }
        // The sum starts on a 64-byte boundary, as register slots do.
        let summed_at = total.next_multiple_of(64);
        let buffers = Arena::allocate(&format!("{actor} bucket"), MemoryKind::Host, (summed_at + total) as u64)
            .map_err(|e| e.to_string())?;
        let packed = buffers.view(0, total as u64).map_err(|e| e.to_string())?;
        let summed = buffers.view(summed_at as u64, total as u64).map_err(|e| e.to_string())?;
        Ok(Self { flat, parts, _buffers: buffers, packed: [packed], summed: [summed] })
    }
}

impl std::fmt::Debug for BucketKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BucketKernel").field("parts", &self.parts).finish_non_exhaustive()
    }
}

impl Kernel for BucketKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        // SAFETY: the buffers belong to this kernel; no view of them escapes a firing.
        let packed = unsafe { self.packed[0].as_mut_slice() };
        for (i, range) in self.parts.iter().enumerate() {
            packed[range.clone()].copy_from_slice(io.input(i));
        }
        let mut flat_io = KernelIo::new(io.piece(), io.group(), &self.packed, &self.summed, io.context());
        self.flat.run(&mut flat_io)?;
        // SAFETY: as above; the flat kernel has returned and holds no view.
        let summed = unsafe { self.summed[0].as_slice() };
        for (i, range) in self.parts.iter().enumerate() {
            io.output(i).copy_from_slice(&summed[range.clone()]);
        }
        Ok(())
    }
}
