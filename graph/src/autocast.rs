//! Mixed precision: `Graph::mixed_precision(Precision::Bf16)` (or `Precision::F16`) makes
//! every op applied afterwards cast its float inputs by the op's [`Autocast`] class
//! (products in bf16 or f16, numerically sensitive ops in f32, elementwise ops in their
//! inputs' dtype). Below, "bf16" stands for the precision's low dtype, bf16 or f16.
//!
//! The casts are inserted in the DSL, when an op is applied, not by a compiler pass:
//! dtypes are then settled before anything reads them, so every op's shape rule checks
//! the dtypes it will run on, autodiff builds the backward ops through the same DSL (a
//! gradient product runs in bf16 too, the gradient of a cast is a cast back), and the
//! compiler, the reference evaluator and the memory plan see ordinary tensors with their
//! true sizes. A pass rewriting dtypes afterwards would have to re-infer every op and
//! patch gradients that were built for other dtypes.
//!
//! What stays f32: variables (master weights) and optimizer state, so updates add small
//! steps to f32 values; their gradients come back f32 through the gradient of their cast.
//! Losses, softmax, layer norm, cross-entropy, reductions and updates run in f32; the
//! cross-entropy and the masked softmax read bf16 logits or scores as they are, widening
//! each element as it loads ([`Autocast::Widen`]), so a vocabulary's logits and
//! attention's scores get no f32 copy and their gradients come out bf16; the masked
//! softmax stores its probabilities in bf16 too, rounded once, as the product that reads
//! them would have cast them.
//!
//! bf16 keeps f32's exponent range, so gradients do not underflow and no loss scaling is
//! needed. f16 has 3 more mantissa bits but its largest value is 65504 and its smallest
//! normal 6.1e-5: small gradients flush to zero and large ones overflow. Under
//! `Precision::F16`, [`Graph::minimize`] therefore scales the loss dynamically (see
//! `crate::optim`'s loss scaling) unless the optimizer names its own loss scale.
//! Each tensor is cast to a dtype once and the cast shared by all its readers.

use crate::dsl::{Graph, Tensor};
use crate::ops::{Autocast, Cast, OpDef};
use crate::plan::DType;
use crate::GraphError;
use std::sync::Arc;

/// The compute precision of a graph's ops ([`Graph::mixed_precision`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// Every op in its inputs' dtype, no casts inserted (the default).
    #[default]
    F32,
    /// bf16 products and elementwise ops, f32 master weights, optimizer state and
    /// numerically sensitive ops.
    Bf16,
    /// As [`Precision::Bf16`] with f16 (IEEE half) instead: training scales its loss
    /// dynamically ([`crate::LossScale::dynamic`]) unless the optimizer sets a scale.
    F16,
}

impl Precision {
    /// The dtype products and elementwise ops run in: `None` for [`Precision::F32`].
    pub fn low_dtype(self) -> Option<DType> {
        match self {
            Precision::F32 => None,
            Precision::Bf16 => Some(DType::Bf16),
            Precision::F16 => Some(DType::F16),
        }
    }
}

impl Graph {
    /// Sets the precision of the ops applied from now on (set it before building the
    /// model): [`Precision::Bf16`] or [`Precision::F16`] turns on mixed precision,
    /// [`Precision::F32`] turns it off. Switching between bf16 and f16 once ops have been
    /// applied in one of them is refused: a graph mixing both would cast between them on
    /// every edge where they meet, rounding each time.
    pub fn mixed_precision(&self, precision: Precision) -> Result<(), GraphError> {
        let current = self.precision();
        if let (Some(from), Some(to)) = (current.low_dtype(), precision.low_dtype()) {
            if from != to && self.tensor_count() > 0 {
                return Err(GraphError::Precision(format!(
                    "the graph already runs ops in {from} mixed precision; switching to {to} would mix both \
                     (turn mixed precision on once, before building the model)"
                )));
            }
        }
        self.set_precision(precision);
        Ok(())
    }

    /// The inputs `op` runs on under the graph's precision: `inputs` with the casts its
    /// [`Autocast`] class asks for (none with [`Precision::F32`]).
    pub(crate) fn autocast_inputs<'g>(
        &'g self,
        op: &Arc<dyn OpDef>,
        inputs: &[Tensor<'g>],
    ) -> Result<Vec<Tensor<'g>>, GraphError> {
        let Some(low) = self.precision().low_dtype() else {
            return Ok(inputs.to_vec());
        };
        let dtypes: Vec<DType> = inputs.iter().map(Tensor::dtype).collect();
        let targets: Vec<DType> = match op.autocast() {
            Autocast::Keep => dtypes,
            // The first input is read as it is; another bf16 input (a mask) is cast to f32,
            // so the op computes in f32 whatever its other operands were fed as.
            Autocast::Widen => {
                dtypes.iter().enumerate().map(|(i, &d)| if i > 0 && d == low { DType::F32 } else { d }).collect()
            }
            Autocast::Low => dtypes.iter().map(|&d| if d == DType::F32 { low } else { d }).collect(),
            Autocast::F32 => dtypes.iter().map(|&d| if d == low { DType::F32 } else { d }).collect(),
            Autocast::Promote => {
                let has_low = dtypes.contains(&low);
                let widening = inputs.iter().any(|t| t.dtype() == DType::F32 && !stretched(t, inputs));
                inputs
                    .iter()
                    .map(|t| match t.dtype() {
                        d if d == low && widening => DType::F32,
                        DType::F32 if has_low && !widening => low,
                        other => other,
                    })
                    .collect()
            }
        };
        inputs.iter().zip(targets).map(|(t, to)| t.cast(to)).collect()
    }

    /// `tensor` cast to `to`, made once per (tensor, dtype) and then shared.
    pub(crate) fn cast_shared<'g>(&'g self, tensor: Tensor<'g>, to: DType) -> Result<Tensor<'g>, GraphError> {
        if let Some(cast) = self.cached_cast(tensor.id(), to) {
            return Ok(cast);
        }
        let cast = self.apply1(Cast { to }, &[tensor])?;
        self.cache_cast(tensor.id(), to, cast.id());
        Ok(cast)
    }
}

/// Whether `t` is read stretched over the other operands (fewer elements than the
/// largest): a bias or a scale rather than a stream of activations.
fn stretched(t: &Tensor<'_>, inputs: &[Tensor<'_>]) -> bool {
    let largest = inputs.iter().map(|i| i.shape().numel()).max().unwrap_or(0);
    t.shape().numel() < largest
}
