//! The logical side of regflow: the graph DSL ([`Graph`], [`Tensor`] and the ops in
//! [`ops`]), reverse-mode autodiff ([`Graph::grad`]), a host reference evaluator
//! ([`Graph::eval`]), seeded initializers, and the [`plan`] module, the physical plan of
//! actors, register descriptors, streams and memory that the runtime executes.
//!
//! ```
//! use regflow_graph::{DType, Graph, HostArray, Init};
//!
//! let g = Graph::new();
//! let x = g.input("x", [2, 3], DType::F64).unwrap();
//! let w = g.variable("w", [2, 3], DType::F64, Init::Constant(2.0)).unwrap();
//! let loss = x.mul(&w).unwrap().relu().unwrap().sum_to(&[].into()).unwrap();
//! let dw = g.grad(loss, &[w]).unwrap()[0];
//! let feed = HostArray::f64([2, 3], vec![1.0, -1.0, 2.0, -2.0, 3.0, -3.0]).unwrap();
//! let out = g.eval(&[(x, feed)], &[loss, dw]).unwrap();
//! assert_eq!(out[0].to_f64_vec(), [12.0]);
//! assert_eq!(out[1].to_f64_vec(), [1.0, 0.0, 2.0, 0.0, 3.0, 0.0]);
//! ```
//!
//! Plans are built by hand with [`plan::PlanBuilder`] or loaded from JSON until the
//! compiler that lowers graphs to plans arrives.
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

mod autodiff;
pub mod checkpoint;
mod compile;
mod dsl;
mod error;
mod eval;
mod init;
pub mod ops;
mod optim;
pub mod parallel;
pub mod plan;
pub mod sbp;
mod session;
mod tensor;

/// Threads the host kernels may use (matrix products split their output tiles over them).
static CPU_THREADS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);

/// Sets how many threads host matrix products use (default 1). Each output element is
/// computed by one thread in a fixed order, so results are bitwise reproducible.
pub fn set_cpu_threads(threads: usize) {
    CPU_THREADS.store(threads.max(1), std::sync::atomic::Ordering::Relaxed);
}

/// Threads host matrix products use.
pub fn cpu_threads() -> usize {
    CPU_THREADS.load(std::sync::atomic::Ordering::Relaxed)
}

pub use compile::{
    Accumulate, CompileOptions, CompiledGraph, CompiledInput, CompiledKernel, CompiledVariable, DatasetInputs,
};
pub use dsl::{Graph, Node, Tensor, TensorId, TensorInfo, TensorSource};
pub use error::GraphError;
pub use init::{Init, SplitMix64};
pub use optim::{Optimizer, OptimizerKind, Schedule, TrainStep};
pub use parallel::{ParallelInfo, ParallelInput, ParallelOptions, PipelineSchedule};
pub use session::Session;
pub use tensor::{
    DType, Element, HostArray, HostData, HostSlice, HostSliceMut, HostTensor, HostTensorMut, Real, Shape, TensorMeta,
};
