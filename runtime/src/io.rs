//! How a job exchanges pieces with the program that embeds it: feeders push into fed
//! sources, fetchers take what sinks deliver. Both sides recycle a fixed set of buffers,
//! so steady state allocates nothing, and both give backpressure: a push waits for a free
//! buffer, and a sink waits (without blocking its thread) until the user fetches.

use crate::inbox::{Envelope, InboxSender};
use crate::kernel::{Kernel, KernelError, KernelIo};
use crate::RuntimeError;
use crossbeam_channel::{Receiver, Sender};
use regflow_actors::{ActorId, Body, Cmd, Message};
use std::time::Duration;

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

/// Kernel of a fed source: copies the oldest pushed buffer into every output.
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
            io.output(o).copy_from_slice(&buffer);
        }
        // The feeder may be gone; then nobody needs the buffer back.
        let _ = self.pool.send(buffer);
        Ok(())
    }
}

/// Pushes pieces into a fed source. Closing it (or dropping it) ends the source's data.
#[derive(Debug)]
pub struct Feeder {
    pub(crate) name: String,
    pub(crate) source: ActorId,
    pub(crate) bytes: u64,
    pub(crate) data: Sender<Vec<u8>>,
    pub(crate) pool: Receiver<Vec<u8>>,
    pub(crate) inbox: InboxSender,
    pub(crate) closed: bool,
}

impl Feeder {
    /// Pushes one piece. Waits while the source already holds as many pieces as it has
    /// buffers (its register count plus one): that is the job's backpressure.
    pub fn push(&mut self, piece: &[u8]) -> Result<(), RuntimeError> {
        self.push_with(piece.len(), |buffer| buffer.extend_from_slice(piece))
    }

    /// Pushes one piece of `bytes` bytes that `write` appends to an empty pooled buffer,
    /// so a caller that produces the bytes (a typed feed cutting its part) needs no buffer
    /// of its own. Checks and waits as [`Feeder::push`] does.
    pub(crate) fn push_with(&mut self, bytes: usize, write: impl FnOnce(&mut Vec<u8>)) -> Result<(), RuntimeError> {
        if self.closed {
            return Err(RuntimeError::FeedClosed { source_name: self.name.clone() });
        }
        if bytes as u64 != self.bytes {
            return Err(RuntimeError::FeedSize { source_name: self.name.clone(), got: bytes, expected: self.bytes });
        }
        let mut buffer = self.pool.recv().map_err(|_| RuntimeError::Stopped)?;
        buffer.clear();
        write(&mut buffer);
        assert_eq!(
            buffer.len(),
            bytes,
            "feeder '{}': the piece written is not the size announced (broken invariant)",
            self.name
        );
        self.data.send(buffer).map_err(|_| RuntimeError::Stopped)?;
        self.command(Cmd::Feed)
    }

    /// Ends the source's data: it sends end-of-data once its pushed pieces are through.
    pub fn close(&mut self) -> Result<(), RuntimeError> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        self.command(Cmd::CloseFeed)
    }

    fn command(&self, cmd: Cmd) -> Result<(), RuntimeError> {
        let msg = Message { dst: self.source, src: self.source, body: Body::Cmd(cmd) };
        self.inbox.send(Envelope::Actor(msg)).map_err(|_| RuntimeError::Stopped)
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
    pub(crate) pool: Receiver<Vec<Vec<u8>>>,
    /// Where the buffer goes back if the fetcher is gone.
    pub(crate) give_back: Sender<Vec<Vec<u8>>>,
    /// The sink's own inbox, to return the credit when the fetcher is gone.
    pub(crate) inbox: InboxSender,
    pub(crate) sink: ActorId,
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
        if let Err(crossbeam_channel::SendError(undelivered)) =
            self.deliveries.send(Delivery { piece: io.piece(), parts })
        {
            // The fetcher is gone: nobody wants the pieces. Recycle the buffer and the
            // credit, so the sink keeps draining its inputs instead of stalling the job.
            let _ = self.give_back.send(undelivered.parts);
            let msg = Message { dst: self.sink, src: self.sink, body: Body::Cmd(Cmd::Fetched) };
            let _ = self.inbox.send(Envelope::Actor(msg));
        }
        Ok(())
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
#[derive(Debug)]
pub struct Fetcher {
    pub(crate) sink: ActorId,
    pub(crate) deliveries: Receiver<Delivery>,
    pub(crate) pool: Sender<Vec<Vec<u8>>>,
    pub(crate) inbox: InboxSender,
}

impl Fetcher {
    /// The next piece; `None` once the sink has delivered its last piece (or the job stopped:
    /// [`crate::Job::wait`] says which).
    pub fn recv(&self) -> Option<Fetched<'_>> {
        self.deliveries.recv().ok().map(|d| self.wrap(d))
    }

    /// Like [`Fetcher::recv`], giving up after `timeout` with `Err(())`.
    #[allow(clippy::result_unit_err)]
    pub fn recv_timeout(&self, timeout: Duration) -> Result<Option<Fetched<'_>>, ()> {
        match self.deliveries.recv_timeout(timeout) {
            Ok(d) => Ok(Some(self.wrap(d))),
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => Ok(None),
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => Err(()),
        }
    }

    fn wrap(&self, delivery: Delivery) -> Fetched<'_> {
        Fetched { fetcher: self, piece: delivery.piece, parts: Some(delivery.parts) }
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
            let _ = self.fetcher.pool.send(parts);
            let sink = self.fetcher.sink;
            let msg = Message { dst: sink, src: sink, body: Body::Cmd(Cmd::Fetched) };
            let _ = self.fetcher.inbox.send(Envelope::Actor(msg));
        }
    }
}
