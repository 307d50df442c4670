//! Attributes of `slice` ops.

use super::axis_index;
use crate::Shape;
use serde::{Deserialize, Serialize};

/// Elements `start..end` of axis `axis`: `start < end`, and `end` at most the axis' size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slice {
    /// The sliced axis; negative counts from the end.
    pub axis: isize,
    /// First index kept.
    pub start: usize,
    /// One past the last index kept.
    pub end: usize,
}

/// The gradient of [`Slice`]: its input, placed at `start` of axis `axis` in zeros whose
/// axis has size `size` (the sliced tensor's).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SliceGrad {
    /// The axis the slice was taken on; negative counts from the end.
    pub axis: isize,
    /// Where the slice starts.
    pub start: usize,
    /// Size of the axis in the output.
    pub size: usize,
}

impl Slice {
    /// The axis index and its size in `shape`, with the range checked.
    pub fn resolve(&self, shape: &Shape) -> Result<(usize, usize), String> {
        let axis = axis_index(shape, self.axis)?;
        let (start, end, size) = (self.start, self.end, shape.dims()[axis]);
        if start >= end {
            return Err(format!("slice {start}..{end} of axis {axis} is empty: start must be less than end"));
        }
        if end > size {
            return Err(format!("slice {start}..{end} out of bounds for axis {axis} of size {size}"));
        }
        Ok((axis, size))
    }
}

impl SliceGrad {
    /// The axis index and the slice's length in `shape` (the slice's shape), checked.
    pub fn resolve(&self, shape: &Shape) -> Result<(usize, usize), String> {
        let axis = axis_index(shape, self.axis)?;
        let len = shape.dims()[axis];
        if self.start.checked_add(len).is_none_or(|end| end > self.size) {
            return Err(format!("a slice of {len} at {} does not fit axis {axis} of size {}", self.start, self.size));
        }
        Ok((axis, len))
    }
}
