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
//! **Timelines.** With `JobBuilder::trace`, a queued kernel is launched as untraced, between
//! two CUDA events of the stream's [`StreamTimer`]; once the stream's actors are done (or
//! every [`TIMER_MARKS`] / 2 kernels, when the timer's batch is full) the stream waits for
//! them and the events become the kernels' [`TraceEvent::DeviceSlice`]s: when the GPU ran
//! each kernel, on a row of its own beside the stream's host row (the launches). Nothing
//! waits for a kernel to time it, so the timeline is the untraced schedule, overlap between
//! streams and the GPU's idle gaps included, at the cost of two event records per kernel
//! (and a wait per full batch). A kernel's slice runs from the GPU reaching the event before
//! it to the event after it: where the host launches slower than the GPU runs, the gap
//! waiting for the launch counts in the kernel's slice.
//!
//! `REGFLOW_CUDA_TRACE=serial` instead runs each traced kernel alone: the stream waits for
//! it and records the host clock around launch and completion, so each slice is the
//! kernel's own time plus a launch and a wait (microseconds), with nothing beside it: a
//! profile, not a schedule, and slower than untraced.

use super::SliceTag;
use super::{DeviceStream, Launched};
use crate::inbox::{Envelope, InboxSender};
use crate::kernel::{Kernel, KernelError, KernelIo};
use crate::trace::TraceEvent;
use regflow_actors::{ActorId, Body, Completion, Message};
use regflow_cuda::{Device, Stream, StreamTimer};
use regflow_kernels::Execution;
use std::collections::HashMap;
use std::ffi::c_void;
use std::time::{Duration, Instant};

/// Marks (CUDA events) of a stream's timer per batch: two per timed kernel. A batch is
/// resolved (the stream waits) when full, so this bounds how often a traced run stalls.
pub(crate) const TIMER_MARKS: usize = 8192;

/// How a traced stream times its kernels (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TraceMode {
    /// Events around each kernel, the stream running as untraced (the default).
    Events,
    /// Each kernel alone, waited for (`REGFLOW_CUDA_TRACE=serial`).
    Serial,
}

/// The timed kernels of a traced stream not yet resolved into slices, and those that are.
#[derive(Debug)]
struct Timing {
    timer: StreamTimer,
    /// Each timed kernel's firing and its marks before and after, in this batch.
    pending: Vec<(SliceTag, usize, usize)>,
    /// The batch's marks as host instants (a buffer kept between batches).
    instants: Vec<Instant>,
    /// Resolved slices, handed over at the end.
    slices: Vec<TraceEvent>,
}

impl Timing {
    /// Waits for the stream and turns the batch's marks into slices.
    fn resolve(&mut self, stream: &Stream) -> Result<(), regflow_cuda::CudaError> {
        self.instants.clear();
        self.timer.resolve(stream, &mut self.instants)?;
        for &(tag, before, after) in &self.pending {
            let (start, end) = (self.instants[before], self.instants[after]);
            self.slices.push(TraceEvent::DeviceSlice { actor: tag.actor, piece: tag.piece, start, end });
        }
        self.pending.clear();
        Ok(())
    }
}

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

/// A CUDA call's failure on the stream labelled `label` (a free function, for where a field
/// of the stream is borrowed).
fn stream_failed(label: &str, e: regflow_cuda::CudaError) -> KernelError {
    KernelError(format!("stream of {label}: {e}"))
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
    trace_mode: TraceMode,
    /// Made at the first timed launch (events mode).
    timing: Option<Timing>,
}

impl CudaStream {
    /// A new stream of device `ordinal` (labelled `label` in errors) that reports to
    /// `inbox`.
    pub(crate) fn new(ordinal: usize, label: String, inbox: InboxSender) -> Result<Self, regflow_cuda::CudaError> {
        let device = Device::open(ordinal)?;
        let stream = device.stream()?;
        let callback_every_kernel = std::env::var_os("REGFLOW_CUDA_CALLBACK_EVERY_KERNEL").is_some_and(|v| v == "1");
        let trace_mode = match std::env::var_os("REGFLOW_CUDA_TRACE") {
            Some(v) if v == "serial" => TraceMode::Serial,
            _ => TraceMode::Events,
        };
        Ok(Self {
            stream,
            device,
            label,
            inbox,
            completers: HashMap::new(),
            queued: false,
            bound: false,
            callback_every_kernel,
            trace_mode,
            timing: None,
        })
    }

    fn failed(&self, e: regflow_cuda::CudaError) -> KernelError {
        stream_failed(&self.label, e)
    }

    /// Launches `kernel` between two marks of the stream's timer (made at the first call),
    /// resolving the batch first when it has no room for two.
    fn launch_timed(
        &mut self,
        tag: SliceTag,
        kernel: &mut dyn Kernel,
        io: &mut KernelIo<'_>,
    ) -> Result<(), KernelError> {
        if self.timing.is_none() {
            let timer = self.stream.timer(TIMER_MARKS).map_err(|e| self.failed(e))?;
            let capacity = TIMER_MARKS / 2;
            self.timing = Some(Timing {
                timer,
                pending: Vec::with_capacity(capacity),
                instants: Vec::with_capacity(TIMER_MARKS),
                slices: Vec::with_capacity(capacity),
            });
        }
        let (stream, label) = (&self.stream, &self.label);
        let failed = |e| stream_failed(label, e);
        let Some(timing) = self.timing.as_mut() else { return Ok(()) };
        if timing.timer.room() < 2 {
            timing.resolve(stream).map_err(failed)?;
        }
        let before = timing.timer.mark(stream).map_err(failed)?;
        kernel.run(io)?;
        let after = timing.timer.mark(stream).map_err(failed)?;
        timing.pending.push((tag, before, after));
        Ok(())
    }

    /// How a queued kernel completes: at launch where only this stream's actors hear of it
    /// (and no callback after every kernel is asked for), else at a callback queued now.
    fn completion(&mut self, actor: ActorId, completion_wanted: bool) -> Result<Completion, KernelError> {
        self.queued = true;
        if !completion_wanted && !self.callback_every_kernel {
            // Only actors of this stream hear of it, and the stream runs their kernels
            // after this one: no callback (see the module docs).
            return Ok(Completion::Done);
        }
        let inbox = &self.inbox;
        let completer =
            self.completers.entry(actor).or_insert_with(|| Box::new(Completer { inbox: inbox.clone(), actor }));
        let arg = &**completer as *const Completer as *mut c_void;
        // SAFETY: the completer lives in a box owned by this stream until it is dropped,
        // after `stream` has drained; `complete` only sends a message.
        unsafe { self.stream.call_back(complete, arg) }.map_err(|e| self.failed(e))?;
        Ok(Completion::Pending)
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
        timed: Option<SliceTag>,
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
                let start = timed.map(|_| Instant::now());
                kernel.run(io)?;
                Ok(Launched { completion: Completion::Done, span: start.map(|start| (start, Instant::now())) })
            }
            Execution::Queued if timed.is_some() && self.trace_mode == TraceMode::Serial => {
                // A timeline wants each kernel's own time: run it alone and wait for it
                // (see the module docs: a traced cuda stream runs serially, so nothing is
                // queued before it).
                let start = Instant::now();
                kernel.run(io)?;
                self.stream.synchronize().map_err(|e| self.failed(e))?;
                Ok(Launched { completion: Completion::Done, span: Some((start, Instant::now())) })
            }
            Execution::Queued => {
                let start = timed.map(|_| Instant::now());
                match timed {
                    Some(tag) => self.launch_timed(tag, kernel, io)?,
                    None => kernel.run(io)?,
                }
                let completion = self.completion(actor, completion_wanted)?;
                Ok(Launched { completion, span: start.map(|start| (start, Instant::now())) })
            }
        }
    }

    fn finish(&mut self) -> Result<(), KernelError> {
        self.synchronize_queued()
    }

    fn drain_device_slices(&mut self, out: &mut Vec<TraceEvent>) -> Result<(), KernelError> {
        let Some(timing) = self.timing.as_mut() else { return Ok(()) };
        timing.resolve(&self.stream).map_err(|e| stream_failed(&self.label, e))?;
        out.append(&mut timing.slices);
        Ok(())
    }

    fn native(&self) -> u64 {
        self.stream.handle().0
    }
}
