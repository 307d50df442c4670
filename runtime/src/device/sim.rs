//! The `sim` device: kernels compute their bytes on the host at launch, but complete after
//! a modeled duration. A sim stream is serial: a kernel starts when the previous one on the
//! stream ends. The stream thread itself reports the completions that someone off the
//! stream waits for: it waits on its inbox only until the next modeled end
//! ([`DeviceStream::next_completion`]), then hands itself the `ActDone`. The others complete
//! at launch, as on `cuda` (see `Firing::completion_wanted`).
//!
//! **Why not a poller thread.** The design (and this device until the thirty-third
//! session) had one poller thread keep every sim stream's timers and send each `ActDone`
//! through the stream's inbox, waking the stream 40 µs ahead so that it spun when the
//! message landed. In a pipeline of sim stages each completion then took two hand-overs
//! between threads before the next stage could launch (poller → stream → next stream),
//! and the poller was one more spinning thread on cores the stages share. The stream
//! thread knows its own deadlines, so it times them itself: one hand-over fewer per stage,
//! one thread fewer (B3 in `BENCHMARKS.md`).

use super::{DeviceStream, Launched, SliceTag};
use crate::kernel::{Kernel, KernelError, KernelIo};
use regflow_actors::{ActorId, Completion};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// One stream of a sim device.
#[derive(Debug)]
pub(crate) struct SimStream {
    /// When the last kernel launched on the stream ends: the next one starts then.
    busy_until: Instant,
    /// The launches someone waits for, oldest first, with their modeled ends. The stream
    /// is serial, so the ends come in launch order.
    pending: VecDeque<(Instant, ActorId)>,
}

impl SimStream {
    /// A stream with room for `capacity` pending launches, allocated now (the launches in
    /// flight are bounded by the register counts, so a launch does not allocate).
    pub(crate) fn new(capacity: usize) -> Self {
        Self { busy_until: Instant::now(), pending: VecDeque::with_capacity(capacity.max(1)) }
    }
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
        self.pending.push_back((end, actor));
        Ok(Launched { completion: Completion::Pending, span: Some((start, end)) })
    }

    fn times_completions(&self) -> bool {
        true
    }

    fn next_completion(&self) -> Option<Instant> {
        self.pending.front().map(|&(at, _)| at)
    }

    fn take_completed(&mut self, now: Instant) -> Option<ActorId> {
        match self.pending.front() {
            Some(&(at, actor)) if at <= now => {
                self.pending.pop_front();
                Some(actor)
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::KernelIo;
    use regflow_actors::GroupPosition;

    struct Nothing;
    impl Kernel for Nothing {
        fn run(&mut self, _io: &mut KernelIo<'_>) -> Result<(), KernelError> {
            Ok(())
        }
    }

    #[test]
    fn a_sim_stream_completes_its_launches_in_order_after_their_modeled_time() {
        let id = |index: u32| ActorId::new(0, 0, 0, index).expect("a small id");
        let mut stream = SimStream::new(4);
        let context = regflow_kernels::StreamContext::default();
        let mut launch = |actor: u32, wanted: bool| {
            let mut io = KernelIo::new(0, GroupPosition { index: 0, count: 1 }, &[], &[], &context);
            let modeled = Duration::from_millis(50);
            stream.launch(id(actor), &mut Nothing, &mut io, modeled, None, wanted).map(|l| l.completion)
        };
        let before = Instant::now();
        assert_eq!(launch(1, true), Ok(Completion::Pending));
        // Nobody waits for the second: it completes at launch, but still takes its time.
        assert_eq!(launch(2, false), Ok(Completion::Done));
        assert_eq!(launch(3, true), Ok(Completion::Pending));
        let first = stream.next_completion().expect("two launches pending");
        assert!(first >= before + Duration::from_millis(50), "the first ends after its modeled time");
        assert_eq!(stream.take_completed(before), None, "nothing has ended yet");
        assert_eq!(stream.take_completed(first), Some(id(1)));
        // The third starts when the second ends: 100 ms after the first's end.
        let third = stream.next_completion().expect("one launch pending");
        assert!(third >= first + Duration::from_millis(100), "{third:?} vs {first:?}");
        assert_eq!(stream.take_completed(third - Duration::from_millis(1)), None);
        assert_eq!(stream.take_completed(third), Some(id(3)));
        assert_eq!(stream.next_completion(), None);
    }
}
