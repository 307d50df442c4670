//! Op meanings: for each op, one file here says how to infer its outputs, how to
//! differentiate it, how it splits across a mesh (SBP signatures, `localize`) and what it
//! costs (flops), and adds the DSL method to [`Tensor`].
//!
//! An op's *attributes* are plan data (`regflow_plan::ops`, serializable, so a plan file
//! names the op), and its *computation* is each device's kernel (`regflow_kernels::cpu`
//! for the host). [`OpDef`] requires both, so the reference evaluator runs the same CPU
//! kernels a job runs. Adding an op touches three files: its attributes in the plan, its
//! meaning here, its CPU kernel (see docs/architecture.md).

use crate::plan::TensorMeta;
use crate::sbp::{NdSbp, SbpSignature};
use crate::{GraphError, Tensor};
pub use regflow_kernels::{HostCompute, HostContext};
pub use regflow_plan::OpAttrs;
use std::fmt;
use std::sync::Arc;

mod binary;
mod cast;
mod fill;
mod reduce_to;
mod unary;

// Linear algebra and neural-network ops.
mod attention;
mod cross_entropy;
mod dropout;
mod embedding;
mod fused;
mod layer_norm;
mod matmul;
mod permuted_matmul;
mod softmax;

// Reductions and shape ops.
mod concat;
mod permute;
mod reduce;
mod reshape;
mod slice;

pub use binary::{Binary, BinaryKind};
pub use cast::Cast;
pub use fill::{CausalMask, Fill};
pub use reduce_to::{BroadcastTo, SumSquares, SumTo};
pub use unary::{Unary, UnaryKind};

/// What the gradient rule of one op application sees.
#[derive(Debug)]
pub struct GradCtx<'g> {
    /// The op's inputs.
    pub inputs: Vec<Tensor<'g>>,
    /// The op's outputs.
    pub outputs: Vec<Tensor<'g>>,
    /// Gradient of the loss with respect to each output (`None`: the loss does not depend on it).
    pub output_grads: Vec<Option<Tensor<'g>>>,
}

impl<'g> GradCtx<'g> {
    /// Gradient of output 0 (every single-output op has one when it is asked for gradients).
    pub fn grad(&self) -> Result<Tensor<'g>, GraphError> {
        self.output_grads.first().copied().flatten().ok_or_else(|| GraphError::Kernel {
            op: "autodiff".into(),
            message: "gradient rule called without an output gradient (broken invariant)".into(),
        })
    }
}

/// The gradients of an op's inputs: `None` where an input gets none (integer indices).
pub type InputGrads<'g> = Vec<Option<Tensor<'g>>>;

/// An op: shape and dtype inference, gradient rule, layouts and cost. Its attributes
/// ([`OpAttrs`]) go into plans; its host computation ([`HostCompute`]) is the CPU kernel.
pub trait OpDef: fmt::Debug + Send + Sync + OpAttrs + HostCompute {
    /// Short name, used in errors, plans and traces (`matmul`, `add`, ...).
    fn name(&self) -> &'static str;

    /// Outputs for these inputs, or a message saying what does not fit; the graph wraps
    /// it with the op's name and input shapes.
    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String>;

    /// Gradients of the inputs, built with the DSL from the output gradients.
    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError>;

    /// The ways this op can run along one mesh axis, given its logical inputs and outputs:
    /// each signature says the layout (`Split(dim)`, `Partial`, `Broadcast`) every input
    /// must have and every output then has. A signature is valid when every device running
    /// [`OpDef::localize`]'s op on its parts of the inputs gets exactly its part of each
    /// output, for any number of devices and uneven splits included (or, where parts must
    /// line up, as for a dimension a reshape factors, for the device counts where the local
    /// shapes do: the compiler checks them per mesh and drops the others). All-`Broadcast` is
    /// always valid and is not listed; the default lists nothing else (the op then runs
    /// replicated).
    fn sbp_signatures(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let _ = (inputs, outputs);
        Vec::new()
    }

    /// Arithmetic beyond one pass over the outputs for inputs of these shapes (a product's
    /// multiply-adds): what replicating the op on every device wastes, weighed against
    /// bytes moved when signatures are chosen. Ops that touch each element a few times
    /// (elementwise, reductions, shape ops) count 0, the default, so that a free local
    /// slice does not make the chooser split everything ahead of a gather.
    fn flops(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> f64 {
        let _ = (inputs, outputs);
        0.0
    }

    /// The op one device runs on its parts under a chosen signature: `None` when this op,
    /// applied to the local shapes, already computes the right part (most ops). Ops whose
    /// parameters carry logical sizes (a target shape, a divisor, an index range) return a
    /// copy adjusted to the device's part, or an error naming what cannot be split.
    fn localize(&self, ctx: &LocalContext<'_>) -> Result<Option<Arc<dyn OpDef>>, String> {
        let _ = ctx;
        Ok(None)
    }

    /// How mixed precision treats this op's float inputs ([`Autocast`]); the default,
    /// [`Autocast::F32`], is the safe one for numerically sensitive ops (softmax, layer
    /// norm, cross-entropy, reductions, optimizer updates) and for any new op.
    fn autocast(&self) -> Autocast {
        Autocast::F32
    }
}

/// What mixed precision ([`crate::Precision::Bf16`] or [`crate::Precision::F16`]) does to
/// an op's float inputs when the op is applied; with [`crate::Precision::F32`] (the
/// default) nothing is cast. "bf16" below is the precision's low dtype: bf16, or f16.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Autocast {
    /// Products (matmul and its kin): f32 operands are cast to the low dtype (bf16 or
    /// f16), the result is in it (computed with f32 accumulation, as tensor cores do).
    Low,
    /// Numerically sensitive ops: bf16 inputs are cast to f32, the result is f32.
    F32,
    /// Elementwise arithmetic runs in its inputs' dtype: all bf16 stays bf16. Where bf16
    /// meets f32, an f32 operand that is stretched over the result (a bias, a scale) is
    /// narrowed to bf16, as a fused `x·W + b` does on a GPU; an f32 operand of the
    /// result's full size (a residual stream) instead widens the bf16 one to f32.
    Promote,
    /// Moves or converts elements: inputs are left as they are (reshape, permute, slice,
    /// cast, fill, broadcast).
    Keep,
    /// Numerically sensitive, but reads its first input in bf16 as it is: each element is
    /// widened to f32 as it is loaded and the arithmetic is f32, so no f32 copy of it is
    /// made (the cross-entropy of a vocabulary's logits, whose f32 cast would be the plan's
    /// largest tensor; attention's masked softmax). Other bf16 inputs (a mask) are cast to
    /// f32. The result is f32 where the op makes a new value that stays f32 (a loss), the
    /// first input's dtype where the next op would cast it to that anyway (attention's
    /// probabilities, read by a bf16 product) or where it is that input's gradient; each
    /// equals the cast-then-f32 result, cast where it is bf16, bit for bit (widening is
    /// exact, and a bf16 result is rounded once from f32).
    Widen,
}

/// What [`OpDef::localize`] sees of one device's share of an op.
#[derive(Debug)]
pub struct LocalContext<'a> {
    /// The op's logical inputs.
    pub logical_inputs: &'a [TensorMeta],
    /// The op's logical outputs.
    pub logical_outputs: &'a [TensorMeta],
    /// This device's inputs.
    pub local_inputs: &'a [TensorMeta],
    /// This device's outputs.
    pub local_outputs: &'a [TensorMeta],
    /// For each input, where this device's part starts in each logical dimension.
    pub input_offsets: &'a [Vec<usize>],
    /// For each output, where this device's part starts in each logical dimension.
    pub output_offsets: &'a [Vec<usize>],
    /// Layout of each input (one entry per mesh axis).
    pub input_layouts: &'a [NdSbp],
    /// Layout of each output.
    pub output_layouts: &'a [NdSbp],
}
pub use attention::{Attention, AttentionGrad};
pub use concat::{concat, Concat};
pub use cross_entropy::{SparseCrossEntropy, SparseCrossEntropyGrad};
pub use dropout::Dropout;
pub use embedding::{Embedding, EmbeddingGrad};
pub use fused::{BiasGelu, BiasGeluGrad};
pub use layer_norm::{LayerNorm, LayerNormGrad};
pub use matmul::{MatMul, MatMulBatchSum};
pub use permute::Permute;
pub use permuted_matmul::PermutedMatMul;
pub use reduce::{MaxMask, Reduce, ReduceKind};
pub use reshape::Reshape;
pub use slice::{Slice, SliceGrad};
pub use softmax::{LogSoftmax, MaskedSoftmax, MaskedSoftmaxGrad, Softmax, SoftmaxGrad};
