//! Elementwise `add`, `sub`, `mul`, `div` with numpy broadcasting.

use super::{GradCtx, InputGrads, OpDef};
use crate::plan::{Shape, TensorMeta};
use crate::sbp::{Sbp, SbpSignature};
use crate::{GraphError, Tensor};
pub use regflow_plan::ops::{Binary, BinaryKind};

/// The layout an operand of shape `operand`, read broadcast to `output`, must have when
/// the output is split along `out_dim`: split along its own matching dimension when it has
/// that dimension at full size, else `Broadcast` (it is stretched along that dimension, so
/// every device needs all of it).
pub(crate) fn operand_sbp(operand: &Shape, output: &Shape, out_dim: usize) -> Sbp {
    let offset = output.rank() - operand.rank().min(output.rank());
    match out_dim.checked_sub(offset) {
        Some(dim) if operand.dims().get(dim) == output.dims().get(out_dim) => Sbp::Split(dim),
        _ => Sbp::Broadcast,
    }
}

impl OpDef for Binary {
    fn name(&self) -> &'static str {
        match self.0 {
            BinaryKind::Add => "add",
            BinaryKind::Sub => "sub",
            BinaryKind::Mul => "mul",
            BinaryKind::Div => "div",
            BinaryKind::ReluGrad => "relu_grad",
        }
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let [a, b] = inputs else { return Err(format!("takes 2 inputs, got {}", inputs.len())) };
        if a.dtype != b.dtype {
            return Err(format!("dtype mismatch: {} vs {}", a.dtype, b.dtype));
        }
        if !a.dtype.is_float() {
            return Err(format!("needs float inputs, got {}", a.dtype));
        }
        let shape = Shape::broadcast(&a.shape, &b.shape)
            .ok_or_else(|| format!("shapes {} and {} do not broadcast", a.shape, b.shape))?;
        Ok(vec![TensorMeta { shape, dtype: a.dtype }])
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        let (a, b, dy) = (ctx.inputs[0], ctx.inputs[1], ctx.grad()?);
        let (da, db) = match self.0 {
            BinaryKind::Add => (dy, dy),
            BinaryKind::Sub => (dy, dy.neg()?),
            BinaryKind::Mul => (dy.mul(&b)?, dy.mul(&a)?),
            BinaryKind::Div => (dy.div(&b)?, dy.mul(&a)?.div(&b.mul(&b)?)?.neg()?),
            // Second derivatives of ReLU are not needed by any optimizer here.
            BinaryKind::ReluGrad => return Err(GraphError::NoGradient { op: "relu_grad".into(), index: 0 }),
        };
        Ok(vec![Some(da.sum_to(&a.shape())?), Some(db.sum_to(&b.shape())?)])
    }

    /// A split of the output dimension `d` splits each operand that has `d` at full size
    /// and broadcasts the ones stretched along it. Summands: `add`/`sub` take them on both
    /// sides; `mul` on either side (the other whole); `div` and `relu_grad` (linear in the
    /// gradient `a`, masked by the whole `b`) in the first operand only. `(P, B)` is not
    /// valid for `add`: the whole `b` would be added once per device.
    fn sbp_signatures(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let ([a, b], [out]) = (inputs, outputs) else { return Vec::new() };
        let mut signatures: Vec<SbpSignature> = (0..out.shape.rank())
            .map(|d| {
                let operands = [operand_sbp(&a.shape, &out.shape, d), operand_sbp(&b.shape, &out.shape, d)];
                SbpSignature::new(operands, [Sbp::Split(d)])
            })
            .collect();
        let (partial, whole) = (Sbp::Partial, Sbp::Broadcast);
        match self.0 {
            BinaryKind::Add | BinaryKind::Sub => signatures.push(SbpSignature::new([partial, partial], [partial])),
            BinaryKind::Mul => {
                signatures.push(SbpSignature::new([partial, whole], [partial]));
                signatures.push(SbpSignature::new([whole, partial], [partial]));
            }
            BinaryKind::Div | BinaryKind::ReluGrad => signatures.push(SbpSignature::new([partial, whole], [partial])),
        }
        signatures
    }

    /// Elementwise: runs in its inputs' dtype (see `Autocast::Promote`).
    fn autocast(&self) -> super::Autocast {
        super::Autocast::Promote
    }
}

impl<'g> Tensor<'g> {
    pub(crate) fn binary(&self, kind: BinaryKind, rhs: &Tensor<'g>) -> Result<Tensor<'g>, GraphError> {
        self.graph().apply1(Binary(kind), &[*self, *rhs])
    }

    /// `self + rhs`, broadcasting.
    pub fn add(&self, rhs: &Tensor<'g>) -> Result<Tensor<'g>, GraphError> {
        self.binary(BinaryKind::Add, rhs)
    }

    /// `self - rhs`, broadcasting.
    pub fn sub(&self, rhs: &Tensor<'g>) -> Result<Tensor<'g>, GraphError> {
        self.binary(BinaryKind::Sub, rhs)
    }

    /// `self * rhs` elementwise, broadcasting.
    pub fn mul(&self, rhs: &Tensor<'g>) -> Result<Tensor<'g>, GraphError> {
        self.binary(BinaryKind::Mul, rhs)
    }

    /// `self / rhs` elementwise, broadcasting.
    pub fn div(&self, rhs: &Tensor<'g>) -> Result<Tensor<'g>, GraphError> {
        self.binary(BinaryKind::Div, rhs)
    }
}
