//! The `Plan`: per node its devices, streams, actors and register descriptors, plus the
//! memory layout derived from them. Serialized as JSON with a schema version.
//!
//! Vocabulary (from OneFlow): a *regst desc* (register descriptor) describes the registers
//! one actor produces for its consumers; a *regst* is one of its `register_num` slots; a
//! *piece* is one unit of data (a micro-batch) flowing through the plan.
//!
//! ```
//! use regflow_graph::plan::{ActorKind, DeviceKind, KernelConf, PlanBuilder, SourcePieces, StreamKind};
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
//! let again = regflow_graph::plan::Plan::from_json(&plan.to_json()).unwrap();
//! assert_eq!(plan, again);
//! ```

mod builder;
mod collectives;
mod display;
mod error;
mod memory;
mod types;
mod validate;

pub use builder::PlanBuilder;
pub use error::PlanError;
pub use memory::{DeviceMemory, PlanMemory};
pub use types::*;
