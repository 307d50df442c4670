//! Attributes of `permute` ops.

use super::axis_index;
use crate::Shape;
use serde::{Deserialize, Serialize};

/// Output axis `i` is input axis `perm[i]`; `perm` is a permutation of the input's axes
/// (negative entries count from the end).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Permute(pub Vec<isize>);

impl Permute {
    /// The permutation as axis indices of an input of `shape`, checked.
    pub fn resolve(&self, shape: &Shape) -> Result<Vec<usize>, String> {
        let (perm, rank) = (&self.0, shape.rank());
        if perm.len() != rank {
            return Err(format!("permutation {perm:?} has {} axes, but the input has rank {rank}", perm.len()));
        }
        let mut seen = vec![false; rank];
        let mut axes = Vec::with_capacity(rank);
        for &p in perm {
            let axis = axis_index(shape, p)?;
            if seen[axis] {
                return Err(format!("{perm:?} is not a permutation of 0..{rank}: axis {axis} appears twice"));
            }
            seen[axis] = true;
            axes.push(axis);
        }
        Ok(axes)
    }
}
