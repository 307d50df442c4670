//! `embedding`: rows of a table gathered by integer ids, and the scatter-add op that is
//! its gradient.

use super::{GradCtx, InputGrads, LocalContext, OpDef};
use crate::plan::{Shape, TensorMeta};
use crate::sbp::{Sbp, SbpSignature};
use crate::{DType, GraphError, Tensor};
use regflow_plan::ops::Rows;
use regflow_plan::ops::VocabPart;
pub use regflow_plan::ops::{Embedding, EmbeddingGrad};
use std::sync::Arc;

fn check_ids(ids: &TensorMeta) -> Result<(), String> {
    if ids.dtype != DType::I64 {
        return Err(format!("ids must be i64, got {}", ids.dtype));
    }
    Ok(())
}

impl OpDef for VocabPart {
    fn name(&self) -> &'static str {
        if self.grad {
            "embedding_grad"
        } else {
            "embedding"
        }
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        if self.grad {
            EmbeddingGrad::new(self.rows.held.len()).infer(inputs)
        } else {
            Embedding.infer(inputs)
        }
    }

    fn grad<'g>(&self, _ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        // Gradients are taken of the logical graph, before it is split over devices.
        Err(GraphError::NoGradient { op: format!("{} (one device's part)", self.name()), index: 0 })
    }
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
        Ok(vec![Some(table.graph().apply1(EmbeddingGrad::new(vocab_size), &[ids, dy])?), None])
    }

    /// A split of the ids splits the output (table whole); a split of the features splits
    /// the output's last dimension (ids whole); gathering is linear in the table, so
    /// summands give summands; and a split of the table's rows (vocabulary parallelism)
    /// gives summands: each device gathers the rows it holds and zeros for the others.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let [_, ids] = inputs else { return Vec::new() };
        let (partial, whole) = (Sbp::Partial, Sbp::Broadcast);
        let rank = ids.shape.rank();
        let mut signatures: Vec<SbpSignature> =
            (0..rank).map(|d| SbpSignature::new([whole, Sbp::Split(d)], [Sbp::Split(d)])).collect();
        signatures.push(SbpSignature::new([Sbp::Split(1), whole], [Sbp::Split(rank)]));
        signatures.push(SbpSignature::new([partial, whole], [partial]));
        signatures.push(SbpSignature::new([Sbp::Split(0), whole], [partial]));
        signatures
    }

    /// With the table's rows split, gathers only the rows this device holds.
    fn localize(&self, ctx: &LocalContext<'_>) -> Result<Option<Arc<dyn OpDef>>, String> {
        let (Some(logical), Some(local), Some(offsets)) =
            (ctx.logical_inputs.first(), ctx.local_inputs.first(), ctx.input_offsets.first())
        else {
            return Ok(None);
        };
        Ok(vocab_part(logical, local, offsets, false))
    }
}

/// The vocabulary-parallel part of a device holding `local` of the `logical` table at
/// `offsets`, or `None` if it holds every row.
fn vocab_part(logical: &TensorMeta, local: &TensorMeta, offsets: &[usize], grad: bool) -> Option<Arc<dyn OpDef>> {
    let (&vocab_size, &rows, &start) = (logical.shape.dims().first()?, local.shape.dims().first()?, offsets.first()?);
    (rows != vocab_size)
        .then(|| Arc::new(VocabPart { rows: Rows { vocab_size, held: start..start + rows }, grad }) as _)
}

impl OpDef for EmbeddingGrad {
    fn name(&self) -> &'static str {
        "embedding_grad"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        if let Some(base) = self.base {
            // Its adjoint and layouts would be another op's: a graph adds the two gradients.
            return Err(format!(
                "embedding_grad with a {base} base is the compiler's fold of a table gradient and an add \
                 (graph/src/compile/fold_table_grads.rs); a graph applies the plain op and `add`"
            ));
        }
        let [_, dy] = inputs else { return Err(format!("takes 2 inputs, got {}", inputs.len())) };
        // The output table, checked by the rule the kernels apply to a plan file's op.
        let features = dy.shape.dims().last().copied().unwrap_or(0);
        let out = TensorMeta::new([self.vocab_size, features], dy.dtype);
        self.check(inputs, std::slice::from_ref(&out))?;
        Ok(vec![out])
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        // Scatter-add is linear in dy; its adjoint is the gather.
        let (ids, dtable) = (ctx.inputs[0], ctx.grad()?);
        Ok(vec![None, Some(dtable.embedding(&ids)?)])
    }

    /// A split of the ids and `dy` leaves each device partial sums of the table gradient;
    /// a split of the features of `dy` (ids whole) splits the gradient's features; the
    /// scatter is linear in `dy`, so summands give summands; and with the ids and `dy`
    /// whole, the gradient's rows may be split (vocabulary parallelism): each device
    /// scatters only into the rows it holds.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let [ids, _] = inputs else { return Vec::new() };
        let (partial, whole) = (Sbp::Partial, Sbp::Broadcast);
        let rank = ids.shape.rank();
        let mut signatures: Vec<SbpSignature> =
            (0..rank).map(|d| SbpSignature::new([Sbp::Split(d), Sbp::Split(d)], [partial])).collect();
        signatures.push(SbpSignature::new([whole, Sbp::Split(rank)], [Sbp::Split(1)]));
        signatures.push(SbpSignature::new([whole, partial], [partial]));
        signatures.push(SbpSignature::new([whole, whole], [Sbp::Split(0)]));
        signatures
    }

    /// With the gradient's rows split, scatters only into the rows this device holds.
    fn localize(&self, ctx: &LocalContext<'_>) -> Result<Option<Arc<dyn OpDef>>, String> {
        let (Some(logical), Some(local), Some(offsets)) =
            (ctx.logical_outputs.first(), ctx.local_outputs.first(), ctx.output_offsets.first())
        else {
            return Ok(None);
        };
        Ok(vocab_part(logical, local, offsets, true))
    }
}

impl<'g> Tensor<'g> {
    /// Looks up rows of this table (`[V, D]`) by `ids` (i64, any shape): the result has
    /// shape `ids.shape + [D]`. An id outside `0..V` fails when evaluated.
    pub fn embedding(&self, ids: &Tensor<'g>) -> Result<Tensor<'g>, GraphError> {
        self.graph().apply1(Embedding, &[*self, *ids])
    }
}
