//! `permute` and `transpose`: reorder a tensor's axes, as a strided copy.

use super::reduce::axis_index;
use super::{GradCtx, InputGrads, OpDef};
use crate::sbp::{Sbp, SbpSignature};
use crate::tensor::{Element, HostTensor, HostTensorMut, Shape, TensorMeta};
use crate::{DType, GraphError, Tensor};

/// Output axis `i` is input axis `perm[i]`; `perm` is a permutation of the input's axes
/// (negative entries count from the end).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permute(pub Vec<isize>);

impl Permute {
    /// The permutation as axis indices of an input of `shape`, checked.
    fn resolve(&self, shape: &Shape) -> Result<Vec<usize>, String> {
        let (perm, rank) = (&self.0, shape.rank());
        if perm.len() != rank {
            return Err(format!("permutation {perm:?} has {} axes, but the input has rank {rank}", perm.len()));
        }
        let mut seen = vec![false; rank];
        let mut axes = Vec::with_capacity(rank);
        for &p in perm {
            let axis = axis_index(shape, p)?;
            if seen[axis] {
                return Err(format!("{perm:?} is not a permutation of 0..{rank}: axis {axis} appears twice"));
            }
            seen[axis] = true;
            axes.push(axis);
        }
        Ok(axes)
    }
}

/// Writes `x` (of shape `shape`) with its axes permuted by `perm` into `out`. Walks the
/// output in order, one innermost row at a time, keeping the matching input offset with
/// an odometer so no index is recomputed from scratch.
pub(crate) fn permute_copy<T: Copy>(x: &[T], shape: &Shape, perm: &[usize], out: &mut [T]) -> Result<(), String> {
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
    let in_strides = shape.strides();
    let dims: Vec<usize> = perm.iter().map(|&p| shape.dims()[p]).collect();
    let strides: Vec<usize> = perm.iter().map(|&p| in_strides[p]).collect();
    // Not the identity, so the rank is at least 2.
    let outer = dims.len() - 1;
    let (row, row_stride) = (dims[outer], strides[outer]);
    let mut index = vec![0usize; outer];
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

fn permute_typed<T: Element>(
    perm: &[usize],
    input: &HostTensor<'_>,
    out: &mut HostTensorMut<'_>,
) -> Result<(), String> {
    permute_copy(input.as_slice::<T>()?, input.shape, perm, out.as_mut_slice::<T>()?)
}

impl OpDef for Permute {
    fn name(&self) -> &'static str {
        "permute"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let [x] = inputs else { return Err(format!("takes 1 input, got {}", inputs.len())) };
        let perm = self.resolve(&x.shape)?;
        Ok(vec![TensorMeta { shape: Shape(perm.iter().map(|&p| x.shape.dims()[p]).collect()), dtype: x.dtype }])
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        let perm = self
            .resolve(&ctx.inputs[0].shape())
            .map_err(|message| GraphError::Kernel { op: self.name().into(), message })?;
        let mut inverse = vec![0isize; perm.len()];
        for (i, &p) in perm.iter().enumerate() {
            inverse[p] = i as isize;
        }
        Ok(vec![Some(ctx.grad()?.permute(&inverse)?)])
    }

    fn compute(&self, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
        let perm = self.resolve(inputs[0].shape)?;
        match outputs[0].dtype() {
            DType::F32 => permute_typed::<f32>(&perm, &inputs[0], &mut outputs[0]),
            DType::F64 => permute_typed::<f64>(&perm, &inputs[0], &mut outputs[0]),
            DType::I64 => permute_typed::<i64>(&perm, &inputs[0], &mut outputs[0]),
        }
    }

    /// A split of input axis `perm[i]` is a split of output axis `i`; summands permute to
    /// summands.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let [x] = inputs else { return Vec::new() };
        let Ok(perm) = self.resolve(&x.shape) else { return Vec::new() };
        let mut signatures: Vec<SbpSignature> =
            perm.iter().enumerate().map(|(i, &p)| SbpSignature::new([Sbp::Split(p)], [Sbp::Split(i)])).collect();
        signatures.push(SbpSignature::new([Sbp::Partial], [Sbp::Partial]));
        signatures
    }
}

impl<'g> Tensor<'g> {
    /// Reorders the axes: output axis `i` is input axis `perm[i]`.
    pub fn permute(&self, perm: &[isize]) -> Result<Tensor<'g>, GraphError> {
        self.graph().apply1(Permute(perm.to_vec()), &[*self])
    }

    /// Swaps axes `a` and `b`.
    pub fn transpose(&self, a: isize, b: isize) -> Result<Tensor<'g>, GraphError> {
        let meta = self.meta();
        let resolve = |axis| {
            axis_index(&meta.shape, axis).map_err(|message| GraphError::Op {
                op: "transpose".into(),
                inputs: vec![meta.to_string()],
                message,
            })
        };
        let (a, b) = (resolve(a)?, resolve(b)?);
        let mut perm: Vec<isize> = (0..meta.shape.rank() as isize).collect();
        perm.swap(a, b);
        self.permute(&perm)
    }
}
