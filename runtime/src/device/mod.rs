//! Devices behind one trait with asynchronous completion: `cpu` runs kernels on the stream
//! thread and completes at once; `sim` computes on the host but completes after a modeled
//! duration, on a poller thread, the same path CUDA events will take.

mod cpu;
mod sim;

pub(crate) use cpu::CpuStream;
pub(crate) use sim::SimPoller;

use crate::kernel::{Kernel, KernelError, KernelIo};
use regflow_actors::{ActorId, Completion};
use regflow_kernels::KernelRegistry;
use regflow_plan::DeviceKind;
use std::time::{Duration, Instant};

/// When a launched kernel runs, as far as the device knows at launch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Launched {
    /// Done now, or an `ActDone` will follow.
    pub(crate) completion: Completion,
    /// When the kernel starts and ends (modeled on `sim`); on `cpu` only when asked for,
    /// since reading the clock twice per firing costs more than a small kernel.
    pub(crate) span: Option<(Instant, Instant)>,
}

/// One stream of one device, owned by its stream thread.
pub(crate) trait DeviceStream: Send {
    /// Runs or queues `kernel` for `actor`. `modeled` is the plan's modeled duration;
    /// `timed` asks for the kernel's start and end (for timelines).
    fn launch(
        &mut self,
        actor: ActorId,
        kernel: &mut dyn Kernel,
        io: &mut KernelIo<'_>,
        modeled: Duration,
        timed: bool,
    ) -> Result<Launched, KernelError>;
}

/// The device kinds this build runs. A plan naming another kind (`cuda` without a CUDA
/// backend) is refused when its job is built, never run on the CPU instead.
pub(crate) const KINDS: [DeviceKind; 2] = [DeviceKind::Cpu, DeviceKind::Sim];

/// Adds the kernels of devices of kind `kind` to `registry`: each device brings its own.
/// `cpu` runs the host kernels; `sim` computes with the same host kernels and only models
/// time.
pub(crate) fn register_kernels(registry: &mut KernelRegistry, kind: DeviceKind) {
    match kind {
        DeviceKind::Cpu | DeviceKind::Sim => regflow_kernels::cpu::register(registry, kind),
        DeviceKind::Cuda => {}
    }
}
