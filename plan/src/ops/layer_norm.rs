//! Attributes of `layer_norm` ops.

use crate::{DType, TensorMeta};
use serde::{Deserialize, Serialize};

/// `(x - mean) / √(var + eps) · gamma + beta` over the last axis of `x` (`[..., D]`), with
/// `gamma` and `beta` of shape `[D]`; the variance is the biased (population) one.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LayerNorm {
    /// Added to the variance before the square root.
    pub eps: f64,
    /// The output's dtype where it is not the input's: bf16 or f16 from f32 inputs,
    /// computed in f32 and each element rounded as a `cast` rounds it, so the output is
    /// bitwise `cast(layer_norm(x))` without the f32 tensor between them (the compiler
    /// folds mixed precision's casts after layer norms so, `compile/fold_casts.rs`).
    /// `None` (the default, left out of plan files): the input's dtype.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub out: Option<DType>,
}

impl LayerNorm {
    /// A layer norm whose output has its input's dtype.
    pub fn new(eps: f64) -> Self {
        Self { eps, out: None }
    }

    /// The output dtype of this op on an input (and scale and shift) of `input`, or why
    /// the pair is refused: an `out` must be bf16 or f16, from f32.
    pub fn output_dtype(&self, input: DType) -> Result<DType, String> {
        match self.out {
            None => Ok(input),
            Some(out) => narrowing("layer_norm", "out", out, input).map(|()| out),
        }
    }
}

/// The gradients of [`LayerNorm`] from inputs `(x, gamma, dy)`: three outputs, `dx`,
/// `dgamma` and `dbeta`, computed in one pass (the statistics are recomputed, not stored).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LayerNormGrad {
    /// The forward op's `eps`.
    pub eps: f64,
    /// `dy`'s dtype where it is not `x`'s: bf16 or f16 with f32 `x` and `gamma`, each
    /// element widened (exactly) as a `cast` to f32 widens it and the rest computed in
    /// f32, so the outputs are bitwise those of `layer_norm_grad(x, gamma, cast(dy))`
    /// without the f32 copy of `dy`. `None` (the default, left out of plan files): `x`'s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dy: Option<DType>,
}

impl LayerNormGrad {
    /// A layer norm's gradient whose `dy` has `x`'s dtype.
    pub fn new(eps: f64) -> Self {
        Self { eps, dy: None }
    }

    /// The dtype `dy` must have for an `x` (and `gamma`) of `input`, or why the pair is
    /// refused: a `dy` attribute must be bf16 or f16, with f32 `x`.
    pub fn dy_dtype(&self, input: DType) -> Result<DType, String> {
        match self.dy {
            None => Ok(input),
            Some(dy) => narrowing("layer_norm_grad", "dy", dy, input).map(|()| dy),
        }
    }
}

/// Whether op `op`'s attribute `attribute` = `narrow` may pair with f32-computed tensors of
/// `input`: only bf16 or f16 beside f32 (the pairs mixed precision makes and the kernels
/// have; f64 would round twice on the way to bf16).
fn narrowing(op: &str, attribute: &str, narrow: DType, input: DType) -> Result<(), String> {
    if !narrow.is_half() {
        return Err(format!(
            "{op} with {attribute} = {narrow}: {attribute} must be bf16 or f16 (leave it out for the input's dtype)"
        ));
    }
    if input != DType::F32 {
        return Err(format!("{op} with {attribute} = {narrow} needs f32 inputs, got {input}"));
    }
    Ok(())
}

/// The features `D` of a layer norm's input `x` of `[..., D]` (or of its gradient's), with
/// `eps` finite and not negative, `x` of a float dtype and each of `parameters` (scale and
/// shift, or the scale alone) `[D]` of `x`'s dtype; or why not. The graph's shape rule and
/// the kernels' checks both ask it.
pub fn layer_norm_features(eps: f64, x: &TensorMeta, parameters: &[&TensorMeta]) -> Result<usize, String> {
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(format!("eps must be finite and >= 0, got {eps}"));
    }
    if !x.dtype.is_float() {
        return Err(format!("needs a float input, got {}", x.dtype));
    }
    let Some(&features) = x.shape.dims().last() else {
        return Err("input must have rank >= 1, got a scalar".into());
    };
    for p in parameters {
        if p.dtype != x.dtype {
            return Err(format!("dtype mismatch: {} vs {}", x.dtype, p.dtype));
        }
        if p.shape.dims() != [features] {
            return Err(format!("scale and shift must have shape [{features}], got {}", p.shape));
        }
    }
    Ok(features)
}
