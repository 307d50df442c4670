//! Fused elementwise ops: `bias_gelu` (a linear layer's bias add and its GELU in one pass)
//! and its gradient.

use super::{GradCtx, InputGrads, OpDef};
use crate::plan::TensorMeta;
use crate::sbp::{Sbp, SbpSignature};
use crate::{GraphError, Tensor};
use regflow_kernels::cpu::fused::check_bias;
pub use regflow_plan::ops::{BiasGelu, BiasGeluGrad};

/// Splits of `x` (and `dy`) along a leading axis with the bias whole, or along the last
/// axis with the bias split the same way; `operands` is how many `x`-shaped inputs follow
/// the bias.
fn bias_splits(inputs: &[TensorMeta], trailing: usize) -> Vec<SbpSignature> {
    let rank = inputs.first().map_or(0, |x| x.shape.rank());
    (0..rank)
        .map(|d| {
            let bias = if d + 1 == rank { Sbp::Split(0) } else { Sbp::Broadcast };
            let mut layouts = vec![Sbp::Split(d), bias];
            layouts.extend(std::iter::repeat_n(Sbp::Split(d), trailing));
            SbpSignature::new(layouts, [Sbp::Split(d)])
        })
        .collect()
}

impl OpDef for BiasGelu {
    fn name(&self) -> &'static str {
        "bias_gelu"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let [x, bias] = inputs else { return Err(format!("takes 2 inputs (x, bias), got {}", inputs.len())) };
        check_bias(x, bias)?;
        Ok(vec![x.clone()])
    }

    /// `dx = dy·gelu'(x + bias)` in one op; the bias's gradient is `dx` summed to `[N]`.
    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        let (x, bias, dy) = (ctx.inputs[0], ctx.inputs[1], ctx.grad()?);
        let dx = x.graph().apply1(BiasGeluGrad, &[x, bias, dy])?;
        Ok(vec![Some(dx), Some(dx.sum_to(&bias.shape())?)])
    }

    /// Elementwise: any axis may be split, the bias with the last one.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        bias_splits(inputs, 0)
    }

    /// Elementwise: runs in its inputs' dtype (see `Autocast::Promote`).
    fn autocast(&self) -> super::Autocast {
        super::Autocast::Promote
    }
}

impl OpDef for BiasGeluGrad {
    fn name(&self) -> &'static str {
        "bias_gelu_grad"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let [x, bias, dy] = inputs else { return Err(format!("takes 3 inputs (x, bias, dy), got {}", inputs.len())) };
        check_bias(x, bias)?;
        if dy != x {
            return Err(format!("dy must match x: {x} vs {dy}"));
        }
        Ok(vec![x.clone()])
    }

    fn grad<'g>(&self, _ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        // Second derivatives of GELU are not needed by any optimizer here.
        Err(GraphError::NoGradient { op: self.name().into(), index: 0 })
    }

    /// Elementwise in `x` and `dy`; with `x` and the bias whole, linear in `dy`, so
    /// summands of `dy` give summands.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let mut signatures = bias_splits(inputs, 1);
        signatures.push(SbpSignature::new([Sbp::Broadcast, Sbp::Broadcast, Sbp::Partial], [Sbp::Partial]));
        signatures
    }

    /// Elementwise: runs in its inputs' dtype (see `Autocast::Promote`).
    fn autocast(&self) -> super::Autocast {
        super::Autocast::Promote
    }
}

impl<'g> Tensor<'g> {
    /// `gelu(self + bias)` in one kernel (GELU with the tanh approximation, as
    /// [`Tensor::gelu`]), for `self` of shape `[..., N]` and `bias` of shape `[N]`.
    pub fn bias_gelu(&self, bias: &Tensor<'g>) -> Result<Tensor<'g>, GraphError> {
        self.graph().apply1(BiasGelu, &[*self, *bias])
    }
}
