//! Elementwise `add`, `sub`, `mul`, `div` with numpy broadcasting.

use super::{GradCtx, InputGrads, OpDef};
use crate::sbp::{Sbp, SbpSignature};
use crate::tensor::{HostTensor, HostTensorMut, Real, Shape, TensorMeta};
use crate::{DType, GraphError, Tensor};

/// Which binary op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BinaryKind {
    /// a + b
    Add,
    /// a - b
    Sub,
    /// a * b
    Mul,
    /// a / b
    Div,
}

/// An elementwise binary op with broadcasting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Binary(pub BinaryKind);

/// Calls `f(out_index, a_index, b_index)` for every element of `out`, where `a` and `b`
/// are read broadcast to `out`'s shape.
pub(crate) fn for_each_broadcast(out: &Shape, a: &Shape, b: &Shape, mut f: impl FnMut(usize, usize, usize)) {
    let n = out.numel();
    if a == out && b == out {
        for i in 0..n {
            f(i, i, i);
        }
        return;
    }
    let (sa, sb) = (a.broadcast_strides(out), b.broadcast_strides(out));
    let dims = out.dims();
    let mut index = vec![0usize; dims.len()];
    let (mut ia, mut ib) = (0usize, 0usize);
    for o in 0..n {
        f(o, ia, ib);
        // Odometer increment, updating the two read offsets incrementally.
        for d in (0..dims.len()).rev() {
            index[d] += 1;
            ia += sa[d];
            ib += sb[d];
            if index[d] < dims[d] {
                break;
            }
            ia -= sa[d] * dims[d];
            ib -= sb[d] * dims[d];
            index[d] = 0;
        }
    }
}

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

fn compute_typed<T: Real>(
    kind: BinaryKind,
    inputs: &[HostTensor<'_>],
    out: &mut HostTensorMut<'_>,
) -> Result<(), String> {
    let (a, b) = (inputs[0].as_slice::<T>()?, inputs[1].as_slice::<T>()?);
    let shape = out.shape.clone();
    let o = out.as_mut_slice::<T>()?;
    let op = |x: T, y: T| match kind {
        BinaryKind::Add => x + y,
        BinaryKind::Sub => x - y,
        BinaryKind::Mul => x * y,
        BinaryKind::Div => x / y,
    };
    for_each_broadcast(&shape, inputs[0].shape, inputs[1].shape, |i, ia, ib| o[i] = op(a[ia], b[ib]));
    Ok(())
}

impl OpDef for Binary {
    fn name(&self) -> &'static str {
        match self.0 {
            BinaryKind::Add => "add",
            BinaryKind::Sub => "sub",
            BinaryKind::Mul => "mul",
            BinaryKind::Div => "div",
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
        };
        Ok(vec![Some(da.sum_to(&a.shape())?), Some(db.sum_to(&b.shape())?)])
    }

    fn compute(&self, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
        match outputs[0].dtype() {
            DType::F32 => compute_typed::<f32>(self.0, inputs, &mut outputs[0]),
            DType::F64 => compute_typed::<f64>(self.0, inputs, &mut outputs[0]),
            DType::I64 => Err("integer arithmetic is not supported".into()),
        }
    }

    /// A split of the output dimension `d` splits each operand that has `d` at full size
    /// and broadcasts the ones stretched along it. Summands: `add`/`sub` take them on both
    /// sides; `mul` on either side (the other whole); `div` in the numerator only. `(P, B)`
    /// is not valid for `add`: the whole `b` would be added once per device.
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
            BinaryKind::Div => signatures.push(SbpSignature::new([partial, whole], [partial])),
        }
        signatures
    }
}

impl<'g> Tensor<'g> {
    fn binary(&self, kind: BinaryKind, rhs: &Tensor<'g>) -> Result<Tensor<'g>, GraphError> {
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
