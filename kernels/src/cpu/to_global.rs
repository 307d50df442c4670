//! CPU kernels of `to_global` ops.

use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::*;
use regflow_plan::{HostSlice, HostSliceMut, HostTensor, HostTensorMut};

impl HostCompute for ToGlobal {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        match (&inputs[0].data, &mut outputs[0].data) {
            (HostSlice::F32(x), HostSliceMut::F32(o)) => o.copy_from_slice(x),
            (HostSlice::F64(x), HostSliceMut::F64(o)) => o.copy_from_slice(x),
            (HostSlice::I64(x), HostSliceMut::I64(o)) => o.copy_from_slice(x),
            _ => return Err("dtype mismatch (broken invariant)".into()),
        }
        Ok(())
    }
}
