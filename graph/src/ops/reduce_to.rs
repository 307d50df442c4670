//! `sum_to` and `broadcast_to`: the pair that makes broadcasting differentiable (the
//! gradient of one is the other); and `sum_squares`, a squared norm in one pass.

use super::binary::operand_sbp;
use super::{GradCtx, InputGrads, LocalContext, OpDef};
use crate::plan::{Shape, TensorMeta};
use crate::sbp::{Sbp, SbpSignature};
use crate::{GraphError, Tensor};
pub use regflow_plan::ops::{BroadcastTo, SumSquares, SumTo};
use std::sync::Arc;

impl OpDef for SumTo {
    fn name(&self) -> &'static str {
        "sum_to"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let [x] = inputs else { return Err(format!("takes 1 input, got {}", inputs.len())) };
        // `self.0` must broadcast to the input's shape.
        if Shape::broadcast(&self.0, &x.shape).as_ref() != Some(&x.shape) {
            return Err(format!("{} does not broadcast to {}, so it cannot be summed to it", self.0, x.shape));
        }
        Ok(vec![TensorMeta { shape: self.0.clone(), dtype: x.dtype }])
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        Ok(vec![Some(ctx.grad()?.broadcast_to(&ctx.inputs[0].shape())?)])
    }

    /// A split of a kept dimension stays a split of the output; a split of a dimension
    /// summed away leaves each device a partial sum; summands sum to summands.
    fn sbp_signatures(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let ([x], [y]) = (inputs, outputs) else { return Vec::new() };
        let mut signatures: Vec<SbpSignature> = (0..x.shape.rank())
            .map(|d| {
                // The output read broadcast to the input: kept where it has the dimension at full size.
                let out = match operand_sbp(&y.shape, &x.shape, d) {
                    Sbp::Split(kept) => Sbp::Split(kept),
                    _ => Sbp::Partial,
                };
                SbpSignature::new([Sbp::Split(d)], [out])
            })
            .collect();
        signatures.push(SbpSignature::new([Sbp::Partial], [Sbp::Partial]));
        signatures
    }

    /// Sums to the local output shape.
    fn localize(&self, ctx: &LocalContext<'_>) -> Result<Option<Arc<dyn OpDef>>, String> {
        Ok(local_target(&self.0, ctx).map(|shape| Arc::new(SumTo(shape)) as Arc<dyn OpDef>))
    }

    /// A sum over broadcast dimensions (a bias gradient): the kernel accumulates in f32 whatever the dtype, so bf16 stays bf16.
    fn autocast(&self) -> super::Autocast {
        super::Autocast::Promote
    }
}

impl OpDef for SumSquares {
    fn name(&self) -> &'static str {
        "sum_squares"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let [x] = inputs else { return Err(format!("takes 1 input, got {}", inputs.len())) };
        if !x.dtype.is_float() {
            return Err(format!("sums the squares of a float tensor, got {x}"));
        }
        Ok(vec![TensorMeta { shape: Shape::scalar(), dtype: x.dtype }])
    }

    /// `2·x·dy`.
    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        let x = ctx.inputs[0];
        Ok(vec![Some(x.mul(&ctx.grad()?)?.mul_scalar(2.0)?)])
    }

    /// A split of any dimension leaves each device a partial sum; a whole tensor a whole
    /// sum. (Squares of summands are not summands: a partial input is converted first.)
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let [x] = inputs else { return Vec::new() };
        (0..x.shape.rank()).map(|d| SbpSignature::new([Sbp::Split(d)], [Sbp::Partial])).collect()
    }
}

impl<'g> Tensor<'g> {
    /// `Σ x²` over every element, as a scalar: the squared L2 norm in one pass, equal bit
    /// for bit to `self.mul(self)?.sum_to(&Shape::scalar())`.
    pub fn sum_squares(&self) -> Result<Tensor<'g>, GraphError> {
        self.graph().apply1(SumSquares, &[*self])
    }
}

/// The local output shape when it differs from the logical `target`.
fn local_target(target: &Shape, ctx: &LocalContext<'_>) -> Option<Shape> {
    match ctx.local_outputs {
        [local] if local.shape != *target => Some(local.shape.clone()),
        _ => None,
    }
}

impl OpDef for BroadcastTo {
    fn name(&self) -> &'static str {
        "broadcast_to"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let [x] = inputs else { return Err(format!("takes 1 input, got {}", inputs.len())) };
        if Shape::broadcast(&x.shape, &self.0).as_ref() != Some(&self.0) {
            return Err(format!("{} does not broadcast to {}", x.shape, self.0));
        }
        Ok(vec![TensorMeta { shape: self.0.clone(), dtype: x.dtype }])
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        Ok(vec![Some(ctx.grad()?.sum_to(&ctx.inputs[0].shape())?)])
    }

    /// A split of an input dimension stays a split of the output; an output dimension the
    /// input is stretched along can be split with the whole input on every device (each
    /// broadcasts to its part); summands broadcast to summands.
    fn sbp_signatures(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let ([x], [y]) = (inputs, outputs) else { return Vec::new() };
        let mut signatures: Vec<SbpSignature> = (0..y.shape.rank())
            .map(|d| SbpSignature::new([operand_sbp(&x.shape, &y.shape, d)], [Sbp::Split(d)]))
            .collect();
        signatures.push(SbpSignature::new([Sbp::Partial], [Sbp::Partial]));
        signatures
    }

    /// Broadcasts to the local output shape.
    fn localize(&self, ctx: &LocalContext<'_>) -> Result<Option<Arc<dyn OpDef>>, String> {
        Ok(local_target(&self.0, ctx).map(|shape| Arc::new(BroadcastTo(shape)) as Arc<dyn OpDef>))
    }

    /// Moves elements: any dtype as it is.
    fn autocast(&self) -> super::Autocast {
        super::Autocast::Keep
    }
}

impl<'g> Tensor<'g> {
    /// Sums down to `shape` (which must broadcast to this tensor's shape); the identity if
    /// the shapes are equal.
    pub fn sum_to(&self, shape: &Shape) -> Result<Tensor<'g>, GraphError> {
        if &self.shape() == shape {
            return Ok(*self);
        }
        self.graph().apply1(SumTo(shape.clone()), &[*self])
    }

    /// Broadcasts up to `shape`; the identity if the shapes are equal.
    pub fn broadcast_to(&self, shape: &Shape) -> Result<Tensor<'g>, GraphError> {
        if &self.shape() == shape {
            return Ok(*self);
        }
        self.graph().apply1(BroadcastTo(shape.clone()), &[*self])
    }
}
