//! Elementwise unary ops: `neg`, `relu`, `exp`, `log`, `sqrt`, `tanh`, `sigmoid`, `gelu`
//! (tanh form), scalar `add_scalar` / `mul_scalar` / `pow_scalar`, and the helpers their
//! gradients use (`step`, `gelu_derivative`).

use super::{GradCtx, InputGrads, OpDef};
use crate::sbp::{Sbp, SbpSignature};
use crate::tensor::{HostTensor, HostTensorMut, Real, TensorMeta};
use crate::{DType, GraphError, Tensor};

/// Which unary op.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum UnaryKind {
    /// -x
    Neg,
    /// max(x, 0)
    Relu,
    /// 1 where x > 0, else 0 (the derivative of relu; its own derivative is 0).
    Step,
    /// e^x
    Exp,
    /// ln x
    Log,
    /// √x
    Sqrt,
    /// tanh x
    Tanh,
    /// 1 / (1 + e^-x)
    Sigmoid,
    /// 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))
    Gelu,
    /// d gelu / dx
    GeluDerivative,
    /// x + c
    AddScalar(f64),
    /// x · c
    MulScalar(f64),
    /// x^p
    PowScalar(f64),
}

/// An elementwise unary op.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Unary(pub UnaryKind);

const GELU_C: f64 = 0.797_884_560_802_865_4; // √(2/π)
const GELU_A: f64 = 0.044_715;

fn apply<T: Real>(kind: UnaryKind, x: T) -> T {
    let c = |v: f64| T::from_f64(v);
    match kind {
        UnaryKind::Neg => -x,
        UnaryKind::Relu => {
            if x > T::zero() {
                x
            } else {
                T::zero()
            }
        }
        UnaryKind::Step => {
            if x > T::zero() {
                T::one()
            } else {
                T::zero()
            }
        }
        UnaryKind::Exp => x.exp(),
        UnaryKind::Log => x.ln(),
        UnaryKind::Sqrt => x.sqrt(),
        UnaryKind::Tanh => x.tanh(),
        UnaryKind::Sigmoid => {
            // Stable on both sides: never exponentiates a large positive number.
            if x >= T::zero() {
                T::one() / (T::one() + (-x).exp())
            } else {
                let e = x.exp();
                e / (T::one() + e)
            }
        }
        UnaryKind::Gelu => {
            let inner = c(GELU_C) * (x + c(GELU_A) * x * x * x);
            c(0.5) * x * (T::one() + inner.tanh())
        }
        UnaryKind::GeluDerivative => {
            let inner = c(GELU_C) * (x + c(GELU_A) * x * x * x);
            let t = inner.tanh();
            let dinner = c(GELU_C) * (T::one() + c(3.0 * GELU_A) * x * x);
            c(0.5) * (T::one() + t) + c(0.5) * x * (T::one() - t * t) * dinner
        }
        UnaryKind::AddScalar(v) => x + c(v),
        UnaryKind::MulScalar(v) => x * c(v),
        UnaryKind::PowScalar(p) => T::from_f64(x.to_f64().powf(p)),
    }
}

fn compute_typed<T: Real>(kind: UnaryKind, input: &HostTensor<'_>, out: &mut HostTensorMut<'_>) -> Result<(), String> {
    let x = input.as_slice::<T>()?;
    let out = out.as_mut_slice::<T>()?;
    // One tight loop per kind (the match outside), so the simple ones vectorize.
    macro_rules! map {
        ($f:expr) => {
            for (o, &v) in out.iter_mut().zip(x) {
                *o = $f(v);
            }
        };
    }
    let zero = T::zero();
    match kind {
        UnaryKind::Neg => map!(|v: T| -v),
        UnaryKind::Relu => map!(|v: T| if v > zero { v } else { zero }),
        UnaryKind::Step => map!(|v: T| if v > zero { T::one() } else { zero }),
        UnaryKind::AddScalar(c) => {
            let c = T::from_f64(c);
            map!(|v: T| v + c)
        }
        UnaryKind::MulScalar(c) => {
            let c = T::from_f64(c);
            map!(|v: T| v * c)
        }
        other => map!(|v: T| apply(other, v)),
    }
    Ok(())
}

impl OpDef for Unary {
    fn name(&self) -> &'static str {
        match self.0 {
            UnaryKind::Neg => "neg",
            UnaryKind::Relu => "relu",
            UnaryKind::Step => "step",
            UnaryKind::Exp => "exp",
            UnaryKind::Log => "log",
            UnaryKind::Sqrt => "sqrt",
            UnaryKind::Tanh => "tanh",
            UnaryKind::Sigmoid => "sigmoid",
            UnaryKind::Gelu => "gelu",
            UnaryKind::GeluDerivative => "gelu_derivative",
            UnaryKind::AddScalar(_) => "add_scalar",
            UnaryKind::MulScalar(_) => "mul_scalar",
            UnaryKind::PowScalar(_) => "pow_scalar",
        }
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let [x] = inputs else { return Err(format!("takes 1 input, got {}", inputs.len())) };
        if !x.dtype.is_float() {
            return Err(format!("needs a float input, got {}", x.dtype));
        }
        Ok(vec![x.clone()])
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        let (x, y, dy) = (ctx.inputs[0], ctx.outputs[0], ctx.grad()?);
        let dx = match self.0 {
            UnaryKind::Neg => dy.neg()?,
            UnaryKind::Relu => dy.mul(&x.unary(UnaryKind::Step)?)?,
            UnaryKind::Step => dy.zeros_like()?,
            UnaryKind::Exp => dy.mul(&y)?,
            UnaryKind::Log => dy.div(&x)?,
            UnaryKind::Sqrt => dy.div(&y.mul_scalar(2.0)?)?,
            UnaryKind::Tanh => dy.mul(&y.mul(&y)?.neg()?.add_scalar(1.0)?)?,
            UnaryKind::Sigmoid => dy.mul(&y.mul(&y.neg()?.add_scalar(1.0)?)?)?,
            UnaryKind::Gelu => dy.mul(&x.unary(UnaryKind::GeluDerivative)?)?,
            UnaryKind::GeluDerivative => return Err(GraphError::NoGradient { op: "gelu_derivative".into(), index: 0 }),
            UnaryKind::AddScalar(_) => dy,
            UnaryKind::MulScalar(c) => dy.mul_scalar(c)?,
            UnaryKind::PowScalar(p) => dy.mul(&x.pow_scalar(p - 1.0)?.mul_scalar(p)?)?,
        };
        Ok(vec![Some(dx)])
    }

    fn compute(&self, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
        match outputs[0].dtype() {
            DType::F32 => compute_typed::<f32>(self.0, &inputs[0], &mut outputs[0]),
            DType::F64 => compute_typed::<f64>(self.0, &inputs[0], &mut outputs[0]),
            DType::I64 => Err("integer math is not supported".into()),
        }
    }

    /// Any split passes through; summands pass through only the linear kinds (`neg`,
    /// `mul_scalar`), for which the sum of the results is the result of the sum.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let rank = inputs.first().map_or(0, |x| x.shape.rank());
        let mut signatures: Vec<SbpSignature> =
            (0..rank).map(|d| SbpSignature::new([Sbp::Split(d)], [Sbp::Split(d)])).collect();
        if matches!(self.0, UnaryKind::Neg | UnaryKind::MulScalar(_)) {
            signatures.push(SbpSignature::new([Sbp::Partial], [Sbp::Partial]));
        }
        signatures
    }
}

impl<'g> Tensor<'g> {
    /// Applies an elementwise unary op.
    pub fn unary(&self, kind: UnaryKind) -> Result<Tensor<'g>, GraphError> {
        self.graph().apply1(Unary(kind), &[*self])
    }

    /// -x
    pub fn neg(&self) -> Result<Tensor<'g>, GraphError> {
        self.unary(UnaryKind::Neg)
    }

    /// max(x, 0)
    pub fn relu(&self) -> Result<Tensor<'g>, GraphError> {
        self.unary(UnaryKind::Relu)
    }

    /// e^x
    pub fn exp(&self) -> Result<Tensor<'g>, GraphError> {
        self.unary(UnaryKind::Exp)
    }

    /// ln x
    pub fn log(&self) -> Result<Tensor<'g>, GraphError> {
        self.unary(UnaryKind::Log)
    }

    /// √x
    pub fn sqrt(&self) -> Result<Tensor<'g>, GraphError> {
        self.unary(UnaryKind::Sqrt)
    }

    /// tanh x
    pub fn tanh(&self) -> Result<Tensor<'g>, GraphError> {
        self.unary(UnaryKind::Tanh)
    }

    /// The logistic sigmoid.
    pub fn sigmoid(&self) -> Result<Tensor<'g>, GraphError> {
        self.unary(UnaryKind::Sigmoid)
    }

    /// GELU, tanh approximation (as in GPT-2).
    pub fn gelu(&self) -> Result<Tensor<'g>, GraphError> {
        self.unary(UnaryKind::Gelu)
    }

    /// x + c
    pub fn add_scalar(&self, c: f64) -> Result<Tensor<'g>, GraphError> {
        self.unary(UnaryKind::AddScalar(c))
    }

    /// x · c
    pub fn mul_scalar(&self, c: f64) -> Result<Tensor<'g>, GraphError> {
        self.unary(UnaryKind::MulScalar(c))
    }

    /// x^p
    pub fn pow_scalar(&self, p: f64) -> Result<Tensor<'g>, GraphError> {
        self.unary(UnaryKind::PowScalar(p))
    }
}
