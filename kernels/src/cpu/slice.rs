//! CPU kernels of `slice` ops.

use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::*;
use regflow_plan::{Element, HostTensor, HostTensorMut, Shape};

impl HostCompute for Slice {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        let resolved = self.resolve(inputs[0].shape)?;
        by_element!(outputs[0].dtype(), T => slice_typed::<T>(self, resolved, &inputs[0], &mut outputs[0]))
    }

    /// Moves elements only: bf16 is copied as it is.
    fn half_native(&self) -> bool {
        true
    }
}

impl HostCompute for SliceGrad {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        let resolved = self.resolve(inputs[0].shape)?;
        by_element!(outputs[0].dtype(), T => slice_grad_typed::<T>(self, resolved, &inputs[0], &mut outputs[0]))
    }

    /// Moves elements only: bf16 is copied as it is.
    fn half_native(&self) -> bool {
        true
    }
}

fn slice_grad_typed<T: Element + Default>(
    op: &SliceGrad,
    (axis, len): (usize, usize),
    input: &HostTensor<'_>,
    out: &mut HostTensorMut<'_>,
) -> Result<(), String> {
    let o = out.as_mut_slice::<T>()?;
    o.fill(T::default());
    AxisBlocks::new(input.shape, axis).copy((input.as_slice::<T>()?, len, 0), (o, op.size, op.start), len)
}

fn slice_typed<T: Element>(
    slice: &Slice,
    (axis, size): (usize, usize),
    input: &HostTensor<'_>,
    out: &mut HostTensorMut<'_>,
) -> Result<(), String> {
    let len = slice.end - slice.start;
    AxisBlocks::new(input.shape, axis).copy(
        (input.as_slice::<T>()?, size, slice.start),
        (out.as_mut_slice::<T>()?, len, 0),
        len,
    )
}

/// A tensor seen as `outer` blocks, each `size * inner` elements, for moving ranges of
/// one axis: `outer` is the product of the dimensions before the axis, `inner` of those
/// after it.
#[derive(Debug, Clone, Copy)]
pub struct AxisBlocks {
    /// Number of blocks.
    pub(crate) outer: usize,
    /// Elements per index of the axis.
    pub(crate) inner: usize,
}

impl AxisBlocks {
    /// The blocks of `shape` around `axis` (a valid axis index).
    pub(crate) fn new(shape: &Shape, axis: usize) -> Self {
        let dims = shape.dims();
        Self { outer: dims[..axis].iter().product(), inner: dims[axis + 1..].iter().product() }
    }

    /// Copies indices `src_start..src_start + len` of the axis of `src` (whose axis has
    /// size `src_size`) to indices `dst_start..` of `dst` (axis size `dst_size`).
    pub(crate) fn copy<T: Copy>(
        &self,
        (src, src_size, src_start): (&[T], usize, usize),
        (dst, dst_size, dst_start): (&mut [T], usize, usize),
        len: usize,
    ) -> Result<(), String> {
        let (run, src_block, dst_block) = (len * self.inner, src_size * self.inner, dst_size * self.inner);
        if src_start + len > src_size
            || dst_start + len > dst_size
            || src.len() != self.outer * src_block
            || dst.len() != self.outer * dst_block
        {
            return Err(format!(
                "copy of {len} indices from {src_start} of {src_size} to {dst_start} of {dst_size} does not fit \
                 {} and {} elements (broken invariant)",
                src.len(),
                dst.len()
            ));
        }
        for o in 0..self.outer {
            let from = o * src_block + src_start * self.inner;
            let to = o * dst_block + dst_start * self.inner;
            dst[to..to + run].copy_from_slice(&src[from..from + run]);
        }
        Ok(())
    }
}
