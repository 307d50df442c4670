//! `slice`: a half-open range of one axis, and `slice_grad`, its gradient, which puts a
//! slice back into zeros of the full shape.

use super::reduce::axis_index;
use super::{GradCtx, InputGrads, OpDef};
use crate::sbp::{Sbp, SbpSignature};
use crate::tensor::{Element, HostTensor, HostTensorMut, Shape, TensorMeta};
use crate::{DType, GraphError, Tensor};

/// Elements `start..end` of axis `axis`: `start < end`, and `end` at most the axis' size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slice {
    /// The sliced axis; negative counts from the end.
    pub axis: isize,
    /// First index kept.
    pub start: usize,
    /// One past the last index kept.
    pub end: usize,
}

/// The gradient of [`Slice`]: its input, placed at `start` of axis `axis` in zeros whose
/// axis has size `size` (the sliced tensor's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceGrad {
    /// The axis the slice was taken on; negative counts from the end.
    pub axis: isize,
    /// Where the slice starts.
    pub start: usize,
    /// Size of the axis in the output.
    pub size: usize,
}

/// A tensor seen as `outer` blocks, each `size * inner` elements, for moving ranges of
/// one axis: `outer` is the product of the dimensions before the axis, `inner` of those
/// after it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AxisBlocks {
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

impl Slice {
    /// The axis index and its size in `shape`, with the range checked.
    fn resolve(&self, shape: &Shape) -> Result<(usize, usize), String> {
        let axis = axis_index(shape, self.axis)?;
        let (start, end, size) = (self.start, self.end, shape.dims()[axis]);
        if start >= end {
            return Err(format!("slice {start}..{end} of axis {axis} is empty: start must be less than end"));
        }
        if end > size {
            return Err(format!("slice {start}..{end} out of bounds for axis {axis} of size {size}"));
        }
        Ok((axis, size))
    }
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

impl OpDef for Slice {
    fn name(&self) -> &'static str {
        "slice"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let [x] = inputs else { return Err(format!("takes 1 input, got {}", inputs.len())) };
        let (axis, _) = self.resolve(&x.shape)?;
        let mut shape = x.shape.clone();
        shape.0[axis] = self.end - self.start;
        Ok(vec![TensorMeta { shape, dtype: x.dtype }])
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        let (axis, size) = self
            .resolve(&ctx.inputs[0].shape())
            .map_err(|message| GraphError::Kernel { op: self.name().into(), message })?;
        let dy = ctx.grad()?;
        let op = SliceGrad { axis: axis as isize, start: self.start, size };
        Ok(vec![Some(dy.graph().apply1(op, &[dy])?)])
    }

    fn compute(&self, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
        let resolved = self.resolve(inputs[0].shape)?;
        match outputs[0].dtype() {
            DType::F32 => slice_typed::<f32>(self, resolved, &inputs[0], &mut outputs[0]),
            DType::F64 => slice_typed::<f64>(self, resolved, &inputs[0], &mut outputs[0]),
            DType::I64 => slice_typed::<i64>(self, resolved, &inputs[0], &mut outputs[0]),
        }
    }

    /// Any axis but the sliced one may be split; summands slice to summands.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let [x] = inputs else { return Vec::new() };
        let Ok((axis, _)) = self.resolve(&x.shape) else { return Vec::new() };
        splits_but(axis, x)
    }
}

/// Splits of every axis of `x` but `axis`, and summands to summands.
fn splits_but(axis: usize, x: &TensorMeta) -> Vec<SbpSignature> {
    let mut signatures: Vec<SbpSignature> = (0..x.shape.rank())
        .filter(|&d| d != axis)
        .map(|d| SbpSignature::new([Sbp::Split(d)], [Sbp::Split(d)]))
        .collect();
    signatures.push(SbpSignature::new([Sbp::Partial], [Sbp::Partial]));
    signatures
}

impl SliceGrad {
    /// The axis index and the slice's length in `shape` (the slice's shape), checked.
    fn resolve(&self, shape: &Shape) -> Result<(usize, usize), String> {
        let axis = axis_index(shape, self.axis)?;
        let len = shape.dims()[axis];
        if self.start.checked_add(len).is_none_or(|end| end > self.size) {
            return Err(format!("a slice of {len} at {} does not fit axis {axis} of size {}", self.start, self.size));
        }
        Ok((axis, len))
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

impl OpDef for SliceGrad {
    fn name(&self) -> &'static str {
        "slice_grad"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let [dy] = inputs else { return Err(format!("takes 1 input, got {}", inputs.len())) };
        let (axis, _) = self.resolve(&dy.shape)?;
        let mut shape = dy.shape.clone();
        shape.0[axis] = self.size;
        Ok(vec![TensorMeta { shape, dtype: dy.dtype }])
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        let (_, len) = self
            .resolve(&ctx.inputs[0].shape())
            .map_err(|message| GraphError::Kernel { op: self.name().into(), message })?;
        Ok(vec![Some(ctx.grad()?.slice(self.axis, self.start, self.start + len)?)])
    }

    fn compute(&self, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
        let resolved = self.resolve(inputs[0].shape)?;
        match outputs[0].dtype() {
            DType::F32 => slice_grad_typed::<f32>(self, resolved, &inputs[0], &mut outputs[0]),
            DType::F64 => slice_grad_typed::<f64>(self, resolved, &inputs[0], &mut outputs[0]),
            DType::I64 => slice_grad_typed::<i64>(self, resolved, &inputs[0], &mut outputs[0]),
        }
    }

    /// Any axis but the padded one may be split; summands pad to summands.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let [dy] = inputs else { return Vec::new() };
        let Ok((axis, _)) = self.resolve(&dy.shape) else { return Vec::new() };
        splits_but(axis, dy)
    }
}

impl<'g> Tensor<'g> {
    /// Indices `start..end` (half-open) of axis `axis`; needs `start < end` and `end` at
    /// most the axis' size.
    pub fn slice(&self, axis: isize, start: usize, end: usize) -> Result<Tensor<'g>, GraphError> {
        self.graph().apply1(Slice { axis, start, end }, &[*self])
    }
}
