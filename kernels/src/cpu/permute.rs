//! CPU kernels of `permute` ops.

use crate::cpu::axes::{self, AxisVec};
use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::*;
use regflow_plan::{Element, HostTensor, HostTensorMut, Shape};

impl HostCompute for Permute {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        let perm = resolve_inline(self, inputs[0].shape)?;
        by_element!(outputs[0].dtype(), T => permute_typed::<T>(&perm, &inputs[0], &mut outputs[0]))
    }

    /// Moves elements only: bf16 is copied as it is.
    fn half_native(&self) -> bool {
        true
    }
}

/// [`Permute::resolve`] on the stack. A permutation that does not fit the input is the
/// plan's error, with its message.
fn resolve_inline(permute: &Permute, shape: &Shape) -> Result<AxisVec<usize>, String> {
    let plan_error = || {
        permute
            .resolve(shape)
            .err()
            .unwrap_or_else(|| format!("permutation {:?} of {shape} (broken invariant)", permute.0))
    };
    if permute.0.len() != shape.rank() {
        return Err(plan_error());
    }
    let mut axes = AxisVec::new();
    for &p in &permute.0 {
        match shape.axis(p) {
            Some(axis) if !axes.contains(&axis) => axes.push(axis),
            _ => return Err(plan_error()),
        }
    }
    Ok(axes)
}

fn permute_typed<T: Element>(
    perm: &[usize],
    input: &HostTensor<'_>,
    out: &mut HostTensorMut<'_>,
) -> Result<(), String> {
    permute_copy(input.as_slice::<T>()?, input.shape, perm, out.as_mut_slice::<T>()?)
}

/// Writes `x` (of shape `shape`) with its axes permuted by `perm` into `out`. Walks the
/// output in order, one innermost row at a time, keeping the matching input offset with
/// an odometer so no index is recomputed from scratch.
fn permute_copy<T: Copy>(x: &[T], shape: &Shape, perm: &[usize], out: &mut [T]) -> Result<(), String> {
    if x.len() != shape.numel() || out.len() != x.len() || perm.len() != shape.rank() {
        return Err(format!(
            "{} input elements of shape {shape}, {} outputs, permutation of {} axes (broken invariant)",
            x.len(),
            out.len(),
            perm.len()
        ));
    }
    if perm.iter().enumerate().all(|(i, &p)| i == p) || out.is_empty() {
        out.copy_from_slice(x);
        return Ok(());
    }
    let in_strides = axes::strides(shape.dims());
    let dims: AxisVec<usize> = perm.iter().map(|&p| shape.dims()[p]).collect();
    let strides: AxisVec<usize> = perm.iter().map(|&p| in_strides[p]).collect();
    // Not the identity, so the rank is at least 2.
    let outer = dims.len() - 1;
    let (row, row_stride) = (dims[outer], strides[outer]);
    let mut index: AxisVec<usize> = smallvec::smallvec![0; outer];
    let mut base = 0usize;
    for chunk in out.chunks_exact_mut(row) {
        for (j, o) in chunk.iter_mut().enumerate() {
            *o = x[base + j * row_stride];
        }
        for d in (0..outer).rev() {
            index[d] += 1;
            base += strides[d];
            if index[d] < dims[d] {
                break;
            }
            base -= strides[d] * dims[d];
            index[d] = 0;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stack_resolution_agrees_with_the_plan_one_errors_included() {
        let shape = Shape::new([2, 3, 4]);
        for perm in [vec![0, 1, 2], vec![2, 0, 1], vec![-1, 0, 1], vec![0, 0, 1], vec![0, 1], vec![0, 1, 3], vec![]] {
            let permute = Permute(perm);
            assert_eq!(resolve_inline(&permute, &shape).map(|axes| axes.to_vec()), permute.resolve(&shape));
        }
    }
}
