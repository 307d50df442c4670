//! How a job exchanges pieces with the program that embeds it: feeders push into fed
//! sources, fetchers take what sinks deliver. Both sides recycle a fixed set of buffers,
//! so steady state allocates nothing, and both give backpressure: a push waits for a free
//! buffer, and a sink waits (without blocking its thread) until the user fetches.

use crate::device::staging::check_len;
use crate::inbox::{Envelope, InboxSender};
use crate::job::{thread_token, FetchRecord, UserWaits};
use crate::kernel::{Kernel, KernelError, KernelIo};
use crate::stream::JobShared;
use crate::sync::{lock, Arc};
use crate::RuntimeError;
use crossbeam_channel::{Receiver, Sender};
use regflow_actors::{ActorId, Body, Cmd, Message};
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

/// Kernel of a counting source: writes the piece number (u64, little-endian) at the start
/// of every output of at least 8 bytes, so consumers can check what they got.
#[derive(Debug)]
pub(crate) struct CountSourceKernel;

impl Kernel for CountSourceKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let tag = io.piece().to_le_bytes();
        for o in 0..io.output_count() {
            if let Some(head) = io.output(o).get_mut(..8) {
                head.copy_from_slice(&tag);
            }
        }
        Ok(())
    }
}

/// Kernel of a fed source: copies the oldest pushed buffer into every output (on a `cuda`
/// device into page-locked buffers its stream then copies in, `device::staging`).
#[derive(Debug)]
pub(crate) struct FedSourceKernel {
    pub(crate) data: Receiver<Vec<u8>>,
    pub(crate) pool: Sender<Vec<u8>>,
}

impl Kernel for FedSourceKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let buffer = self
            .data
            .try_recv()
            .map_err(|_| KernelError("fed source fired without a pushed piece (broken invariant)".into()))?;
        for o in 0..io.output_count() {
            check_len(buffer.len(), io.output_len(o)).map_err(|e| KernelError(format!("fed source: {}", e.0)))?;
            io.output(o).copy_from_slice(&buffer);
        }
        // The feeder may be gone; then nobody needs the buffer back.
        let _ = self.pool.send(buffer);
        Ok(())
    }
}

/// How long a push may wait for a free buffer.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Patience {
    /// Not at all.
    None,
    /// Until this instant.
    Until(Instant),
    /// As long as the job runs.
    Forever,
}

/// Pushes pieces into a fed source. Closing it (or dropping it) ends the source's data.
///
/// The source holds a fixed number of pieces (its register count plus one); past that,
/// [`Feeder::push`] waits, [`Feeder::try_push`] returns `Ok(false)` at once and
/// [`Feeder::push_timeout`] after its timeout, like `queue.put`, `put_nowait` and
/// `put(timeout=..)` of a bounded queue, except that "full" is an answer (`Ok(false)`), not
/// an error: errors are for pushes that can never succeed. A push that waits is a node of
/// the watchdog's wait-for graph: if the job can only go on once the program reads a
/// fetcher, the watchdog aborts the job and the push returns that error.
#[derive(Debug)]
pub struct Feeder {
    pub(crate) name: String,
    pub(crate) source: ActorId,
    pub(crate) bytes: u64,
    pub(crate) data: Sender<Vec<u8>>,
    pub(crate) pool: Receiver<Vec<u8>>,
    pub(crate) inbox: InboxSender,
    pub(crate) closed: bool,
    /// A free buffer taken from the pool ahead of its piece (a typed push takes one for
    /// every part before it sends any).
    pub(crate) reserved: Option<Vec<u8>>,
    pub(crate) waits: std::sync::Arc<UserWaits>,
    /// This feed's record in `waits`.
    pub(crate) record: usize,
    pub(crate) shared: Arc<JobShared>,
}

impl Feeder {
    /// Pushes one piece. Waits while the source already holds as many pieces as it has
    /// buffers (its register count plus one): that is the job's backpressure. If the job
    /// stops meanwhile (an error, or the watchdog finding that the job waits on the
    /// program's fetches while this push waits on the job), returns why.
    pub fn push(&mut self, piece: &[u8]) -> Result<(), RuntimeError> {
        self.push_within(piece, Patience::Forever).map(|_| ())
    }

    /// Pushes one piece if the source has room now: `Ok(true)` when pushed, `Ok(false)`
    /// (nothing pushed) when the source is full. Errors as [`Feeder::push`] does.
    pub fn try_push(&mut self, piece: &[u8]) -> Result<bool, RuntimeError> {
        self.push_within(piece, Patience::None)
    }

    /// Pushes one piece, waiting at most `timeout` for room: `Ok(true)` when pushed,
    /// `Ok(false)` (nothing pushed) when the source stayed full. Errors as [`Feeder::push`].
    pub fn push_timeout(&mut self, piece: &[u8], timeout: Duration) -> Result<bool, RuntimeError> {
        self.push_within(piece, Patience::Until(Instant::now() + timeout))
    }

    fn push_within(&mut self, piece: &[u8], patience: Patience) -> Result<bool, RuntimeError> {
        self.check(piece.len())?;
        if !self.reserve(patience)? {
            return Ok(false);
        }
        self.send_reserved(piece.len(), |buffer| buffer.extend_from_slice(piece))?;
        Ok(true)
    }

    /// Refuses a piece of `bytes` bytes this feed cannot take (closed, wrong size).
    pub(crate) fn check(&self, bytes: usize) -> Result<(), RuntimeError> {
        if self.closed {
            return Err(RuntimeError::FeedClosed { source_name: self.name.clone() });
        }
        if bytes as u64 != self.bytes {
            return Err(RuntimeError::FeedSize { source_name: self.name.clone(), got: bytes, expected: self.bytes });
        }
        Ok(())
    }

    /// Takes a free buffer for the next piece, waiting as `patience` allows: `Ok(false)`
    /// when none came. While it waits, the push is in the user-side record.
    pub(crate) fn reserve(&mut self, patience: Patience) -> Result<bool, RuntimeError> {
        if self.reserved.is_some() {
            return Ok(true);
        }
        match self.pool.try_recv() {
            Ok(buffer) => {
                self.reserved = Some(buffer);
                return Ok(true);
            }
            Err(crossbeam_channel::TryRecvError::Disconnected) => return Err(self.stopped()),
            Err(crossbeam_channel::TryRecvError::Empty) if matches!(patience, Patience::None) => return Ok(false),
            Err(crossbeam_channel::TryRecvError::Empty) => {}
        }
        self.waits.push_blocked(self.record);
        // Waits for a buffer, the deadline or the job's abort, whichever comes first.
        let aborted = self.shared.abort_signal.receiver();
        let got = if self.shared.aborting.load(Ordering::Acquire) {
            Err(self.stopped())
        } else {
            match patience {
                Patience::Until(deadline) => crossbeam_channel::select! {
                    recv(self.pool) -> buffer => buffer.map(Some).map_err(|_| self.stopped()),
                    recv(aborted) -> _ => Err(self.stopped()),
                    default(deadline.saturating_duration_since(Instant::now())) => Ok(None),
                },
                _ => crossbeam_channel::select! {
                    recv(self.pool) -> buffer => buffer.map(Some).map_err(|_| self.stopped()),
                    recv(aborted) -> _ => Err(self.stopped()),
                },
            }
        };
        self.waits.push_unblocked(self.record);
        let got = got?;
        let pushed = got.is_some();
        self.reserved = got;
        Ok(pushed)
    }

    /// Sends the piece of `bytes` bytes that `write` appends to the reserved buffer
    /// (checked and reserved before), so a caller that produces the bytes (a typed feed
    /// cutting its part) needs no buffer of its own.
    pub(crate) fn send_reserved(&mut self, bytes: usize, write: impl FnOnce(&mut Vec<u8>)) -> Result<(), RuntimeError> {
        let Some(mut buffer) = self.reserved.take() else {
            panic!("feeder '{}': a piece sent without a reserved buffer (broken invariant)", self.name);
        };
        buffer.clear();
        write(&mut buffer);
        assert_eq!(
            buffer.len(),
            bytes,
            "feeder '{}': the piece written is not the size announced (broken invariant)",
            self.name
        );
        self.data.send(buffer).map_err(|_| self.stopped())?;
        self.waits.feeds[self.record].pushed.fetch_add(1, Ordering::SeqCst);
        self.command(Cmd::Feed)
    }

    /// Ends the source's data: it sends end-of-data once its pushed pieces are through.
    pub fn close(&mut self) -> Result<(), RuntimeError> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        self.waits.feeds[self.record].closed.store(true, Ordering::SeqCst);
        self.command(Cmd::CloseFeed)
    }

    fn command(&self, cmd: Cmd) -> Result<(), RuntimeError> {
        let msg = Message { dst: self.source, src: self.source, body: Body::Cmd(cmd) };
        self.inbox.send(Envelope::Actor(msg)).map_err(|_| self.stopped())
    }

    /// The error of a push the job can no longer take: the job's own error when it has one.
    fn stopped(&self) -> RuntimeError {
        let reason = lock(&self.shared.error).as_ref().map(ToString::to_string);
        RuntimeError::FeedStopped {
            feed: self.waits.feeds[self.record].label(),
            reason: reason.unwrap_or_else(|| "the job has stopped".into()),
        }
    }
}

impl Drop for Feeder {
    fn drop(&mut self) {
        let _ = self.close();
    }
}

/// One piece a sink delivered: its number and the bytes of each sink input.
#[derive(Debug)]
pub(crate) struct Delivery {
    piece: u64,
    parts: Vec<Vec<u8>>,
}

/// Kernel of a sink that delivers to a [`Fetcher`]: copies its inputs into a recycled buffer.
#[derive(Debug)]
pub(crate) struct ChannelSinkKernel {
    pub(crate) deliveries: Sender<Delivery>,
    /// The sink's own end of its deliveries, to take back what a dropped fetcher left.
    /// Holding it keeps the channel connected: whether the fetcher is gone is its record's
    /// `dropped`, not a failed send.
    pub(crate) undelivered: Receiver<Delivery>,
    pub(crate) pool: Receiver<Vec<Vec<u8>>>,
    /// Where buffers go back when the fetcher is gone.
    pub(crate) give_back: Sender<Vec<Vec<u8>>>,
    /// The sink's own inbox, to return the credit when the fetcher is gone.
    pub(crate) inbox: InboxSender,
    pub(crate) sink: ActorId,
    pub(crate) waits: std::sync::Arc<UserWaits>,
    /// This sink's record in `waits`.
    pub(crate) record: usize,
}

impl ChannelSinkKernel {
    /// Gives a piece nobody will fetch back: its buffer to the pool, its credit to the sink.
    fn recycle(&self, parts: Vec<Vec<u8>>) {
        let _ = self.give_back.send(parts);
        let msg = Message { dst: self.sink, src: self.sink, body: Body::Cmd(Cmd::Fetched) };
        let _ = self.inbox.send(Envelope::Actor(msg));
    }
}

impl Kernel for ChannelSinkKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let mut parts = self
            .pool
            .try_recv()
            .map_err(|_| KernelError("sink fired without a free fetch buffer (broken invariant)".into()))?;
        for (i, part) in parts.iter_mut().enumerate() {
            part.clear();
            part.extend_from_slice(io.input(i));
        }
        let record = &self.waits.fetches[self.record];
        if record.dropped.load(Ordering::SeqCst) {
            // Nobody wants the pieces: recycle at once, so the sink keeps draining its
            // inputs instead of stalling the job.
            self.recycle(parts);
            return Ok(());
        }
        record.queued.fetch_add(1, Ordering::SeqCst);
        if let Err(crossbeam_channel::SendError(undelivered)) =
            self.deliveries.send(Delivery { piece: io.piece(), parts })
        {
            record.queued.fetch_sub(1, Ordering::SeqCst);
            self.recycle(undelivered.parts);
            return Ok(());
        }
        // The race a dropped fetcher used to lose (pieces sent between its last look at the
        // channel and its end were lost with their credits, and the sink stalled at zero
        // credits): the fetcher sets `dropped` then drains; we send then look at `dropped`.
        // With a SeqCst fence on each side (Dekker), at least one of us sees the other's
        // write, so every piece is drained by one of us; `try_recv` hands each to one taker.
        fence(Ordering::SeqCst);
        if record.dropped.load(Ordering::SeqCst) {
            while let Ok(delivery) = self.undelivered.try_recv() {
                record.queued.fetch_sub(1, Ordering::SeqCst);
                self.recycle(delivery.parts);
            }
        }
        Ok(())
    }
}

impl Drop for ChannelSinkKernel {
    fn drop(&mut self) {
        self.waits.fetches[self.record].sink_gone.store(true, Ordering::SeqCst);
    }
}

/// Kernel of a sink that hands each piece to a callback on its stream thread (no copy).
pub(crate) struct CallbackSinkKernel(pub(crate) Box<dyn FnMut(&KernelIo<'_>) + Send>);

impl Kernel for CallbackSinkKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        (self.0)(io);
        Ok(())
    }
}

/// Takes the pieces a sink delivers, in piece order.
///
/// Dropping it gives every piece still queued back to the sink (buffers and credits), and
/// the sink drops what it delivers from then on: a dropped fetcher never stalls the job.
#[derive(Debug)]
pub struct Fetcher {
    pub(crate) sink: ActorId,
    pub(crate) deliveries: Receiver<Delivery>,
    pub(crate) pool: Sender<Vec<Vec<u8>>>,
    pub(crate) inbox: InboxSender,
    pub(crate) waits: std::sync::Arc<UserWaits>,
    /// This sink's record in `waits`.
    pub(crate) record: usize,
}

impl Fetcher {
    /// The next piece; `None` once the sink has delivered its last piece (or the job stopped:
    /// [`crate::Job::wait`] says which).
    pub fn recv(&self) -> Option<Fetched<'_>> {
        let record = self.reading();
        let delivery = self.deliveries.recv().ok();
        record.readers.fetch_sub(1, Ordering::SeqCst);
        delivery.map(|d| self.wrap(d))
    }

    /// Like [`Fetcher::recv`], giving up after `timeout` with `Err(())`.
    #[allow(clippy::result_unit_err)]
    pub fn recv_timeout(&self, timeout: Duration) -> Result<Option<Fetched<'_>>, ()> {
        let record = self.reading();
        let delivery = self.deliveries.recv_timeout(timeout);
        record.readers.fetch_sub(1, Ordering::SeqCst);
        match delivery {
            Ok(d) => Ok(Some(self.wrap(d))),
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => Ok(None),
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => Err(()),
        }
    }

    /// Records a thread entering `recv`: it reads this fetcher.
    fn reading(&self) -> &FetchRecord {
        let record = &self.waits.fetches[self.record];
        record.readers.fetch_add(1, Ordering::SeqCst);
        record.reader.store(thread_token(), Ordering::SeqCst);
        record
    }

    fn wrap(&self, delivery: Delivery) -> Fetched<'_> {
        let record = &self.waits.fetches[self.record];
        record.held.fetch_add(1, Ordering::SeqCst);
        record.queued.fetch_sub(1, Ordering::SeqCst);
        record.received.fetch_add(1, Ordering::SeqCst);
        Fetched { fetcher: self, piece: delivery.piece, parts: Some(delivery.parts) }
    }

    /// Gives a piece back: its buffer to the sink's pool, its credit to the sink.
    fn give_back(&self, parts: Vec<Vec<u8>>) {
        let _ = self.pool.send(parts);
        let msg = Message { dst: self.sink, src: self.sink, body: Body::Cmd(Cmd::Fetched) };
        let _ = self.inbox.send(Envelope::Actor(msg));
    }
}

impl Drop for Fetcher {
    fn drop(&mut self) {
        // See `ChannelSinkKernel::run` for why the fence makes this drain complete.
        let record = &self.waits.fetches[self.record];
        record.dropped.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        while let Ok(delivery) = self.deliveries.try_recv() {
            record.queued.fetch_sub(1, Ordering::SeqCst);
            self.give_back(delivery.parts);
        }
    }
}

/// A fetched piece. Dropping it gives its buffer back and lets the sink deliver one more.
#[derive(Debug)]
pub struct Fetched<'f> {
    fetcher: &'f Fetcher,
    piece: u64,
    parts: Option<Vec<Vec<u8>>>,
}

impl Fetched<'_> {
    /// Piece number.
    pub fn piece(&self) -> u64 {
        self.piece
    }

    /// Bytes of the sink's input `i`, or `None` if it has fewer inputs.
    pub fn part(&self, i: usize) -> Option<&[u8]> {
        self.parts.as_ref()?.get(i).map(Vec::as_slice)
    }

    /// Bytes of the sink's first input.
    pub fn bytes(&self) -> &[u8] {
        self.part(0).unwrap_or(&[])
    }
}

impl Drop for Fetched<'_> {
    fn drop(&mut self) {
        if let Some(parts) = self.parts.take() {
            self.fetcher.waits.fetches[self.fetcher.record].held.fetch_sub(1, Ordering::SeqCst);
            self.fetcher.give_back(parts);
        }
    }
}
