//! Bounded frames: a 4-byte little-endian header length, a postcard [`Header`], then the
//! raw payload bytes the header announces (a register slot's tensor, a collective input).
//!
//! Everything a peer sends is checked before it is trusted: a header longer than
//! [`MAX_HEADER_BYTES`] or one postcard cannot decode is an error naming the peer and the
//! values, never a panic and never an allocation the peer chose; payloads are read by the
//! caller straight into the memory they belong in ([`FrameReader::read_payload`]), after
//! the caller has checked their length against what the plan says they must be. Writing
//! encodes the header into a buffer kept per connection and the payload straight from the
//! sender's memory, so the steady state allocates nothing per frame.

use serde::{Deserialize, Serialize};
use std::io::{self, Read, Write};

/// Longest header a peer may send (bytes after the length prefix). Abort reasons are cut
/// to fit ([`MAX_REASON_BYTES`]); every other header is far smaller.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;

/// Longest abort reason sent on the wire; longer ones are cut at a character boundary.
pub const MAX_REASON_BYTES: usize = 16 * 1024;

/// Version of the wire protocol; both sides of a connection must speak the same one.
pub const PROTOCOL_VERSION: u32 = 1;

/// What one frame says. The payload, when [`Header::payload_len`] is not 0, follows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Header {
    /// First frame of each side of a connection.
    Hello(Hello),
    /// The answer to the peer's [`Hello::nonce`]: HMAC-SHA256 over it with the shared secret
    /// (all zeros when neither side has one).
    Proof {
        /// The MAC.
        mac: [u8; 32],
    },
    /// The peer refused the connection and says why.
    Refused {
        /// A sentence.
        reason: String,
    },
    /// An actor message crossing nodes.
    Actor(WireMessage),
    /// One member's input of one collective round.
    Collective {
        /// Index of the group in the plan's sorted group names.
        group: u32,
        /// Round: the member's firing count.
        round: u64,
        /// The member's rank in the group.
        rank: u32,
        /// Payload bytes that follow.
        len: u64,
    },
    /// One chunk of a ring all-reduce: step `step` of round `round` of group `group`, from
    /// the receiver's predecessor in the ring.
    Ring {
        /// Index of the group in the plan's sorted group names.
        group: u32,
        /// Round: the member's firing count.
        round: u64,
        /// Step of the round: reduce-scatter steps first, then all-gather steps.
        step: u32,
        /// Payload bytes that follow.
        len: u64,
    },
    /// The sender's job failed; the receiver's job must abort too.
    Abort {
        /// Why, as the failing node printed it.
        reason: String,
    },
    /// The sender's job is done: it sends nothing more on this connection.
    Bye,
    /// The sender's watchdog found its job stalled: the receiver answers with what its own
    /// actors wait on ([`Header::Snapshot`]), so the wait-for graph spans every node.
    SnapshotRequest,
    /// What the sender's actors wait on: `len` bytes of JSON follow (the runtime's format).
    Snapshot {
        /// Payload bytes that follow.
        len: u64,
    },
    /// The sender is alive (sent when it has had nothing else to send for a while).
    Heartbeat {
        /// Firings of the sender's actors so far: how far its part of the job has come.
        fires: u64,
    },
}

impl Header {
    /// Bytes of payload following this header.
    pub fn payload_len(&self) -> u64 {
        match self {
            Header::Actor(WireMessage { body: WireBody::Ready { len, .. }, .. })
            | Header::Collective { len, .. }
            | Header::Ring { len, .. }
            | Header::Snapshot { len } => *len,
            _ => 0,
        }
    }

    /// A short name of the frame's kind, for errors.
    pub fn kind(&self) -> &'static str {
        match self {
            Header::Hello(_) => "hello",
            Header::Proof { .. } => "proof",
            Header::Refused { .. } => "refused",
            Header::Actor(_) => "actor message",
            Header::Collective { .. } => "collective input",
            Header::Ring { .. } => "ring chunk",
            Header::Abort { .. } => "abort",
            Header::Bye => "bye",
            Header::Heartbeat { .. } => "heartbeat",
            Header::SnapshotRequest => "snapshot request",
            Header::Snapshot { .. } => "snapshot",
        }
    }
}

/// Who opens a connection and what it must agree on with its peer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// [`PROTOCOL_VERSION`] of the sender.
    pub protocol: u32,
    /// The sender's build (crate version and target); nodes of one job run one build.
    pub build: String,
    /// Fingerprint of the plan the sender runs (see `Plan::fingerprint`).
    pub plan: String,
    /// The sender's rank (node).
    pub rank: u32,
    /// The world size the sender was started with.
    pub world: u32,
    /// The sender's host name, for errors.
    pub host: String,
    /// A fresh random challenge: the receiver answers with [`Header::Proof`].
    pub nonce: [u8; 32],
}

/// An actor message on the wire: the runtime's `Message` as plain integers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireMessage {
    /// Recipient `ActorId`, raw.
    pub dst: u64,
    /// Sender `ActorId`, raw.
    pub src: u64,
    /// What it says.
    pub body: WireBody,
}

/// The message kinds that cross nodes (commands and completions stay on their node).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireBody {
    /// Slot `slot` of register `desc` holds piece `piece`; `len` bytes of it follow (0 when
    /// this node already got them for another consumer on the receiving node).
    Ready {
        /// Register descriptor index.
        desc: u32,
        /// Slot.
        slot: u32,
        /// Piece number.
        piece: u64,
        /// Payload bytes that follow: the slot's size, or 0.
        len: u64,
    },
    /// The consumer is done with slot `slot` of `desc`.
    Ack {
        /// Register descriptor index.
        desc: u32,
        /// Slot.
        slot: u32,
    },
    /// No more pieces on `desc`.
    Eord {
        /// Register descriptor index.
        desc: u32,
    },
}

/// What went wrong reading or writing a frame.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The connection failed.
    #[error("the connection failed: {0}")]
    Io(#[from] io::Error),
    /// The connection closed in the middle of a frame.
    #[error("the connection closed in the middle of a frame ({what})")]
    Truncated {
        /// What was being read.
        what: &'static str,
    },
    /// A header length over the bound.
    #[error("a frame announced a {len}-byte header; headers are at most {MAX_HEADER_BYTES} bytes")]
    HeaderTooLarge {
        /// The announced length.
        len: u64,
    },
    /// A header that does not decode.
    #[error("a {len}-byte frame header does not decode: {reason}")]
    Malformed {
        /// Its length.
        len: usize,
        /// What postcard said.
        reason: String,
    },
    /// A header with bytes left over after it.
    #[error("a {len}-byte frame header has {extra} byte(s) after its end")]
    TrailingBytes {
        /// Its length.
        len: usize,
        /// Bytes left.
        extra: usize,
    },
    /// The peer stopped sending in the middle of a payload for longer than the reader's
    /// patience ([`FrameReader::read_payload_within`]).
    #[error("the peer stopped for {:.0} s in the middle of a {len}-byte payload", .after.as_secs_f64())]
    Stalled {
        /// How long no byte came.
        after: std::time::Duration,
        /// The payload's length.
        len: usize,
    },
    /// A header this side cannot encode in [`MAX_HEADER_BYTES`] (a local bug).
    #[error("a {kind} header does not fit in {MAX_HEADER_BYTES} bytes")]
    TooLargeToSend {
        /// The header's kind.
        kind: &'static str,
    },
}

/// Decodes one whole frame header from `bytes` (the length prefix, then the header). On
/// success returns the header and the bytes it took; the payload starts there.
///
/// Used by [`FrameReader`] and by the fuzz tests: any input gives a header or an error.
pub fn decode(bytes: &[u8]) -> Result<(Header, usize), FrameError> {
    let prefix: [u8; 4] =
        bytes.get(..4).and_then(|p| p.try_into().ok()).ok_or(FrameError::Truncated { what: "length" })?;
    let len = u32::from_le_bytes(prefix) as usize;
    if len > MAX_HEADER_BYTES {
        return Err(FrameError::HeaderTooLarge { len: len as u64 });
    }
    let body = bytes.get(4..4 + len).ok_or(FrameError::Truncated { what: "header" })?;
    Ok((decode_header(body)?, 4 + len))
}

/// Encodes `header` as one whole frame (the length prefix, then the header) into a new
/// buffer: for handshakes and tests, where a frame is rare. [`FrameWriter`] reuses its buffer.
pub fn encode(header: &Header) -> Result<Vec<u8>, FrameError> {
    let body = postcard::to_stdvec(header).map_err(|_| FrameError::TooLargeToSend { kind: header.kind() })?;
    if body.len() > MAX_HEADER_BYTES {
        return Err(FrameError::TooLargeToSend { kind: header.kind() });
    }
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&body);
    Ok(frame)
}

fn decode_header(body: &[u8]) -> Result<Header, FrameError> {
    let (header, rest) = postcard::take_from_bytes::<Header>(body)
        .map_err(|e| FrameError::Malformed { len: body.len(), reason: e.to_string() })?;
    if !rest.is_empty() {
        return Err(FrameError::TrailingBytes { len: body.len(), extra: rest.len() });
    }
    Ok(header)
}

/// Cuts `reason` to [`MAX_REASON_BYTES`] at a character boundary.
pub fn cut_reason(reason: &str) -> String {
    if reason.len() <= MAX_REASON_BYTES {
        return reason.to_string();
    }
    let mut end = MAX_REASON_BYTES - 3;
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &reason[..end])
}

/// Reads frames from one connection, with one header buffer allocated up front.
#[derive(Debug)]
pub struct FrameReader<R> {
    inner: R,
    buf: Vec<u8>,
}

impl<R: Read> FrameReader<R> {
    /// Reads frames from `inner` (buffer it: headers are read in small pieces).
    pub fn new(inner: R) -> Self {
        Self { inner, buf: Vec::with_capacity(256) }
    }

    /// The next header; `Ok(None)` when the peer closed the connection between frames.
    pub fn read_header(&mut self) -> Result<Option<Header>, FrameError> {
        let mut prefix = [0u8; 4];
        let mut got = 0;
        while got < 4 {
            match self.inner.read(&mut prefix[got..]) {
                Ok(0) if got == 0 => return Ok(None),
                Ok(0) => return Err(FrameError::Truncated { what: "length" }),
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        let len = u32::from_le_bytes(prefix) as usize;
        if len > MAX_HEADER_BYTES {
            return Err(FrameError::HeaderTooLarge { len: len as u64 });
        }
        // Grows to the largest header seen, at most MAX_HEADER_BYTES, then stays.
        self.buf.resize(len, 0);
        read_exact(&mut self.inner, &mut self.buf, "header")?;
        decode_header(&self.buf).map(Some)
    }

    /// Reads the payload of the last header straight into `into` (its length must be the
    /// header's [`Header::payload_len`]; the caller checked it against the plan).
    pub fn read_payload(&mut self, into: &mut [u8]) -> Result<(), FrameError> {
        read_exact(&mut self.inner, into, "payload")
    }

    /// Reads and drops `len` payload bytes.
    pub fn skip_payload(&mut self, len: u64) -> Result<(), FrameError> {
        let copied = io::copy(&mut (&mut self.inner).take(len), &mut io::sink())?;
        if copied < len {
            return Err(FrameError::Truncated { what: "payload" });
        }
        Ok(())
    }

    /// The reader inside.
    pub fn get_mut(&mut self) -> &mut R {
        &mut self.inner
    }
}

fn read_exact(r: &mut impl Read, into: &mut [u8], what: &'static str) -> Result<(), FrameError> {
    r.read_exact(into).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => FrameError::Truncated { what },
        _ => FrameError::Io(e),
    })
}

impl<R: Read> FrameReader<io::BufReader<R>> {
    /// Reads the payload of the last header into `into`: the bytes the buffer already
    /// holds, then the rest straight from the connection into place (no second copy).
    /// A read that times out (a socket read timeout, which lets the caller check on its
    /// peer between frames) is retried as long as some byte came within `patience`.
    pub fn read_payload_within(&mut self, into: &mut [u8], patience: std::time::Duration) -> Result<(), FrameError> {
        let buffered = self.inner.buffer();
        let mut at = buffered.len().min(into.len());
        into[..at].copy_from_slice(&buffered[..at]);
        io::BufRead::consume(&mut self.inner, at);
        let mut progress = std::time::Instant::now();
        while at < into.len() {
            match self.inner.get_mut().read(&mut into[at..]) {
                Ok(0) => return Err(FrameError::Truncated { what: "payload" }),
                Ok(n) => {
                    at += n;
                    progress = std::time::Instant::now();
                }
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                    if progress.elapsed() >= patience {
                        return Err(FrameError::Stalled { after: progress.elapsed(), len: into.len() });
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
}

/// Writes frames to one connection, encoding headers into one buffer kept for it.
#[derive(Debug)]
pub struct FrameWriter<W> {
    inner: W,
    buf: Vec<u8>,
}

impl<W: Write> FrameWriter<W> {
    /// Writes frames to `inner` (buffer it; [`FrameWriter::flush`] when a batch is done).
    pub fn new(inner: W) -> Self {
        Self { inner, buf: vec![0; 4 + MAX_HEADER_BYTES] }
    }

    /// Writes `header` and then `payload` (which must be `header.payload_len()` bytes).
    pub fn write(&mut self, header: &Header, payload: &[u8]) -> Result<(), FrameError> {
        debug_assert_eq!(payload.len() as u64, header.payload_len(), "payload length differs from the header's");
        let len = postcard::to_slice(header, &mut self.buf[4..])
            .map_err(|_| FrameError::TooLargeToSend { kind: header.kind() })?
            .len();
        self.buf[..4].copy_from_slice(&(len as u32).to_le_bytes());
        self.inner.write_all(&self.buf[..4 + len])?;
        if !payload.is_empty() {
            self.inner.write_all(payload)?;
        }
        Ok(())
    }

    /// Flushes what was written.
    pub fn flush(&mut self) -> Result<(), FrameError> {
        Ok(self.inner.flush()?)
    }

    /// The writer inside.
    pub fn get_mut(&mut self) -> &mut W {
        &mut self.inner
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(header: Header, payload: &[u8]) {
        let mut out = Vec::new();
        FrameWriter::new(&mut out).write(&header, payload).unwrap();
        let mut reader = FrameReader::new(out.as_slice());
        let got = reader.read_header().unwrap().unwrap();
        assert_eq!(got, header);
        let mut body = vec![0; got.payload_len() as usize];
        reader.read_payload(&mut body).unwrap();
        assert_eq!(body, payload);
        assert!(reader.read_header().unwrap().is_none());
    }

    #[test]
    fn frames_round_trip() {
        let ready = WireBody::Ready { desc: 3, slot: 1, piece: 7, len: 5 };
        roundtrip(Header::Actor(WireMessage { dst: 1 << 48, src: 2, body: ready }), b"hello");
        roundtrip(Header::Actor(WireMessage { dst: 1, src: 2, body: WireBody::Ack { desc: 3, slot: 0 } }), b"");
        roundtrip(Header::Collective { group: 0, round: 9, rank: 1, len: 3 }, b"abc");
        roundtrip(Header::Abort { reason: "node 1 failed".into() }, b"");
        roundtrip(Header::Bye, b"");
        roundtrip(Header::Heartbeat { fires: 12345 }, b"");
    }

    #[test]
    fn oversized_and_truncated_headers_are_errors() {
        let big = (MAX_HEADER_BYTES as u32 + 1).to_le_bytes();
        assert!(matches!(decode(&big), Err(FrameError::HeaderTooLarge { .. })));
        let mut reader = FrameReader::new(&big[..]);
        assert!(matches!(reader.read_header(), Err(FrameError::HeaderTooLarge { .. })));
        let mut reader = FrameReader::new(&[5u8, 0, 0, 0, 1][..]);
        assert!(matches!(reader.read_header(), Err(FrameError::Truncated { what: "header" })));
        let mut reader = FrameReader::new(&[5u8, 0][..]);
        assert!(matches!(reader.read_header(), Err(FrameError::Truncated { what: "length" })));
        assert!(matches!(decode(&[1, 0, 0, 0, 200]), Err(FrameError::Malformed { .. })));
    }

    #[test]
    fn encode_gives_what_decode_reads() {
        let header = Header::Refused { reason: "plan differs".into() };
        let frame = encode(&header).unwrap();
        assert_eq!(decode(&frame).unwrap(), (header, frame.len()));
        let too_long = Header::Abort { reason: "x".repeat(MAX_HEADER_BYTES) };
        assert!(matches!(encode(&too_long), Err(FrameError::TooLargeToSend { kind: "abort" })));
    }

    /// Yields its chunks one read at a time; `None` is a read that times out.
    struct Trickle(std::collections::VecDeque<Option<Vec<u8>>>);

    impl Read for Trickle {
        fn read(&mut self, into: &mut [u8]) -> io::Result<usize> {
            match self.0.pop_front() {
                Some(Some(chunk)) => {
                    into[..chunk.len()].copy_from_slice(&chunk);
                    Ok(chunk.len())
                }
                Some(None) => Err(io::ErrorKind::TimedOut.into()),
                None => Ok(0),
            }
        }
    }

    #[test]
    fn a_payload_read_in_place_rides_out_timeouts_but_not_a_stall_or_the_end() {
        let header = Header::Collective { group: 0, round: 0, rank: 0, len: 6 };
        let mut frame = encode(&header).unwrap();
        frame.extend_from_slice(b"ab");
        let patience = std::time::Duration::from_secs(10);
        // The header and 2 payload bytes in one read, a timeout, then the rest.
        let chunks = [Some(frame.clone()), None, Some(b"cdef".to_vec())];
        let mut reader = FrameReader::new(io::BufReader::new(Trickle(chunks.into_iter().collect())));
        assert_eq!(reader.read_header().unwrap(), Some(header.clone()));
        let mut payload = [0u8; 6];
        reader.read_payload_within(&mut payload, patience).unwrap();
        assert_eq!(&payload, b"abcdef");
        // The end of the stream in the middle is a truncated frame; no patience rides out
        // a stall.
        let mut reader = FrameReader::new(io::BufReader::new(Trickle([Some(frame.clone())].into_iter().collect())));
        reader.read_header().unwrap();
        assert!(matches!(
            reader.read_payload_within(&mut payload, patience),
            Err(FrameError::Truncated { what: "payload" })
        ));
        let mut reader = FrameReader::new(io::BufReader::new(Trickle([Some(frame), None].into_iter().collect())));
        reader.read_header().unwrap();
        let stalled = reader.read_payload_within(&mut payload, std::time::Duration::ZERO);
        assert!(matches!(stalled, Err(FrameError::Stalled { len: 6, .. })), "{stalled:?}");
    }

    #[test]
    fn long_reasons_are_cut_to_fit() {
        let reason = "é".repeat(MAX_REASON_BYTES);
        let cut = cut_reason(&reason);
        assert!(cut.len() <= MAX_REASON_BYTES);
        roundtrip(Header::Abort { reason: cut }, b"");
    }
}
