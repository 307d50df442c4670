//! The `cuda` device: one CUDA stream per stream thread. A queued kernel
//! ([`Execution::Queued`]) launches onto the stream. Where someone off the stream waits
//! for it ([`Firing::completion_wanted`]), the firing completes when the device reaches a
//! host callback queued right after it, which sends the actor's `ActDone` into its
//! stream's inbox; otherwise it completes at launch, with no callback: everyone it tells
//! launches after it on this stream, and anything that later leaves the stream waits for
//! a callback queued after it. Consumers on the same stream are told at launch (the
//! stream orders their kernels after it); acks and consumers on other streams wait for the
//! callback, so no register is reused or read elsewhere before the kernel has finished.
//!
//! [`Firing::completion_wanted`]: regflow_actors::Firing::completion_wanted
//!
//! **Callbacks, not an event poller.** The issue sketched a poller thread querying events.
//! `cuLaunchHostFunc` gives the same completion order with no polling at all: the driver's
//! own thread runs the callback when the stream gets there, and the callback only sends
//! one envelope (no CUDA call, no allocation: its argument is a per-actor block made at
//! the actor's first launch and kept until the stream is dropped).
//!
//! A host kernel (a CPU kernel of an op without a CUDA kernel yet, a collective, a feed, a
//! fetch) on a cuda stream first waits for what the stream queued before, then runs on the
//! host over the same managed registers and completes at once.
//!
//! **Timelines.** With `JobBuilder::trace`, each queued kernel runs alone: the stream waits
//! for it and records the host clock around launch and completion. The slices then give
//! each kernel's own time (plus a launch and a wait, microseconds), which is what a
//! per-op profile needs; what they cannot show is overlap between kernels of one stream or
//! between streams, which would need CUDA events read at completion. A traced cuda job is
//! therefore slower than an untraced one, and its timeline is a profile, not a schedule.

use super::{DeviceStream, Launched};
use crate::inbox::{Envelope, InboxSender};
use crate::kernel::{Kernel, KernelError, KernelIo};
use regflow_actors::{ActorId, Body, Completion, Message};
use regflow_cuda::{Device, Stream};
use regflow_kernels::Execution;
use std::collections::HashMap;
use std::ffi::c_void;
use std::time::{Duration, Instant};

/// What a completion callback needs: where to send whose `ActDone`.
#[derive(Debug)]
struct Completer {
    inbox: InboxSender,
    actor: ActorId,
}

/// Runs on the driver's callback thread when the stream reaches it.
///
/// # Safety
///
/// `arg` points to a [`Completer`] that outlives the callback (the stream drains before
/// its completers are dropped).
unsafe extern "C" fn complete(arg: *mut c_void) {
    // SAFETY: see above; the completer is only read.
    let completer = unsafe { &*(arg as *const Completer) };
    let msg = Message { dst: completer.actor, src: completer.actor, body: Body::ActDone };
    // A closed inbox means the stream stopped (abort): nobody waits for this completion.
    let _ = completer.inbox.send(Envelope::Actor(msg));
}

/// One stream of a cuda device, owned by its stream thread.
#[derive(Debug)]
pub(crate) struct CudaStream {
    /// Declared first so it drops (draining its work and callbacks) before `completers`.
    stream: Stream,
    device: Device,
    label: String,
    inbox: InboxSender,
    /// One per actor that has queued a kernel, made at its first launch.
    completers: HashMap<ActorId, Box<Completer>>,
    /// Work was queued since the stream last drained.
    queued: bool,
    /// The device's context is current on the stream thread.
    bound: bool,
    /// Queue a callback after every kernel, wanted or not (`REGFLOW_CUDA_CALLBACK_EVERY_KERNEL=1`):
    /// the behaviour before completions were skipped, kept to measure the difference on one
    /// GPU in one run.
    callback_every_kernel: bool,
}

impl CudaStream {
    /// A new stream of device `ordinal` (labelled `label` in errors) that reports to
    /// `inbox`.
    pub(crate) fn new(ordinal: usize, label: String, inbox: InboxSender) -> Result<Self, regflow_cuda::CudaError> {
        let device = Device::open(ordinal)?;
        let stream = device.stream()?;
        let callback_every_kernel = std::env::var_os("REGFLOW_CUDA_CALLBACK_EVERY_KERNEL").is_some_and(|v| v == "1");
        Ok(Self {
            stream,
            device,
            label,
            inbox,
            completers: HashMap::new(),
            queued: false,
            bound: false,
            callback_every_kernel,
        })
    }

    fn failed(&self, e: regflow_cuda::CudaError) -> KernelError {
        KernelError(format!("stream of {}: {e}", self.label))
    }

    /// Waits for the work queued since the stream last drained, if any.
    fn synchronize_queued(&mut self) -> Result<(), KernelError> {
        if self.queued {
            self.stream.synchronize().map_err(|e| self.failed(e))?;
            self.queued = false;
        }
        Ok(())
    }
}

impl DeviceStream for CudaStream {
    fn launch(
        &mut self,
        actor: ActorId,
        kernel: &mut dyn Kernel,
        io: &mut KernelIo<'_>,
        _modeled: Duration,
        timed: bool,
        completion_wanted: bool,
    ) -> Result<Launched, KernelError> {
        if !self.bound {
            // The stream was made on the job's builder thread; this is its own thread.
            self.device.bind().map_err(|e| self.failed(e))?;
            self.bound = true;
        }
        match kernel.execution() {
            Execution::Host => {
                // The host reads what kernels queued here wrote: let them finish.
                self.synchronize_queued()?;
                let start = timed.then(Instant::now);
                kernel.run(io)?;
                Ok(Launched { completion: Completion::Done, span: start.map(|start| (start, Instant::now())) })
            }
            Execution::Queued if timed => {
                // A timeline wants each kernel's own time: run it alone and wait for it
                // (see the module docs: a traced cuda stream runs serially, so nothing is
                // queued before it).
                let start = Instant::now();
                kernel.run(io)?;
                self.stream.synchronize().map_err(|e| self.failed(e))?;
                Ok(Launched { completion: Completion::Done, span: Some((start, Instant::now())) })
            }
            Execution::Queued if !completion_wanted && !self.callback_every_kernel => {
                // Only actors of this stream hear of it, and the stream runs their kernels
                // after this one: no callback (see the module docs).
                kernel.run(io)?;
                self.queued = true;
                Ok(Launched { completion: Completion::Done, span: None })
            }
            Execution::Queued => {
                kernel.run(io)?;
                let inbox = &self.inbox;
                let completer =
                    self.completers.entry(actor).or_insert_with(|| Box::new(Completer { inbox: inbox.clone(), actor }));
                let arg = &**completer as *const Completer as *mut c_void;
                // SAFETY: the completer lives in a box owned by this stream until it is
                // dropped, after `stream` has drained; `complete` only sends a message.
                unsafe { self.stream.call_back(complete, arg) }.map_err(|e| self.failed(e))?;
                self.queued = true;
                Ok(Launched { completion: Completion::Pending, span: None })
            }
        }
    }

    fn finish(&mut self) -> Result<(), KernelError> {
        self.synchronize_queued()
    }

    fn native(&self) -> u64 {
        self.stream.handle().0
    }
}
