//! `dropout`: seeded, deterministic inverted dropout whose mask is a pure function of the
//! seed and the element index, so the gradient (the same op applied to `dy`) drops exactly
//! the same elements.

use super::{GradCtx, InputGrads, LocalContext, OpDef};
use crate::plan::TensorMeta;
use crate::sbp::{Sbp, SbpSignature};
use crate::{GraphError, Tensor};
pub use regflow_plan::ops::Dropout;
use regflow_plan::ops::DropoutPart;
use std::sync::Arc;

impl OpDef for DropoutPart {
    fn name(&self) -> &'static str {
        "dropout"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        match inputs {
            [x] if x.shape.rank() == self.offsets.len() => self.dropout.infer(inputs),
            _ => Err(format!("takes one input of rank {}", self.offsets.len())),
        }
    }

    fn grad<'g>(&self, _ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        // Gradients are taken of the logical graph, before it is split over devices.
        Err(GraphError::NoGradient { op: "dropout (one device's part)".into(), index: 0 })
    }
}

impl OpDef for Dropout {
    fn name(&self) -> &'static str {
        "dropout"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let [x] = inputs else { return Err(format!("takes 1 input, got {}", inputs.len())) };
        if !(0.0..1.0).contains(&self.p) {
            return Err(format!("p must be in [0, 1), got {}", self.p));
        }
        if !x.dtype.is_float() {
            return Err(format!("needs a float input, got {}", x.dtype));
        }
        Ok(vec![x.clone()])
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        Ok(vec![Some(ctx.grad()?.dropout(self.p, self.seed)?)])
    }

    /// Any split: the mask is a function of the logical element index, which
    /// [`OpDef::localize`] gives each device through its offsets. The mask does not depend
    /// on the values, so dropout is linear: summands give summands.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let rank = inputs.first().map_or(0, |x| x.shape.rank());
        let mut signatures: Vec<SbpSignature> =
            (0..rank).map(|d| SbpSignature::new([Sbp::Split(d)], [Sbp::Split(d)])).collect();
        signatures.push(SbpSignature::new([Sbp::Partial], [Sbp::Partial]));
        signatures
    }

    /// With the input split, draws each local element's mask at its logical index.
    fn localize(&self, ctx: &LocalContext<'_>) -> Result<Option<Arc<dyn OpDef>>, String> {
        let ([logical], [local], [offsets]) = (ctx.logical_inputs, ctx.local_inputs, ctx.input_offsets) else {
            return Ok(None);
        };
        if local.shape == logical.shape {
            return Ok(None);
        }
        if offsets.len() != logical.shape.rank() {
            return Err(format!("{} offsets for an input of rank {}", offsets.len(), logical.shape.rank()));
        }
        Ok(Some(Arc::new(DropoutPart { dropout: *self, logical: logical.shape.clone(), offsets: offsets.clone() })))
    }

    /// Elementwise: runs in its inputs' dtype (see `Autocast::Promote`).
    fn autocast(&self) -> super::Autocast {
        super::Autocast::Promote
    }
}

impl<'g> Tensor<'g> {
    /// Inverted dropout: zeroes each element with probability `p` (in `[0, 1)`) and scales
    /// the rest by `1 / (1 - p)`. The mask depends only on `seed` and the element index:
    /// the same seed drops the same elements on every run.
    pub fn dropout(&self, p: f64, seed: u64) -> Result<Tensor<'g>, GraphError> {
        self.graph().apply1(Dropout { p, seed }, &[*self])
    }
}
