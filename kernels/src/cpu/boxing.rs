//! CPU kernels of `boxing` ops.

use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::*;
use regflow_plan::{HostTensor, HostTensorMut};

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
    fn half_native(&self) -> bool {
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
        if self.first {
            return super::reshape::copy_all(&inputs[0], &mut outputs[0]);
        }
        let out = &mut outputs[0];
        by_element!(out.dtype(), T => out.as_mut_slice::<T>().map(|o| o.fill(T::default())))
    }

    /// Moves elements only: bf16 is copied as it is (its zero is all zero bits).
    fn half_native(&self) -> bool {
        true
    }
}
