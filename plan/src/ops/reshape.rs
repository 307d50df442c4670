//! Attributes of `reshape` ops.

use crate::Shape;
use serde::{Deserialize, Serialize};

/// Reshapes its input to these dimensions; at most one may be -1, which takes whatever
/// size makes the element counts match.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reshape(pub Vec<isize>);

impl Reshape {
    /// A reshape to a fully known shape.
    pub fn to(shape: &Shape) -> Self {
        Reshape(shape.dims().iter().map(|&d| d as isize).collect())
    }

    /// The shape an input of shape `from` becomes.
    pub fn resolve(&self, from: &Shape) -> Result<Shape, String> {
        let spec = &self.0;
        let mut inferred = None;
        let mut known: usize = 1;
        for (i, &d) in spec.iter().enumerate() {
            if d == -1 {
                if inferred.replace(i).is_some() {
                    return Err(format!("at most one dimension may be -1, got {spec:?}"));
                }
            } else {
                let d = usize::try_from(d).map_err(|_| format!("invalid dimension {d} in {spec:?}"))?;
                known = known.checked_mul(d).ok_or_else(|| format!("{spec:?} has too many elements"))?;
            }
        }
        let numel = from.numel();
        let mut dims: Vec<usize> = spec.iter().map(|&d| d.max(0) as usize).collect();
        match inferred {
            None if known != numel => {
                return Err(format!("cannot reshape {from} ({numel} elements) to {spec:?} ({known} elements)"));
            }
            None => {}
            Some(_) if known == 0 => {
                return Err(format!(
                    "cannot reshape {from} ({numel} elements) to {spec:?}: the other dimensions have 0 elements, \
                     so -1 is ambiguous"
                ));
            }
            Some(_) if !numel.is_multiple_of(known) => {
                return Err(format!(
                    "cannot reshape {from} ({numel} elements) to {spec:?}: {numel} is not a multiple of {known}"
                ));
            }
            Some(i) => dims[i] = numel / known,
        }
        Ok(Shape(dims))
    }
}
