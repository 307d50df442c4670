//! Elementwise unary ops: `neg`, `relu`, `exp`, `log`, `sqrt`, `tanh`, `sigmoid`, `gelu`
//! (tanh form), scalar `add_scalar` / `mul_scalar` / `pow_scalar`, and the helpers their
//! gradients use (`step`, `gelu_derivative`).

use super::{GradCtx, InputGrads, OpDef};
use crate::plan::TensorMeta;
use crate::sbp::{Sbp, SbpSignature};
use crate::{GraphError, Tensor};
pub use regflow_plan::ops::{Unary, UnaryKind};

// √(2/π)

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
            // From the output (y > 0 exactly where x > 0), so the input need not outlive the
            // forward pass, and in one pass.
            UnaryKind::Relu => dy.binary(super::BinaryKind::ReluGrad, &y)?,
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

    /// Elementwise: runs in its inputs' dtype (see `Autocast::Promote`).
    fn autocast(&self) -> super::Autocast {
        super::Autocast::Promote
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
