//! regflow kernels: what a compute actor runs. The [`Kernel`] trait and its [`KernelIo`]
//! (typed views of register memory plus the stream's [`StreamContext`]), the
//! [`KernelRegistry`] keyed by (op type, device kind, dtype), the built-in kernels (copy,
//! sum, accumulate) and the CPU kernels of every op ([`cpu`]).
//!
//! A plan names an op as data ([`regflow_plan::OpConf`]: type, attributes, local metas);
//! a device brings its kernels by registering factories for the op types it runs. A
//! missing entry is an error at job build naming the actor, the op, the device and the
//! dtype, never a fallback to another device.
//!
//! ```
//! use regflow_kernels::{HostCompute, HostContext};
//! use regflow_plan::ops::{Binary, BinaryKind};
//! use regflow_plan::HostArray;
//!
//! let a = HostArray::f32([2], vec![1.0, 2.0]).unwrap();
//! let b = HostArray::f32([2], vec![10.0, 20.0]).unwrap();
//! let mut out = HostArray::zeros(&a.meta());
//! Binary(BinaryKind::Add).compute(&HostContext::default(), &[a.view(), b.view()], &mut [out.view_mut()]).unwrap();
//! assert_eq!(out.to_f64_vec(), [11.0, 22.0]);
//! ```
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

mod builtin;
pub mod cpu;
mod host;
mod io;
mod registry;

pub use host::{compute_once, HalfScratch, HostCompute, HostContext, HostOpKernel};
pub use io::{KernelIo, StreamContext, StreamScratch};
pub use registry::{edit_distance, nearest, KernelFactory, KernelKey, KernelRegistry, KernelSpec};

/// A kernel failure, with a message naming what was wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct KernelError(pub String);

/// Where a kernel's work happens, which tells its stream how it completes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Execution {
    /// `run` computes on the host and is done when it returns. On a device with queues
    /// (CUDA) the stream first waits for what it queued before, so the kernel reads
    /// finished registers.
    Host,
    /// `run` only queues work on the stream in its [`StreamContext`]; the firing completes
    /// when the device reaches the end of it. Kernels that compute nothing (no-ops) are of
    /// this kind too: their completion is ordered after the stream's earlier work.
    Queued,
}

/// A kernel: runs once per firing of its actor, on the actor's stream thread.
pub trait Kernel: Send {
    /// Computes the outputs of one firing from its inputs (or, for a [`Execution::Queued`]
    /// kernel, queues that computation on its stream).
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError>;

    /// Where the work of `run` happens; host computation unless a device kernel says so.
    fn execution(&self) -> Execution {
        Execution::Host
    }

    /// Bytes of scratch the kernel needs within one firing (partial sums between its
    /// launches, a staging band), outside the plan's registers; 0 for most kernels. Its
    /// stream lends one scratch as large as the most any of its kernels asks
    /// ([`KernelIo::scratch`]); `Job::kernel_memory` adds the streams' scratch up per
    /// device. Nothing may be kept there from one firing to the next.
    fn scratch_bytes(&self) -> u64 {
        0
    }

    /// Bytes the kernel keeps from one firing to the next outside the plan's registers, as
    /// it holds them now: a matrix product's cache of a weight's packed panels (made by its
    /// first firing, so 0 before), 0 for most kernels. The plan's memory layout does not
    /// count them; a job reports them per actor when it ends (`ActorStats::held_bytes`).
    fn held_bytes(&self) -> u64 {
        0
    }
}
