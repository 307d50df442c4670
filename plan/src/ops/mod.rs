//! Ops as data: the attributes of every op the graph DSL has, one module per family, and
//! [`OpConf`], how a compute actor names its op in a plan (type, attributes, local metas).
//!
//! The *meaning* of an op (shape rule, gradient, SBP signatures, how a device localizes
//! it) lives with the graph (`regflow-graph`), its *computation* with each device's
//! kernels (`regflow-kernels`); both implement their traits for the types here, which are
//! what the plan carries between them.

use crate::{DType, TensorMeta};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

mod attention;
mod binary;
mod boxing;
mod cast;
mod concat;
mod cross_entropy;
mod dropout;
mod embedding;
mod fill;
mod fused;
mod layer_norm;
mod matmul;
mod optim;
mod permute;
mod reduce;
mod reduce_to;
mod reshape;
mod slice;
mod softmax;
mod to_global;
mod unary;

pub use attention::*;
pub use binary::*;
pub use boxing::*;
pub use cast::*;
pub use concat::*;
pub use cross_entropy::*;
pub use dropout::*;
pub use embedding::*;
pub use fill::*;
pub use fused::*;
pub use layer_norm::*;
pub use matmul::*;
pub use optim::*;
pub use permute::*;
pub use reduce::*;
pub use reduce_to::*;
pub use reshape::*;
pub use slice::*;
pub use softmax::*;
pub use to_global::*;
pub use unary::*;

/// An op as the plan carries it: its type (the kernel registry's key), its attributes, and
/// the local metas of the tensors one device's kernel reads and writes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpConf {
    /// Op type (`matmul`, `binary`, `accumulate_mean`, …).
    pub op_type: String,
    /// The op's attributes (`null` for ops without any); each op type parses its own.
    #[serde(default)]
    pub attrs: serde_json::Value,
    /// Local metas of the op's inputs (a tick input, if any, is not among them).
    pub inputs: Vec<TensorMeta>,
    /// For each op input, which of the actor's inputs holds it (an op may read one tensor
    /// twice; the actor reads its register once).
    pub input_map: Vec<usize>,
    /// Local metas of the op's outputs, one per output register, in order.
    pub outputs: Vec<TensorMeta>,
}

impl Eq for OpConf {}

impl OpConf {
    /// The conf of `op` reading `inputs` (through `input_map`) and writing `outputs`.
    pub fn new(op: &dyn OpAttrs, inputs: Vec<TensorMeta>, input_map: Vec<usize>, outputs: Vec<TensorMeta>) -> Self {
        Self { op_type: op.op_type().to_string(), attrs: op.attrs(), inputs, input_map, outputs }
    }

    /// The element type kernels are chosen by: the first float output's (an op may also
    /// read integer indices), else the first output's, else the first input's.
    pub fn dtype(&self) -> DType {
        self.outputs
            .iter()
            .find(|m| m.dtype.is_float())
            .or(self.outputs.first())
            .or(self.inputs.first())
            .map_or(DType::F32, |m| m.dtype)
    }

    /// The attributes parsed as `T`, or a message saying why they do not parse.
    pub fn parse_attrs<T: DeserializeOwned>(&self) -> Result<T, String> {
        serde_json::from_value(self.attrs.clone())
            .map_err(|e| format!("the attributes of op '{}' do not parse: {e} (got {})", self.op_type, self.attrs))
    }

    /// The (op input, op output) pairs whose registers may be one buffer, the output
    /// written in place over the input (an optimizer update's parameter and state); empty
    /// for ops that read every input whole before writing, or write before reading.
    pub fn in_place_pairs(&self) -> Vec<(usize, usize)> {
        match self.op_type.as_str() {
            "update" => self.parse_attrs::<optim::Update>().map(|u| u.in_place_pairs()).unwrap_or_default(),
            "update_group" => self.parse_attrs::<optim::UpdateGroup>().map(|u| u.in_place_pairs()).unwrap_or_default(),
            _ => Vec::new(),
        }
    }
}

/// An op's identity as plan data: its type and its attributes.
pub trait OpAttrs {
    /// The op's type in plans (the kernel registry's key).
    fn op_type(&self) -> &'static str;
    /// The op's attributes as JSON (`null` when it has none).
    fn attrs(&self) -> serde_json::Value;
}

/// Implements [`OpAttrs`] for serializable op types.
macro_rules! op_types {
    ($($ty:ty => $name:literal),* $(,)?) => {
        $(impl OpAttrs for $ty {
            fn op_type(&self) -> &'static str {
                $name
            }
            fn attrs(&self) -> serde_json::Value {
                // Plain data with string keys and finite-or-not floats serializes; a
                // non-finite float becomes null, which the kernel then refuses to parse.
                serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
            }
        })*

        /// Every op type plans carry, for suggestions in errors.
        pub const OP_TYPES: &[&str] = &[$($name),*];
    };
}

op_types! {
    Binary => "binary",
    Unary => "unary",
    Cast => "cast",
    CastGroup => "cast_group",
    Fill => "fill",
    CausalMask => "causal_mask",
    SumTo => "sum_to",
    SumSquares => "sum_squares",
    SumSquaresGroup => "sum_squares_group",
    BroadcastTo => "broadcast_to",
    SparseCrossEntropy => "sparse_cross_entropy",
    SparseCrossEntropyGrad => "sparse_cross_entropy_grad",
    PartCrossEntropy => "part_cross_entropy",
    Dropout => "dropout",
    DropoutPart => "dropout_part",
    Embedding => "embedding",
    EmbeddingGrad => "embedding_grad",
    VocabPart => "vocab_part",
    LayerNorm => "layer_norm",
    LayerNormGrad => "layer_norm_grad",
    MatMul => "matmul",
    MatMulBatchSum => "matmul_batch_sum",
    PermutedMatMul => "permuted_matmul",
    Softmax => "softmax",
    LogSoftmax => "log_softmax",
    SoftmaxGrad => "softmax_grad",
    MaskedSoftmax => "masked_softmax",
    MaskedSoftmaxGrad => "masked_softmax_grad",
    Attention => "attention",
    AttentionGrad => "attention_grad",
    BiasGelu => "bias_gelu",
    BiasGeluGrad => "bias_gelu_grad",
    Concat => "concat",
    Permute => "permute",
    Reduce => "reduce",
    MaxMask => "max_mask",
    PartMean => "part_mean",
    Reshape => "reshape",
    Slice => "slice",
    SliceGrad => "slice_grad",
    LearningRate => "learning_rate",
    ClipFactor => "clip_factor",
    Update => "update",
    UpdateGroup => "update_group",
    NextStep => "next_step",
    UnscaleFactor => "unscale_factor",
    LossScaleUpdate => "loss_scale_update",
    TakePart => "take_part",
    KeepOnFirst => "keep_on_first",
    ToGlobal => "to_global",
}

/// The op type of the mean an acc actor takes over a group of micro-batch pieces (no
/// attributes; one input and one output of the same meta).
pub const ACCUMULATE_MEAN: &str = "accumulate_mean";
