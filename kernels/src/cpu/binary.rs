//! CPU kernels of `binary` ops.

use crate::cpu::axes;
use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::*;
use regflow_plan::{HostTensor, HostTensorMut, Real, Shape, TensorMeta};

impl HostCompute for Binary {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        by_float!(outputs[0].dtype(), "integer arithmetic is not supported", T => compute_typed::<T>(self.0, inputs, &mut outputs[0]))
    }

    fn check(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Result<(), String> {
        let ([a, b], [out]) = (inputs, outputs) else {
            return Err(format!("takes 2 inputs and gives 1 output, but has {} and {}", inputs.len(), outputs.len()));
        };
        if a.dtype != b.dtype || a.dtype != out.dtype {
            return Err(format!("operands {a} and {b} give {out}: all three must have one dtype"));
        }
        match Shape::broadcast(&a.shape, &b.shape) {
            None => Err(format!("shapes {} and {} do not broadcast", a.shape, b.shape)),
            Some(shape) if shape != out.shape => {
                Err(format!("shapes {} and {} broadcast to {shape}, but the output is {}", a.shape, b.shape, out.shape))
            }
            Some(_) => Ok(()),
        }
    }
}

fn compute_typed<T: Real>(
    kind: BinaryKind,
    inputs: &[HostTensor<'_>],
    out: &mut HostTensorMut<'_>,
) -> Result<(), String> {
    let (a, b) = (inputs[0].as_slice::<T>()?, inputs[1].as_slice::<T>()?);
    let shape = out.shape;
    let o = out.as_mut_slice::<T>()?;
    let op = |x: T, y: T| match kind {
        BinaryKind::Add => x + y,
        BinaryKind::Sub => x - y,
        BinaryKind::Mul => x * y,
        BinaryKind::Div => x / y,
    };
    for_each_broadcast(shape.dims(), inputs[0].shape.dims(), inputs[1].shape.dims(), |i, ia, ib| {
        o[i] = op(a[ia], b[ib])
    });
    Ok(())
}

/// Calls `f(out_index, a_index, b_index)` for every element of an output of dimensions
/// `out`, where operands of dimensions `a` and `b` are read broadcast to `out`. Allocates
/// nothing up to rank [`INLINE_RANK`](crate::cpu::axes::INLINE_RANK).
pub fn for_each_broadcast(out: &[usize], a: &[usize], b: &[usize], mut f: impl FnMut(usize, usize, usize)) {
    let n: usize = out.iter().product();
    if a == out && b == out {
        for i in 0..n {
            f(i, i, i);
        }
        return;
    }
    let (sa, sb) = (axes::broadcast_strides(a, out), axes::broadcast_strides(b, out));
    let dims = out;
    let Some((&inner, outer_dims)) = dims.split_last() else {
        f(0, 0, 0);
        return;
    };
    if inner == 0 {
        return;
    }
    // The innermost dimension in a tight loop (a bias row, a broadcast column), the outer
    // ones by an odometer that updates the two read offsets incrementally.
    let rank = dims.len();
    let (step_a, step_b) = (sa[rank - 1], sb[rank - 1]);
    let mut index: axes::AxisVec<usize> = smallvec::smallvec![0; outer_dims.len()];
    let (mut ia, mut ib) = (0usize, 0usize);
    for block in 0..n / inner {
        let base = block * inner;
        for k in 0..inner {
            f(base + k, ia + k * step_a, ib + k * step_b);
        }
        for d in (0..outer_dims.len()).rev() {
            index[d] += 1;
            ia += sa[d];
            ib += sb[d];
            if index[d] < outer_dims[d] {
                break;
            }
            ia -= sa[d] * outer_dims[d];
            ib -= sb[d] * outer_dims[d];
            index[d] = 0;
        }
    }
}
