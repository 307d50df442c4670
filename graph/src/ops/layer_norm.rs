//! `layer_norm` over the last axis with a learned scale and shift, and the op that computes
//! all three of its gradients in one pass.

use super::{GradCtx, InputGrads, OpDef};
use crate::plan::TensorMeta;
use crate::sbp::{Sbp, SbpSignature};
use crate::{GraphError, Tensor};
pub use regflow_plan::ops::{LayerNorm, LayerNormGrad};

impl OpDef for LayerNorm {
    fn name(&self) -> &'static str {
        "layer_norm"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let Some(x) = inputs.first() else { return Err("takes 3 inputs, got none".into()) };
        let y = TensorMeta::new(x.shape.clone(), self.output_dtype(x.dtype)?);
        let outputs = if self.residual.is_some() { vec![x.clone(), y] } else { vec![y] };
        self.check(inputs, &outputs)?;
        Ok(outputs)
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        let (x, gamma, dy) = (ctx.inputs[0], ctx.inputs[1], ctx.grad()?);
        // An output in another dtype (bf16 from f32) has its gradient in that dtype too.
        let grads = x.graph().apply(LayerNormGrad { dy: self.out, ..LayerNormGrad::new(self.eps) }, &[x, gamma, dy])?;
        Ok(grads.into_iter().map(Some).collect())
    }

    /// Rows are independent: any dimension of `x` but the normalized last one may be
    /// split, with the scale and shift whole.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let rank = inputs.first().map_or(0, |x| x.shape.rank());
        let whole = Sbp::Broadcast;
        (0..rank.saturating_sub(1)).map(|d| SbpSignature::new([Sbp::Split(d), whole, whole], [Sbp::Split(d)])).collect()
    }
}

impl OpDef for LayerNormGrad {
    fn name(&self) -> &'static str {
        "layer_norm_grad"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let (Some(x), Some(gamma)) = (inputs.first(), inputs.get(1)) else {
            return Err(format!("takes {} inputs, got {}", 3 + usize::from(self.base), inputs.len()));
        };
        let outputs = vec![x.clone(), gamma.clone(), gamma.clone()];
        self.check(inputs, &outputs)?;
        Ok(outputs)
    }

    fn grad<'g>(&self, _ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        // Second derivatives of layer norm are not needed by any optimizer here.
        Err(GraphError::NoGradient { op: self.name().into(), index: 0 })
    }

    /// A split of the rows of `x` and `dy` splits `dx` and leaves each device partial
    /// sums of `dgamma` and `dbeta`. With `x` and `gamma` whole, all three outputs are
    /// linear in `dy`, so summands of `dy` give summands.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let rank = inputs.first().map_or(0, |x| x.shape.rank());
        let (partial, whole) = (Sbp::Partial, Sbp::Broadcast);
        let mut signatures: Vec<SbpSignature> = (0..rank.saturating_sub(1))
            .map(|d| SbpSignature::new([Sbp::Split(d), whole, Sbp::Split(d)], [Sbp::Split(d), partial, partial]))
            .collect();
        signatures.push(SbpSignature::new([whole, whole, partial], [partial, partial, partial]));
        signatures
    }
}

impl<'g> Tensor<'g> {
    /// Layer normalization over the last axis: `(x - mean) / √(var + eps) · gamma + beta`,
    /// with `gamma` and `beta` of shape `[D]` for `self` of shape `[..., D]`.
    pub fn layer_norm(&self, gamma: &Tensor<'g>, beta: &Tensor<'g>, eps: f64) -> Result<Tensor<'g>, GraphError> {
        self.graph().apply1(LayerNorm::new(eps), &[*self, *gamma, *beta])
    }
}
