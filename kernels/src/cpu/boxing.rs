//! CPU kernels of `boxing` ops.

use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::*;
use regflow_plan::{HostSlice, HostSliceMut, HostTensor, HostTensorMut};

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
        let (src, dst) = ((size, range.start), (range.len(), 0));
        match (&inputs[0].data, &mut outputs[0].data) {
            (HostSlice::F32(x), HostSliceMut::F32(o)) => blocks.copy((x, src.0, src.1), (o, dst.0, dst.1), range.len()),
            (HostSlice::F64(x), HostSliceMut::F64(o)) => blocks.copy((x, src.0, src.1), (o, dst.0, dst.1), range.len()),
            (HostSlice::I64(x), HostSliceMut::I64(o)) => blocks.copy((x, src.0, src.1), (o, dst.0, dst.1), range.len()),
            _ => Err("dtype mismatch (broken invariant)".into()),
        }
    }
}

impl HostCompute for KeepOnFirst {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        macro_rules! keep {
            ($x:expr, $o:expr, $zero:expr) => {{
                if self.first {
                    $o.copy_from_slice($x);
                } else {
                    $o.fill($zero);
                }
                Ok(())
            }};
        }
        match (&inputs[0].data, &mut outputs[0].data) {
            (HostSlice::F32(x), HostSliceMut::F32(o)) => keep!(x, o, 0.0),
            (HostSlice::F64(x), HostSliceMut::F64(o)) => keep!(x, o, 0.0),
            (HostSlice::I64(x), HostSliceMut::I64(o)) => keep!(x, o, 0),
            _ => Err("dtype mismatch (broken invariant)".into()),
        }
    }
}
