//! Attributes of the `cast` op: a tensor converted to another float dtype.

use crate::DType;
use serde::{Deserialize, Serialize};

/// Converts every element to `to` (f32, f64 or bf16), rounding to nearest even where the
/// target is narrower. Mixed precision inserts it where bf16 and f32 computation meet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cast {
    /// The dtype of the result.
    pub to: DType,
}

impl Default for Cast {
    fn default() -> Self {
        Self { to: DType::F32 }
    }
}

/// Several casts to `to` as one op, fused by the compiler where their inputs are ready
/// together (a device's weights at the start of a step) or their outputs are read by the
/// same actors (a device's gradients, read by its fused update): input `m` converted into
/// output `m`, each exactly as one [`Cast`] converts it, in one firing (one multi-tensor
/// launch on CUDA, where one cast per weight cost a launch each).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CastGroup {
    /// The dtype of every result.
    pub to: DType,
    /// Casts in the group: the op's inputs and outputs, one each per member.
    pub members: u32,
}
