//! CPU kernels of `fill` ops.

use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::*;
use regflow_plan::{HostSliceMut, HostTensor, HostTensorMut};

impl HostCompute for Fill {
    fn compute(
        &self,
        _context: &HostContext,
        _inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        match &mut outputs[0].data {
            HostSliceMut::F32(v) => v.fill(self.value as f32),
            HostSliceMut::F64(v) => v.fill(self.value),
            HostSliceMut::I64(v) => v.fill(self.value as i64),
            HostSliceMut::Bf16(v) => v.fill(regflow_plan::bf16_from_f64(self.value)),
        }
        Ok(())
    }

    fn bf16_native(&self) -> bool {
        true
    }
}
