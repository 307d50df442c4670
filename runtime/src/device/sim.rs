//! The `sim` device: kernels compute their bytes on the host at launch, but complete after
//! a modeled duration. A sim stream is serial: a kernel starts when the previous one on the
//! stream ends. Completions are delivered by one poller thread as `ActDone` messages, for
//! the launches someone off the stream waits for; the others complete at launch, as on
//! `cuda` (see `Firing::completion_wanted`).

use super::{DeviceStream, Launched, SliceTag};
use crate::inbox::{Envelope, InboxSender};
use crate::kernel::{Kernel, KernelError, KernelIo};
use regflow_actors::{ActorId, Body, Completion, Message};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

/// How long before a deadline the poller stops sleeping and spins: OS timer wake-ups are
/// late by tens of microseconds, which would add up along a pipeline of modeled kernels.
const SPIN_MARGIN: Duration = Duration::from_micros(150);

/// How long before a kernel's modeled end its stream is woken ([`Envelope::Wake`]): more
/// than a parked thread takes to wake here (12–16 µs on the benchmark VM), so the stream
/// spins when the `ActDone` arrives, and tells the next stage at once, which is spinning
/// too when its own kernel ends then.
const WAKE_AHEAD: Duration = Duration::from_micros(40);

#[derive(Debug)]
struct Timer {
    at: Instant,
    seq: u64,
    inbox: InboxSender,
    actor: ActorId,
    /// Its stream was sent a [`Envelope::Wake`].
    woken: std::cell::Cell<bool>,
}

/// Wakes the stream of every timer due within [`WAKE_AHEAD`] of `now`, once per timer.
fn wake_streams_due(heap: &BinaryHeap<Reverse<Timer>>, now: Instant) {
    for Reverse(timer) in heap.iter() {
        if !timer.woken.get() && timer.at <= now + WAKE_AHEAD {
            timer.woken.set(true);
            // A full inbox has messages to handle: its thread is awake already.
            let _ = timer.inbox.try_send(Envelope::Wake);
        }
    }
}

impl PartialEq for Timer {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Timer {}
impl PartialOrd for Timer {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Timer {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

/// The poller: one thread that sends each `ActDone` at its modeled completion time.
#[derive(Debug)]
pub(crate) struct SimPoller {
    timers: crossbeam_channel::Sender<Timer>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SimPoller {
    /// Starts the poller. `capacity` bounds the kernels in flight on all sim streams, so
    /// scheduling never allocates.
    pub(crate) fn start(capacity: usize) -> std::io::Result<Self> {
        let (tx, rx) = crossbeam_channel::bounded::<Timer>(capacity.max(1));
        let thread = std::thread::Builder::new().name("regflow-sim-poller".into()).spawn(move || poll(rx, capacity))?;
        Ok(Self { timers: tx, thread: Some(thread) })
    }

    /// A stream of a sim device that reports to `inbox`.
    pub(crate) fn stream(&self, inbox: InboxSender) -> SimStream {
        SimStream { busy_until: Instant::now(), timers: self.timers.clone(), inbox, seq: 0 }
    }
}

impl Drop for SimPoller {
    fn drop(&mut self) {
        // Closing our sender ends the poller once every stream has dropped its own.
        let (closed, _) = crossbeam_channel::bounded(0);
        self.timers = closed;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn poll(rx: crossbeam_channel::Receiver<Timer>, capacity: usize) {
    let mut heap: BinaryHeap<Reverse<Timer>> = BinaryHeap::with_capacity(capacity);
    loop {
        let next = heap.peek().map(|Reverse(t)| t.at);
        let received = match next {
            None => match rx.recv() {
                Ok(timer) => Some(timer),
                Err(_) => return,
            },
            Some(at) => {
                let wake = at.checked_sub(SPIN_MARGIN).unwrap_or(at);
                match rx.recv_deadline(wake) {
                    Ok(timer) => Some(timer),
                    Err(crossbeam_channel::RecvTimeoutError::Timeout) => None,
                    // Streams gone: the job is over or aborted; nobody waits for these.
                    Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return,
                }
            }
        };
        if let Some(timer) = received {
            heap.push(Reverse(timer));
            continue;
        }
        // Spin the last stretch: yielding measured slower on the pipeline benchmark (B3),
        // notably under load, and the margin bounds the spin.
        while let Some(Reverse(timer)) = heap.peek() {
            let now = Instant::now();
            if timer.at > now + SPIN_MARGIN {
                break;
            }
            wake_streams_due(&heap, now);
            if timer.at > now {
                std::hint::spin_loop();
                continue;
            }
            if let Some(Reverse(timer)) = heap.pop() {
                let msg = Message { dst: timer.actor, src: timer.actor, body: Body::ActDone };
                // A closed inbox means the stream stopped (abort); nothing to deliver.
                let _ = timer.inbox.send(Envelope::Actor(msg));
            }
        }
    }
}

/// One stream of a sim device.
#[derive(Debug)]
pub(crate) struct SimStream {
    busy_until: Instant,
    timers: crossbeam_channel::Sender<Timer>,
    inbox: InboxSender,
    seq: u64,
}

impl DeviceStream for SimStream {
    fn launch(
        &mut self,
        actor: ActorId,
        kernel: &mut dyn Kernel,
        io: &mut KernelIo<'_>,
        modeled: Duration,
        _timed: Option<SliceTag>,
        completion_wanted: bool,
    ) -> Result<Launched, KernelError> {
        kernel.run(io)?;
        let now = Instant::now();
        let start = self.busy_until.max(now);
        let end = start + modeled;
        self.busy_until = end;
        // Nobody off this stream waits for it: the stream's own later kernels start after
        // `end` anyway, so there is nothing to time (as on `cuda`, no completion event).
        if end <= now || !completion_wanted {
            return Ok(Launched { completion: Completion::Done, span: Some((start, end)) });
        }
        self.seq += 1;
        let timer =
            Timer { at: end, seq: self.seq, inbox: self.inbox.clone(), actor, woken: std::cell::Cell::new(false) };
        self.timers.send(timer).map_err(|_| KernelError("the sim poller has stopped".into()))?;
        Ok(Launched { completion: Completion::Pending, span: Some((start, end)) })
    }
}
