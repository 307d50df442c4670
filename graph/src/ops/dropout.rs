//! `dropout`: seeded, deterministic inverted dropout whose mask is a pure function of the
//! seed and the element index, so the gradient (the same op applied to `dy`) drops exactly
//! the same elements.

use super::{GradCtx, InputGrads, OpDef};
use crate::tensor::{HostTensor, HostTensorMut, Real, TensorMeta};
use crate::{DType, GraphError, SplitMix64, Tensor};

/// `x · mask / (1 - p)`, where element `i` is kept iff the `i`-th output of
/// `SplitMix64::new(seed)` is at least `p · 2^64` (kept with probability `1 - p`).
///
/// The mask is counter-based: any element's bit is computed from `(seed, i)` alone, so
/// a device kernel can draw it in parallel, and no mask tensor is stored. The op is its
/// own adjoint: the gradient is `dropout(dy)` with the same `p` and `seed`.
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

fn compute_typed<T: Real>(op: &Dropout, input: &HostTensor<'_>, out: &mut HostTensorMut<'_>) -> Result<(), String> {
    let x = input.as_slice::<T>()?;
    let scale = T::from_f64(1.0 / (1.0 - op.p));
    for (i, (o, &v)) in out.as_mut_slice::<T>()?.iter_mut().zip(x).enumerate() {
        *o = if op.keeps(i) { v * scale } else { T::zero() };
    }
    Ok(())
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
            DType::F32 => compute_typed::<f32>(self, &inputs[0], &mut outputs[0]),
            DType::F64 => compute_typed::<f64>(self, &inputs[0], &mut outputs[0]),
            DType::I64 => Err("integer dropout is not supported".into()),
        }
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
