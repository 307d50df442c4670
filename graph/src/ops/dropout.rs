//! `dropout`: seeded, deterministic inverted dropout whose mask is a pure function of the
//! seed and the element index, so the gradient (the same op applied to `dy`) drops exactly
//! the same elements.

use super::{GradCtx, InputGrads, LocalContext, OpDef};
use crate::sbp::{Sbp, SbpSignature};
use crate::tensor::{HostTensor, HostTensorMut, Real, Shape, TensorMeta};
use crate::{DType, GraphError, SplitMix64, Tensor};
use std::sync::Arc;

/// `x · mask / (1 - p)`, where element `i` is kept iff the `i`-th output of
/// `SplitMix64::new(seed)` is at least `p · 2^64` (kept with probability `1 - p`).
///
/// The mask is counter-based: any element's bit is computed from `(seed, i)` alone, so
/// a device kernel can draw it in parallel, and no mask tensor is stored. The op is its
/// own adjoint: the gradient is `dropout(dy)` with the same `p` and `seed`. Split over
/// devices, each draws its elements' bits at their logical indices (the offsets its part
/// starts at), so the parts drop exactly what the whole tensor would.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dropout {
    /// Probability of dropping an element, in `[0, 1)`.
    pub p: f64,
    /// Seed of the mask.
    pub seed: u64,
}

/// SplitMix64's increment: state `seed + (i + 1)·GAMMA` gives the stream's `i`-th output.
const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

impl Dropout {
    /// Whether element `index` is kept.
    pub fn keeps(&self, index: usize) -> bool {
        // The saturating float-to-int cast maps p in [0, 1) into 0..2^64.
        let threshold = (self.p * 18_446_744_073_709_551_616.0) as u64;
        SplitMix64::new(self.seed.wrapping_add((index as u64).wrapping_mul(GAMMA))).next_u64() >= threshold
    }
}

/// `index(i)`: the logical index of local element `i` (the identity unless split).
fn compute_typed<T: Real>(
    op: &Dropout,
    index: impl Fn(usize) -> usize,
    input: &HostTensor<'_>,
    out: &mut HostTensorMut<'_>,
) -> Result<(), String> {
    let x = input.as_slice::<T>()?;
    let scale = T::from_f64(1.0 / (1.0 - op.p));
    for (i, (o, &v)) in out.as_mut_slice::<T>()?.iter_mut().zip(x).enumerate() {
        *o = if op.keeps(index(i)) { v * scale } else { T::zero() };
    }
    Ok(())
}

/// One device's part of a [`Dropout`] whose input is split: the mask of each local element
/// is drawn at its logical index, so the parts together drop what the whole would.
#[derive(Debug, Clone, PartialEq)]
struct DropoutPart {
    dropout: Dropout,
    /// Shape of the logical tensor.
    logical: Shape,
    /// Where this device's part starts in each logical dimension.
    offsets: Vec<usize>,
}

impl DropoutPart {
    /// The logical index of element `i` of a local part of shape `local`.
    fn logical_index(&self, local: &Shape, i: usize) -> usize {
        let (strides, dims) = (self.logical.strides(), local.dims());
        let mut rest = i;
        let mut index = 0;
        for d in (0..dims.len()).rev() {
            index += (rest % dims[d] + self.offsets[d]) * strides[d];
            rest /= dims[d];
        }
        index
    }
}

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

    fn compute(&self, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
        let local = inputs[0].shape;
        let index = |i| self.logical_index(local, i);
        match outputs[0].dtype() {
            DType::F32 => compute_typed::<f32>(&self.dropout, index, &inputs[0], &mut outputs[0]),
            DType::F64 => compute_typed::<f64>(&self.dropout, index, &inputs[0], &mut outputs[0]),
            DType::I64 => Err("integer dropout is not supported".into()),
        }
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

    fn compute(&self, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
        match outputs[0].dtype() {
            DType::F32 => compute_typed::<f32>(self, |i| i, &inputs[0], &mut outputs[0]),
            DType::F64 => compute_typed::<f64>(self, |i| i, &inputs[0], &mut outputs[0]),
            DType::I64 => Err("integer dropout is not supported".into()),
        }
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
}

impl<'g> Tensor<'g> {
    /// Inverted dropout: zeroes each element with probability `p` (in `[0, 1)`) and scales
    /// the rest by `1 / (1 - p)`. The mask depends only on `seed` and the element index:
    /// the same seed drops the same elements on every run.
    pub fn dropout(&self, p: f64, seed: u64) -> Result<Tensor<'g>, GraphError> {
        self.graph().apply1(Dropout { p, seed }, &[*self])
    }
}
