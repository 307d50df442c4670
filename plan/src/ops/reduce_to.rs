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
