//! Where a stream thread that found no room to send says whom it waits on, so that the
//! watchdog can name the owner of a wait the thread cannot report itself.
//!
//! A lane to another stream thread (`crate::lane`) and the queue to another node's
//! connection (`crate::net`) are sized from the plan's register counts so that a send
//! never waits. If a plan's sizing is wrong, the sending thread waits for room and, unlike
//! a thread waiting on its inbox, answers no snapshot; what it wrote here is how the
//! watchdog still says on whom it waits ([`crate::FullLane`], and the silent stream's line).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Sends of a job's stream threads that found no room: how many found their lane full, and
/// whom each thread waits on now.
#[derive(Debug, Default)]
pub(crate) struct SendWaits {
    /// Sends through lanes that waited, since the job started (`JobReport::lane_waits`).
    count: AtomicU64,
    /// Per sending plan stream: what it waits on, encoded by [`WaitsOn::encode`]; 0 when
    /// it does not wait.
    waiting_on: Box<[AtomicUsize]>,
    /// The job's abort signal (`JobShared::abort_signal`), disconnected once it aborts: a
    /// thread waiting for room then stops waiting ([`SendWaits::aborted`]). None outside a
    /// job (unit tests, loom models), where nothing aborts.
    abort: Option<crossbeam_channel::Receiver<()>>,
}

/// Whom a stream thread that found no room to send waits on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WaitsOn {
    /// The thread of this plan stream, to take envelopes from their lane.
    Stream(usize),
    /// The writer of the connection to this node, to take frames from its queue.
    Node(u16),
}

/// The top bit of an encoded [`WaitsOn`] marks a node.
const NODE_BIT: usize = 1 << (usize::BITS - 1);

impl WaitsOn {
    fn encode(self) -> usize {
        match self {
            WaitsOn::Stream(s) => s + 1,
            WaitsOn::Node(n) => NODE_BIT | usize::from(n),
        }
    }

    fn decode(code: usize) -> Option<Self> {
        match code {
            0 => None,
            c if c & NODE_BIT != 0 => Some(WaitsOn::Node((c & !NODE_BIT) as u16)),
            c => Some(WaitsOn::Stream(c - 1)),
        }
    }
}

impl SendWaits {
    /// None yet, for a job of `streams` plan streams whose abort disconnects `abort`.
    pub(crate) fn new(streams: usize, abort: crossbeam_channel::Receiver<()>) -> Self {
        Self {
            count: AtomicU64::new(0),
            waiting_on: (0..streams).map(|_| AtomicUsize::new(0)).collect(),
            abort: Some(abort),
        }
    }

    /// Whether the job aborted, so a wait for room must end, and one that would start
    /// gives up at once. A lane's receiver that is itself stuck (waiting for room in a
    /// lane back, full because this sender does not read its inbox while it waits) would
    /// otherwise never take an envelope nor go away, and the two threads outlive their job.
    pub(crate) fn aborted(&self) -> bool {
        self.abort
            .as_ref()
            .is_some_and(|abort| matches!(abort.try_recv(), Err(crossbeam_channel::TryRecvError::Disconnected)))
    }

    /// Sends through lanes that waited for room so far.
    pub(crate) fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Whom the thread of plan stream `from` waits on now, if it waits for room.
    pub(crate) fn waiting_on(&self, from: usize) -> Option<WaitsOn> {
        WaitsOn::decode(self.waiting_on.get(from)?.load(Ordering::Acquire))
    }

    /// The thread of plan stream `from` waits on `on` until the guard is dropped (a wait
    /// on a lane counts once in [`SendWaits::count`]).
    pub(crate) fn begin(&self, from: usize, on: WaitsOn) -> Waiting<'_> {
        if matches!(on, WaitsOn::Stream(_)) {
            self.count.fetch_add(1, Ordering::Relaxed);
        }
        let slot = self.waiting_on.get(from);
        if let Some(slot) = slot {
            slot.store(on.encode(), Ordering::Release);
        }
        Waiting(slot)
    }
}

/// A wait [`SendWaits::begin`] recorded; ends when dropped, however the wait ends.
#[derive(Debug)]
pub(crate) struct Waiting<'a>(Option<&'a AtomicUsize>);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if let Some(slot) = self.0 {
            slot.store(0, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_names_its_stream_or_node_until_its_guard_goes() {
        let (_abort, never) = crossbeam_channel::bounded(1);
        let waits = SendWaits::new(3, never);
        for on in [WaitsOn::Stream(0), WaitsOn::Stream(2), WaitsOn::Node(0), WaitsOn::Node(u16::MAX)] {
            let waiting = waits.begin(1, on);
            assert_eq!(waits.waiting_on(1), Some(on));
            assert_eq!(waits.waiting_on(0), None);
            drop(waiting);
            assert_eq!(waits.waiting_on(1), None);
        }
        assert_eq!(waits.count(), 2, "only the waits on lanes count");
        // A stream the job does not know is not recorded, and nothing fails.
        drop(waits.begin(7, WaitsOn::Stream(0)));
        assert_eq!(waits.waiting_on(7), None);
    }
}
