//! `permute` and `transpose`: reorder a tensor's axes, as a strided copy.

use super::{GradCtx, InputGrads, OpDef};
use crate::plan::{Shape, TensorMeta};
use crate::sbp::{Sbp, SbpSignature};
use crate::{GraphError, Tensor};
use regflow_plan::ops::axis_index;
pub use regflow_plan::ops::Permute;

impl OpDef for Permute {
    fn name(&self) -> &'static str {
        "permute"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let [x] = inputs else { return Err(format!("takes 1 input, got {}", inputs.len())) };
        let perm = self.resolve(&x.shape)?;
        Ok(vec![TensorMeta { shape: Shape(perm.iter().map(|&p| x.shape.dims()[p]).collect()), dtype: x.dtype }])
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        let perm = self
            .resolve(&ctx.inputs[0].shape())
            .map_err(|message| GraphError::Kernel { op: self.name().into(), message })?;
        let mut inverse = vec![0isize; perm.len()];
        for (i, &p) in perm.iter().enumerate() {
            inverse[p] = i as isize;
        }
        Ok(vec![Some(ctx.grad()?.permute(&inverse)?)])
    }

    /// A split of input axis `perm[i]` is a split of output axis `i`; summands permute to
    /// summands.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let [x] = inputs else { return Vec::new() };
        let Ok(perm) = self.resolve(&x.shape) else { return Vec::new() };
        let mut signatures: Vec<SbpSignature> =
            perm.iter().enumerate().map(|(i, &p)| SbpSignature::new([Sbp::Split(p)], [Sbp::Split(i)])).collect();
        signatures.push(SbpSignature::new([Sbp::Partial], [Sbp::Partial]));
        signatures
    }

    /// Moves elements: any dtype as it is.
    fn autocast(&self) -> super::Autocast {
        super::Autocast::Keep
    }
}

impl<'g> Tensor<'g> {
    /// Reorders the axes: output axis `i` is input axis `perm[i]`.
    pub fn permute(&self, perm: &[isize]) -> Result<Tensor<'g>, GraphError> {
        self.graph().apply1(Permute(perm.to_vec()), &[*self])
    }

    /// Swaps axes `a` and `b`.
    pub fn transpose(&self, a: isize, b: isize) -> Result<Tensor<'g>, GraphError> {
        let meta = self.meta();
        let resolve = |axis| {
            axis_index(&meta.shape, axis).map_err(|message| GraphError::Op {
                op: "transpose".into(),
                inputs: vec![meta.to_string()],
                message,
            })
        };
        let (a, b) = (resolve(a)?, resolve(b)?);
        let mut perm: Vec<isize> = (0..meta.shape.rank() as isize).collect();
        perm.swap(a, b);
        self.permute(&perm)
    }
}
