//! CPU kernels of `reshape` ops.

use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::*;
use regflow_plan::{HostSlice, HostSliceMut, HostTensor, HostTensorMut};

impl HostCompute for Reshape {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        copy_all(&inputs[0], &mut outputs[0])
    }

    /// Moves elements only: bf16 is copied as it is.
    fn half_native(&self) -> bool {
        true
    }
}

/// Copies every element of `input` to `out` (same dtype and element count): `reshape`,
/// `to_global` and the first device's `keep_on_first`.
pub(crate) fn copy_all(input: &HostTensor<'_>, out: &mut HostTensorMut<'_>) -> Result<(), String> {
    fn copy<T: Copy>(x: &[T], o: &mut [T]) -> Result<(), String> {
        if x.len() != o.len() {
            return Err(format!("{} input elements for {} outputs (broken invariant)", x.len(), o.len()));
        }
        o.copy_from_slice(x);
        Ok(())
    }
    match (input.data, &mut out.data) {
        (HostSlice::F32(x), HostSliceMut::F32(o)) => copy(x, o),
        (HostSlice::F64(x), HostSliceMut::F64(o)) => copy(x, o),
        (HostSlice::I64(x), HostSliceMut::I64(o)) => copy(x, o),
        (HostSlice::Bf16(x), HostSliceMut::Bf16(o)) => copy(x, o),
        (HostSlice::F16(x), HostSliceMut::F16(o)) => copy(x, o),
        _ => Err(format!("{} input, {} output (broken invariant)", input.dtype(), out.dtype())),
    }
}
