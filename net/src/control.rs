//! The control plane: rank 0 hosts a key-value store and named barriers every rank joins.
//!
//! Rank 0 starts a [`ControlServer`]; every rank, rank 0 included, connects a blocking
//! [`ControlClient`] to it. A connection starts with the same [`handshake`](crate::handshake)
//! as data connections (protocol, build, world size, the shared secret), with one
//! difference: both sides send an empty plan fingerprint, because ranks use the control
//! plane to agree on the plan before they run it. Plans are checked on data connections.
//!
//! After the handshake the server answers [`ControlReply::Joined`] (or
//! [`ControlReply::Refused`]: a rank may join once), then serves [`ControlRequest`]s one at a
//! time. Requests and replies are postcard messages behind a 4-byte little-endian length,
//! at most [`MAX_CONTROL_FRAME_BYTES`]. Every wait is bounded: `get` and `barrier` carry their
//! timeout, the client's socket waits that long plus a margin, and a barrier that cannot
//! complete because a rank left fails at once, naming the rank.

use crate::handshake::HandshakeError;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

mod client;
mod server;
#[cfg(test)]
mod tests;

pub use client::ControlClient;
pub use server::ControlServer;

/// Longest request or reply (a value may be a serialized plan).
pub const MAX_CONTROL_FRAME_BYTES: usize = 256 << 20;

/// What a rank asks the control server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ControlRequest {
    /// Sets `key` to `value`, replacing any earlier value. Answered [`ControlReply::Done`].
    Set {
        /// The key.
        key: String,
        /// The value.
        value: Vec<u8>,
    },
    /// The value of `key`, waiting up to `timeout_ms` for some rank to set it.
    Get {
        /// The key.
        key: String,
        /// How long to wait, in milliseconds.
        timeout_ms: u64,
    },
    /// Waits until every rank of the world arrived at barrier `name` (its next round), up to
    /// `timeout_ms`.
    Barrier {
        /// The barrier's name.
        name: String,
        /// How long to wait, in milliseconds.
        timeout_ms: u64,
    },
}

/// What the control server answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ControlReply {
    /// The rank joined (the answer to a successful handshake).
    Joined,
    /// The rank may not join.
    Refused {
        /// Why, as a sentence.
        reason: String,
    },
    /// A set was stored, or a barrier completed.
    Done,
    /// A key's value.
    Value(Vec<u8>),
    /// No rank set the key in time.
    GetTimedOut,
    /// A barrier did not complete in time.
    BarrierTimedOut {
        /// Ranks that did not arrive.
        missing: Vec<u32>,
        /// Ranks that arrived.
        arrived: Vec<u32>,
        /// Ranks (among the missing) that never joined the control plane.
        never_joined: Vec<u32>,
    },
    /// A rank the barrier waits for left the control plane, so it cannot complete.
    RankLeft {
        /// The rank.
        rank: u32,
        /// Its host.
        host: String,
    },
}

/// What went wrong on the control plane, as a sentence naming ranks, hosts and values.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// Listening on a non-loopback address without a secret.
    #[error(transparent)]
    Insecure(Box<HandshakeError>),
    /// The server cannot listen.
    #[error("rank 0 could not listen for the control plane on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: io::Error,
    },
    /// The server's runtime or thread did not start.
    #[error("rank 0 could not start the control plane's runtime: {source}")]
    Runtime {
        /// Why.
        source: io::Error,
    },
    /// The master's address is not `host:port`.
    #[error("the master '{master}' is no address to connect to: {reason}; write it as host:port")]
    BadMaster {
        /// The address given.
        master: String,
        /// Why.
        reason: String,
    },
    /// Nothing accepted connections at the master's address in time.
    #[error("the master {master} (rank 0) is unreachable after {}: {reason}", seconds(.after))]
    Unreachable {
        /// The master's address.
        master: String,
        /// How long this node tried.
        after: Duration,
        /// The last failure.
        reason: String,
    },
    /// The handshake with the master failed.
    #[error("the handshake with the master {master} failed: {source}")]
    Handshake {
        /// The master's address.
        master: String,
        /// Why.
        source: Box<HandshakeError>,
    },
    /// The master refused this rank after the handshake.
    #[error("the master {master} (rank 0) refused this node: {reason}")]
    Refused {
        /// The master's address.
        master: String,
        /// Its reason.
        reason: String,
    },
    /// The connection to the master broke.
    #[error("the connection to the master {master} (rank 0) broke during {during}: {reason}")]
    Lost {
        /// The master's address.
        master: String,
        /// The call.
        during: String,
        /// Why.
        reason: String,
    },
    /// The master did not answer in time.
    #[error("the master {master} (rank 0) did not answer {during} within {}", seconds(.after))]
    Silent {
        /// The master's address.
        master: String,
        /// The call.
        during: String,
        /// How long this node waited.
        after: Duration,
    },
    /// The master's reply does not decode or does not fit the request.
    #[error("the master {master} (rank 0) answered {during} with something this node does not understand: {reason}")]
    Protocol {
        /// The master's address.
        master: String,
        /// The call.
        during: String,
        /// What was wrong.
        reason: String,
    },
    /// An earlier call failed, so the connection's replies may be out of step.
    #[error("an earlier call on the connection to the master {master} (rank 0) failed; connect again")]
    Broken {
        /// The master's address.
        master: String,
    },
    /// A request over [`MAX_CONTROL_FRAME_BYTES`].
    #[error("{what} is {len} bytes encoded, over the control plane's bound of {MAX_CONTROL_FRAME_BYTES} bytes")]
    TooLarge {
        /// The request.
        what: String,
        /// Its encoded length.
        len: u64,
    },
    /// No rank set the key in time.
    #[error("key '{key}' was not set within {}", seconds(.after))]
    GetTimedOut {
        /// The key.
        key: String,
        /// How long this node waited.
        after: Duration,
    },
    /// A barrier did not complete in time.
    #[error("{}", barrier_timeout(.name, *.after, *.world, .missing, .arrived, .never_joined))]
    BarrierTimedOut {
        /// The barrier.
        name: String,
        /// How long this node waited.
        after: Duration,
        /// The world size.
        world: u32,
        /// Ranks that did not arrive.
        missing: Vec<u32>,
        /// Ranks that arrived.
        arrived: Vec<u32>,
        /// Ranks (among the missing) that never joined the control plane.
        never_joined: Vec<u32>,
    },
    /// A rank left the control plane while others waited for it at a barrier.
    #[error("rank {rank} ({host}) left the control plane while ranks waited at barrier '{barrier}'")]
    RankLeft {
        /// The rank.
        rank: u32,
        /// Its host.
        host: String,
        /// The barrier.
        barrier: String,
    },
}

/// `5 s`, `1.5 s` or `300 ms`.
fn seconds(duration: &Duration) -> String {
    if duration.as_millis() < 1000 {
        format!("{} ms", duration.as_millis())
    } else if duration.subsec_millis() == 0 {
        format!("{} s", duration.as_secs())
    } else {
        format!("{:.1} s", duration.as_secs_f64())
    }
}

/// `rank 2` or `ranks [2, 3]`.
fn ranks(list: &[u32]) -> String {
    match list {
        [one] => format!("rank {one}"),
        _ => format!("ranks {list:?}"),
    }
}

fn barrier_timeout(
    name: &str,
    after: Duration,
    world: u32,
    missing: &[u32],
    arrived: &[u32],
    never_joined: &[u32],
) -> String {
    let mut text = format!(
        "barrier '{name}' timed out after {}: {} of {world} did not arrive ({} arrived",
        seconds(&after),
        ranks(missing),
        ranks(arrived)
    );
    if !never_joined.is_empty() {
        text.push_str(&format!("; {} never joined the control plane", ranks(never_joined)));
    }
    text.push(')');
    text
}

/// Why a control message could not be read or written.
#[derive(Debug, thiserror::Error)]
enum WireError {
    #[error("{}", describe_io(.0))]
    Io(#[from] io::Error),
    #[error("the connection closed in the middle of a message")]
    Truncated,
    #[error("a message of {0} bytes is over the control plane's bound of {MAX_CONTROL_FRAME_BYTES} bytes")]
    TooLarge(u64),
    #[error("a message does not decode: {0}")]
    Malformed(String),
}

impl WireError {
    fn is_timeout(&self) -> bool {
        matches!(self, WireError::Io(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut))
    }
}

/// An io error as the end of a sentence: `connection refused`, not `Connection refused (os
/// error 111)`.
fn describe_io(error: &io::Error) -> String {
    match error.kind() {
        io::ErrorKind::ConnectionRefused => "connection refused".to_string(),
        io::ErrorKind::ConnectionReset => "the connection was reset".to_string(),
        io::ErrorKind::BrokenPipe => "the connection is closed".to_string(),
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => "timed out".to_string(),
        _ => error.to_string(),
    }
}

/// `message` behind its 4-byte little-endian length, ready to write in one call.
fn encode_message<T: Serialize>(message: &T) -> Result<Vec<u8>, WireError> {
    let mut frame = postcard::to_extend(message, vec![0u8; 4]).map_err(|e| WireError::Malformed(e.to_string()))?;
    let len = frame.len() - 4;
    if len > MAX_CONTROL_FRAME_BYTES {
        return Err(WireError::TooLarge(len as u64));
    }
    frame[..4].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(frame)
}

/// Checks a message's announced length against the bound.
fn message_len(prefix: [u8; 4]) -> Result<usize, WireError> {
    let len = u32::from_le_bytes(prefix) as usize;
    if len > MAX_CONTROL_FRAME_BYTES {
        return Err(WireError::TooLarge(len as u64));
    }
    Ok(len)
}

fn decode_message<T: DeserializeOwned>(body: &[u8]) -> Result<T, WireError> {
    match postcard::take_from_bytes::<T>(body) {
        Ok((message, [])) => Ok(message),
        Ok((_, rest)) => Err(WireError::Malformed(format!("{} byte(s) after its end", rest.len()))),
        Err(e) => Err(WireError::Malformed(e.to_string())),
    }
}

/// Reads one message; `Ok(None)` when the peer closed the connection between messages.
fn read_message<T: DeserializeOwned>(stream: &mut impl Read) -> Result<Option<T>, WireError> {
    let mut prefix = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match stream.read(&mut prefix[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(WireError::Truncated),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let len = message_len(prefix)?;
    // Grows as bytes arrive: a peer announcing 256 MiB and sending less costs what it sent.
    let mut body = Vec::new();
    stream.take(len as u64).read_to_end(&mut body)?;
    if body.len() < len {
        return Err(WireError::Truncated);
    }
    decode_message(&body).map(Some)
}

fn write_message(stream: &mut impl Write, frame: &[u8]) -> Result<(), WireError> {
    stream.write_all(frame)?;
    Ok(stream.flush()?)
}
