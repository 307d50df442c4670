//! CPU kernels of `to_global` ops.

use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::*;
use regflow_plan::{HostTensor, HostTensorMut};

impl HostCompute for ToGlobal {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        super::reshape::copy_all(&inputs[0], &mut outputs[0])
    }

    /// Moves elements only: bf16 is copied as it is.
    fn half_native(&self) -> bool {
        true
    }
}
