//! The connection handshake: both sides show they run one job and prove the shared secret.
//!
//! Both ends of every connection run the same steps ([`handshake`]):
//!
//! 1. send a [`Header::Hello`] with a fresh 32-byte random nonce;
//! 2. read the peer's hello and check, in this order: protocol version, build, world size,
//!    rank (inside the world, not this node's own, the one expected), plan fingerprint;
//! 3. send a [`Header::Proof`]: HMAC-SHA256, keyed with the shared secret (or the empty key),
//!    over `peer's nonce || my nonce || my rank (LE u32) || peer's rank (LE u32) || "regflow"`;
//! 4. read the peer's proof and verify it in constant time.
//!
//! A side that finds a mismatch or a wrong proof sends [`Header::Refused`] with its reason
//! (best effort) before it returns the error, so the other side can say why it was turned
//! away. The proof covers both nonces, not only the challenge, so that a proof one side sends
//! cannot be replayed or reflected into another connection, even between two ends of one
//! rank (rank 0's control client and the control server it hosts).
//!
//! The secret keeps strangers out; it is only as strong as it is long and random (anyone who
//! records a handshake can guess short secrets offline). Without one, nodes listen on loopback
//! addresses only ([`check_bind`]).

use crate::frame::{self, FrameError, FrameReader, Header, Hello, PROTOCOL_VERSION};
use hmac::digest::KeyInit;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use std::fmt;
use std::io::{self, Read, Write};
use std::net::SocketAddr;

mod error;
mod secret;
#[cfg(test)]
mod tests;

pub use error::HandshakeError;
pub use secret::{Secret, SECRET_FILE_VAR, SECRET_VAR};

type HmacSha256 = Hmac<Sha256>;

/// Who this side of a connection is, as its hello tells the peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// This node's rank.
    pub rank: u32,
    /// The number of ranks in the job.
    pub world: u32,
    /// This node's host name, for the peer's errors.
    pub host: String,
    /// This node's build ([`Identity::build_id`]); all nodes of a job must run one build.
    pub build: String,
    /// Fingerprint of the plan this node runs; empty on control-plane connections.
    pub plan: String,
}

impl Identity {
    /// This node as rank `rank` of `world`, running `plan`, with this host's name and build.
    pub fn new(rank: u32, world: u32, plan: impl Into<String>) -> Identity {
        Identity { rank, world, host: local_host(), build: Identity::build_id(), plan: plan.into() }
    }

    /// The build this binary is: crate version and target, e.g. `regflow 0.1.0 x86_64-linux`.
    pub fn build_id() -> String {
        format!("regflow {} {}-{}", env!("CARGO_PKG_VERSION"), std::env::consts::ARCH, std::env::consts::OS)
    }

    fn as_peer(&self) -> PeerInfo {
        PeerInfo { rank: self.rank, host: self.host.clone() }
    }
}

/// This host's name: the kernel's, `/etc/hostname`, `$HOSTNAME`, else `unknown-host`.
pub fn local_host() -> String {
    let from_file = |path: &str| std::fs::read_to_string(path).ok().map(|name| name.trim().to_string());
    from_file("/proc/sys/kernel/hostname")
        .filter(|name| !name.is_empty())
        .or_else(|| from_file("/etc/hostname").filter(|name| !name.is_empty()))
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|name| !name.is_empty()))
        .unwrap_or_else(|| "unknown-host".to_string())
}

/// Which peer a connection must reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// Exactly this rank. It may be this node's own rank: that is how a node's control
    /// client reaches the control server the same node hosts.
    Rank(u32),
    /// Any rank of the world but this node's own (a node accepting data connections).
    AnyOtherRank,
    /// Any rank of the world, this node's own included (the control server: rank 0's own
    /// client joins it like every other rank's).
    AnyRank,
}

/// The peer a handshake reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerInfo {
    /// Its rank.
    pub rank: u32,
    /// Its host name, as it says.
    pub host: String,
}

impl fmt::Display for PeerInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} on {}", self.rank, self.host)
    }
}

/// Refuses binding `addr` without a secret unless it is a loopback address.
pub fn check_bind(addr: &SocketAddr, secret: &Secret) -> Result<(), HandshakeError> {
    if addr.ip().is_loopback() || secret.is_set() {
        Ok(())
    } else {
        Err(HandshakeError::Unprotected { addr: *addr })
    }
}

/// Runs the handshake on `stream` as `me` and returns the peer it reached. Both sides call
/// it; it reads exactly the handshake's frames, so the stream is ready for what follows.
///
/// The caller sets the socket's read and write timeouts; a read that times out is
/// [`HandshakeError::Timeout`], naming the peer as far as known.
pub fn handshake<S: Read + Write>(
    stream: &mut S,
    me: &Identity,
    secret: &Secret,
    expect: Expect,
) -> Result<PeerInfo, HandshakeError> {
    let start = Start::new(me, secret, expect)?;
    send(stream, &start.hello())?;
    let frame = receive(stream).map_err(|e| read_failed(start.who(), "hello", e))?;
    let (proving, proof) = start.on_hello(frame).map_err(|e| refuse(stream, e))?;
    send(stream, &proof)?;
    let frame = receive(stream).map_err(|e| read_failed(proving.peer.to_string(), "proof", e))?;
    proving.on_proof(frame).map_err(|e| refuse(stream, e))
}

/// The async twin of [`handshake`] for the control server: same steps, same frames, every
/// read bounded by `deadline`.
pub(crate) async fn handshake_async<S>(
    stream: &mut S,
    me: &Identity,
    secret: &Secret,
    expect: Expect,
    deadline: tokio::time::Instant,
) -> Result<PeerInfo, HandshakeError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::AsyncWriteExt;
    let start = Start::new(me, secret, expect)?;
    stream.write_all(&frame::encode(&start.hello())?).await.map_err(write_failed)?;
    let frame = receive_async(stream, deadline).await.map_err(|e| read_failed(start.who(), "hello", e))?;
    let (proving, proof) = match start.on_hello(frame) {
        Ok(next) => next,
        Err(e) => return Err(refuse_async(stream, e).await),
    };
    stream.write_all(&frame::encode(&proof)?).await.map_err(write_failed)?;
    let frame = receive_async(stream, deadline).await.map_err(|e| read_failed(proving.peer.to_string(), "proof", e))?;
    match proving.on_proof(frame) {
        Ok(peer) => Ok(peer),
        Err(e) => Err(refuse_async(stream, e).await),
    }
}

fn send<S: Write>(stream: &mut S, header: &Header) -> Result<(), HandshakeError> {
    stream.write_all(&frame::encode(header)?).and_then(|()| stream.flush()).map_err(write_failed)
}

fn receive<S: Read>(stream: &mut S) -> Result<Option<Header>, FrameError> {
    // Unbuffered on purpose: it must not read past the handshake's frames.
    FrameReader::new(stream).read_header()
}

async fn receive_async<S>(stream: &mut S, deadline: tokio::time::Instant) -> Result<Option<Header>, FrameError>
where
    S: tokio::io::AsyncRead + Unpin,
{
    match tokio::time::timeout_at(deadline, read_frame_async(stream)).await {
        Ok(result) => result,
        Err(_) => Err(FrameError::Io(io::ErrorKind::TimedOut.into())),
    }
}

async fn read_frame_async<S: tokio::io::AsyncRead + Unpin>(stream: &mut S) -> Result<Option<Header>, FrameError> {
    use tokio::io::AsyncReadExt;
    let mut prefix = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match stream.read(&mut prefix[got..]).await? {
            0 if got == 0 => return Ok(None),
            0 => return Err(FrameError::Truncated { what: "length" }),
            n => got += n,
        }
    }
    let len = u32::from_le_bytes(prefix) as usize;
    if len > frame::MAX_HEADER_BYTES {
        return Err(FrameError::HeaderTooLarge { len: len as u64 });
    }
    let mut whole = vec![0u8; 4 + len];
    whole[..4].copy_from_slice(&prefix);
    stream.read_exact(&mut whole[4..]).await.map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => FrameError::Truncated { what: "header" },
        _ => FrameError::Io(e),
    })?;
    frame::decode(&whole).map(|(header, _)| Some(header))
}

fn refuse<S: Write>(stream: &mut S, error: HandshakeError) -> HandshakeError {
    if let Some(reason) = error.refusal() {
        // Best effort: the peer may be gone already, and this side's error says it all.
        let _ = send(stream, &Header::Refused { reason });
    }
    error
}

async fn refuse_async<S: tokio::io::AsyncWrite + Unpin>(stream: &mut S, error: HandshakeError) -> HandshakeError {
    use tokio::io::AsyncWriteExt;
    if let Some(reason) = error.refusal() {
        if let Ok(refusal) = frame::encode(&Header::Refused { reason }) {
            // Best effort, as in `refuse`.
            let _ = stream.write_all(&refusal).await;
        }
    }
    error
}

fn read_failed(who: String, awaited: &'static str, error: FrameError) -> HandshakeError {
    match error {
        FrameError::Io(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
            HandshakeError::Timeout { peer: who, awaited }
        }
        FrameError::Io(e) if is_disconnect(&e) => HandshakeError::Closed { peer: who, awaited },
        FrameError::Truncated { .. } => HandshakeError::Closed { peer: who, awaited },
        FrameError::Io(e) => HandshakeError::Frame(FrameError::Io(e)),
        other if awaited == "hello" => HandshakeError::NotRegflow { peer: who, source: other },
        other => HandshakeError::Frame(other),
    }
}

fn write_failed(error: io::Error) -> HandshakeError {
    HandshakeError::Frame(FrameError::Io(error))
}

fn is_disconnect(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::UnexpectedEof
    )
}

/// The handshake before the peer's hello: this side's nonce and what it expects.
struct Start<'a> {
    me: &'a Identity,
    secret: &'a Secret,
    expect: Expect,
    nonce: [u8; 32],
}

/// The handshake after the peer's hello: who it is and both nonces.
struct Proving<'a> {
    me: &'a Identity,
    secret: &'a Secret,
    peer: PeerInfo,
    my_nonce: [u8; 32],
    peer_nonce: [u8; 32],
}

impl<'a> Start<'a> {
    fn new(me: &'a Identity, secret: &'a Secret, expect: Expect) -> Result<Self, HandshakeError> {
        let mut nonce = [0u8; 32];
        getrandom::fill(&mut nonce).map_err(|e| HandshakeError::Random { reason: e.to_string() })?;
        Ok(Start { me, secret, expect, nonce })
    }

    fn hello(&self) -> Header {
        Header::Hello(Hello {
            protocol: PROTOCOL_VERSION,
            build: self.me.build.clone(),
            plan: self.me.plan.clone(),
            rank: self.me.rank,
            world: self.me.world,
            host: self.me.host.clone(),
            nonce: self.nonce,
        })
    }

    /// The peer as far as known before its hello.
    fn who(&self) -> String {
        match self.expect {
            Expect::Rank(rank) => format!("rank {rank}"),
            Expect::AnyOtherRank | Expect::AnyRank => "the peer (rank not yet known)".to_string(),
        }
    }

    /// Checks the peer's hello; on success, the proof to send.
    fn on_hello(self, frame: Option<Header>) -> Result<(Proving<'a>, Header), HandshakeError> {
        let hello = match frame {
            Some(Header::Hello(hello)) => hello,
            Some(Header::Refused { reason }) => return Err(HandshakeError::Refused { peer: None, reason }),
            Some(other) => {
                return Err(HandshakeError::UnexpectedFrame { peer: self.who(), kind: other.kind(), awaited: "hello" })
            }
            None => return Err(HandshakeError::Closed { peer: self.who(), awaited: "hello" }),
        };
        let peer = PeerInfo { rank: hello.rank, host: hello.host.clone() };
        self.check(&hello, &peer)?;
        let proving = Proving { me: self.me, secret: self.secret, peer, my_nonce: self.nonce, peer_nonce: hello.nonce };
        let proof = Header::Proof { mac: proving.my_proof() };
        Ok((proving, proof))
    }

    fn check(&self, hello: &Hello, peer: &PeerInfo) -> Result<(), HandshakeError> {
        let (me, peer) = (self.me, peer.clone());
        if hello.protocol != PROTOCOL_VERSION {
            return Err(HandshakeError::Version {
                peer,
                theirs: hello.protocol,
                me: me.as_peer(),
                ours: PROTOCOL_VERSION,
            });
        }
        if hello.build != me.build {
            let (theirs, ours) = (hello.build.clone(), me.build.clone());
            return Err(HandshakeError::Build { peer, theirs, me: me.as_peer(), ours });
        }
        if hello.world != me.world {
            return Err(HandshakeError::World { peer, theirs: hello.world, me: me.as_peer(), ours: me.world });
        }
        if hello.rank >= me.world {
            return Err(HandshakeError::RankOutOfRange { peer, world: me.world });
        }
        let own_rank_expected = self.expect == Expect::AnyRank || self.expect == Expect::Rank(me.rank);
        if hello.rank == me.rank && !own_rank_expected {
            return Err(HandshakeError::DuplicateRank { peer_host: peer.host, me: me.as_peer() });
        }
        if let Expect::Rank(expected) = self.expect {
            if expected != hello.rank {
                return Err(HandshakeError::UnexpectedRank { peer, expected, me: me.as_peer() });
            }
        }
        if hello.plan != me.plan {
            let (theirs, ours) = (hello.plan.clone(), me.plan.clone());
            return Err(HandshakeError::Plan { peer, theirs, me: me.as_peer(), ours });
        }
        if hello.nonce == self.nonce {
            return Err(HandshakeError::EchoedNonce { peer });
        }
        Ok(())
    }
}

impl Proving<'_> {
    fn my_proof(&self) -> [u8; 32] {
        let mac = proof_mac(self.secret.key(), &self.peer_nonce, &self.my_nonce, self.me.rank, self.peer.rank);
        mac.finalize().into_bytes().into()
    }

    /// Verifies the peer's proof; on success, the peer.
    fn on_proof(self, frame: Option<Header>) -> Result<PeerInfo, HandshakeError> {
        let peer_mac = match frame {
            Some(Header::Proof { mac }) => mac,
            Some(Header::Refused { reason }) => return Err(HandshakeError::Refused { peer: Some(self.peer), reason }),
            Some(other) => {
                let peer = self.peer.to_string();
                return Err(HandshakeError::UnexpectedFrame { peer, kind: other.kind(), awaited: "proof" });
            }
            None => return Err(HandshakeError::Closed { peer: self.peer.to_string(), awaited: "proof" }),
        };
        let expected = |key: &[u8]| proof_mac(key, &self.my_nonce, &self.peer_nonce, self.peer.rank, self.me.rank);
        if expected(self.secret.key()).verify_slice(&peer_mac).is_ok() {
            return Ok(self.peer);
        }
        let hint = if !self.secret.is_set() {
            "; this node has no secret set"
        } else if expected(&[]).verify_slice(&peer_mac).is_ok() {
            "; it has no secret set"
        } else {
            ""
        };
        Err(HandshakeError::BadProof { peer: self.peer, hint })
    }
}

/// The MAC `prover` sends to answer `challenge` (the verifier's nonce); it covers the
/// prover's own nonce too, which ties it to this one connection.
fn proof_mac(key: &[u8], challenge: &[u8; 32], prover_nonce: &[u8; 32], prover: u32, verifier: u32) -> HmacSha256 {
    let mut mac = keyed_hmac(key);
    mac.update(challenge);
    mac.update(prover_nonce);
    mac.update(&prover.to_le_bytes());
    mac.update(&verifier.to_le_bytes());
    mac.update(b"regflow");
    mac
}

/// HMAC-SHA256 keyed with `key` of any length. HMAC (RFC 2104) hashes a key longer than the
/// hash's 64-byte block and pads a shorter one with zeros; doing that here gives the
/// constructor a block-sized key, so it cannot fail.
fn keyed_hmac(key: &[u8]) -> HmacSha256 {
    let mut block = [0u8; 64];
    if key.len() > block.len() {
        block[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        block[..key.len()].copy_from_slice(key);
    }
    <HmacSha256 as KeyInit>::new(&block.into())
}
