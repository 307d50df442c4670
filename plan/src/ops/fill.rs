//! Attributes of `fill` ops and `causal_mask`.

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

/// A causal attention mask of shape and dtype `meta` (`[len, len]`): 0 where query row `i`
/// may attend key column `j` (`j <= i`), `masked` above the diagonal. No inputs: made on
/// the device each step, so a step feeds no mask from the host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CausalMask {
    /// The value above the diagonal: a large negative number.
    pub masked: f64,
    /// Output shape and dtype.
    pub meta: TensorMeta,
}
