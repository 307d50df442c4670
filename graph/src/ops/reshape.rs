//! `reshape`: the same elements in row-major order under another shape, one dimension of
//! which may be -1 (inferred from the element count).

use super::{GradCtx, InputGrads, LocalContext, OpDef};
use crate::plan::{Shape, TensorMeta};
use crate::sbp::{Sbp, SbpSignature};
use crate::{GraphError, Tensor};
pub use regflow_plan::ops::Reshape;
use std::sync::Arc;

impl OpDef for Reshape {
    fn name(&self) -> &'static str {
        "reshape"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let [x] = inputs else { return Err(format!("takes 1 input, got {}", inputs.len())) };
        Ok(vec![TensorMeta { shape: self.resolve(&x.shape)?, dtype: x.dtype }])
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        Ok(vec![Some(ctx.grad()?.reshape_to(&ctx.inputs[0].shape())?)])
    }

    /// Input dimension `d` may be split as output dimension `e` when both have the same
    /// size and the same number of elements before them (the same product of the leading
    /// dimensions): then an index of `d` means the same elements as that index of `e`, so
    /// each device's part, in row-major order, is its part of the output. Summands reshape
    /// to summands.
    fn sbp_signatures(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let ([x], [y]) = (inputs, outputs) else { return Vec::new() };
        let leading = |dims: &[usize]| -> Vec<(usize, usize)> {
            let mut before = 1usize;
            dims.iter()
                .map(|&n| {
                    let entry = (before, n);
                    before = before.saturating_mul(n);
                    entry
                })
                .collect()
        };
        let (from, to) = (leading(x.shape.dims()), leading(y.shape.dims()));
        let mut signatures = Vec::new();
        for (d, entry) in from.iter().enumerate() {
            for (e, _) in to.iter().enumerate().filter(|(_, other)| *other == entry) {
                signatures.push(SbpSignature::new([Sbp::Split(d)], [Sbp::Split(e)]));
            }
        }
        // A dimension factored into several (or several merged into one) keeps its split on
        // the outermost factor when the device count divides it (`[B·T, D] -> [B, T, H, d]`
        // splits heads); the compiler checks the local shapes line up for its mesh.
        for (d, &(before, n)) in from.iter().enumerate() {
            for (e, &(other_before, m)) in to.iter().enumerate() {
                let factored = n != m && n > 1 && m > 1 && (n % m == 0 || m % n == 0);
                if other_before == before && factored {
                    signatures.push(SbpSignature::new([Sbp::Split(d)], [Sbp::Split(e)]));
                }
            }
        }
        signatures.push(SbpSignature::new([Sbp::Partial], [Sbp::Partial]));
        signatures
    }

    /// Reshapes to the local output shape.
    fn localize(&self, ctx: &LocalContext<'_>) -> Result<Option<Arc<dyn OpDef>>, String> {
        match (ctx.logical_outputs, ctx.local_outputs) {
            ([logical], [local]) if local.shape != logical.shape => Ok(Some(Arc::new(Reshape::to(&local.shape)))),
            _ => Ok(None),
        }
    }

    /// Moves elements: any dtype as it is.
    fn autocast(&self) -> super::Autocast {
        super::Autocast::Keep
    }
}

impl<'g> Tensor<'g> {
    /// The same elements, row-major, under the dimensions `shape`; one of them may be -1,
    /// inferred from the element count.
    pub fn reshape(&self, shape: &[isize]) -> Result<Tensor<'g>, GraphError> {
        self.graph().apply1(Reshape(shape.to_vec()), &[*self])
    }

    /// Reshapes to a fully known shape; the identity if the shape is already `shape`.
    pub fn reshape_to(&self, shape: &Shape) -> Result<Tensor<'g>, GraphError> {
        if &self.shape() == shape {
            return Ok(*self);
        }
        self.graph().apply1(Reshape::to(shape), &[*self])
    }
}
