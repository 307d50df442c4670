//! Attributes of `reduce_to` ops.

use crate::Shape;
use serde::{Deserialize, Serialize};

/// Sums a tensor down to a shape it broadcasts from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SumTo(pub Shape);

/// Broadcasts a tensor up to a shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BroadcastTo(pub Shape);
