//! CPU kernels of `dropout` ops.

use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::*;
use regflow_plan::{HostTensor, HostTensorMut, Real};

impl HostCompute for DropoutPart {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        let local = inputs[0].shape.dims();
        if local.len() != self.offsets.len() || local.len() != self.logical.rank() {
            return Err(format!(
                "a part of shape {} with {} offsets of a logical {} (broken invariant)",
                inputs[0].shape,
                self.offsets.len(),
                self.logical
            ));
        }
        // `DropoutPart::logical_index` with the strides computed once per firing.
        let strides = crate::cpu::axes::strides(self.logical.dims());
        let index = |i: usize| {
            let (mut rest, mut index) = (i, 0);
            for d in (0..local.len()).rev() {
                index += (rest % local[d] + self.offsets[d]) * strides[d];
                rest /= local[d];
            }
            index
        };
        by_float!(outputs[0].dtype(), "integer dropout is not supported", T => compute_typed::<T>(&self.dropout, index, &inputs[0], &mut outputs[0]))
    }
}

impl HostCompute for Dropout {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        by_float!(outputs[0].dtype(), "integer dropout is not supported", T => compute_typed::<T>(self, |i| i, &inputs[0], &mut outputs[0]))
    }
}

/// `index(i)`: the logical index of local element `i` (the identity unless split).
fn compute_typed<T: Real>(
    op: &Dropout,
    index: impl Fn(usize) -> usize,
    input: &HostTensor<'_>,
    out: &mut HostTensorMut<'_>,
) -> Result<(), String> {
    let x = input.as_slice::<T>()?;
    let scale = T::from_f64(1.0 / (1.0 - op.p));
    for (i, (o, &v)) in out.as_mut_slice::<T>()?.iter_mut().zip(x).enumerate() {
        *o = if op.keeps(index(i)) { v * scale } else { T::zero() };
    }
    Ok(())
}
