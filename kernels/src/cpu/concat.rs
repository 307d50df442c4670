//! CPU kernels of `concat` ops.

use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::*;
use regflow_plan::{Element, HostTensor, HostTensorMut};

impl HostCompute for Concat {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        let axis = self.resolve(outputs[0].shape)?;
        by_element!(outputs[0].dtype(), T => concat_typed::<T>(axis, inputs, &mut outputs[0]))
    }

    /// Moves elements only: bf16 is copied as it is.
    fn half_native(&self) -> bool {
        true
    }
}

fn concat_typed<T: Element>(axis: usize, inputs: &[HostTensor<'_>], out: &mut HostTensorMut<'_>) -> Result<(), String> {
    let blocks = crate::cpu::slice::AxisBlocks::new(out.shape, axis);
    let total = out.shape.dims()[axis];
    let o = out.as_mut_slice::<T>()?;
    let mut offset = 0;
    for input in inputs {
        let size = input.shape.dims()[axis];
        blocks.copy((input.as_slice::<T>()?, size, 0), (&mut *o, total, offset), size)?;
        offset += size;
    }
    Ok(())
}
