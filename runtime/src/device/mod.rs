//! Devices behind one trait with asynchronous completion: `cpu` runs kernels on the stream
//! thread and completes at once; `sim` computes on the host but completes after a modeled
//! duration, on a poller thread, the same path CUDA events will take.

mod cpu;
mod sim;

pub(crate) use cpu::CpuStream;
pub(crate) use sim::SimPoller;

use crate::kernel::{Kernel, KernelError, KernelIo};
use regflow_actors::{ActorId, Completion};
use std::time::{Duration, Instant};

/// When a launched kernel runs, as far as the device knows at launch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Launched {
    /// Done now, or an `ActDone` will follow.
    pub(crate) completion: Completion,
    /// When the kernel started (modeled on `sim`).
    pub(crate) start: Instant,
    /// When it ends (modeled on `sim`).
    pub(crate) end: Instant,
}

/// One stream of one device, owned by its stream thread.
pub(crate) trait DeviceStream: Send {
    /// Runs or queues `kernel` for `actor`. `modeled` is the plan's modeled duration.
    fn launch(
        &mut self,
        actor: ActorId,
        kernel: &mut dyn Kernel,
        io: &mut KernelIo<'_>,
        modeled: Duration,
    ) -> Result<Launched, KernelError>;
}
