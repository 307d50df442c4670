//! Reductions over a set of axes: `sum`, `mean`, `max` (and `sum_all` / `mean_all`), plus
//! `max_mask`, the helper the gradient of `max` uses.

use super::binary::{for_each_broadcast, operand_sbp};
use super::{GradCtx, InputGrads, LocalContext, OpDef};
use crate::sbp::{Sbp, SbpSignature};
use crate::tensor::{HostTensor, HostTensorMut, Real, Shape, TensorMeta};
use crate::{DType, GraphError, Tensor};
use std::sync::Arc;

/// Which reduction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceKind {
    /// Sum of the elements.
    Sum,
    /// Arithmetic mean of the elements.
    Mean,
    /// Largest element; NaNs are skipped (a group of only NaNs gives -inf).
    Max,
}

/// Reduces the axes `axes` (all of them when empty) of its input; `keepdim` keeps each
/// reduced axis as a dimension of 1 instead of removing it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reduce {
    /// Which reduction.
    pub kind: ReduceKind,
    /// Axes to reduce; negative axes count from the end; empty means every axis.
    pub axes: Vec<isize>,
    /// Whether reduced axes stay as dimensions of 1.
    pub keepdim: bool,
}

/// 1.0 where input 0 equals input 1 broadcast to its shape, else 0.0: the positions that
/// hold the maximum when input 1 is the keepdim `max` of input 0. Piecewise constant, so
/// its gradients are zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxMask;

/// `axis` as an index into `shape`'s dimensions, or the error every shape op reports.
pub(crate) fn axis_index(shape: &Shape, axis: isize) -> Result<usize, String> {
    shape.axis(axis).ok_or_else(|| format!("axis {axis} out of range for rank {}", shape.rank()))
}

/// Which of `shape`'s axes `axes` names (all of them when `axes` is empty).
fn reduced_axes(shape: &Shape, axes: &[isize]) -> Result<Vec<bool>, String> {
    if axes.is_empty() {
        return Ok(vec![true; shape.rank()]);
    }
    let mut reduced = vec![false; shape.rank()];
    for &axis in axes {
        let index = axis_index(shape, axis)?;
        if reduced[index] {
            return Err(format!("axes {axes:?} name axis {index} twice"));
        }
        reduced[index] = true;
    }
    Ok(reduced)
}

/// How many input elements each output element reduces.
fn reduced_count(shape: &Shape, reduced: &[bool]) -> usize {
    shape.dims().iter().zip(reduced).filter(|(_, &r)| r).map(|(&d, _)| d).product()
}

/// `shape` with every reduced axis set to 1.
fn keepdim_shape(shape: &Shape, reduced: &[bool]) -> Shape {
    Shape(shape.dims().iter().zip(reduced).map(|(&d, &r)| if r { 1 } else { d }).collect())
}

impl Reduce {
    /// The output shape for an input of `shape`.
    fn output_shape(&self, shape: &Shape) -> Result<Shape, String> {
        let reduced = reduced_axes(shape, &self.axes)?;
        if self.keepdim {
            return Ok(keepdim_shape(shape, &reduced));
        }
        Ok(Shape(shape.dims().iter().zip(&reduced).filter(|(_, &r)| !r).map(|(&d, _)| d).collect()))
    }
}

/// A device's share of a `mean` whose reduced axes are split: the sum of its elements
/// divided by the logical count, so that the devices' results sum to the mean.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PartMean {
    /// The `mean` it stands for (its axes and keepdim).
    mean: Reduce,
    /// Elements each logical output element averages.
    logical_count: usize,
}

impl OpDef for PartMean {
    fn name(&self) -> &'static str {
        "mean"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        self.mean.infer(inputs)
    }

    fn grad<'g>(&self, _ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        // Gradients are taken of the logical graph, before it is split over devices.
        Err(GraphError::NoGradient { op: "mean (one device's part)".into(), index: 0 })
    }

    fn compute(&self, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
        let reduced = reduced_axes(inputs[0].shape, &self.mean.axes)?;
        let divisor = Some(self.logical_count);
        match outputs[0].dtype() {
            DType::F32 => reduce_typed::<f32>(ReduceKind::Mean, &reduced, divisor, &inputs[0], &mut outputs[0]),
            DType::F64 => reduce_typed::<f64>(ReduceKind::Mean, &reduced, divisor, &inputs[0], &mut outputs[0]),
            DType::I64 => Err("integer reductions are not supported".into()),
        }
    }
}

/// `divisor`: what a mean divides by (`None`: the number of elements reduced).
fn reduce_typed<T: Real>(
    kind: ReduceKind,
    reduced: &[bool],
    divisor: Option<usize>,
    input: &HostTensor<'_>,
    out: &mut HostTensorMut<'_>,
) -> Result<(), String> {
    let x = input.as_slice::<T>()?;
    let keep = keepdim_shape(input.shape, reduced);
    let o = out.as_mut_slice::<T>()?;
    if o.len() != keep.numel() {
        return Err(format!("output has {} elements, expected {} (broken invariant)", o.len(), keep.numel()));
    }
    // The keepdim output, read "broadcast" to the input's shape, gives each input element
    // its output slot; keepdim and squeezed outputs share one row-major layout.
    match kind {
        ReduceKind::Sum | ReduceKind::Mean => {
            o.fill(T::zero());
            for_each_broadcast(input.shape, input.shape, &keep, |i, _, io| o[io] += x[i]);
        }
        ReduceKind::Max => {
            o.fill(T::from_f64(f64::NEG_INFINITY));
            for_each_broadcast(input.shape, input.shape, &keep, |i, _, io| {
                if x[i] > o[io] {
                    o[io] = x[i];
                }
            });
        }
    }
    if kind == ReduceKind::Mean {
        // An empty reduction gives 0 / 0 = NaN, as numpy does.
        let count = divisor.unwrap_or_else(|| reduced_count(input.shape, reduced));
        let scale = T::from_f64(1.0 / count as f64);
        o.iter_mut().for_each(|v| *v = *v * scale);
    }
    Ok(())
}

impl OpDef for Reduce {
    fn name(&self) -> &'static str {
        match self.kind {
            ReduceKind::Sum => "sum",
            ReduceKind::Mean => "mean",
            ReduceKind::Max => "max",
        }
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let [x] = inputs else { return Err(format!("takes 1 input, got {}", inputs.len())) };
        if !x.dtype.is_float() {
            return Err(format!("needs a float input, got {}", x.dtype));
        }
        let shape = self.output_shape(&x.shape)?;
        if self.kind == ReduceKind::Max {
            let reduced = reduced_axes(&x.shape, &self.axes)?;
            if let Some(axis) = (0..x.shape.rank()).find(|&a| reduced[a] && x.shape.dims()[a] == 0) {
                return Err(format!("cannot take the max over axis {axis}, which has size 0"));
            }
        }
        Ok(vec![TensorMeta { shape, dtype: x.dtype }])
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        let (x, y, dy) = (ctx.inputs[0], ctx.outputs[0], ctx.grad()?);
        let shape = x.shape();
        let reduced = reduced_axes(&shape, &self.axes)
            .map_err(|message| GraphError::Kernel { op: self.name().into(), message })?;
        let keep = keepdim_shape(&shape, &reduced);
        let dy_keep = dy.reshape_to(&keep)?;
        let dx = match self.kind {
            ReduceKind::Sum => dy_keep.broadcast_to(&shape)?,
            ReduceKind::Mean => {
                // With a count of 0, x has no elements and the scale is never used.
                let count = reduced_count(&shape, &reduced).max(1);
                dy_keep.broadcast_to(&shape)?.mul_scalar(1.0 / count as f64)?
            }
            ReduceKind::Max => {
                // Ties share the gradient evenly: each of k maxima gets dy / k.
                let hits = x.graph().apply1(MaxMask, &[x, y.reshape_to(&keep)?])?;
                let axes: Vec<isize> = (0..shape.rank()).filter(|&a| reduced[a]).map(|a| a as isize).collect();
                let share = hits.div(&hits.sum(&axes, true)?)?;
                share.mul(&dy_keep)?
            }
        };
        Ok(vec![Some(dx)])
    }

    fn compute(&self, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
        let reduced = reduced_axes(inputs[0].shape, &self.axes)?;
        match outputs[0].dtype() {
            DType::F32 => reduce_typed::<f32>(self.kind, &reduced, None, &inputs[0], &mut outputs[0]),
            DType::F64 => reduce_typed::<f64>(self.kind, &reduced, None, &inputs[0], &mut outputs[0]),
            DType::I64 => Err("integer reductions are not supported".into()),
        }
    }

    /// A split of a kept axis stays a split of the output; a split of a reduced axis
    /// leaves each device a partial `sum` or `mean` (not `max`); `sum` and `mean` take
    /// summands.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let [x] = inputs else { return Vec::new() };
        let Ok(reduced) = reduced_axes(&x.shape, &self.axes) else { return Vec::new() };
        let linear = self.kind != ReduceKind::Max;
        let mut signatures = Vec::new();
        let mut out_dim = 0;
        for (d, &r) in reduced.iter().enumerate() {
            if !r {
                signatures.push(SbpSignature::new([Sbp::Split(d)], [Sbp::Split(out_dim)]));
            } else if linear {
                signatures.push(SbpSignature::new([Sbp::Split(d)], [Sbp::Partial]));
            }
            if !r || self.keepdim {
                out_dim += 1;
            }
        }
        if linear {
            signatures.push(SbpSignature::new([Sbp::Partial], [Sbp::Partial]));
        }
        signatures
    }

    /// A `mean` over split axes divides each device's sum by the logical count.
    fn localize(&self, ctx: &LocalContext<'_>) -> Result<Option<Arc<dyn OpDef>>, String> {
        let ([logical], [local]) = (ctx.logical_inputs, ctx.local_inputs) else { return Ok(None) };
        if self.kind != ReduceKind::Mean {
            return Ok(None);
        }
        let reduced = reduced_axes(&logical.shape, &self.axes)?;
        let logical_count = reduced_count(&logical.shape, &reduced);
        if reduced_count(&local.shape, &reduced) == logical_count {
            return Ok(None);
        }
        Ok(Some(Arc::new(PartMean { mean: self.clone(), logical_count })))
    }
}

fn max_mask_typed<T: Real>(inputs: &[HostTensor<'_>], out: &mut HostTensorMut<'_>) -> Result<(), String> {
    let (x, m) = (inputs[0].as_slice::<T>()?, inputs[1].as_slice::<T>()?);
    let o = out.as_mut_slice::<T>()?;
    for_each_broadcast(inputs[0].shape, inputs[0].shape, inputs[1].shape, |i, _, im| {
        o[i] = if x[i] == m[im] { T::one() } else { T::zero() };
    });
    Ok(())
}

impl OpDef for MaxMask {
    fn name(&self) -> &'static str {
        "max_mask"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let [x, m] = inputs else { return Err(format!("takes 2 inputs, got {}", inputs.len())) };
        if x.dtype != m.dtype {
            return Err(format!("dtype mismatch: {} vs {}", x.dtype, m.dtype));
        }
        if !x.dtype.is_float() {
            return Err(format!("needs float inputs, got {}", x.dtype));
        }
        if Shape::broadcast(&m.shape, &x.shape).as_ref() != Some(&x.shape) {
            return Err(format!("{} does not broadcast to {}", m.shape, x.shape));
        }
        Ok(vec![x.clone()])
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        Ok(vec![Some(ctx.inputs[0].zeros_like()?), Some(ctx.inputs[1].zeros_like()?)])
    }

    fn compute(&self, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
        match outputs[0].dtype() {
            DType::F32 => max_mask_typed::<f32>(inputs, &mut outputs[0]),
            DType::F64 => max_mask_typed::<f64>(inputs, &mut outputs[0]),
            DType::I64 => Err("integer comparisons are not supported".into()),
        }
    }

    /// Elementwise over `x`: a split of `x` splits the maxima where they have the
    /// dimension at full size and needs them whole where they are stretched along it.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let [x, m] = inputs else { return Vec::new() };
        (0..x.shape.rank())
            .map(|d| SbpSignature::new([Sbp::Split(d), operand_sbp(&m.shape, &x.shape, d)], [Sbp::Split(d)]))
            .collect()
    }
}

impl<'g> Tensor<'g> {
    fn reduce(&self, kind: ReduceKind, axes: &[isize], keepdim: bool) -> Result<Tensor<'g>, GraphError> {
        self.graph().apply1(Reduce { kind, axes: axes.to_vec(), keepdim }, &[*self])
    }

    /// Sum over `axes` (every axis when empty); `keepdim` keeps them as dimensions of 1.
    pub fn sum(&self, axes: &[isize], keepdim: bool) -> Result<Tensor<'g>, GraphError> {
        self.reduce(ReduceKind::Sum, axes, keepdim)
    }

    /// Mean over `axes` (every axis when empty); `keepdim` keeps them as dimensions of 1.
    pub fn mean(&self, axes: &[isize], keepdim: bool) -> Result<Tensor<'g>, GraphError> {
        self.reduce(ReduceKind::Mean, axes, keepdim)
    }

    /// Maximum over `axes` (every axis when empty); `keepdim` keeps them as dimensions of
    /// 1. Its gradient goes to the maximal elements, split evenly among ties.
    pub fn max(&self, axes: &[isize], keepdim: bool) -> Result<Tensor<'g>, GraphError> {
        self.reduce(ReduceKind::Max, axes, keepdim)
    }

    /// Sum of every element, as a scalar.
    pub fn sum_all(&self) -> Result<Tensor<'g>, GraphError> {
        self.sum(&[], false)
    }

    /// Mean of every element, as a scalar.
    pub fn mean_all(&self) -> Result<Tensor<'g>, GraphError> {
        self.mean(&[], false)
    }
}
