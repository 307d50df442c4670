//! Devices behind one trait with asynchronous completion: `cpu` runs kernels on the stream
//! thread and completes at once; `sim` computes on the host but completes after a modeled
//! duration, which its stream thread times itself; `cuda` queues kernels on a CUDA stream
//! and completes from the driver's callback.

mod cpu;
mod cuda;
mod sim;
pub(crate) mod staging;

pub(crate) use cpu::CpuStream;
pub(crate) use cuda::CudaStream;
pub(crate) use sim::SimStream;

use crate::kernel::{Kernel, KernelError, KernelIo};
use crate::trace::TraceEvent;
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

/// Which firing a timed launch is: the plan actor and the piece, for a device that reports
/// when its kernels ran after the launch ([`DeviceStream::drain_device_slices`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SliceTag {
    /// The actor's index in the plan.
    pub(crate) actor: u32,
    /// The piece it fired on.
    pub(crate) piece: u64,
}

/// One stream of one device, owned by its stream thread.
pub(crate) trait DeviceStream: Send {
    /// Runs or queues `kernel` for `actor`. `modeled` is the plan's modeled duration;
    /// `timed` (the firing) asks for the kernel's start and end (for timelines). Without
    /// `completion_wanted` ([`Firing::completion_wanted`]) nobody off this stream waits for
    /// the kernel, and a device whose stream runs kernels in launch order may answer
    /// [`Completion::Done`] at once instead of reporting the completion later.
    ///
    /// [`Firing::completion_wanted`]: regflow_actors::Firing::completion_wanted
    fn launch(
        &mut self,
        actor: ActorId,
        kernel: &mut dyn Kernel,
        io: &mut KernelIo<'_>,
        modeled: Duration,
        timed: Option<SliceTag>,
        completion_wanted: bool,
    ) -> Result<Launched, KernelError>;

    /// Whether an untimed [`DeviceStream::launch`] is exactly `kernel.run(io)` and
    /// [`Completion::Done`] (a host device): the stream thread then runs the kernel
    /// itself, without the call through the device.
    fn runs_at_launch(&self) -> bool {
        false
    }

    /// Waits for the work still queued once the stream's actors are done, and reports its
    /// failure: a kernel that completed at launch for the protocol (nobody off the stream
    /// waited for it) may still be running, and its error would otherwise be lost when the
    /// stream is dropped. Devices that run kernels at launch have nothing to wait for.
    fn finish(&mut self) -> Result<(), KernelError> {
        Ok(())
    }

    /// Appends to `out` the device's own slices of the timed kernels queued so far (when
    /// the GPU ran them, [`TraceEvent::DeviceSlice`]), waiting for them to run. Devices
    /// whose launch span is the kernel's have none.
    fn drain_device_slices(&mut self, out: &mut Vec<TraceEvent>) -> Result<(), KernelError> {
        let _ = out;
        Ok(())
    }

    /// Whether the stream thread reports this device's completions itself
    /// ([`DeviceStream::next_completion`]); asked once per thread.
    fn times_completions(&self) -> bool {
        false
    }

    /// When the earliest launch that someone waits for completes, for a device whose
    /// stream thread reports its own completions (`sim`: the modeled end): the thread
    /// waits on its inbox only until then, then takes them with
    /// [`DeviceStream::take_completed`]. `None` for the others, and when none is pending.
    fn next_completion(&self) -> Option<Instant> {
        None
    }

    /// The actor whose launch completes first, if it has completed by `now`, taken off
    /// the pending ones (see [`DeviceStream::next_completion`]).
    fn take_completed(&mut self, now: Instant) -> Option<ActorId> {
        let _ = now;
        None
    }

    /// The native stream handle kernels launch onto ([`StreamContext::native`]); 0 for
    /// devices that run kernels on the host.
    ///
    /// [`StreamContext::native`]: regflow_kernels::StreamContext
    fn native(&self) -> u64 {
        0
    }
}

/// The device kinds this runtime knows. `cpu` and `sim` always run; a `cuda` device runs
/// where [`unavailable`] says nothing against it.
pub(crate) const KINDS: [DeviceKind; 3] = [DeviceKind::Cpu, DeviceKind::Sim, DeviceKind::Cuda];

/// Which GPU each `cuda` device of a plan runs on: `cuda:i` on ordinal `i`, unless the job
/// maps them (`JobBuilder::cuda_ordinals`), e.g. two devices of a data-parallel plan on one
/// GPU.
#[derive(Debug, Clone, Default)]
pub(crate) struct GpuMap(Option<Vec<usize>>);

impl GpuMap {
    /// Plan device `cuda:i` runs on GPU `ordinals[i]`.
    pub(crate) fn new(ordinals: Vec<usize>) -> Self {
        Self(Some(ordinals))
    }

    /// The GPU ordinal of plan device `cuda:index`, or why there is none.
    pub(crate) fn ordinal(&self, index: u16) -> Result<usize, String> {
        match &self.0 {
            None => Ok(usize::from(index)),
            Some(ordinals) => ordinals.get(usize::from(index)).copied().ok_or_else(|| {
                format!("the job maps {} cuda device(s) to GPUs ({ordinals:?}), none for cuda:{index}", ordinals.len())
            }),
        }
    }

    /// The index kernels of device `index` of kind `kind` see: the GPU ordinal for `cuda`
    /// (where their modules are loaded), the plan's index otherwise. 0 where unmapped
    /// (refused before any kernel is made).
    pub(crate) fn kernel_index(&self, kind: DeviceKind, index: u16) -> u16 {
        match kind {
            DeviceKind::Cuda => self.ordinal(index).map_or(0, |o| u16::try_from(o).unwrap_or(u16::MAX)),
            _ => index,
        }
    }
}

/// Why device `index` of kind `kind` cannot run here, or `None` when it can: a `cuda`
/// device needs this build's CUDA backend, the driver and its GPU. A plan naming such a
/// device is refused when its job is built, never run on the CPU instead.
pub(crate) fn unavailable(kind: DeviceKind, index: u16, gpus: &GpuMap) -> Option<String> {
    match kind {
        DeviceKind::Cpu | DeviceKind::Sim => None,
        DeviceKind::Cuda => match gpus.ordinal(index) {
            Ok(ordinal) => regflow_cuda::Device::open(ordinal).err().map(|e| e.to_string()),
            Err(why) => Some(why),
        },
    }
}

/// Adds the kernels of devices of kind `kind` to `registry`: each device brings its own.
/// `cpu` runs the host kernels; `sim` computes with the same host kernels and only models
/// time; `cuda` queues its CUDA kernels and runs the host kernels of ops without one.
pub(crate) fn register_kernels(registry: &mut KernelRegistry, kind: DeviceKind) {
    match kind {
        DeviceKind::Cpu | DeviceKind::Sim => regflow_kernels::cpu::register(registry, kind),
        DeviceKind::Cuda => regflow_cuda::register(registry),
    }
}
