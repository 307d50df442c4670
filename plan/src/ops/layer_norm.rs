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
    /// The dtype of a second summand `b`, a fourth input of the first one's shape: the
    /// norm's input is `x = input 0 + b`, computed as an `add` of the two computes it (a
    /// bf16 or f16 `b` beside f32 widened exactly), written as the first output, and
    /// normalized into the second: the residual stream's add before a pre-norm block's
    /// norm, whose sum the norm no longer reads back (`graph/src/compile/fold_norm_inputs.rs`).
    /// `b` has input 0's dtype, or is bf16 or f16 beside f32. `None` (the default, left
    /// out of plan files): three inputs, one output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub residual: Option<DType>,
    /// With a summand: a fifth input, a `[D]` bias in the summand's dtype added to the
    /// summand first, as a `binary` add of the two computes it (in f32 for 16-bit ones,
    /// rounded once to the summand's dtype), so the bits are those of the norm of
    /// `x + (b + bias)` made by two adds: the bias of the block's last product, whose add
    /// folds in too. `false` (the default, left out of plan files): no bias.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub summand_bias: bool,
}

impl LayerNorm {
    /// A layer norm whose output has its input's dtype.
    pub fn new(eps: f64) -> Self {
        Self { eps, out: None, residual: None, summand_bias: false }
    }

    /// Whether `inputs` (`x`, `gamma`, `beta`, and `b` with [`LayerNorm::residual`]) and
    /// `outputs` (`y`, or the sum and `y`) fit the op, or why not: `x` and the parameters
    /// as [`layer_norm_features`] says, `y` of `x`'s shape in [`LayerNorm::output_dtype`],
    /// `b` of `x`'s shape in the residual's dtype, the sum like `x`. The graph's shape rule
    /// and the kernels ask it.
    pub fn check(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Result<(), String> {
        let wanted = match (self.residual, self.summand_bias) {
            (None, false) => (3, 1),
            (Some(_), false) => (4, 2),
            (Some(_), true) => (5, 2),
            (None, true) => return Err("a bias of the summand needs a summand (residual)".into()),
        };
        let Some([x, gamma, beta]) = inputs.get(..3).filter(|_| (inputs.len(), outputs.len()) == wanted) else {
            return Err(format!(
                "takes {} inputs and gives {} output(s), but has {} and {}",
                wanted.0,
                wanted.1,
                inputs.len(),
                outputs.len()
            ));
        };
        layer_norm_features(self.eps, x, &[gamma, beta])?;
        if let Some(residual) = self.residual {
            if residual != x.dtype {
                narrowing("layer_norm", "residual", residual, x.dtype)?;
            }
            let expected = TensorMeta::new(x.shape.clone(), residual);
            if inputs[3] != expected {
                return Err(format!("the summand added to the input must be {expected}, got {}", inputs[3]));
            }
            if outputs[0] != *x {
                return Err(format!("the sum must match the input {x}, got {}", outputs[0]));
            }
            let features = gamma.shape.clone();
            if let Some(bias) = inputs.get(4).filter(|&b| *b != TensorMeta::new(features.clone(), residual)) {
                return Err(format!("the summand's bias must be {}, got {bias}", TensorMeta::new(features, residual)));
            }
        }
        let expected = TensorMeta::new(x.shape.clone(), self.output_dtype(x.dtype)?);
        let y = &outputs[outputs.len() - 1];
        if *y != expected {
            return Err(format!("the output must be {expected} for the input {x}, got {y}"));
        }
        Ok(())
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

/// The gradients of [`LayerNorm`] from inputs `(x, gamma, dy)` (and `base` with
/// [`LayerNormGrad::base`]): three outputs, `dx`, `dgamma` and `dbeta`, computed in one pass
/// (the statistics are recomputed, not stored).
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
    /// A fourth input, `base`, of `dx`'s meta, added to `dx` (`dx + base`, each element one
    /// addition of the computed `dx` and the base, as an `add` after the op adds them, so
    /// the bits are those of `add(base, layer_norm_grad(..).dx)`): the residual stream's
    /// gradient a pre-norm block adds to its norm's input gradient, summed without the
    /// `add`'s pass over three tensors (`graph/src/compile/fold_norm_grads.rs`). `false`
    /// (the default, left out of plan files): three inputs.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub base: bool,
    /// A fourth output: `dx` (with the base, if any) rounded to bf16 or f16 as a `cast`
    /// rounds it, from f32 `x` (the 16-bit copy of the residual gradient that mixed
    /// precision's products read, which the folded `add` wrote as its second output).
    /// `None` (the default, left out of plan files): three outputs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dx_narrow: Option<DType>,
}

impl LayerNormGrad {
    /// A layer norm's gradient whose `dy` has `x`'s dtype.
    pub fn new(eps: f64) -> Self {
        Self { eps, dy: None, base: false, dx_narrow: None }
    }

    /// Whether `inputs` (`x`, `gamma`, `dy`, and `base` with [`LayerNormGrad::base`]) and
    /// `outputs` (`dx`, `dgamma`, `dbeta`, and the narrow `dx` with
    /// [`LayerNormGrad::dx_narrow`]) fit the op, or why not: `x` and `gamma` as
    /// [`layer_norm_features`] says, `dy` of `x`'s shape in [`LayerNormGrad::dy_dtype`],
    /// `dx` and a base like `x`, `dgamma` and `dbeta` like `gamma`, a narrow `dx` of `x`'s
    /// shape in bf16 or f16 from f32. The graph's shape rule and the kernels ask it.
    pub fn check(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Result<(), String> {
        let wanted = (3 + usize::from(self.base), 3 + usize::from(self.dx_narrow.is_some()));
        let (Some([x, gamma, dy]), Some([dx, dgamma, dbeta])) = (
            inputs.get(..3).filter(|_| inputs.len() == wanted.0),
            outputs.get(..3).filter(|_| outputs.len() == wanted.1),
        ) else {
            return Err(format!(
                "takes {} inputs and gives {} outputs, but has {} and {}",
                wanted.0,
                wanted.1,
                inputs.len(),
                outputs.len()
            ));
        };
        if let Some(narrow) = self.dx_narrow {
            narrowing("layer_norm_grad", "dx_narrow", narrow, x.dtype)?;
            let expected = TensorMeta::new(x.shape.clone(), narrow);
            if outputs[3] != expected {
                return Err(format!("the narrow dx must be {expected} for the input {x}, got {}", outputs[3]));
            }
        }
        layer_norm_features(self.eps, x, &[gamma])?;
        let expected = TensorMeta::new(x.shape.clone(), self.dy_dtype(x.dtype)?);
        if *dy != expected {
            return Err(format!("dy must be {expected} for the input {x}, got {dy}"));
        }
        if let Some(base) = inputs.get(3).filter(|&base| base != x) {
            return Err(format!("the base added to dx must match the input {x}, got {base}"));
        }
        if dx != x || dgamma != gamma || dbeta != gamma {
            return Err(format!(
                "dx must match the input {x} and dgamma and dbeta gamma {gamma}, got {dx}, {dgamma} and {dbeta}"
            ));
        }
        Ok(())
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
