//! Serving a regflow plan inside a service: a [`Model`] handle (`Clone + Send + Sync`) that
//! many threads or tasks submit typed requests to at once.
//!
//! - **Concurrent requests through the actor pipeline.** Requests wait in a bounded queue;
//!   one dispatcher thread pushes them into the plan's fed sources as pieces, so as many
//!   are computed at once as the plan's registers allow, and one collector thread reads the
//!   answers in piece order and hands each request its own. [`Model::infer`] blocks,
//!   [`Model::infer_async`] returns a future that needs no particular async runtime.
//! - **Backpressure that answers.** A full queue answers [`ServeError::Overloaded`] at once
//!   ([`Model::try_infer`], [`Model::infer_async`]); a request past its deadline while
//!   queued is dropped before it uses any compute ([`ServeError::DeadlineExceeded`]);
//!   dropping a future cancels its request.
//! - **Dynamic batching** ([`ModelBuilder::dynamic_batching`]): requests of a few rows are
//!   packed into one piece of the plan's batch size, padded with zeros, and split back;
//!   padding never reaches an answer.
//! - **Metrics** ([`Model::metrics`], [`MetricsSnapshot::to_prometheus`]): requests by
//!   outcome, queue depth, batch sizes, a latency histogram.
//!
//! ```
//! use regflow_graph::{CompileOptions, DType, Graph, HostArray, Init};
//! use regflow_serve::Model;
//!
//! let g = Graph::new();
//! let x = g.input("x", [4, 3], DType::F32)?;
//! let w = g.variable("w", [3, 2], DType::F32, Init::Constant(0.5))?;
//! let y = x.matmul(&w)?;
//! let compiled = g.compile(&[y], &[], &CompileOptions::default())?;
//!
//! // Requests of 1 to 4 rows, batched together for up to 1 ms.
//! let model = Model::builder(compiled.plan)
//!     .dynamic_batching(std::time::Duration::from_millis(1))
//!     .build()?;
//! let answer = model.infer([("x", HostArray::f32([1, 3], vec![1.0, 2.0, 3.0])?)])?;
//! assert_eq!(answer[0], HostArray::f32([1, 2], vec![3.0, 3.0])?);
//! model.shutdown()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod batch;
mod collect;
mod error;
mod metrics;
mod model;
mod reply;

pub use error::ServeError;
pub use metrics::{Metrics, MetricsSnapshot, LATENCY_BUCKETS_US};
pub use model::{Model, ModelBuilder, DEFAULT_QUEUE};
pub use reply::{Answer, InferFuture};

/// The serving guide, `docs/serving.md`, whose code blocks run as this crate's doctests.
#[doc = include_str!("../../docs/serving.md")]
mod serving_guide {}
