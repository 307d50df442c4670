//! CPU kernels of `reduce` ops.

use crate::cpu::axes::AxisVec;
use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::*;
use regflow_plan::{HostTensor, HostTensorMut, Real, Shape};

impl HostCompute for PartMean {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        let reduced = reduced_axes_inline(inputs[0].shape, &self.mean.axes)?;
        let divisor = Some(self.logical_count);
        by_float!(outputs[0].dtype(), "integer reductions are not supported", T => reduce_typed::<T>(ReduceKind::Mean, &reduced, divisor, &inputs[0], &mut outputs[0]))
    }
}

impl HostCompute for Reduce {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        let reduced = reduced_axes_inline(inputs[0].shape, &self.axes)?;
        by_float!(outputs[0].dtype(), "integer reductions are not supported", T => reduce_typed::<T>(self.kind, &reduced, None, &inputs[0], &mut outputs[0]))
    }
}

impl HostCompute for MaxMask {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        by_float!(outputs[0].dtype(), "integer comparisons are not supported", T => max_mask_typed::<T>(inputs, &mut outputs[0]))
    }
}

fn max_mask_typed<T: Real>(inputs: &[HostTensor<'_>], out: &mut HostTensorMut<'_>) -> Result<(), String> {
    let (x, m) = (inputs[0].as_slice::<T>()?, inputs[1].as_slice::<T>()?);
    let o = out.as_mut_slice::<T>()?;
    let dims = inputs[0].shape.dims();
    crate::cpu::binary::for_each_broadcast(dims, dims, inputs[1].shape.dims(), |i, _, im| {
        o[i] = if x[i] == m[im] { T::one() } else { T::zero() };
    });
    Ok(())
}

/// `divisor`: what a mean divides by (`None`: the number of elements reduced).
fn reduce_typed<T: Real>(
    kind: ReduceKind,
    reduced: &[bool],
    divisor: Option<usize>,
    input: &HostTensor<'_>,
    out: &mut HostTensorMut<'_>,
) -> Result<(), String> {
    let x = input.as_slice::<T>()?;
    let dims = input.shape.dims();
    // The keepdim shape (every reduced axis 1), on the stack.
    let keep: AxisVec<usize> = dims.iter().zip(reduced).map(|(&d, &r)| if r { 1 } else { d }).collect();
    let kept: usize = keep.iter().product();
    let o = out.as_mut_slice::<T>()?;
    if o.len() != kept {
        return Err(format!("output has {} elements, expected {kept} (broken invariant)", o.len()));
    }
    // The keepdim output, read "broadcast" to the input's shape, gives each input element
    // its output slot; keepdim and squeezed outputs share one row-major layout.
    match kind {
        ReduceKind::Sum | ReduceKind::Mean => {
            o.fill(T::zero());
            crate::cpu::binary::for_each_broadcast(dims, dims, &keep, |i, _, io| o[io] += x[i]);
        }
        ReduceKind::Max => {
            o.fill(T::from_f64(f64::NEG_INFINITY));
            crate::cpu::binary::for_each_broadcast(dims, dims, &keep, |i, _, io| {
                if x[i] > o[io] {
                    o[io] = x[i];
                }
            });
        }
    }
    if kind == ReduceKind::Mean {
        // An empty reduction gives 0 / 0 = NaN, as numpy does.
        let count = divisor.unwrap_or_else(|| reduced_count(input.shape, reduced));
        let scale = T::from_f64(1.0 / count as f64);
        o.iter_mut().for_each(|v| *v = *v * scale);
    }
    Ok(())
}

/// [`reduced_axes`] on the stack: which axes of `shape` `axes` names (all when empty). An
/// axis out of range or named twice is the plan's error, with its message.
fn reduced_axes_inline(shape: &Shape, axes: &[isize]) -> Result<AxisVec<bool>, String> {
    let mut reduced: AxisVec<bool> = smallvec::smallvec![axes.is_empty(); shape.rank()];
    for &axis in axes {
        match shape.axis(axis) {
            Some(index) if !reduced[index] => reduced[index] = true,
            _ => {
                return Err(reduced_axes(shape, axes)
                    .err()
                    .unwrap_or_else(|| format!("axes {axes:?} of {shape} (broken invariant)")))
            }
        }
    }
    Ok(reduced)
}

/// How many input elements each output element reduces.
pub fn reduced_count(shape: &Shape, reduced: &[bool]) -> usize {
    shape.dims().iter().zip(reduced).filter(|(_, &r)| r).map(|(&d, _)| d).product()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stack_axes_agree_with_the_plan_ones_errors_included() {
        let shape = Shape::new([2, 3, 4]);
        for axes in [vec![], vec![0], vec![-1, 0], vec![1, 1], vec![3], vec![0, 1, 2]] {
            assert_eq!(reduced_axes_inline(&shape, &axes).map(|r| r.to_vec()), reduced_axes(&shape, &axes));
        }
    }
}
