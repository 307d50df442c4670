//! Attributes of `fill` ops.

use crate::TensorMeta;
use serde::{Deserialize, Serialize};

/// Every element `value`, of shape and dtype `meta`. No inputs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fill {
    /// The value.
    pub value: f64,
    /// Output shape and dtype.
    pub meta: TensorMeta,
}

impl Fill {
    /// A fill op.
    pub fn new(value: f64, meta: TensorMeta) -> Self {
        Self { value, meta }
    }
}
