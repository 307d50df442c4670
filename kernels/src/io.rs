//! What one firing of a kernel sees: its registers as bytes or typed tensors, its piece and
//! group position, and the context of the stream it runs on.

use regflow_memory::BufferView;
use regflow_plan::{DType, DeviceKind, GroupPosition, HostSlice, HostSliceMut, HostTensor, HostTensorMut, TensorMeta};

/// The stream a kernel runs on: its device and what the job configured for it. A CUDA
/// kernel finds its stream handle here; CPU kernels read the thread count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamContext {
    /// Kind of the device.
    pub device: DeviceKind,
    /// Index of the device among its node's devices of that kind.
    pub device_index: u16,
    /// Threads one kernel of this device may use (matrix products split their output
    /// tiles over them); a per-job setting, 1 by default.
    pub threads: usize,
    /// The device's native stream handle (a `CUstream` on `cuda`) that queued kernels
    /// launch onto; 0 on host devices.
    pub native: u64,
    /// Scratch the stream lends its kernels for the span of one firing (partial sums
    /// between two launches, a staging band): [`StreamScratch::bytes`] at
    /// [`StreamScratch::address`], as much as the most any kernel of the stream asks
    /// ([`Kernel::scratch_bytes`](crate::Kernel::scratch_bytes)). One scratch serves every
    /// kernel of the stream because the stream runs them one after another: a kernel's
    /// launches of one firing are done before the next kernel's begin.
    pub scratch: StreamScratch,
}

impl Default for StreamContext {
    fn default() -> Self {
        Self { device: DeviceKind::Cpu, device_index: 0, threads: 1, native: 0, scratch: StreamScratch::NONE }
    }
}

/// The scratch a stream lends its kernels ([`StreamContext::scratch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamScratch {
    /// Its address on the device (a device pointer on `cuda`); 0 without scratch.
    pub address: u64,
    /// Its size in bytes.
    pub bytes: u64,
}

impl StreamScratch {
    /// No scratch: the stream's kernels asked for none.
    pub const NONE: StreamScratch = StreamScratch { address: 0, bytes: 0 };
}

/// The registers of one firing.
///
/// Inputs are read-only, outputs writable. The register protocol guarantees that nobody
/// else writes an input, or touches an output, while the kernel runs.
#[derive(Debug)]
pub struct KernelIo<'a> {
    piece: u64,
    group: GroupPosition,
    inputs: &'a [BufferView],
    outputs: &'a [BufferView],
    context: &'a StreamContext,
}

/// Why a register cannot be viewed as a tensor.
fn cast_error(meta: &TensorMeta, e: bytemuck::PodCastError) -> String {
    format!("register of {meta} is not a whole, aligned {}: {e}", meta.dtype)
}

/// `bytes` as a tensor of `meta`.
pub(crate) fn view<'a>(meta: &'a TensorMeta, bytes: &'a [u8]) -> Result<HostTensor<'a>, String> {
    let data = match meta.dtype {
        DType::F32 => HostSlice::F32(bytemuck::try_cast_slice(bytes).map_err(|e| cast_error(meta, e))?),
        DType::F64 => HostSlice::F64(bytemuck::try_cast_slice(bytes).map_err(|e| cast_error(meta, e))?),
        DType::I64 => HostSlice::I64(bytemuck::try_cast_slice(bytes).map_err(|e| cast_error(meta, e))?),
        DType::Bf16 => HostSlice::Bf16(bytemuck::try_cast_slice(bytes).map_err(|e| cast_error(meta, e))?),
        DType::F16 => HostSlice::F16(bytemuck::try_cast_slice(bytes).map_err(|e| cast_error(meta, e))?),
    };
    Ok(HostTensor { shape: &meta.shape, data })
}

/// A tensor of `meta`'s shape with no elements: an input given in place (see
/// [`HostCompute::compute`](crate::host::HostCompute::compute)).
pub(crate) fn empty_view(meta: &TensorMeta) -> HostTensor<'_> {
    let data = match meta.dtype {
        DType::F32 => HostSlice::F32(&[]),
        DType::F64 => HostSlice::F64(&[]),
        DType::I64 => HostSlice::I64(&[]),
        DType::Bf16 => HostSlice::Bf16(&[]),
        DType::F16 => HostSlice::F16(&[]),
    };
    HostTensor { shape: &meta.shape, data }
}

/// `bytes` as a writable tensor of `meta`.
pub(crate) fn view_mut<'a>(meta: &'a TensorMeta, bytes: &'a mut [u8]) -> Result<HostTensorMut<'a>, String> {
    let data = match meta.dtype {
        DType::F32 => HostSliceMut::F32(bytemuck::try_cast_slice_mut(bytes).map_err(|e| cast_error(meta, e))?),
        DType::F64 => HostSliceMut::F64(bytemuck::try_cast_slice_mut(bytes).map_err(|e| cast_error(meta, e))?),
        DType::I64 => HostSliceMut::I64(bytemuck::try_cast_slice_mut(bytes).map_err(|e| cast_error(meta, e))?),
        DType::Bf16 => HostSliceMut::Bf16(bytemuck::try_cast_slice_mut(bytes).map_err(|e| cast_error(meta, e))?),
        DType::F16 => HostSliceMut::F16(bytemuck::try_cast_slice_mut(bytes).map_err(|e| cast_error(meta, e))?),
    };
    Ok(HostTensorMut { shape: &meta.shape, data })
}

impl<'a> KernelIo<'a> {
    /// The registers of one firing of piece `piece`. The caller (a stream) guarantees
    /// that the views are the firing's slots: inputs ready for this actor, outputs free.
    #[inline]
    pub fn new(
        piece: u64,
        group: GroupPosition,
        inputs: &'a [BufferView],
        outputs: &'a [BufferView],
        context: &'a StreamContext,
    ) -> Self {
        Self { piece, group, inputs, outputs, context }
    }

    /// Piece number of this firing.
    pub fn piece(&self) -> u64 {
        self.piece
    }

    /// Position in an acc group: `index == 0` starts a new accumulation.
    pub fn group(&self) -> GroupPosition {
        self.group
    }

    /// The stream this kernel runs on.
    pub fn context(&self) -> &'a StreamContext {
        self.context
    }

    /// The address of the stream's scratch for a kernel that asked for `bytes` of it
    /// ([`Kernel::scratch_bytes`](crate::Kernel::scratch_bytes)); an error naming both
    /// sizes where the stream lends less (a stream made without asking its kernels).
    pub fn scratch(&self, bytes: u64) -> Result<u64, crate::KernelError> {
        let lent = self.context.scratch;
        if lent.bytes < bytes || (bytes > 0 && lent.address == 0) {
            return Err(crate::KernelError(format!(
                "the kernel needs {bytes} bytes of its stream's scratch, but the stream lends {} bytes \
                 (broken invariant: a stream's scratch is sized from its kernels' scratch_bytes)",
                lent.bytes
            )));
        }
        Ok(lent.address)
    }

    /// Number of inputs.
    pub fn input_count(&self) -> usize {
        self.inputs.len()
    }

    /// Number of outputs.
    pub fn output_count(&self) -> usize {
        self.outputs.len()
    }

    /// Input `i`. Panics if `i` is out of range (a kernel bug, not a user error).
    pub fn input(&self, i: usize) -> &'a [u8] {
        // SAFETY: the slot is Ready for this actor and no producer writes it until the
        // actor acks it, which happens after this kernel completes; the arena outlives
        // the job's threads.
        unsafe { self.inputs[i].as_slice() }
    }

    /// The address of input `i`'s bytes, for kernels that hand it to a device (a CUDA
    /// kernel's argument); never dereferenced here.
    pub fn input_addr(&self, i: usize) -> u64 {
        self.inputs[i].addr() as u64
    }

    /// The address of output `i`'s bytes, as [`KernelIo::input_addr`].
    pub fn output_addr(&self, i: usize) -> u64 {
        self.outputs[i].addr() as u64
    }

    /// Input `i`'s first byte, for a kernel whose input lies inside its output (an
    /// all-gather's own part, gathered in place), which must never hold a reference to its
    /// input and a mutable one to its output at once.
    pub fn input_ptr(&self, i: usize) -> *const u8 {
        self.inputs[i].as_ptr()
    }

    /// Output `i`'s first byte, as [`KernelIo::input_ptr`]; `&mut self` as [`KernelIo::output`].
    pub fn output_ptr(&mut self, i: usize) -> *mut u8 {
        self.outputs[i].as_ptr()
    }

    /// Whether input `i`'s bytes and output `o`'s overlap (a register within another,
    /// `RegstDesc::within`).
    pub fn overlaps(&self, i: usize, o: usize) -> bool {
        let (input, output) = (&self.inputs[i], &self.outputs[o]);
        !input.is_empty()
            && !output.is_empty()
            && input.addr() < output.addr() + output.len()
            && output.addr() < input.addr() + input.len()
    }

    /// Bytes of input `i`'s slot.
    pub fn input_len(&self, i: usize) -> usize {
        self.inputs[i].len()
    }

    /// Bytes of output `i`'s slot.
    pub fn output_len(&self, i: usize) -> usize {
        self.outputs[i].len()
    }

    /// Input `i` as a tensor of `meta`.
    pub fn input_tensor(&self, i: usize, meta: &'a TensorMeta) -> Result<HostTensor<'a>, String> {
        view(meta, self.input(i))
    }

    /// Output `i` with the lifetime of the registers, so a kernel can hold several outputs
    /// at once. The caller must take each output at most once per firing: outputs are
    /// distinct registers, but two views of the same one would alias.
    pub(crate) fn output_detached(&mut self, i: usize) -> &'a mut [u8] {
        // SAFETY: as for `output`; distinct indices are distinct slots of distinct registers,
        // and the caller takes each index once.
        unsafe { self.outputs[i].as_mut_slice() }
    }

    /// Output `i`. Panics if `i` is out of range (a kernel bug, not a user error).
    pub fn output(&mut self, i: usize) -> &mut [u8] {
        // SAFETY: the slot was free (every consumer acked it) when this firing took it,
        // and no consumer reads it before this kernel completes; `&mut self` keeps two
        // borrows of one output apart.
        unsafe { self.outputs[i].as_mut_slice() }
    }

    /// Output `i` as a writable tensor of `meta`.
    pub fn output_tensor(&mut self, i: usize, meta: &'a TensorMeta) -> Result<HostTensorMut<'_>, String> {
        view_mut(meta, self.output(i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kernel_gets_the_streams_scratch_only_where_it_holds_what_the_kernel_asks() {
        let lent = StreamContext { scratch: StreamScratch { address: 4096, bytes: 100 }, ..StreamContext::default() };
        let io = KernelIo::new(0, GroupPosition { index: 0, count: 1 }, &[], &[], &lent);
        assert_eq!(io.scratch(100), Ok(4096));
        assert_eq!(io.scratch(0), Ok(4096));
        let error = io.scratch(101).unwrap_err().to_string();
        assert!(error.contains("needs 101 bytes") && error.contains("lends 100 bytes"), "{error}");
        let none = StreamContext::default();
        let io = KernelIo::new(0, GroupPosition { index: 0, count: 1 }, &[], &[], &none);
        assert_eq!(io.scratch(0), Ok(0));
        assert!(io.scratch(1).is_err());
    }
}
