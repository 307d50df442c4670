//! Buckets: one collective round for several tensors, packed end to end.
//!
//! The compiler merges small collectives of independent tensors into one bucket member per
//! device (see `regflow_graph`'s `compile/bucket.rs`): data inputs and outputs `0..parts`.
//! The kernel packs the inputs into a flat buffer, runs the group's flat kernel (in process
//! or across nodes, whichever the group is) once on it, and unpacks the result:
//!
//! - [`CollectiveOp::AllReduceBucket`]: the parts end to end, all-reduced; output `i` is the
//!   sum of input `i` (DDP's gradient buckets).
//! - [`CollectiveOp::ReduceScatterBucket`]: every part is split into `size` equal blocks and
//!   the packed buffer holds them rank by rank (every part's block 0, then every part's
//!   block 1, ...), so the flat reduce-scatter's block `r` is rank `r`'s block of every part;
//!   output `i` is this member's block of the sum of part `i` (ZeRO's gradient buckets).
//! - [`CollectiveOp::AllGatherBucket`]: the inverse: this member's blocks end to end, gathered
//!   rank by rank, and each part's blocks copied to their places in output `i` (the updated
//!   parameters of a ZeRO bucket).
//!
//! The two buffers are allocated once, when the kernel is made; a round allocates nothing.
//! The copies cost two passes over a bucket's bytes, which is why only small tensors are
//! bucketed: for them one rendezvous (thread wake-ups, or a network round trip) costs more
//! than the copy. Sums are unchanged: each element is still summed over the group in rank
//! order.

use crate::kernel::{Kernel, KernelError, KernelIo};
use regflow_memory::{Arena, BufferView, MemoryKind};
use regflow_plan::{CollectiveConf, CollectiveOp};
use std::ops::Range;

/// Checks the data registers of a bucket of `op` over `size` members: an all-reduce part's
/// sum is as long as its summands; a reduce-scatter part's output (an all-gather part's
/// input) is one of `size` equal blocks of whole elements of its whole tensor.
pub(super) fn check_parts(
    op: CollectiveOp,
    size: u32,
    element: usize,
    inputs: &[u64],
    outputs: &[u64],
) -> Result<(), String> {
    let members = u64::from(size.max(1));
    for (i, (&input, &output)) in inputs.iter().zip(outputs).enumerate() {
        let (whole, block) = match op {
            CollectiveOp::ReduceScatterBucket { .. } => (input, output),
            CollectiveOp::AllGatherBucket { .. } => (output, input),
            _ if input != output => {
                return Err(format!(
                    "bucket part {i} has {input} input but {output} output bytes; each part's sum is as long as its summands"
                ))
            }
            _ => continue,
        };
        if block.checked_mul(members) != Some(whole) || block % element as u64 != 0 {
            return Err(format!(
                "bucket part {i} has {input} input and {output} output bytes; a {} part is a tensor of whole \
                 {element}-byte elements and one of {members} equal blocks of it",
                op_of(op)
            ));
        }
    }
    Ok(())
}

fn op_of(op: CollectiveOp) -> &'static str {
    match op {
        CollectiveOp::ReduceScatterBucket { .. } => "reduce-scatter bucket's",
        _ => "all-gather bucket's",
    }
}

/// Wraps the flat collective kernel of a bucket of `parts.len()` tensors.
pub(super) struct BucketKernel {
    flat: Box<dyn Kernel>,
    op: CollectiveOp,
    size: usize,
    /// Bytes of each part in this member's flat input block (all-gather), flat output
    /// block (reduce-scatter) or flat buffer (all-reduce).
    parts: Vec<Range<usize>>,
    /// Bytes of one member's block of every part (reduce-scatter, all-gather); the whole
    /// flat buffer for an all-reduce.
    block: usize,
    /// The packed inputs and the flat result, side by side; kept alive for the views.
    _buffers: Arena,
    packed: [BufferView; 1],
    result: [BufferView; 1],
}

impl BucketKernel {
    /// A bucket of `conf.op` around `flat`, the collective of its parts end to end, with
    /// data registers of `inputs` and `outputs` bytes (checked by [`check_parts`]); `actor`
    /// names the buffers.
    pub(super) fn new(
        actor: &str,
        flat: Box<dyn Kernel>,
        conf: &CollectiveConf,
        inputs: &[u64],
        outputs: &[u64],
    ) -> Result<Self, String> {
        let size = conf.size.max(1) as usize;
        // The bytes of each part in one member's block (or in the whole buffer).
        let part_bytes = match conf.op {
            CollectiveOp::AllGatherBucket { .. } => inputs,
            _ => outputs,
        };
        let mut parts = Vec::with_capacity(part_bytes.len());
        let mut block = 0usize;
        for &bytes in part_bytes {
            let bytes =
                usize::try_from(bytes).map_err(|_| format!("a part of {bytes} bytes does not fit in memory"))?;
            parts.push(block..block + bytes);
            block += bytes;
        }
        let whole = match conf.op {
            CollectiveOp::AllReduceBucket { .. } => block,
            _ => block.checked_mul(size).ok_or("the bucket's bytes overflow")?,
        };
        let (packed_bytes, result_bytes) = match conf.op {
            CollectiveOp::ReduceScatterBucket { .. } => (whole, block),
            CollectiveOp::AllGatherBucket { .. } => (block, whole),
            _ => (whole, whole),
        };
        // The result starts on a 64-byte boundary, as register slots do.
        let result_at = packed_bytes.next_multiple_of(64);
        let buffers = Arena::allocate(&format!("{actor} bucket"), MemoryKind::Host, (result_at + result_bytes) as u64)
            .map_err(|e| e.to_string())?;
        let packed = buffers.view(0, packed_bytes as u64).map_err(|e| e.to_string())?;
        let result = buffers.view(result_at as u64, result_bytes as u64).map_err(|e| e.to_string())?;
        Ok(Self { flat, op: conf.op, size, parts, block, _buffers: buffers, packed: [packed], result: [result] })
    }

    /// Where part `i`'s bytes lie in the flat buffer and in its own tensor, as pairs of
    /// byte ranges (flat, tensor): one pair end to end, or, where `blocked`, one per member
    /// (block `r` of the part at the part's place in block `r` of the buffer).
    fn spans(&self, i: usize, blocked: bool) -> impl Iterator<Item = (Range<usize>, Range<usize>)> + '_ {
        let part = &self.parts[i];
        let (len, blocks) = (part.len(), if blocked { self.size } else { 1 });
        (0..blocks).map(move |r| {
            let at = r * self.block + part.start;
            (at..at + len, r * len..(r + 1) * len)
        })
    }

    /// Packs the inputs: end to end, or (reduce-scatter) block `r` of every part in block
    /// `r` of the buffer.
    fn pack(&self, io: &KernelIo<'_>, packed: &mut [u8]) {
        let blocked = matches!(self.op, CollectiveOp::ReduceScatterBucket { .. });
        for i in 0..self.parts.len() {
            let input = io.input(i);
            for (flat, tensor) in self.spans(i, blocked) {
                packed[flat].copy_from_slice(&input[tensor]);
            }
        }
    }

    /// Unpacks the flat result into the outputs: end to end, or (all-gather) block `r` of
    /// the result into each part's block `r`.
    fn unpack(&self, result: &[u8], io: &mut KernelIo<'_>) {
        let blocked = matches!(self.op, CollectiveOp::AllGatherBucket { .. });
        for i in 0..self.parts.len() {
            let output = io.output(i);
            for (flat, tensor) in self.spans(i, blocked) {
                output[tensor].copy_from_slice(&result[flat]);
            }
        }
    }
}

impl std::fmt::Debug for BucketKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BucketKernel").field("op", &self.op).field("parts", &self.parts).finish_non_exhaustive()
    }
}

impl Kernel for BucketKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        // SAFETY: the buffers belong to this kernel; no view of them escapes a firing.
        let packed = unsafe { self.packed[0].as_mut_slice() };
        self.pack(io, packed);
        let mut flat_io = KernelIo::new(io.piece(), io.group(), &self.packed, &self.result, io.context());
        self.flat.run(&mut flat_io)?;
        // SAFETY: as above; the flat kernel has returned and holds no view.
        let result = unsafe { self.result[0].as_slice() };
        self.unpack(result, io);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_must_be_equal_blocks_of_whole_elements() {
        let rs = CollectiveOp::ReduceScatterBucket { parts: 2 };
        let ag = CollectiveOp::AllGatherBucket { parts: 2 };
        let ar = CollectiveOp::AllReduceBucket { parts: 2 };
        assert_eq!(check_parts(rs, 2, 4, &[16, 8], &[8, 4]), Ok(()));
        assert_eq!(check_parts(ag, 2, 4, &[8, 4], &[16, 8]), Ok(()));
        assert_eq!(check_parts(ar, 2, 4, &[16, 8], &[16, 8]), Ok(()));
        assert_eq!(
            check_parts(rs, 2, 4, &[16, 12], &[8, 4]).unwrap_err(),
            "bucket part 1 has 12 input and 4 output bytes; a reduce-scatter bucket's part is a tensor of whole \
             4-byte elements and one of 2 equal blocks of it"
        );
        // Three elements do not split into two blocks of whole elements.
        assert!(check_parts(ag, 2, 4, &[6], &[12]).unwrap_err().contains("all-gather bucket's part"));
        assert_eq!(
            check_parts(ar, 2, 4, &[16], &[8]).unwrap_err(),
            "bucket part 0 has 16 input but 8 output bytes; each part's sum is as long as its summands"
        );
    }
}
