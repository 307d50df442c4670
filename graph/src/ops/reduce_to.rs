//! `sum_to` and `broadcast_to`: the pair that makes broadcasting differentiable (the
//! gradient of one is the other).

use super::binary::{for_each_broadcast, operand_sbp};
use super::{GradCtx, InputGrads, LocalContext, OpDef};
use crate::sbp::{Sbp, SbpSignature};
use crate::tensor::{HostTensor, HostTensorMut, Real, Shape, TensorMeta};
use crate::{DType, GraphError, Tensor};
use std::sync::Arc;

/// Sums a tensor down to a shape it broadcasts from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SumTo(pub Shape);

/// Broadcasts a tensor up to a shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BroadcastTo(pub Shape);

fn sum_to_typed<T: Real>(input: &HostTensor<'_>, out: &mut HostTensorMut<'_>) -> Result<(), String> {
    let x = input.as_slice::<T>()?;
    let shape = out.shape.clone();
    let o = out.as_mut_slice::<T>()?;
    o.fill(T::zero());
    // Walk the input; the output is the operand read "broadcast" to the input's shape.
    for_each_broadcast(input.shape, input.shape, &shape, |i, _, io| o[io] += x[i]);
    Ok(())
}

fn broadcast_typed<T: Real>(input: &HostTensor<'_>, out: &mut HostTensorMut<'_>) -> Result<(), String> {
    let x = input.as_slice::<T>()?;
    let shape = out.shape.clone();
    let o = out.as_mut_slice::<T>()?;
    for_each_broadcast(&shape, input.shape, &shape, |i, ix, _| o[i] = x[ix]);
    Ok(())
}

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

    fn compute(&self, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
        match outputs[0].dtype() {
            DType::F32 => sum_to_typed::<f32>(&inputs[0], &mut outputs[0]),
            DType::F64 => sum_to_typed::<f64>(&inputs[0], &mut outputs[0]),
            DType::I64 => Err("integer sums are not supported".into()),
        }
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

    fn compute(&self, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
        match outputs[0].dtype() {
            DType::F32 => broadcast_typed::<f32>(&inputs[0], &mut outputs[0]),
            DType::F64 => broadcast_typed::<f64>(&inputs[0], &mut outputs[0]),
            DType::I64 => broadcast_typed_i64(&inputs[0], &mut outputs[0]),
        }
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
}

fn broadcast_typed_i64(input: &HostTensor<'_>, out: &mut HostTensorMut<'_>) -> Result<(), String> {
    let x = input.as_slice::<i64>()?;
    let shape = out.shape.clone();
    let o = out.as_mut_slice::<i64>()?;
    for_each_broadcast(&shape, input.shape, &shape, |i, ix, _| o[i] = x[ix]);
    Ok(())
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
