//! CPU kernels of `boxing` ops.

use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::*;
use regflow_plan::{Element, HostTensor, HostTensorMut};

impl HostCompute for TakePart {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        // The part is a slice of one axis: the slice op's block copy moves it (an empty
        // part, which the DSL's slice rejects, copies nothing).
        let size = inputs[0].shape.dims()[self.dim];
        let range = regflow_plan::part_range(size, self.parts, self.index);
        let blocks = crate::cpu::slice::AxisBlocks::new(inputs[0].shape, self.dim);
        let (input, out) = (&inputs[0], &mut outputs[0]);
        by_element!(out.dtype(), T => blocks.copy(
            (input.as_slice::<T>()?, size, range.start),
            (out.as_mut_slice::<T>()?, range.len(), 0),
            range.len()
        ))
    }

    /// Moves elements only: bf16 is copied as it is.
    fn bf16_native(&self) -> bool {
        true
    }
}

impl HostCompute for KeepOnFirst {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        let (input, out) = (&inputs[0], &mut outputs[0]);
        by_element!(out.dtype(), T => keep_on_first::<T>(self.first, input.as_slice::<T>()?, out.as_mut_slice::<T>()?))
    }

    /// Moves elements only: bf16 is copied as it is (its zero is all zero bits).
    fn bf16_native(&self) -> bool {
        true
    }
}

/// The value on the first device of the axis, zeros (`T::default()`) on the others.
fn keep_on_first<T: Element + Default>(first: bool, x: &[T], out: &mut [T]) -> Result<(), String> {
    if x.len() != out.len() {
        return Err(format!("input of {} elements, output of {} (broken invariant)", x.len(), out.len()));
    }
    if first {
        out.copy_from_slice(x);
    } else {
        out.fill(T::default());
    }
    Ok(())
}
