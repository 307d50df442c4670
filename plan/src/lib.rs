//! The regflow plan, the contract between the compiler and the runtime: dtypes, shapes and
//! tensor metas, op configs as data, initializers, and the serializable [`Plan`] (devices,
//! streams, actors, register descriptors, its typed signature and variables) with its
//! builder, validation and memory layout. A plan file alone is enough to run a job.
//!
//! Vocabulary (from OneFlow): a *regst desc* (register descriptor) describes the registers
//! one actor produces for its consumers; a *regst* is one of its `register_num` slots; a
//! *piece* is one unit of data (a micro-batch) flowing through the plan.
//!
//! ```
//! use regflow_plan::{ActorKind, DeviceKind, KernelConf, PlanBuilder, SourcePieces, StreamKind};
//!
//! let mut b = PlanBuilder::new();
//! let cpu = b.device(0, DeviceKind::Cpu, 0);
//! let stream = b.stream(cpu, StreamKind::Compute);
//! let src = b.actor("src", stream, ActorKind::Source { pieces: SourcePieces::Count(4) });
//! let x = b.regst("src.out", src, 8, 2);
//! let f = b.actor("f", stream, ActorKind::Compute { kernel: KernelConf::Copy });
//! b.consume(f, x);
//! let y = b.regst("f.out", f, 8, 1);
//! let sink = b.actor("sink", stream, ActorKind::Sink);
//! b.consume(sink, y);
//! let plan = b.build().unwrap();
//! let again = regflow_plan::Plan::from_json(&plan.to_json()).unwrap();
//! assert_eq!(plan, again);
//! ```

#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

mod bf16_round;
mod builder;
mod collectives;
mod display;
mod error;
mod in_place;
mod index;
mod init;
mod memory;
pub mod ops;
mod order;
mod signature;
mod tensor;
mod types;
mod validate;

pub use bf16_round::{bf16_from_f64, f16_from_f64};
/// The bf16 element type ([`DType::Bf16`]'s values), re-exported so every crate names one type.
pub use half::bf16;
/// The f16 element type ([`DType::F16`]'s values), re-exported like [`bf16`].
pub use half::f16;
pub use init::{Init, SplitMix64};
pub use ops::{OpAttrs, OpConf};
pub use tensor::{
    ArrayError, DType, Element, HostArray, HostData, HostSlice, HostSliceMut, HostTensor, HostTensorMut, Real, Shape,
    TensorMeta,
};

pub use builder::PlanBuilder;
pub use error::PlanError;
pub use in_place::InPlaceCheck;
pub use index::PlanIndex;
pub use memory::{DeviceMemory, PlanMemory};
pub use signature::*;
pub use types::*;

/// Elements `part` of `parts` holds of a dimension of length `len`: the first `len % parts`
/// parts get one element more.
pub fn part_range(len: usize, parts: usize, part: usize) -> std::ops::Range<usize> {
    let (base, extra) = (len / parts, len % parts);
    let start = part * base + part.min(extra);
    start..start + base + usize::from(part < extra)
}
