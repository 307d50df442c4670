//! regflow: a OneFlow-style dataflow actor runtime for distributed deep learning.
//!
//! This facade re-exports the crates, bottom up: [`memory`] (arenas and layouts),
//! [`plan`] (the self-contained plan a job runs), [`kernels`] (the kernel registry and
//! the CPU kernels), [`actors`] (the register-slot protocol), [`runtime`] (threads,
//! devices, [`runtime::Job`]) and [`graph`] (the DSL and the compiler that emits plans);
//! [`launch`] starts the processes of a multi-process job on one host.
//! Most programs only need [`prelude`].
//!
//! ```
//! use regflow::prelude::*;
//!
//! // source -> double (a custom kernel) -> sink, on one cpu stream.
//! let mut b = PlanBuilder::new();
//! let cpu = b.device(0, DeviceKind::Cpu, 0);
//! let s = b.stream(cpu, StreamKind::Compute);
//! let src = b.actor("src", s, ActorKind::Source { pieces: SourcePieces::Fed });
//! let x = b.regst("x", src, 4, 2);
//! let double = b.actor("double", s, ActorKind::Compute { kernel: KernelConf::Custom { name: "double".into() } });
//! b.consume(double, x);
//! let y = b.regst("y", double, 4, 2);
//! let sink = b.actor("sink", s, ActorKind::Sink);
//! b.consume(sink, y);
//!
//! struct Double;
//! impl Kernel for Double {
//!     fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
//!         let v = u32::from_le_bytes(io.input(0).try_into().unwrap());
//!         io.output(0).copy_from_slice(&(2 * v).to_le_bytes());
//!         Ok(())
//!     }
//! }
//! let mut job = Job::builder(b.build()?).kernel("double", |_| Ok(Box::new(Double))).build()?;
//! let mut feeder = job.feeder("src")?;
//! let fetcher = job.fetcher("sink")?;
//! for v in [1u32, 2, 3] {
//!     feeder.push(&v.to_le_bytes())?;
//! }
//! feeder.close()?;
//! let out: Vec<u32> = std::iter::from_fn(|| fetcher.recv())
//!     .map(|p| u32::from_le_bytes(p.bytes().try_into().unwrap()))
//!     .collect();
//! assert_eq!(out, [2, 4, 6]);
//! job.wait()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub use regflow_actors as actors;
pub use regflow_cuda as cuda;
pub use regflow_graph as graph;
pub use regflow_kernels as kernels;
pub use regflow_memory as memory;
pub use regflow_plan as plan;
pub use regflow_runtime as runtime;

#[cfg(unix)]
pub mod launch;
mod report;
pub use report::Report;
pub mod train;

/// The names most programs use.
pub mod prelude {
    pub use crate::train::sharded::{latest_complete, load_sharded, save_sharded, ShardedCheckpoint};
    pub use crate::train::{LoadStateDict, ReportState, StateDict, TrainError, Trainer};
    pub use regflow_memory::MemoryKind;
    pub use regflow_plan::{
        ActorIndex, ActorKind, DeviceKind, KernelConf, Plan, PlanBuilder, PlanError, RegstDescId, SourcePieces,
        StreamKind,
    };
    pub use regflow_runtime::{
        Feeder, Fetched, Fetcher, Job, JobBuilder, JobReport, Kernel, KernelError, KernelIo, RuntimeError, WaitForGraph,
    };
}

/// The README's examples, compiled and run as doctests so they cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
