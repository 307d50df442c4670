//! Reductions over a set of axes: `sum`, `mean`, `max` (and `sum_all` / `mean_all`), plus
//! `max_mask`, the helper the gradient of `max` uses.

use super::binary::operand_sbp;
use super::{GradCtx, InputGrads, LocalContext, OpDef};
use crate::plan::{Shape, TensorMeta};
use crate::sbp::{Sbp, SbpSignature};
use crate::{GraphError, Tensor};
use regflow_kernels::cpu::reduce::reduced_count;
use regflow_plan::ops::PartMean;
use regflow_plan::ops::{keepdim_shape, reduced_axes};
pub use regflow_plan::ops::{MaxMask, Reduce, ReduceKind};
use std::sync::Arc;

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
