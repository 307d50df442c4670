//! A stream thread's inbox: many senders, one receiver, FIFO per sender, blocking receive
//! after a bounded spin.
//!
//! It has two parts. Other stream threads of the job write into *lanes*, one ring per
//! sending stream ([`crate::lane`]), with no locked instruction. Everyone else (device
//! completion threads, feeders, the watchdog, connections, aborts) sends through a
//! channel: a crossbeam channel in normal builds and, under `--cfg loom`, a
//! mutex-and-condvar queue made of loom primitives with the same semantics, so loom
//! explores every interleaving of the threads that use it (crossbeam's internals have
//! their own tests). A receiver with nothing in either sleeps on the channel.
//! The spin-then-park wait ([`InboxReceiver::recv_spinning`]) is written once over both.

use crate::lane::{lane, Doorbell, LaneReceiver, LaneSender};
use crate::sync::{spin_loop, yield_now, Arc};
use regflow_actors::Message;

/// What travels to a stream thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Envelope {
    /// A message for one of its actors.
    Actor(Message),
    /// Two messages for its actors, in this order: what one firing sent to the same
    /// other stream (a `Ready` downstream and an `Ack` upstream, when both neighbours run
    /// there), in one hand-over instead of two.
    Pair(Message, Message),
    /// The watchdog asks for a snapshot of its actors.
    Snapshot,
    /// Abort: stop at once.
    Stop,
    /// Nothing to handle: a lane has envelopes, sent while the receiver was going to sleep
    /// (see [`crate::lane`]).
    Lanes,
}

/// The receiver has gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Disconnected;

/// Why a wait with a deadline ([`InboxReceiver::recv_until`]) ended without an envelope.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Waited {
    /// The deadline came.
    Due,
    /// Every sender is gone.
    Closed,
}

#[cfg(not(loom))]
mod imp {
    use super::{Disconnected, Envelope, Waited};

    /// Sending half of the channel.
    #[derive(Debug, Clone)]
    pub(crate) struct InboxSender(crossbeam_channel::Sender<Envelope>);

    /// Receiving half of the channel.
    #[derive(Debug)]
    pub(crate) struct ChannelReceiver(crossbeam_channel::Receiver<Envelope>);

    /// A channel with room for `capacity` envelopes, allocated now.
    pub(crate) fn channel(capacity: usize) -> (InboxSender, ChannelReceiver) {
        let (tx, rx) = crossbeam_channel::bounded(capacity.max(1));
        (InboxSender(tx), ChannelReceiver(rx))
    }

    impl InboxSender {
        pub(crate) fn send(&self, envelope: Envelope) -> Result<(), Disconnected> {
            self.0.send(envelope).map_err(|_| Disconnected)
        }

        /// Sends unless the inbox is full or gone; returns whether it sent. For envelopes
        /// beyond the inbox's sizing (a lane's wake-up, [`Envelope::Lanes`]): a full inbox
        /// is awake anyway.
        pub(crate) fn try_send(&self, envelope: Envelope) -> bool {
            self.0.try_send(envelope).is_ok()
        }
    }

    impl ChannelReceiver {
        pub(crate) fn try_recv(&self) -> Option<Envelope> {
            self.0.try_recv().ok()
        }

        /// Whether nothing is queued: one atomic load, no write, so a spinning receiver
        /// does not take the cache line from the senders.
        pub(crate) fn is_empty(&self) -> bool {
            self.0.is_empty()
        }

        /// Blocks until an envelope arrives; `None` once every sender is gone.
        pub(crate) fn recv(&self) -> Option<Envelope> {
            self.0.recv().ok()
        }

        /// [`ChannelReceiver::recv`] until `deadline` at the latest.
        pub(crate) fn recv_deadline(&self, deadline: std::time::Instant) -> Result<Envelope, Waited> {
            self.0.recv_deadline(deadline).map_err(|e| match e {
                crossbeam_channel::RecvTimeoutError::Timeout => Waited::Due,
                crossbeam_channel::RecvTimeoutError::Disconnected => Waited::Closed,
            })
        }
    }
}

#[cfg(loom)]
mod imp {
    use super::{Disconnected, Envelope, Waited};
    use loom::sync::{Arc, Condvar, Mutex};
    use std::collections::VecDeque;

    #[derive(Debug)]
    struct Queue {
        items: Mutex<(VecDeque<Envelope>, usize)>,
        ready: Condvar,
    }

    /// Sending half.
    #[derive(Debug)]
    pub(crate) struct InboxSender(Arc<Queue>);

    /// Receiving half.
    #[derive(Debug)]
    pub(crate) struct ChannelReceiver(Arc<Queue>);

    pub(crate) fn channel(_capacity: usize) -> (InboxSender, ChannelReceiver) {
        let queue = Arc::new(Queue { items: Mutex::new((VecDeque::new(), 1)), ready: Condvar::new() });
        (InboxSender(queue.clone()), ChannelReceiver(queue))
    }

    impl Clone for InboxSender {
        fn clone(&self) -> Self {
            crate::sync::lock(&self.0.items).1 += 1;
            InboxSender(self.0.clone())
        }
    }

    impl Drop for InboxSender {
        fn drop(&mut self) {
            crate::sync::lock(&self.0.items).1 -= 1;
            self.0.ready.notify_one();
        }
    }

    impl InboxSender {
        pub(crate) fn send(&self, envelope: Envelope) -> Result<(), Disconnected> {
            crate::sync::lock(&self.0.items).0.push_back(envelope);
            self.0.ready.notify_one();
            Ok(())
        }

        pub(crate) fn try_send(&self, envelope: Envelope) -> bool {
            self.send(envelope).is_ok()
        }
    }

    impl ChannelReceiver {
        pub(crate) fn try_recv(&self) -> Option<Envelope> {
            crate::sync::lock(&self.0.items).0.pop_front()
        }

        pub(crate) fn is_empty(&self) -> bool {
            crate::sync::lock(&self.0.items).0.is_empty()
        }

        pub(crate) fn recv(&self) -> Option<Envelope> {
            let mut items = crate::sync::lock(&self.0.items);
            loop {
                if let Some(envelope) = items.0.pop_front() {
                    return Some(envelope);
                }
                if items.1 == 0 {
                    return None;
                }
                items = self.0.ready.wait(items).unwrap_or_else(|p| p.into_inner());
            }
        }

        /// Loom has no clock to wait on: the models use no deadlines (no `sim` device), so
        /// this only looks.
        pub(crate) fn recv_deadline(&self, _deadline: std::time::Instant) -> Result<Envelope, Waited> {
            let mut items = crate::sync::lock(&self.0.items);
            match items.0.pop_front() {
                Some(envelope) => Ok(envelope),
                None if items.1 == 0 => Err(Waited::Closed),
                None => Err(Waited::Due),
            }
        }
    }
}

pub(crate) use imp::InboxSender;
use imp::{channel, ChannelReceiver};

/// Receiving half: the lanes of the other stream threads, then the channel.
#[derive(Debug)]
pub(crate) struct InboxReceiver {
    lanes: Vec<LaneReceiver>,
    /// The lane to look at first: the last one that had an envelope.
    cursor: std::cell::Cell<usize>,
    doorbell: Arc<Doorbell>,
    channel: ChannelReceiver,
}

/// An inbox whose channel has room for `capacity` envelopes, allocated now. The job sizes
/// it from the register counts, which bound the messages in flight to one stream, so a
/// send never waits and never allocates. It has no lanes until [`InboxReceiver::lane`].
pub(crate) fn inbox(capacity: usize) -> (InboxSender, InboxReceiver) {
    let (tx, rx) = channel(capacity);
    let receiver = InboxReceiver {
        lanes: Vec::new(),
        cursor: std::cell::Cell::new(0),
        doorbell: Arc::new(Doorbell::default()),
        channel: rx,
    };
    (tx, receiver)
}

impl InboxReceiver {
    /// Lets the senders of this inbox's lanes skip their locked swap, where the process
    /// can make the heavy barrier instead (see [`crate::lane`]); only before its first lane.
    pub(crate) fn use_asymmetric_barrier(&mut self) {
        if self.lanes.is_empty() {
            self.doorbell = Arc::new(Doorbell::asymmetric());
        }
    }

    /// Whether its lanes' senders skip their locked swap (the barrier is asymmetric).
    #[cfg(test)]
    pub(crate) fn asymmetric_barrier(&self) -> bool {
        self.doorbell.is_asymmetric()
    }

    /// Moves the lanes' read ends (whose indices the receiving thread writes at every
    /// envelope) into memory the calling thread allocates now; see
    /// [`StreamWorker::reallocate`](crate::stream::StreamWorker::reallocate).
    pub(crate) fn reallocate(&mut self) {
        self.lanes = crate::own_memory::vec(&mut self.lanes);
    }

    /// A lane of at least `capacity` envelopes into this inbox, for one other stream
    /// thread; `wake` is a sender of this inbox's channel, which the lane's sender keeps to
    /// wake the receiver (so the channel ends only after the lanes' senders are gone).
    /// The lane goes from plan stream `from` to this inbox's, `to`; a send that finds it
    /// full says so in `waits`.
    pub(crate) fn lane(
        &mut self,
        capacity: usize,
        wake: InboxSender,
        waits: std::sync::Arc<crate::send_waits::SendWaits>,
        from_to: (usize, usize),
    ) -> LaneSender {
        let (sender, receiver) = lane(capacity, self.doorbell.clone(), wake, waits, from_to);
        self.lanes.push(receiver);
        sender
    }

    /// An envelope already there: the channel's first (aborts and snapshots do not wait
    /// behind a busy lane), else the lanes', starting with the last lane that had one.
    /// A lane's wake-up ([`Envelope::Lanes`]) is not returned: it only says to look at
    /// the lanes, which this does anyway.
    #[inline]
    pub(crate) fn try_recv(&self) -> Option<Envelope> {
        if !self.channel.is_empty() {
            match self.channel.try_recv() {
                Some(Envelope::Lanes) | None => {}
                Some(envelope) => return Some(envelope),
            }
        }
        self.try_recv_lanes()
    }

    #[inline]
    fn try_recv_lanes(&self) -> Option<Envelope> {
        let count = self.lanes.len();
        let first = self.cursor.get();
        for offset in 0..count {
            let at = if first + offset >= count { first + offset - count } else { first + offset };
            if let Some(envelope) = self.lanes[at].try_recv() {
                self.cursor.set(at);
                return Some(envelope);
            }
        }
        None
    }

    /// Whether nothing is queued: loads only, no write, so a spinning receiver does not
    /// take cache lines from the senders.
    pub(crate) fn is_empty(&self) -> bool {
        self.channel.is_empty() && self.lanes.iter().all(LaneReceiver::is_empty)
    }

    /// Blocks until an envelope arrives; `None` once every sender of the channel is gone
    /// and the lanes are empty (the lanes' senders hold channel senders too).
    pub(crate) fn recv(&self) -> Option<Envelope> {
        self.park(None).ok()
    }

    /// Blocks until an envelope arrives or `until` comes (if given): the sleep of
    /// [`InboxReceiver::recv`] and [`InboxReceiver::recv_until`].
    pub(crate) fn park(&self, until: Option<std::time::Instant>) -> Result<Envelope, Waited> {
        let channel_recv = || match until {
            None => self.channel.recv().ok_or(Waited::Closed),
            Some(deadline) => self.channel.recv_deadline(deadline),
        };
        loop {
            if let Some(envelope) = self.try_recv() {
                return Ok(envelope);
            }
            if self.lanes.is_empty() {
                return match channel_recv() {
                    Ok(Envelope::Lanes) => continue,
                    other => other,
                };
            }
            if !self.doorbell.raise() {
                // The kernel refused the barrier a sleep relies on: look again instead.
                self.doorbell.lower();
                yield_now();
                continue;
            }
            if let Some(envelope) = self.try_recv_lanes() {
                self.doorbell.lower();
                return Ok(envelope);
            }
            match channel_recv() {
                // The sender lowered the doorbell: look at the lanes again.
                Ok(Envelope::Lanes) => {}
                Ok(envelope) => {
                    self.doorbell.lower();
                    return Ok(envelope);
                }
                Err(waited) => {
                    self.doorbell.lower();
                    return self.try_recv_lanes().ok_or(waited);
                }
            }
        }
    }

    /// The next envelope, if one comes before `deadline` (a modeled kernel's end, which
    /// the stream thread then reports itself): sleeps until [`DEADLINE_SPIN`] before it,
    /// then spins, yielding its core between looks, so that it sees the deadline within
    /// about a microsecond rather than a timer's wake-up later.
    /// The deadline is looked at first: a thread kept busy by its inbox still reports a
    /// completion when it is due, not once the inbox runs dry.
    pub(crate) fn recv_until(&self, deadline: std::time::Instant) -> Result<Envelope, Waited> {
        if std::time::Instant::now() >= deadline {
            return Err(Waited::Due);
        }
        if let Some(envelope) = self.try_recv() {
            return Ok(envelope);
        }
        crate::activity::asleep(|| {
            let mut round = 0u32;
            loop {
                let now = std::time::Instant::now();
                if now >= deadline {
                    return Err(Waited::Due);
                }
                if deadline - now > DEADLINE_SPIN {
                    match self.park(Some(deadline - DEADLINE_SPIN)) {
                        Err(Waited::Due) => continue,
                        other => return other,
                    }
                }
                round += 1;
                if let Some(envelope) = self.spin_round(round) {
                    return Ok(envelope);
                }
            }
        })
    }

    /// Round `round` (from 1) of a spin: a pause in the first [`PAUSE_ROUNDS`], then a
    /// yield of the core (on a machine with fewer cores than busy threads, the sender may
    /// need this very core to send); then a look at the inbox, by loads only until
    /// something is there.
    #[inline]
    fn spin_round(&self, round: u32) -> Option<Envelope> {
        if round <= PAUSE_ROUNDS {
            spin_loop();
        } else {
            yield_now();
        }
        if self.is_empty() {
            return None;
        }
        self.try_recv()
    }
}

/// Most rounds a receiver spins on an empty inbox before it parks. Loom explores a spin of
/// two rounds (a message landing during the spin, or after it).
#[cfg(not(loom))]
const SPIN_ROUNDS: u32 = 4096;
#[cfg(loom)]
const SPIN_ROUNDS: u32 = 2;

/// Longest a receiver usually spins before it parks. A message from a thread that is
/// itself busy (a cross-thread chain, B2 in `examples/bench_actors.rs`) comes back within
/// a few microseconds; parking costs a futex wait here and a futex wake in the sender,
/// each several microseconds on a VM, and with lanes the heavy barrier (`membarrier`,
/// see [`crate::lane`]): 13–38 µs a call on the 2-vCPU benchmark VM while the other
/// thread spins, whose vCPU has left the guest on `pause` and must be brought back for
/// the barrier's interrupt. With 8 µs, a peer held up that long (by the host, or by its
/// own parking) made the waiting thread park too, and the two took turns parking: B2 made
/// 219 `membarrier` calls per run, 15 with 50 µs, and its median hop fell by 8–14 %
/// (BENCHMARKS.md, issue 13, twenty-fifth session). An idle stream spins this long once,
/// then sleeps; it spins at all only while the stream threads awake fit on the cores.
#[cfg(not(loom))]
pub(crate) const SPIN_TIME: std::time::Duration = std::time::Duration::from_micros(50);

/// How long before a deadline [`InboxReceiver::recv_until`] stops sleeping and spins:
/// a timed sleep ends late by tens of microseconds (Linux's default timer slack of 50 µs,
/// then the VM's wake-up), which would add up along a pipeline of modeled kernels. On the
/// 2-vCPU Zen 3 VM (`bench_actors b3`, 2 registers, m = 32, best of each invocation,
/// median of 8–10 alternated invocations): 40 µs 1.076×, 100 µs 1.027–1.030×, 250 µs
/// 1.019–1.020×, 500 µs 1.019×, 1 000 µs (always spinning) 1.025×; 100 µs with the
/// thread's timer slack cut to 1 µs 1.020×, no better than the longer spin.
pub(crate) const DEADLINE_SPIN: std::time::Duration = std::time::Duration::from_micros(250);

/// Rounds of `spin_loop` before the spin yields its core instead (measured on the 2-core
/// benchmark VM under load: pausing alone made B2 and B3 slower than parking at once,
/// since the thread that would send needed the core).
#[cfg(not(loom))]
const PAUSE_ROUNDS: u32 = 32;
#[cfg(loom)]
const PAUSE_ROUNDS: u32 = 1;

/// Spin rounds between two reads of the clock (a clock read costs more than a round).
#[cfg(not(loom))]
const ROUNDS_PER_CLOCK: u32 = 4;

impl InboxReceiver {
    /// The next envelope: one already queued, or one arriving within a bounded spin (at
    /// most [`SPIN_TIME`] and [`SPIN_ROUNDS`] rounds), or else blocks until one arrives.
    /// `None` once every sender is gone.
    pub(crate) fn recv_spinning(&self) -> Option<Envelope> {
        if let Some(envelope) = self.try_recv() {
            return Some(envelope);
        }
        // The thread counts as asleep for all of its wait: the spin yields its core after a
        // few rounds, so it keeps no thread with work off a core (`crate::activity`). It
        // spins at all only while the threads awake fit on the cores.
        crate::activity::asleep(|| {
            #[cfg(not(loom))]
            if !crate::activity::may_spin() {
                return self.recv();
            }
            self.spin_then_recv()
        })
    }

    fn spin_then_recv(&self) -> Option<Envelope> {
        #[cfg(not(loom))]
        let start = std::time::Instant::now();
        for round in 1..=SPIN_ROUNDS {
            if let Some(envelope) = self.spin_round(round) {
                return Some(envelope);
            }
            #[cfg(not(loom))]
            if round % ROUNDS_PER_CLOCK == 0 && start.elapsed() >= SPIN_TIME {
                break;
            }
            #[cfg(loom)]
            let _ = round;
        }
        self.recv()
    }
}
