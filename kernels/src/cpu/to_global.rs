//! CPU kernels of `to_global` ops.

use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::*;
use regflow_plan::{Element, HostTensor, HostTensorMut};

impl HostCompute for ToGlobal {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        let (input, out) = (&inputs[0], &mut outputs[0]);
        by_element!(out.dtype(), T => copy::<T>(input.as_slice::<T>()?, out.as_mut_slice::<T>()?))
    }

    /// Moves elements only: bf16 is copied as it is.
    fn bf16_native(&self) -> bool {
        true
    }
}

fn copy<T: Element>(x: &[T], out: &mut [T]) -> Result<(), String> {
    if x.len() != out.len() {
        return Err(format!("input of {} elements, output of {} (broken invariant)", x.len(), out.len()));
    }
    out.copy_from_slice(x);
    Ok(())
}
