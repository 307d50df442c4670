//! The writer of one connection: frames from the stream threads' channel onto the socket,
//! a `Ready`'s bytes straight from the slot that holds them.

use super::{Link, Outgoing, WireCheck};
use crate::RuntimeError;
use regflow_actors::{Body, Message};
use regflow_net::frame::{FrameWriter, Header, WireBody, WireMessage};
use std::io::{IoSlice, Write};
use std::sync::atomic::Ordering;

/// How long a writer with nothing to send waits before it sends a heartbeat, at most (a
/// quarter of the silence the peer allows, if that is shorter).
pub(super) const HEARTBEAT_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// How long a writer whose send failed leaves the reader to report the cause first.
const READER_FIRST: std::time::Duration = std::time::Duration::from_secs(1);

/// Buffer of small frames between flushes.
const WRITE_BUFFER: usize = 64 * 1024;
/// A payload of this size or more is not copied into the buffer: it goes out with what the
/// buffer holds (its header included) in one vectored write.
const DIRECT_PAYLOAD: usize = 16 * 1024;

/// Coalesces small writes (headers, small payloads) in one buffer allocated up front, and
/// writes a large payload straight from the caller's memory, together with the buffered
/// bytes before it, in one `writev`: a large `Ready` costs one system call, not two, and
/// its bytes are never copied in user space.
pub(super) struct Coalescer {
    inner: Box<dyn Write + Send>,
    pending: Vec<u8>,
}

impl Coalescer {
    pub(super) fn new(inner: Box<dyn Write + Send>) -> Self {
        Self { inner, pending: Vec::with_capacity(WRITE_BUFFER) }
    }

    /// Writes all of `pending` and then all of `tail`, vectored, however the OS splits them.
    fn write_both(&mut self, mut tail: &[u8]) -> std::io::Result<()> {
        let mut head = 0usize;
        while head < self.pending.len() || !tail.is_empty() {
            let slices = [IoSlice::new(&self.pending[head..]), IoSlice::new(tail)];
            let n = match self.inner.write_vectored(&slices) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            let from_head = n.min(self.pending.len() - head);
            head += from_head;
            tail = &tail[n - from_head..];
        }
        self.pending.clear();
        Ok(())
    }
}

impl Write for Coalescer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if buf.len() < DIRECT_PAYLOAD && self.pending.len() + buf.len() <= WRITE_BUFFER {
            self.pending.extend_from_slice(buf);
        } else if buf.len() < DIRECT_PAYLOAD {
            self.write_both(&[])?;
            self.pending.extend_from_slice(buf);
        } else {
            self.write_both(buf)?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.write_both(&[])?;
        self.inner.flush()
    }
}

pub(super) struct Writer {
    link: Link,
    /// Heartbeat interval.
    beat: std::time::Duration,
    out: FrameWriter<Coalescer>,
    items: crossbeam_channel::Receiver<Outgoing>,
    /// Per slot of each register crossing to `node`: the last piece whose bytes went out,
    /// so a second consumer there of the same piece gets the message without the bytes.
    first_slot: Vec<u32>,
    sent: Vec<u64>,
}

impl Writer {
    pub(super) fn new(
        link: Link,
        write: Box<dyn Write + Send>,
        items: crossbeam_channel::Receiver<Outgoing>,
        check: &WireCheck,
    ) -> Self {
        let node = link.node;
        // Only registers with a consumer on `node` get entries: allocated once, here.
        let plan = &check.plan;
        let mut first_slot = vec![u32::MAX; plan.regst_descs.len()];
        let mut slots = 0u32;
        for (d, desc) in plan.regst_descs.iter().enumerate() {
            if desc.consumers.iter().any(|c| check.node_of[c.index()] == node) {
                first_slot[d] = slots;
                slots += desc.register_num;
            }
        }
        Self {
            beat: HEARTBEAT_EVERY.min(link.silence / 4),
            link,
            out: FrameWriter::new(Coalescer::new(write)),
            items,
            first_slot,
            sent: vec![u64::MAX; slots as usize],
        }
    }

    pub(super) fn run(mut self) {
        // A first beat at once: the peer's reader knows this node's job is up.
        if self.heartbeat().is_err() {
            return;
        }
        loop {
            let item = match self.items.recv_timeout(self.beat) {
                Ok(item) => item,
                // Nothing to send for a while: say this node is alive.
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => match self.heartbeat() {
                    Ok(()) => continue,
                    Err(()) => return,
                },
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return,
            };
            let bye = matches!(item, Outgoing::Bye);
            let result = self.write(item).and_then(|()| {
                // Flush once the queue is empty: frames written together go out together.
                if bye || self.items.is_empty() {
                    self.out.flush().map_err(|e| e.to_string())
                } else {
                    Ok(())
                }
            });
            if let Err(message) = result {
                self.lost(message);
                return;
            }
            if bye {
                return;
            }
        }
    }

    /// Writes one frame, and records it.
    fn send(&mut self, header: &Header, payload: &[u8]) -> Result<(), regflow_net::frame::FrameError> {
        self.link.recorder.record(true, header);
        self.out.write(header, payload)
    }

    /// Writes and flushes a heartbeat; a failure aborts the job (as any failed write).
    fn heartbeat(&mut self) -> Result<(), ()> {
        let fires = self.link.shared.probes.iter().map(|p| p.fires.load(crate::sync::Ordering::Relaxed)).sum();
        let written = self.send(&Header::Heartbeat { fires }, &[]).and_then(|()| self.out.flush());
        written.map_err(|e| self.lost(e.to_string()))
    }

    /// Aborts the job with the connection's failure, unless the job is already over.
    ///
    /// A send fails when the peer closed the connection; its reader then sees why (the
    /// peer's abort, or the end of the stream with the flight recorder and the last step),
    /// which says more than a broken pipe. So the reader gets [`READER_FIRST`] to report
    /// before the writer does.
    fn lost(&self, message: String) {
        let waited = std::time::Instant::now();
        while !self.link.reader_stopped.load(Ordering::Acquire)
            && !self.link.shared.aborting.load(crate::sync::Ordering::Acquire)
            && waited.elapsed() < READER_FIRST
        {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        if !self.link.done.load(Ordering::Acquire) {
            let host = self.link.host();
            self.link.shared.abort(
                RuntimeError::PeerLost { node: self.link.node, host, message: format!("sending failed: {message}") },
                &self.link.router,
            );
        }
    }

    fn write(&mut self, item: Outgoing) -> Result<(), String> {
        match item {
            Outgoing::Actor(msg) => self.write_actor(msg),
            Outgoing::Collective { group, round, rank, bytes } => {
                // SAFETY: the member's landing buffer holds these bytes unchanged until the
                // peers have them (collective::net explains why).
                let payload = unsafe { std::slice::from_raw_parts(bytes.ptr, bytes.len) };
                let header = Header::Collective { group, round, rank, len: bytes.len as u64 };
                self.send(&header, payload).map_err(|e| e.to_string())
            }
            Outgoing::Ring { group, round, step, bytes } => {
                // SAFETY: the member's staging buffer of this step holds the chunk unchanged
                // until the successor has it (collective::net explains why).
                let payload = unsafe { std::slice::from_raw_parts(bytes.ptr, bytes.len) };
                let header = Header::Ring { group, round, step, len: bytes.len as u64 };
                self.send(&header, payload).map_err(|e| e.to_string())
            }
            Outgoing::Abort(reason) => self.send(&Header::Abort { reason }, &[]).map_err(|e| e.to_string()),
            Outgoing::Bye => self.send(&Header::Bye, &[]).map_err(|e| e.to_string()),
            Outgoing::SnapshotRequest => self.send(&Header::SnapshotRequest, &[]).map_err(|e| e.to_string()),
            Outgoing::Snapshot(json) => {
                self.send(&Header::Snapshot { len: json.len() as u64 }, &json).map_err(|e| e.to_string())
            }
        }
    }

    fn write_actor(&mut self, msg: Message) -> Result<(), String> {
        let (dst, src) = (msg.dst.bits(), msg.src.bits());
        let (body, payload): (WireBody, &[u8]) = match msg.body {
            Body::Ready { regst, piece, data } => {
                let first = self.first_slot.get(regst.desc.index()).copied().unwrap_or(u32::MAX);
                let entry = (first != u32::MAX).then(|| (first + regst.slot) as usize);
                let already = entry.and_then(|e| self.sent.get(e)).is_some_and(|&p| p == piece);
                let payload: &[u8] = if already {
                    &[]
                } else {
                    let view = self.link.arenas.try_view(data).ok_or_else(|| {
                        format!("register {} slot {} has no memory on this node to send from", data.desc.0, data.slot)
                    })?;
                    if let Some(e) = entry.filter(|&e| e < self.sent.len()) {
                        self.sent[e] = piece;
                    }
                    // SAFETY: the slot holds piece `piece` until every consumer acked it,
                    // and the consumer this message goes to acks only after receiving it.
                    unsafe { view.as_slice() }
                };
                let body = WireBody::Ready { desc: regst.desc.0, slot: regst.slot, piece, len: payload.len() as u64 };
                (body, payload)
            }
            Body::Ack { regst } => (WireBody::Ack { desc: regst.desc.0, slot: regst.slot }, &[]),
            Body::Eord { desc } => (WireBody::Eord { desc: desc.0 }, &[]),
            Body::ActDone | Body::Cmd(_) => {
                return Err(format!("a {:?} message for {} cannot cross nodes", msg.body, msg.dst));
            }
        };
        self.send(&Header::Actor(WireMessage { dst, src, body }), payload).map_err(|e| e.to_string())
    }
}
