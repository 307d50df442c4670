//! `cast`: a tensor converted to another float dtype; the op mixed precision inserts
//! (`crate::autocast`).

use super::{Autocast, GradCtx, InputGrads, OpDef};
use crate::plan::TensorMeta;
use crate::sbp::{Sbp, SbpSignature};
use crate::{GraphError, Tensor};
pub use regflow_plan::ops::Cast;

impl OpDef for Cast {
    fn name(&self) -> &'static str {
        "cast"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let [x] = inputs else { return Err(format!("takes 1 input, got {}", inputs.len())) };
        if !x.dtype.is_float() || !self.to.is_float() {
            return Err(format!(
                "casts between float dtypes only (f32, f64, bf16, f16), not {} to {}",
                x.dtype, self.to
            ));
        }
        Ok(vec![TensorMeta::new(x.shape.clone(), self.to)])
    }

    /// The gradient comes back in the input's dtype: a master weight cast to bf16 gets
    /// an f32 gradient.
    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        let (x, dy) = (ctx.inputs[0], ctx.grad()?);
        Ok(vec![Some(dy.cast(x.dtype())?)])
    }

    /// Splits pass through. Summands pass through a widening cast only (bf16 or f16 → f32,
    /// f32 → f64; not bf16 ↔ f16, which round each other's values): each part widens exactly and the parts are then summed in the wider
    /// type, which is at least as precise as widening the sum. A narrowing cast of
    /// summands would round every part and sum in bf16; without `(P) → (P)` the compiler
    /// reduces in the wide type first and casts once, as PyTorch's autocast does.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let Some(x) = inputs.first() else { return Vec::new() };
        let mut signatures: Vec<SbpSignature> =
            (0..x.shape.rank()).map(|d| SbpSignature::new([Sbp::Split(d)], [Sbp::Split(d)])).collect();
        if self.to == x.dtype || self.to.size() > x.dtype.size() {
            signatures.push(SbpSignature::new([Sbp::Partial], [Sbp::Partial]));
        }
        signatures
    }

    fn autocast(&self) -> Autocast {
        Autocast::Keep
    }
}

impl<'g> Tensor<'g> {
    /// The tensor converted to the float dtype `to` (rounding to nearest even where `to`
    /// is narrower); the tensor itself when it already has that dtype. Under mixed
    /// precision the same conversion of one tensor is made once and shared.
    pub fn cast(&self, to: crate::plan::DType) -> Result<Tensor<'g>, GraphError> {
        if self.dtype() == to {
            return Ok(*self);
        }
        self.graph().cast_shared(*self, to)
    }
}
