//! `embedding`: rows of a table gathered by integer ids, and the scatter-add op that is
//! its gradient.

use super::{GradCtx, InputGrads, OpDef};
use crate::tensor::{HostTensor, HostTensorMut, Real, Shape, TensorMeta};
use crate::{DType, GraphError, Tensor};

/// `table[ids]`: table `[V, D]` (float), ids of any shape (i64, each in `0..V`), output
/// `ids.shape + [D]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Embedding;

/// The gradient of [`Embedding`] with respect to the table, from inputs `(ids, dy)`: a
/// `[vocab_size, D]` table of zeros into which row `i` of `dy` is added at row `ids[i]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmbeddingGrad {
    /// Rows of the table (`V`).
    pub vocab_size: usize,
}

fn check_ids(ids: &TensorMeta) -> Result<(), String> {
    if ids.dtype != DType::I64 {
        return Err(format!("ids must be i64, got {}", ids.dtype));
    }
    Ok(())
}

/// Id `i` as a row index, or an error naming it.
fn row(ids: &[i64], i: usize, rows: usize) -> Result<usize, String> {
    let id = ids[i];
    usize::try_from(id).ok().filter(|&r| r < rows).ok_or_else(|| format!("id {id} out of range for {rows} rows"))
}

fn gather_typed<T: Real>(inputs: &[HostTensor<'_>], out: &mut HostTensorMut<'_>) -> Result<(), String> {
    let (table, ids) = (inputs[0].as_slice::<T>()?, inputs[1].as_slice::<i64>()?);
    let (rows, features) = (inputs[0].shape.dims()[0], inputs[0].shape.dims()[1]);
    let out = out.as_mut_slice::<T>()?;
    for i in 0..ids.len() {
        let r = row(ids, i, rows)?;
        out[i * features..(i + 1) * features].copy_from_slice(&table[r * features..(r + 1) * features]);
    }
    Ok(())
}

fn scatter_typed<T: Real>(inputs: &[HostTensor<'_>], out: &mut HostTensorMut<'_>) -> Result<(), String> {
    let (ids, dy) = (inputs[0].as_slice::<i64>()?, inputs[1].as_slice::<T>()?);
    let (rows, features) = (out.shape.dims()[0], out.shape.dims()[1]);
    let out = out.as_mut_slice::<T>()?;
    out.fill(T::zero());
    for i in 0..ids.len() {
        let r = row(ids, i, rows)?;
        for (o, &d) in out[r * features..(r + 1) * features].iter_mut().zip(&dy[i * features..(i + 1) * features]) {
            *o += d;
        }
    }
    Ok(())
}

impl OpDef for Embedding {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let [table, ids] = inputs else { return Err(format!("takes 2 inputs, got {}", inputs.len())) };
        if !table.dtype.is_float() {
            return Err(format!("table must be float, got {}", table.dtype));
        }
        let &[_, features] = table.shape.dims() else {
            return Err(format!("table must be [V, D], got {}", table.shape));
        };
        check_ids(ids)?;
        let mut dims = ids.shape.dims().to_vec();
        dims.push(features);
        Ok(vec![TensorMeta::new(Shape::new(dims), table.dtype)])
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        let (table, ids, dy) = (ctx.inputs[0], ctx.inputs[1], ctx.grad()?);
        let vocab_size = table.shape().dims()[0];
        Ok(vec![Some(table.graph().apply1(EmbeddingGrad { vocab_size }, &[ids, dy])?), None])
    }

    fn compute(&self, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
        match outputs[0].dtype() {
            DType::F32 => gather_typed::<f32>(inputs, &mut outputs[0]),
            DType::F64 => gather_typed::<f64>(inputs, &mut outputs[0]),
            DType::I64 => Err("integer tables are not supported".into()),
        }
    }
}

impl OpDef for EmbeddingGrad {
    fn name(&self) -> &'static str {
        "embedding_grad"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let [ids, dy] = inputs else { return Err(format!("takes 2 inputs, got {}", inputs.len())) };
        check_ids(ids)?;
        if !dy.dtype.is_float() {
            return Err(format!("dy must be float, got {}", dy.dtype));
        }
        let dims = dy.shape.dims();
        match dims.split_last() {
            Some((&features, lead)) if lead == ids.shape.dims() => {
                Ok(vec![TensorMeta::new([self.vocab_size, features], dy.dtype)])
            }
            _ => Err(format!("dy must have shape {} + [D], got {}", ids.shape, dy.shape)),
        }
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        // Scatter-add is linear in dy; its adjoint is the gather.
        let (ids, dtable) = (ctx.inputs[0], ctx.grad()?);
        Ok(vec![None, Some(dtable.embedding(&ids)?)])
    }

    fn compute(&self, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
        match outputs[0].dtype() {
            DType::F32 => scatter_typed::<f32>(inputs, &mut outputs[0]),
            DType::F64 => scatter_typed::<f64>(inputs, &mut outputs[0]),
            DType::I64 => Err("integer tables are not supported".into()),
        }
    }
}

impl<'g> Tensor<'g> {
    /// Looks up rows of this table (`[V, D]`) by `ids` (i64, any shape): the result has
    /// shape `ids.shape + [D]`. An id outside `0..V` fails when evaluated.
    pub fn embedding(&self, ids: &Tensor<'g>) -> Result<Tensor<'g>, GraphError> {
        self.graph().apply1(Embedding, &[*self, *ids])
    }
}
