//! CPU kernels: the host computation of every op of the graph DSL, moved here from the op
//! definitions so that a plan runs without the DSL. One module per op family; [`register`]
//! adds them to a registry for a device kind (`cpu`, and `sim`, which computes on the
//! host and only models time).
//!
//! A firing allocates nothing: per-axis scratch lives on the stack ([`axes`], up to rank
//! [`axes::INLINE_RANK`]), and the matrix products' packing buffers are reused per thread
//! (the workspace patches gemm-common for that). With `cpu_threads > 1` a kernel's shares
//! run on the stream thread and helpers of it started once (`team`). The products run at
//! the widest instruction set the processor has, unless [`isa`] caps it.

use crate::builtin::AccumulateMean;

/// `$call` with the element type `$t` chosen by a float `$dtype` (`f32` or `f64`); integer
/// tensors are refused with the message `$refusal`. Every float kernel dispatches so. bf16
/// and f16 tensors never get here: `HostOpKernel` widens them to f32 first (`crate::host`).
macro_rules! by_float {
    ($dtype:expr, $refusal:expr, $t:ident => $call:expr) => {
        match $dtype {
            regflow_plan::DType::F32 => {
                type $t = f32;
                $call
            }
            regflow_plan::DType::F64 => {
                type $t = f64;
                $call
            }
            regflow_plan::DType::I64 => Err(String::from($refusal)),
            regflow_plan::DType::Bf16 | regflow_plan::DType::F16 => Err(String::from(
                "16-bit float tensors are computed widened to f32 (HostOpKernel, compute_once), not here (broken invariant)",
            )),
        }
    };
}

/// `$call` with the element type `$t` chosen by `$dtype`, for kernels that only move
/// elements and so run on every dtype.
macro_rules! by_element {
    ($dtype:expr, $t:ident => $call:expr) => {
        match $dtype {
            regflow_plan::DType::F32 => {
                type $t = f32;
                $call
            }
            regflow_plan::DType::F64 => {
                type $t = f64;
                $call
            }
            regflow_plan::DType::I64 => {
                type $t = i64;
                $call
            }
            regflow_plan::DType::Bf16 => {
                type $t = regflow_plan::bf16;
                $call
            }
            regflow_plan::DType::F16 => {
                type $t = regflow_plan::f16;
                $call
            }
        }
    };
}

use crate::host::{HostCompute, HostOpKernel};
use crate::{KernelError, KernelFactory, KernelRegistry, KernelSpec};
use regflow_plan::ops::{self, OpAttrs};
use regflow_plan::{DType, DeviceKind};
use serde::de::DeserializeOwned;
use std::sync::Arc;

pub mod attention;
pub mod axes;
pub(crate) mod balance;
pub mod binary;
pub mod boxing;
pub mod cast;
pub mod concat;
pub mod cross_entropy;
pub mod dropout;
pub mod embedding;
pub mod fast_math;
pub mod fill;
pub mod fused;
pub mod gemm_backend;
pub mod isa;
pub mod layer_norm;
pub mod matmul;
pub mod optim;
pub mod permute;
pub mod permuted_matmul;
pub mod reduce;
pub mod reduce_to;
pub mod reshape;
pub(crate) mod shares;
pub mod slice;
pub mod softmax;
mod team;
pub mod to_global;
pub mod unary;
mod update;

/// What a kernel check says of an op that got other than `inputs` inputs and one output.
pub(crate) fn not_n_to_one(inputs: usize, metas: (&[regflow_plan::TensorMeta], &[regflow_plan::TensorMeta])) -> String {
    format!("takes {inputs} inputs and gives 1 output, but has {} and {}", metas.0.len(), metas.1.len())
}

/// A factory that parses the op's attributes as `T` and runs its host computation.
fn host<T: HostCompute + DeserializeOwned + 'static>() -> KernelFactory {
    Arc::new(|spec| {
        let (op, conf) = checked_op::<T>(spec)?;
        Ok(Box::new(HostOpKernel::new(op, conf)))
    })
}

/// The op of `spec`'s actor, its attributes parsed as `T` and its metas checked by `T`.
fn checked_op<'s, T: HostCompute + DeserializeOwned>(
    spec: &KernelSpec<'s>,
) -> Result<(T, &'s regflow_plan::OpConf), KernelError> {
    let conf = spec.op.ok_or_else(|| {
        KernelError(format!("actor '{}' runs an op kernel without an op (broken invariant)", spec.actor))
    })?;
    let op: T = conf.parse_attrs().map_err(KernelError)?;
    op.check(&conf.inputs, &conf.outputs).map_err(|m| KernelError(format!("op '{}': {m}", conf.op_type)))?;
    Ok((op, conf))
}

/// The factory of `matmul`'s CPU kernel: where the right operand holds the same values for
/// several pieces (a weight handed to every micro-batch, [`KernelSpec::input_repeats`]),
/// the kernel that packs it once for all of them ([`matmul::HeldWeightMatMul`]), else the
/// host kernel.
fn matmul_kernel() -> KernelFactory {
    Arc::new(|spec| {
        let (op, conf) = checked_op::<ops::MatMul>(spec)?;
        let every = conf.input_map.get(1).and_then(|&b| spec.input_repeats.get(b)).copied().unwrap_or(1);
        Ok(match matmul::HeldWeightMatMul::new(op, conf, every) {
            Some(kernel) => Box::new(kernel),
            None => Box::new(HostOpKernel::new(op, conf)),
        })
    })
}

/// Registers `T`'s host kernel under its op type for each of `dtypes`.
fn add<T: HostCompute + DeserializeOwned + OpAttrs + Default + 'static>(
    registry: &mut KernelRegistry,
    device: DeviceKind,
    dtypes: &[DType],
) {
    add_as::<T>(registry, T::default().op_type(), device, dtypes);
}

fn add_as<T: HostCompute + DeserializeOwned + 'static>(
    registry: &mut KernelRegistry,
    op_type: &str,
    device: DeviceKind,
    dtypes: &[DType],
) {
    for &dtype in dtypes {
        registry.register_op(op_type, device, dtype, host::<T>());
    }
}

/// Adds the CPU kernels of every op to `registry` for devices of kind `device`.
pub fn register(registry: &mut KernelRegistry, device: DeviceKind) {
    const FLOAT: &[DType] = &[DType::F32, DType::F64];
    // Ops mixed precision runs in bf16 or f16 (widened to f32 by `HostOpKernel`, see
    // `crate::host`; "bf16" below stands for either):
    // products, elementwise arithmetic, the fused MLP activation, the cross-entropy's
    // gradient (bf16 logits in, bf16 gradient out; its loss is f32, a kernel keyed f32) and
    // the masked softmax and its gradient (bf16 scores and an f32 mask in, bf16
    // probabilities out, computed in f32; bf16 probabilities and gradients).
    // Softmax, layer norm, reductions and optimizer updates stay f32 only: the graph's
    // autocast casts their inputs to f32, and a plan asking for them in bf16 is refused at
    // job build (layer norm may still write bf16 from f32, or read a bf16 gradient: below).
    const LOW: &[DType] = &[DType::F32, DType::F64, DType::Bf16, DType::F16];
    const ANY: &[DType] = &[DType::F32, DType::F64, DType::I64, DType::Bf16, DType::F16];
    let r = registry;
    add_as::<ops::Binary>(r, "binary", device, LOW);
    add_as::<ops::Unary>(r, "unary", device, LOW);
    add::<ops::Cast>(r, device, LOW);
    // Casts the compiler fused (`graph/src/compile/fuse_casts.rs`), keyed as `cast` is.
    add_as::<ops::CastGroup>(r, "cast_group", device, LOW);
    add_as::<ops::Fill>(r, "fill", device, ANY);
    add_as::<ops::CausalMask>(r, "causal_mask", device, LOW);
    // A bias's gradient summed over the batch: summed in f32 (widened), rounded once.
    add_as::<ops::SumTo>(r, "sum_to", device, LOW);
    add_as::<ops::SumSquares>(r, "sum_squares", device, FLOAT);
    add_as::<ops::SumSquaresGroup>(r, "sum_squares_group", device, FLOAT);
    add_as::<ops::BroadcastTo>(r, "broadcast_to", device, ANY);
    add::<ops::SparseCrossEntropy>(r, device, FLOAT);
    add::<ops::SparseCrossEntropyGrad>(r, device, LOW);
    add_as::<ops::PartCrossEntropy>(r, "part_cross_entropy", device, LOW);
    add_as::<ops::Dropout>(r, "dropout", device, LOW);
    add_as::<ops::DropoutPart>(r, "dropout_part", device, LOW);
    add::<ops::Embedding>(r, device, FLOAT);
    add_as::<ops::EmbeddingGrad>(r, "embedding_grad", device, FLOAT);
    add_as::<ops::VocabPart>(r, "vocab_part", device, FLOAT);
    // Keyed by the output's dtype: bf16 and f16 for an f32 layer norm whose output cast
    // the compiler folded into it (`LayerNorm::out`); a 16-bit input is refused at job
    // build (`LayerNorm::check`). The gradient, keyed f32, may read a 16-bit `dy`.
    add_as::<ops::LayerNorm>(r, "layer_norm", device, LOW);
    add_as::<ops::LayerNormGrad>(r, "layer_norm_grad", device, FLOAT);
    for &dtype in LOW {
        r.register_op("matmul", device, dtype, matmul_kernel());
    }
    add::<ops::MatMulBatchSum>(r, device, LOW);
    add::<ops::PermutedMatMul>(r, device, LOW);
    add_as::<ops::Softmax>(r, "softmax", device, FLOAT);
    add_as::<ops::LogSoftmax>(r, "log_softmax", device, FLOAT);
    add_as::<ops::SoftmaxGrad>(r, "softmax_grad", device, FLOAT);
    add_as::<ops::MaskedSoftmax>(r, "masked_softmax", device, LOW);
    // bf16: the gradient of bf16 scores the forward op widened (mixed precision).
    add_as::<ops::MaskedSoftmaxGrad>(r, "masked_softmax_grad", device, LOW);
    // bf16 q, k and v under mixed precision (attention is a pair of products), computed
    // in f32 with an f32 log-sum-exp; the gradient reads them and that f32 `lse`.
    add_as::<ops::Attention>(r, "attention", device, LOW);
    add_as::<ops::AttentionGrad>(r, "attention_grad", device, LOW);
    add::<ops::BiasGelu>(r, device, LOW);
    add::<ops::BiasGeluGrad>(r, device, LOW);
    add_as::<ops::Concat>(r, "concat", device, ANY);
    add_as::<ops::Permute>(r, "permute", device, ANY);
    add_as::<ops::Reduce>(r, "reduce", device, FLOAT);
    add_as::<ops::MaxMask>(r, "max_mask", device, FLOAT);
    add_as::<ops::PartMean>(r, "part_mean", device, FLOAT);
    add_as::<ops::Reshape>(r, "reshape", device, ANY);
    add_as::<ops::Slice>(r, "slice", device, ANY);
    add_as::<ops::SliceGrad>(r, "slice_grad", device, ANY);
    add_as::<ops::LearningRate>(r, "learning_rate", device, FLOAT);
    add_as::<ops::ClipFactor>(r, "clip_factor", device, FLOAT);
    add_as::<ops::Update>(r, "update", device, FLOAT);
    // A device's updates fused by the compiler: its own kernel (no views per member).
    r.register_op("update_group", device, DType::F32, update::update_group_factory::<f32>());
    r.register_op("update_group", device, DType::F64, update::update_group_factory::<f64>());
    add_as::<ops::NextStep>(r, "next_step", device, ANY);
    add_as::<ops::UnscaleFactor>(r, "unscale_factor", device, FLOAT);
    add_as::<ops::LossScaleUpdate>(r, "loss_scale_update", device, FLOAT);
    add_as::<ops::TakePart>(r, "take_part", device, ANY);
    add_as::<ops::KeepOnFirst>(r, "keep_on_first", device, ANY);
    add_as::<ops::ToGlobal>(r, "to_global", device, ANY);
    for dtype in [DType::F32, DType::F64] {
        let factory: KernelFactory = match dtype {
            DType::F64 => Arc::new(|_| Ok(Box::new(AccumulateMean::<f64>(std::marker::PhantomData)))),
            _ => Arc::new(|_| Ok(Box::new(AccumulateMean::<f32>(std::marker::PhantomData)))),
        };
        r.register_op(ops::ACCUMULATE_MEAN, device, dtype, factory);
    }
}

/// A registry with the built-in CPU kernels for `cpu` and `sim` devices.
pub fn registry() -> KernelRegistry {
    let mut registry = KernelRegistry::new();
    register(&mut registry, DeviceKind::Cpu);
    register(&mut registry, DeviceKind::Sim);
    registry
}
