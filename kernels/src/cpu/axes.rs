//! Per-axis scratch (dimensions, strides, odometer positions) kept on the stack, so that a
//! kernel's firing allocates nothing: tensors of rank up to [`INLINE_RANK`] never touch the
//! heap (a higher rank still works, and allocates).

use smallvec::SmallVec;

/// Ranks whose per-axis scratch lives on the stack.
pub const INLINE_RANK: usize = 8;

/// One value per axis.
pub type AxisVec<T> = SmallVec<[T; INLINE_RANK]>;

/// Row-major strides of `dims`, in elements (as [`regflow_plan::Shape::strides`]).
pub fn strides(dims: &[usize]) -> AxisVec<usize> {
    let mut strides: AxisVec<usize> = SmallVec::from_elem(1, dims.len());
    for i in (0..dims.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * dims[i + 1];
    }
    strides
}

/// Strides to read a tensor of `dims` as if broadcast to `target` (0 on stretched
/// dimensions), as [`regflow_plan::Shape::broadcast_strides`]. `target` must be a
/// broadcast of `dims`.
pub fn broadcast_strides(dims: &[usize], target: &[usize]) -> AxisVec<usize> {
    let own = strides(dims);
    let offset = target.len() - dims.len();
    (0..target.len()).map(|i| if i < offset || dims[i - offset] == 1 { 0 } else { own[i - offset] }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use regflow_plan::Shape;

    #[test]
    fn strides_agree_with_the_shape_ones() {
        for dims in [vec![], vec![3], vec![2, 3, 4], vec![1, 5, 1, 2], vec![2; 10]] {
            let shape = Shape::new(dims.clone());
            assert_eq!(strides(&dims).as_slice(), shape.strides().as_slice());
            for target in [vec![4, 2, 3, 4], vec![7, 2, 5, 3, 2], vec![2; 12]] {
                let target = Shape::new(target);
                if Shape::broadcast(&shape, &target).as_ref() == Some(&target) {
                    assert_eq!(
                        broadcast_strides(&dims, target.dims()).as_slice(),
                        shape.broadcast_strides(&target).as_slice()
                    );
                }
            }
        }
    }
}
