//! `concat`: joins tensors of one dtype along an axis on which alone their shapes differ.

use super::{GradCtx, InputGrads, OpDef};
use crate::plan::TensorMeta;
use crate::sbp::{Sbp, SbpSignature};
use crate::{GraphError, Tensor};
pub use regflow_plan::ops::Concat;

impl OpDef for Concat {
    fn name(&self) -> &'static str {
        "concat"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let Some(first) = inputs.first() else { return Err("needs at least one input".into()) };
        let axis = self.resolve(&first.shape)?;
        let mut shape = first.shape.clone();
        for (i, x) in inputs.iter().enumerate().skip(1) {
            if x.dtype != first.dtype {
                return Err(format!("dtype mismatch: input {i} is {}, input 0 is {}", x.dtype, first.dtype));
            }
            let same_elsewhere = x.shape.rank() == first.shape.rank()
                && (0..x.shape.rank()).all(|a| a == axis || x.shape.dims()[a] == first.shape.dims()[a]);
            if !same_elsewhere {
                return Err(format!(
                    "input {i} has shape {}, input 0 has {}: they must agree on every axis but {axis}",
                    x.shape, first.shape
                ));
            }
            shape.0[axis] = shape.0[axis]
                .checked_add(x.shape.dims()[axis])
                .ok_or_else(|| format!("axis {axis} of the result would hold more than {} elements", usize::MAX))?;
        }
        Ok(vec![TensorMeta { shape, dtype: first.dtype }])
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        let dy = ctx.grad()?;
        let axis =
            self.resolve(&dy.shape()).map_err(|message| GraphError::Kernel { op: self.name().into(), message })?;
        let mut offset = 0;
        let mut grads = Vec::with_capacity(ctx.inputs.len());
        for x in &ctx.inputs {
            let size = x.shape().dims()[axis];
            grads.push(match (x.dtype().is_float(), size) {
                (false, _) => None,
                // An empty slice is not a slice: an input with nothing on the axis gets zeros.
                (true, 0) => Some(x.zeros_like()?),
                (true, _) => Some(dy.slice(axis as isize, offset, offset + size)?),
            });
            offset += size;
        }
        Ok(grads)
    }

    /// Any axis but the joined one may be split (on every input alike); summands join to
    /// summands.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let Some(first) = inputs.first() else { return Vec::new() };
        let Ok(axis) = self.resolve(&first.shape) else { return Vec::new() };
        let all = |sbp: Sbp| SbpSignature::new(vec![sbp; inputs.len()], [sbp]);
        let mut signatures: Vec<SbpSignature> =
            (0..first.shape.rank()).filter(|&d| d != axis).map(|d| all(Sbp::Split(d))).collect();
        signatures.push(all(Sbp::Partial));
        signatures
    }

    /// Elementwise: runs in its inputs' dtype (see `Autocast::Promote`).
    fn autocast(&self) -> super::Autocast {
        super::Autocast::Promote
    }
}

/// Joins `tensors` (at least one, all of one graph and dtype) along `axis`; their shapes
/// must agree on every other axis.
pub fn concat<'g>(tensors: &[Tensor<'g>], axis: isize) -> Result<Tensor<'g>, GraphError> {
    let Some(first) = tensors.first() else {
        return Err(GraphError::Op {
            op: "concat".into(),
            inputs: Vec::new(),
            message: "needs at least one input".into(),
        });
    };
    first.graph().apply1(Concat { axis }, tensors)
}

impl<'g> Tensor<'g> {
    /// This tensor followed by `others` along `axis` (see [`concat()`]).
    pub fn concat(&self, others: &[Tensor<'g>], axis: isize) -> Result<Tensor<'g>, GraphError> {
        let mut tensors = Vec::with_capacity(others.len() + 1);
        tensors.push(*self);
        tensors.extend_from_slice(others);
        concat(&tensors, axis)
    }
}
