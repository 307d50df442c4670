//! CPU kernels of `fill` ops and `causal_mask`.

use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::*;
use regflow_plan::{HostSliceMut, HostTensor, HostTensorMut, Real};

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
            HostSliceMut::F16(v) => v.fill(regflow_plan::f16_from_f64(self.value)),
        }
        Ok(())
    }

    fn half_native(&self) -> bool {
        true
    }
}

impl HostCompute for CausalMask {
    fn compute(
        &self,
        _context: &HostContext,
        _inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        let len = self.meta.shape.dims().last().copied().unwrap_or(1);
        let out = &mut outputs[0];
        by_float!(out.dtype(), "a causal mask is a float tensor", T => {
            causal::<T>(out.as_mut_slice::<T>()?, len, T::from_f64(self.masked));
            Ok(())
        })
    }
}

/// Row `i` of `len`: zeros up to column `i`, `masked` after it.
fn causal<T: Real>(out: &mut [T], len: usize, masked: T) {
    for (i, row) in out.chunks_mut(len.max(1)).enumerate() {
        let (allowed, hidden) = row.split_at_mut((i + 1).min(row.len()));
        allowed.fill(T::zero());
        hidden.fill(masked);
    }
}
