//! A lane: a bounded ring from one stream thread to another's inbox, written by one thread
//! and read by one, so an envelope crosses threads with plain loads and stores.
//!
//! Why not the inbox's channel for everything: a crossbeam bounded channel serves many
//! senders, so every send and every receive claims its slot with a locked compare-and-swap
//! after loading the slot's stamp, a cache miss the core must wait for while the other
//! thread holds the line. In a chain of actors alternating over two streams (B2 in
//! `examples/bench_actors.rs`) those waits were most of a hop. A lane has one writer and
//! one reader: the sender stores the envelope and then its new tail, the receiver loads the
//! tail and then the envelopes up to it, and each side reads the other's index only when
//! its own copy says the ring is full (sender) or empty (receiver).
//!
//! A receiver that finds its lanes and its channel empty sleeps on the channel. So that no
//! envelope is left in a lane while its receiver sleeps, the receiver raises its
//! [`Doorbell`] before it looks at the lanes a last time, and a sender looks at the doorbell
//! after it published an envelope: one of the two sees the other's write (the receiver the
//! envelope, or the sender the raised doorbell, which it lowers and answers with an
//! [`Envelope::Lanes`](crate::inbox::Envelope::Lanes) through the channel). Both do it with
//! a swap of the doorbell, so the two are ordered on that one location (acquire and
//! release suffice, and loom checks exactly that). Every write of the doorbell is a
//! swap, the receiver's lowering included (see [`Doorbell::lower`]). Written with a store
//! and a fence on each side instead (and the lowering a swap), loom still reports a
//! deadlock in a two-thread model; we did not settle whether that is real or a false alarm
//! (loom's README says it treats sequentially consistent stores as acquire-release), and
//! use the form it checks.
//!
//! The handshake may be asymmetric where the kernel offers a heavy barrier (Linux's
//! `membarrier`, as in userspace RCU): a sender then only loads the doorbell after a
//! compiler barrier, and the receiver about to sleep makes every running thread of the
//! process pass a full barrier. A locked instruction on every send waits for the
//! envelope's stores to leave the core, which means waiting for the receiver's core to
//! give up the slot's cache line: most of a send's time in B2 (`perf annotate`: two thirds
//! of the samples of the sending function on the load after a fence). But the heavy
//! barrier interrupts the process's running threads each time a receiver goes to sleep,
//! and with more stream threads than cores receivers sleep often: the tiny GPT over 8
//! devices on 2 cores (`train_parallel --layout dp2xtp2xpp2`) ran 16 ms per step with
//! locked instructions on both sides and 20-22 with the heavy barrier. So a job asks for
//! it only when the stream threads of all the process's jobs, its own included, fit on
//! the cores as it is built (`crate::activity::StreamThreads`; [`Doorbell::asymmetric`]);
//! elsewhere, and under loom, both sides swap the doorbell. A job keeps the choice it made: one
//! built earlier, when the threads fitted, goes on with the heavy barrier after later jobs
//! have outnumbered the cores (switching a live doorbell's mode would need every sender
//! to have seen the switch before the receiver relies on it).
//!
//! The job makes a lane for every pair of hosted streams whose actors share a register,
//! sized from the register counts like the inbox (`job::setup::lane_capacities`), so a send
//! never waits; the cold path that would wait for room exists for a plan the sizing got
//! wrong, and ends with an error once the receiver has gone or the job aborts (two
//! threads each waiting for room in the other's lane would otherwise outlive the job).
//! While it waits, the thread answers no snapshot, so it says whom it waits on in
//! [`SendWaits`]: the watchdog reports it as a [`crate::FullLane`], an edge of the
//! wait-for graph from the waiting stream to the one that has not taken the lane's
//! envelopes.

use crate::inbox::{Disconnected, Envelope};
use crate::send_waits::{SendWaits, WaitsOn};
use crate::sync::{Arc, AtomicBool, AtomicUsize, Ordering, UnsafeCell};
use crossbeam_utils::CachePadded;
use std::cell::Cell;

/// How many slots ahead of the one it writes a sender claims cache lines for writing.
const CLAIM_AHEAD: usize = 4;

/// Asks the core to fetch the cache lines of `bytes` at `at` for writing, ahead of the
/// write. The receiver read them last: without this, the sender's stores wait in its store
/// buffer for the lines to come over, and so does any later load that cannot be forwarded
/// from a store (copies of messages, on the sender's next firing).
#[inline(always)]
fn claim_for_writing(at: *const u8, bytes: usize) {
    #[cfg(all(target_arch = "x86_64", not(loom)))]
    for offset in [0, 64, bytes - 1] {
        // SAFETY: a prefetch only hints; `at + offset` lies within the slot.
        unsafe {
            std::arch::asm!("prefetchw [{0}]", in(reg) at.add(offset), options(nostack, preserves_flags, readonly));
        }
    }
    #[cfg(not(all(target_arch = "x86_64", not(loom))))]
    let _ = (at, bytes);
}

/// What the sender and the receiver of a lane share.
#[derive(Debug)]
struct Ring {
    slots: Box<[UnsafeCell<Envelope>]>,
    /// `slots.len() - 1` (the length is a power of two).
    mask: usize,
    /// The next index the receiver reads; only the receiver writes it.
    head: CachePadded<AtomicUsize>,
    /// The next index the sender writes; only the sender writes it.
    tail: CachePadded<AtomicUsize>,
    /// The receiver has gone: a sender waiting for room stops.
    closed: AtomicBool,
}

// SAFETY: a slot is written only by the one sender, at indices the receiver has released
// (`head` loaded with acquire ordering), and read only by the one receiver, at indices the
// sender has published (`tail` loaded with acquire ordering); the halves are not `Clone`.
unsafe impl Sync for Ring {}
// SAFETY: as above; `Envelope` is plain data.
unsafe impl Send for Ring {}

/// The barriers of the doorbell's handshake.
mod barrier {
    /// Whether the receivers' heavy barrier works in this process, so that senders need
    /// only the compiler's: asked (and registered) once.
    pub(super) fn asymmetric() -> bool {
        #[cfg(all(target_os = "linux", not(loom)))]
        {
            static REGISTERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
            *REGISTERED.get_or_init(|| membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED))
        }
        #[cfg(not(all(target_os = "linux", not(loom))))]
        false
    }

    /// Makes every running thread of the process pass a full barrier; false if the
    /// kernel refused (then the caller must not rely on it).
    pub(super) fn heavy() -> bool {
        #[cfg(all(target_os = "linux", not(loom)))]
        {
            membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)
        }
        #[cfg(not(all(target_os = "linux", not(loom))))]
        false
    }

    #[cfg(all(target_os = "linux", not(loom)))]
    const MEMBARRIER_CMD_PRIVATE_EXPEDITED: libc::c_long = 1 << 3;
    #[cfg(all(target_os = "linux", not(loom)))]
    const MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED: libc::c_long = 1 << 4;

    #[cfg(all(target_os = "linux", not(loom)))]
    fn membarrier(command: libc::c_long) -> bool {
        // SAFETY: `membarrier(cmd, flags = 0, cpu_id = 0)` takes no pointers; an old
        // kernel or a sandbox that forbids it answers with an error, which we report.
        unsafe { libc::syscall(libc::SYS_membarrier, command, 0 as libc::c_long, 0 as libc::c_long) == 0 }
    }
}

/// A receiver's flag that it is about to sleep on its inbox's channel, shared with the
/// senders of its lanes.
#[derive(Debug)]
pub(crate) struct Doorbell {
    asleep: CachePadded<AtomicBool>,
    /// The handshake's barrier is asymmetric (see the module's docs).
    asymmetric: bool,
}

impl Default for Doorbell {
    /// A doorbell whose handshake swaps it on both sides.
    fn default() -> Self {
        Self { asleep: CachePadded::new(AtomicBool::new(false)), asymmetric: false }
    }
}

impl Doorbell {
    /// A doorbell whose senders need only a compiler barrier, if this process can make
    /// the heavy barrier (registered on first use); else one swapped on both sides.
    pub(crate) fn asymmetric() -> Self {
        Self { asleep: CachePadded::new(AtomicBool::new(false)), asymmetric: barrier::asymmetric() }
    }

    /// Whether the handshake's barrier is asymmetric.
    #[cfg(test)]
    pub(crate) fn is_asymmetric(&self) -> bool {
        self.asymmetric
    }

    /// Raised before the receiver's last look at its lanes; then it sleeps unless that
    /// look found an envelope. False if the heavy barrier failed: the receiver must then
    /// not sleep (it yields and looks again), since a sender may miss the doorbell.
    #[must_use]
    pub(crate) fn raise(&self) -> bool {
        // Symmetric: a read-modify-write of the one location both sides write, so the
        // senders' swaps and this one are totally ordered: either a sender's swap comes
        // first and its envelope is visible to the look that follows (release, then
        // acquire), or it comes after and reads `true`. Asymmetric: the heavy barrier
        // after it orders the senders' loads.
        self.asleep.swap(true, Ordering::AcqRel);
        !self.asymmetric || barrier::heavy()
    }

    /// Lowered by the receiver once it is awake (a sender may have lowered it already).
    /// A swap, not a store: every write of the doorbell is a read-modify-write, so the
    /// next raise reads the latest sender's swap and acquires what it published. With a
    /// plain store here a sender's swap could be ordered before the store in the
    /// doorbell's history while coming later in time; the next raise then read the
    /// receiver's own store, saw nothing of the envelope, and slept with it in the lane
    /// (a deadlock loom found in a two-thread model of the handshake).
    pub(crate) fn lower(&self) {
        self.asleep.swap(false, Ordering::AcqRel);
    }

    /// Whether a sender that published an envelope must wake the receiver: true at most
    /// once per raise.
    #[inline(always)]
    fn answer(&self) -> bool {
        if self.asymmetric {
            // The receiver's heavy barrier orders this load after the envelope's stores.
            std::sync::atomic::compiler_fence(Ordering::SeqCst);
            return self.asleep.load(Ordering::Relaxed) && self.asleep.swap(false, Ordering::AcqRel);
        }
        self.asleep.swap(false, Ordering::AcqRel)
    }
}

/// The writing end of a lane, owned by one stream thread (not `Clone`, not `Sync`).
#[derive(Debug)]
pub(crate) struct LaneSender {
    ring: Arc<Ring>,
    doorbell: Arc<Doorbell>,
    /// The receiver's channel, for the wake-up envelope.
    wake: crate::inbox::InboxSender,
    /// The next index to write (the sender's copy of `ring.tail`).
    tail: Cell<usize>,
    /// The receiver's `head` as last read: room is known up to `head_seen + slots`.
    head_seen: Cell<usize>,
    /// Where a send that finds the lane full says so (`JobReport::lane_waits`, and the
    /// watchdog's owner of the wait).
    waits: std::sync::Arc<SendWaits>,
    /// The plan streams of the sending and the receiving thread.
    from: usize,
    to: usize,
}

/// The reading end of a lane, kept by the receiving inbox.
#[derive(Debug)]
pub(crate) struct LaneReceiver {
    ring: Arc<Ring>,
    /// The next index to read (the receiver's copy of `ring.head`).
    head: Cell<usize>,
    /// The sender's `tail` as last read: envelopes are known up to it.
    tail_seen: Cell<usize>,
}

/// A lane of at least `capacity` envelopes (rounded up to a power of two), allocated now,
/// from plan stream `from` into a receiver of plan stream `to` whose doorbell is
/// `doorbell` and whose channel `wake` reaches; a send that finds it full says so in
/// `waits`.
pub(crate) fn lane(
    capacity: usize,
    doorbell: Arc<Doorbell>,
    wake: crate::inbox::InboxSender,
    waits: std::sync::Arc<SendWaits>,
    (from, to): (usize, usize),
) -> (LaneSender, LaneReceiver) {
    let len = capacity.max(2).next_power_of_two();
    let ring = Arc::new(Ring {
        slots: (0..len).map(|_| UnsafeCell::new(Envelope::Lanes)).collect(),
        mask: len - 1,
        head: CachePadded::new(AtomicUsize::new(0)),
        tail: CachePadded::new(AtomicUsize::new(0)),
        closed: AtomicBool::new(false),
    });
    let sender =
        LaneSender { ring: ring.clone(), doorbell, wake, tail: Cell::new(0), head_seen: Cell::new(0), waits, from, to };
    let receiver = LaneReceiver { ring, head: Cell::new(0), tail_seen: Cell::new(0) };
    (sender, receiver)
}

/// A stream thread's lanes to the other streams of the job, by plan stream index.
#[derive(Debug, Default)]
pub(crate) struct Lanes(Vec<Option<LaneSender>>);

impl Lanes {
    /// No lanes yet, to any of `streams` streams.
    pub(crate) fn new(streams: usize) -> Self {
        Self((0..streams).map(|_| None).collect())
    }

    /// Sends to plan stream `to` through `lane` from now on.
    pub(crate) fn insert(&mut self, to: usize, lane: LaneSender) {
        if let Some(entry) = self.0.get_mut(to) {
            *entry = Some(lane);
        }
    }

    /// Moves the lanes' write ends (whose indices the sending thread writes at every
    /// envelope) into memory the calling thread allocates now; see
    /// [`StreamWorker::reallocate`](crate::stream::StreamWorker::reallocate).
    pub(crate) fn reallocate(&mut self) {
        self.0 = crate::own_memory::vec(&mut self.0);
    }

    /// The lane to plan stream `to`, if the plan gave the two streams one.
    #[inline]
    pub(crate) fn to(&self, to: usize) -> Option<&LaneSender> {
        self.0.get(to)?.as_ref()
    }
}

impl LaneSender {
    /// Publishes `envelope`, and wakes the receiver if it went to sleep.
    #[inline]
    pub(crate) fn send(&self, envelope: Envelope) -> Result<(), Disconnected> {
        let tail = self.tail.get();
        if tail.wrapping_sub(self.head_seen.get()) > self.ring.mask {
            self.wait_for_room(tail)?;
        }
        // SAFETY: index `tail` is beyond what the receiver may read (it reads below the
        // published tail) and was released by it (`head_seen` came from an acquire load).
        self.ring.slots[tail & self.ring.mask].with_mut(|slot| unsafe { slot.write(envelope) });
        self.ring.tail.store(tail.wrapping_add(1), Ordering::Release);
        self.tail.set(tail.wrapping_add(1));
        if self.ring.mask >= 2 * CLAIM_AHEAD {
            let slot = &self.ring.slots[tail.wrapping_add(CLAIM_AHEAD) & self.ring.mask];
            slot.with(|at| claim_for_writing(at.cast::<u8>(), std::mem::size_of::<Envelope>()));
        }
        if self.doorbell.answer() {
            // A full channel has envelopes its receiver takes before it sleeps again.
            let _ = self.wake.try_send(Envelope::Lanes);
        }
        Ok(())
    }

    /// Waits until the receiver has taken an envelope: never, for a lane sized from the
    /// plan's register counts (see the module's docs). Ends with an error once the
    /// receiver has gone or the job aborted.
    #[cold]
    #[inline(never)]
    fn wait_for_room(&self, tail: usize) -> Result<(), Disconnected> {
        // Says whom this thread waits on from the first look that found no room to the end.
        let mut waiting = None;
        loop {
            let head = self.ring.head.load(Ordering::Acquire);
            if tail.wrapping_sub(head) <= self.ring.mask {
                self.head_seen.set(head);
                return Ok(());
            }
            waiting.get_or_insert_with(|| self.waits.begin(self.from, WaitsOn::Stream(self.to)));
            if self.ring.closed.load(Ordering::Acquire) || self.waits.aborted() {
                return Err(Disconnected);
            }
            crate::sync::yield_now();
        }
    }
}

impl LaneReceiver {
    /// The oldest envelope the sender has published, if any.
    #[inline]
    pub(crate) fn try_recv(&self) -> Option<Envelope> {
        let head = self.head.get();
        if head == self.tail_seen.get() {
            let tail = self.ring.tail.load(Ordering::Acquire);
            if tail == head {
                return None;
            }
            self.tail_seen.set(tail);
        }
        // SAFETY: `head` is below the tail the sender published (acquire load), and the
        // sender does not write it again before this receiver releases it below.
        let envelope = self.ring.slots[head & self.ring.mask].with(|slot| unsafe { *slot });
        self.ring.head.store(head.wrapping_add(1), Ordering::Release);
        self.head.set(head.wrapping_add(1));
        Some(envelope)
    }

    /// Whether the sender has published nothing this receiver has not taken: one load of
    /// the sender's index when the receiver's copy says empty, no write.
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        let head = self.head.get();
        if head != self.tail_seen.get() {
            return false;
        }
        let tail = self.ring.tail.load(Ordering::Acquire);
        self.tail_seen.set(tail);
        tail == head
    }
}

impl Drop for LaneReceiver {
    fn drop(&mut self) {
        self.ring.closed.store(true, Ordering::Release);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use regflow_actors::{ActorId, Body, Message};

    fn message(n: u64) -> Envelope {
        let id = ActorId::new(0, 0, 0, n as u32).expect("small ids fit");
        Envelope::Actor(Message { dst: id, src: id, body: Body::ActDone })
    }

    /// A lane of two envelopes from plan stream `from` to `to` (of `streams`), both sent.
    /// Bind every field: one left to `..` is dropped at once (the job aborts).
    struct FullLane {
        tx: LaneSender,
        rx: LaneReceiver,
        waits: std::sync::Arc<SendWaits>,
        /// Dropping it aborts the job.
        abort: crossbeam_channel::Sender<()>,
        /// The receiver's channel, which the lane's wake-ups reach.
        _channel: crate::inbox::InboxReceiver,
    }

    fn full_lane((from, to): (usize, usize), streams: usize) -> FullLane {
        let (wake, _channel) = crate::inbox::inbox(4);
        let (abort, aborted) = crossbeam_channel::bounded(1);
        let waits = std::sync::Arc::new(SendWaits::new(streams, aborted));
        let (tx, rx) = lane(2, Arc::new(Doorbell::default()), wake, waits.clone(), (from, to));
        tx.send(message(0)).expect("room");
        tx.send(message(1)).expect("room");
        FullLane { tx, rx, waits, abort, _channel }
    }

    #[test]
    fn envelopes_arrive_in_order_across_many_wraps() {
        let (wake, _channel) = crate::inbox::inbox(4);
        let (tx, rx) = lane(3, Arc::new(Doorbell::default()), wake, Default::default(), (0, 1));
        assert_eq!(rx.ring.slots.len(), 4, "the capacity is rounded up to a power of two");
        let mut next = 0;
        for sent in 0..1000u64 {
            tx.send(message(sent)).expect("the receiver is here");
            if sent % 3 == 2 {
                while let Some(got) = rx.try_recv() {
                    assert_eq!(got, message(next));
                    next += 1;
                }
                assert!(rx.is_empty());
            }
        }
        while let Some(got) = rx.try_recv() {
            assert_eq!(got, message(next));
            next += 1;
        }
        assert_eq!(next, 1000);
    }

    #[test]
    fn a_raised_doorbell_is_answered_once_through_the_channel() {
        for doorbell in [Doorbell::default(), Doorbell::asymmetric()] {
            let asymmetric = doorbell.asymmetric;
            // `channel` has no lanes: it shows what the lane's sender put in the channel
            // (`is_empty`), and swallows the wake-up (`try_recv`).
            let (wake, channel) = crate::inbox::inbox(4);
            let doorbell = Arc::new(doorbell);
            let (tx, rx) = lane(4, doorbell.clone(), wake, Default::default(), (0, 1));
            tx.send(message(0)).expect("the receiver is here");
            assert!(channel.is_empty(), "an awake receiver is not woken (asymmetric: {asymmetric})");
            assert!(doorbell.raise());
            tx.send(message(1)).expect("the receiver is here");
            tx.send(message(2)).expect("the receiver is here");
            assert!(!channel.is_empty(), "a raised doorbell is answered (asymmetric: {asymmetric})");
            assert_eq!(channel.try_recv(), None, "the wake-up itself is not an envelope to handle");
            assert!(channel.is_empty(), "one wake-up per raise (asymmetric: {asymmetric})");
            assert_eq!(
                (rx.try_recv(), rx.try_recv(), rx.try_recv(), rx.try_recv()),
                (Some(message(0)), Some(message(1)), Some(message(2)), None)
            );
        }
    }

    #[test]
    fn a_sender_waiting_for_room_names_its_receiver_until_it_gets_room() {
        let FullLane { tx, rx, waits, abort: _abort, _channel } = full_lane((2, 0), 3);
        assert_eq!((waits.count(), waits.waiting_on(2)), (0, None), "no send waited yet");
        let sender = std::thread::spawn(move || tx.send(message(2)).map(|()| tx));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while waits.waiting_on(2).is_none() {
            assert!(std::time::Instant::now() < deadline, "the third send never said it waits");
            std::thread::yield_now();
        }
        assert_eq!(waits.waiting_on(2), Some(WaitsOn::Stream(0)), "stream 2 waits on stream 0's lane");
        assert_eq!(waits.waiting_on(0), None);
        assert_eq!(rx.try_recv(), Some(message(0)));
        let tx = sender.join().expect("the sender does not panic").expect("the receiver is here");
        assert_eq!((waits.count(), waits.waiting_on(2)), (1, None), "one send waited, and no longer does");
        assert_eq!((rx.try_recv(), rx.try_recv(), rx.try_recv()), (Some(message(1)), Some(message(2)), None));
        drop(tx);
    }

    #[test]
    fn a_sender_waiting_for_room_stops_when_the_job_aborts() {
        // The receiver stays (a thread stuck itself, not reading): only the abort ends
        // the wait, and it ends the waits that start after it too.
        let FullLane { tx, rx, waits, abort, _channel } = full_lane((0, 1), 2);
        let (done, ended) = std::sync::mpsc::channel();
        std::thread::spawn(move || done.send((tx.send(message(2)), tx)));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while waits.waiting_on(0).is_none() {
            assert!(std::time::Instant::now() < deadline, "the third send never said it waits");
            std::thread::yield_now();
        }
        drop(abort);
        // A wait the abort does not end fails here (and ends when `rx` goes, unwinding).
        let (sent, tx) = ended.recv_timeout(std::time::Duration::from_secs(30)).expect("the abort ends the wait");
        assert_eq!(sent, Err(Disconnected), "the abort ends the wait");
        assert_eq!(tx.send(message(3)), Err(Disconnected), "and a wait that starts after it");
        assert_eq!((waits.count(), waits.waiting_on(0)), (2, None), "both sends found the lane full, and stopped");
        assert_eq!((rx.try_recv(), rx.try_recv(), rx.try_recv()), (Some(message(0)), Some(message(1)), None));
    }

    #[test]
    fn a_sender_waiting_for_room_stops_when_the_receiver_goes() {
        let FullLane { tx, rx, waits, abort: _abort, _channel } = full_lane((0, 1), 2);
        assert_eq!(waits.count(), 0, "no send waited yet");
        drop(rx);
        assert_eq!(tx.send(message(2)), Err(Disconnected));
        assert_eq!((waits.count(), waits.waiting_on(0)), (1, None), "the third send found the lane full, and stopped");
    }
}
