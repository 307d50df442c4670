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
