//! Attributes of `concat` ops.

use super::axis_index;
use crate::Shape;
use serde::{Deserialize, Serialize};

/// Concatenates its inputs (one or more) along `axis`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Concat {
    /// The joined axis; negative counts from the end.
    pub axis: isize,
}

impl Concat {
    /// The axis index, checked against the first input's shape.
    pub fn resolve(&self, first: &Shape) -> Result<usize, String> {
        axis_index(first, self.axis)
    }
}
