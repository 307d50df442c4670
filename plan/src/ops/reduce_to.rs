//! Attributes of `reduce_to` ops.

use crate::Shape;
use serde::{Deserialize, Serialize};

/// Sums a tensor down to a shape it broadcasts from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SumTo(pub Shape);

/// Broadcasts a tensor up to a shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BroadcastTo(pub Shape);

/// `Σ x²` over every element, to a scalar of `x`'s dtype: a gradient's squared norm in one
/// pass (each square rounded as a separate `x · x` would be, then summed in the order
/// `sum_to` sums, so the bits are those of `x.mul(x).sum_to([])`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SumSquares;

/// A chain of [`SumSquares`] and scalar adds in one op, as the compiler fuses a device's
/// part of the global gradient norm (`compile/fuse_norms.rs` in `regflow-graph`): inputs
/// `([carry], x₀, x₁, …)`, one scalar output `((carry + Σx₀²) + Σx₁²) + …` (without a carry,
/// `(Σx₀² + Σx₁²) + …`), each `Σxᵢ²` computed as [`SumSquares`] computes it and rounded to
/// the dtype, each sum rounded as the scalar `add` it replaces: the chain's bits on the CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SumSquaresGroup {
    /// Whether the first input is a running total carried in (a scalar of the dtype).
    pub carried: bool,
}

impl SumSquaresGroup {
    /// Checks `conf`'s metas, as every device's kernel needs them: at least one tensor
    /// after the carry (if any), every input mapped, all of the output's dtype, a scalar
    /// carry and a scalar output.
    pub fn check(&self, conf: &crate::OpConf) -> Result<(), String> {
        self.check_metas(&conf.inputs, &conf.outputs)?;
        if conf.input_map.len() != conf.inputs.len() {
            return Err(format!("maps {} inputs to actor inputs, but has {}", conf.input_map.len(), conf.inputs.len()));
        }
        Ok(())
    }

    /// [`SumSquaresGroup::check`] of the metas alone (the input map aside).
    pub fn check_metas(&self, inputs: &[crate::TensorMeta], outputs: &[crate::TensorMeta]) -> Result<(), String> {
        let carried = usize::from(self.carried);
        let scalar = |m: &crate::TensorMeta| m.shape.numel() == 1;
        let fits = inputs.len() > carried
            && matches!(outputs, [out] if scalar(out) && inputs.iter().all(|m| m.dtype == out.dtype))
            && (!self.carried || scalar(&inputs[0]));
        if fits {
            return Ok(());
        }
        let list = |metas: &[crate::TensorMeta]| metas.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
        Err(format!(
            "sums the squares of at least one tensor{} into one scalar, all of one dtype, but has inputs [{}] and \
             outputs [{}]",
            if self.carried { " after a carried scalar" } else { "" },
            list(inputs),
            list(outputs)
        ))
    }
}
