//! Attributes of `reduce` ops.

use crate::Shape;
use serde::{Deserialize, Serialize};

/// Which reduction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReduceKind {
    /// Sum of the elements.
    Sum,
    /// Arithmetic mean of the elements.
    Mean,
    /// Largest element; NaNs are skipped (a group of only NaNs gives -inf).
    Max,
}

/// Reduces the axes `axes` (all of them when empty) of its input; `keepdim` keeps each
/// reduced axis as a dimension of 1 instead of removing it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reduce {
    /// Which reduction.
    pub kind: ReduceKind,
    /// Axes to reduce; negative axes count from the end; empty means every axis.
    pub axes: Vec<isize>,
    /// Whether reduced axes stay as dimensions of 1.
    pub keepdim: bool,
}

/// 1.0 where input 0 equals input 1 broadcast to its shape, else 0.0: the positions that
/// hold the maximum when input 1 is the keepdim `max` of input 0. Piecewise constant, so
/// its gradients are zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MaxMask;

/// A device's share of a `mean` whose reduced axes are split: the sum of its elements
/// divided by the logical count, so that the devices' results sum to the mean.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartMean {
    /// The `mean` it stands for (its axes and keepdim).
    pub mean: Reduce,
    /// Elements each logical output element averages.
    pub logical_count: usize,
}

impl Reduce {
    /// The output shape for an input of `shape`.
    pub fn output_shape(&self, shape: &Shape) -> Result<Shape, String> {
        let reduced = reduced_axes(shape, &self.axes)?;
        if self.keepdim {
            return Ok(keepdim_shape(shape, &reduced));
        }
        Ok(Shape(shape.dims().iter().zip(&reduced).filter(|(_, &r)| !r).map(|(&d, _)| d).collect()))
    }
}

/// `axis` as an index into `shape`'s dimensions, or the error every shape op reports.
pub fn axis_index(shape: &Shape, axis: isize) -> Result<usize, String> {
    shape.axis(axis).ok_or_else(|| format!("axis {axis} out of range for rank {}", shape.rank()))
}

/// Which of `shape`'s axes `axes` names (all of them when `axes` is empty).
pub fn reduced_axes(shape: &Shape, axes: &[isize]) -> Result<Vec<bool>, String> {
    if axes.is_empty() {
        return Ok(vec![true; shape.rank()]);
    }
    let mut reduced = vec![false; shape.rank()];
    for &axis in axes {
        let index = axis_index(shape, axis)?;
        if reduced[index] {
            return Err(format!("axes {axes:?} name axis {index} twice"));
        }
        reduced[index] = true;
    }
    Ok(reduced)
}

/// `shape` with every reduced axis set to 1.
pub fn keepdim_shape(shape: &Shape, reduced: &[bool]) -> Shape {
    Shape(shape.dims().iter().zip(reduced).map(|(&d, &r)| if r { 1 } else { d }).collect())
}
