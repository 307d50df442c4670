//! The logical side of regflow: the graph DSL ([`Graph`], [`Tensor`] and the ops in
//! [`ops`]: shape rules, gradients, SBP signatures), reverse-mode autodiff
//! ([`Graph::grad`]), optimizers, a host reference evaluator ([`Graph::eval`], running the
//! CPU kernels of `regflow-kernels`), and the compiler that lowers a step onto a mesh and
//! emits a self-contained [`plan::Plan`] (re-exported from `regflow-plan`).
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
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

mod autocast;
mod autodiff;
pub mod checkpoint;
mod compile;
mod dsl;
mod error;
mod eval;
pub mod ops;
mod optim;
pub mod parallel;
pub mod sbp;
mod session;

pub use autocast::Precision;
pub use compile::{
    Accumulate, CompileError, CompileOptions, CompiledGraph, CompiledInput, CompiledVariable, DatasetInputs,
    NoSignature,
};
pub use dsl::{Graph, Node, Tensor, TensorId, TensorInfo, TensorSource};
pub use error::GraphError;
pub use optim::{LossScale, Optimizer, OptimizerKind, Schedule, TrainStep};
pub use parallel::{CollectiveStreams, CopyStreams, ParallelInfo, ParallelInput, ParallelOptions, PipelineSchedule};
pub use regflow_plan as plan;
pub use regflow_plan::{
    ArrayError, DType, Element, HostArray, HostData, HostSlice, HostSliceMut, HostTensor, HostTensorMut, Init, Real,
    Shape, SplitMix64, TensorMeta,
};
pub use session::Session;
