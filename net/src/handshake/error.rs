//! Why a handshake failed, as sentences naming both sides and both values.

use super::PeerInfo;
use crate::frame::{self, FrameError, PROTOCOL_VERSION};
use std::net::SocketAddr;
use std::path::PathBuf;

/// Why a handshake (or the secret it needs) failed. Each is a sentence naming both sides.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// The peer speaks another wire protocol version.
    #[error("{peer} speaks wire protocol version {theirs}, this node ({me}) speaks version {ours}; all nodes of a job must run the same regflow")]
    Version {
        /// The peer.
        peer: PeerInfo,
        /// Its version.
        theirs: u32,
        /// This node.
        me: PeerInfo,
        /// This node's version.
        ours: u32,
    },
    /// The peer runs another build.
    #[error("{peer} runs build '{theirs}', this node ({me}) runs build '{ours}'; all nodes of a job must run the same build")]
    Build {
        /// The peer.
        peer: PeerInfo,
        /// Its build.
        theirs: String,
        /// This node.
        me: PeerInfo,
        /// This node's build.
        ours: String,
    },
    /// The peer was started with another world size.
    #[error("{peer} was started with a world of {theirs} ranks, this node ({me}) with a world of {ours}")]
    World {
        /// The peer.
        peer: PeerInfo,
        /// Its world size.
        theirs: u32,
        /// This node.
        me: PeerInfo,
        /// This node's world size.
        ours: u32,
    },
    /// The peer claims a rank outside the world.
    #[error("{peer} claims a rank outside the world of {world} ranks (0 to {})", .world.saturating_sub(1))]
    RankOutOfRange {
        /// The peer and the rank it claims.
        peer: PeerInfo,
        /// The world size.
        world: u32,
    },
    /// The peer claims this node's own rank.
    #[error("a peer on {peer_host} claims rank {}, which is this node's own rank ({me}); two nodes were started with the same rank", .me.rank)]
    DuplicateRank {
        /// The peer's host.
        peer_host: String,
        /// This node.
        me: PeerInfo,
    },
    /// The peer is not the rank this connection was for.
    #[error("this node ({me}) expected rank {expected} on this connection, but {peer} answered")]
    UnexpectedRank {
        /// The peer that answered.
        peer: PeerInfo,
        /// The rank expected.
        expected: u32,
        /// This node.
        me: PeerInfo,
    },
    /// The peer runs another plan.
    #[error("{peer} runs plan {}, this node ({me}) runs plan {}", short_plan(.theirs), short_plan(.ours))]
    Plan {
        /// The peer.
        peer: PeerInfo,
        /// Its plan fingerprint.
        theirs: String,
        /// This node.
        me: PeerInfo,
        /// This node's plan fingerprint.
        ours: String,
    },
    /// The peer's hello carried this node's own nonce: a reflected handshake.
    #[error("{peer} sent back this node's own challenge (a reflected or replayed handshake)")]
    EchoedNonce {
        /// The peer, as it claims to be.
        peer: PeerInfo,
    },
    /// The peer's proof does not verify with this node's secret.
    #[error("{peer} did not prove the cluster's shared secret (REGFLOW_SECRET){hint}")]
    BadProof {
        /// The peer, as it claims to be.
        peer: PeerInfo,
        /// What is known of why: empty, or which side has no secret.
        hint: &'static str,
    },
    /// The peer refused the connection.
    #[error("{} refused the connection: {reason}", peer_or_unknown(.peer))]
    Refused {
        /// The peer, when its hello came before the refusal.
        peer: Option<PeerInfo>,
        /// Its reason, as it wrote it.
        reason: String,
    },
    /// The peer sent a frame the handshake does not expect.
    #[error("{peer} sent a {kind} frame where its {awaited} was due")]
    UnexpectedFrame {
        /// The peer, as far as known.
        peer: String,
        /// The frame's kind.
        kind: &'static str,
        /// The frame due.
        awaited: &'static str,
    },
    /// The peer's first bytes are no regflow frame.
    #[error("{peer} does not speak regflow's wire protocol (version {PROTOCOL_VERSION}): {source}")]
    NotRegflow {
        /// The peer, as far as known.
        peer: String,
        /// What did not decode.
        source: FrameError,
    },
    /// The peer sent nothing within the socket's timeout.
    #[error("{peer} did not answer the handshake within the timeout (its {awaited} did not come); is it a node of this job, and alive?")]
    Timeout {
        /// The peer, as far as known.
        peer: String,
        /// The frame due.
        awaited: &'static str,
    },
    /// The peer closed the connection.
    #[error("{peer} closed the connection before its {awaited} came")]
    Closed {
        /// The peer, as far as known.
        peer: String,
        /// The frame due.
        awaited: &'static str,
    },
    /// Reading or writing a frame failed.
    #[error("the handshake failed: {0}")]
    Frame(#[from] FrameError),
    /// No random bytes for the nonce.
    #[error("the operating system gave no random bytes for the handshake's challenge: {reason}")]
    Random {
        /// What failed.
        reason: String,
    },
    /// A non-loopback address to listen on, without a secret.
    #[error("refusing to listen on {addr} without a shared secret: any host that reaches it could join the job; set REGFLOW_SECRET (or REGFLOW_SECRET_FILE) to the same long random string on every node, or listen on a loopback address for a single-host job")]
    Unprotected {
        /// The address.
        addr: SocketAddr,
    },
    /// `REGFLOW_SECRET_FILE` names a file that cannot be used.
    #[error("cannot use REGFLOW_SECRET_FILE={}: {reason}", .path.display())]
    SecretFile {
        /// The path.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// `REGFLOW_SECRET` is set but empty.
    #[error("REGFLOW_SECRET is set but empty; set it to a long random string, or unset it")]
    EmptySecret,
    /// Both variables are set.
    #[error("both REGFLOW_SECRET and REGFLOW_SECRET_FILE are set; set only one of them")]
    SecretConflict,
}

impl HandshakeError {
    /// What to tell the peer in a [`Header::Refused`] before dropping it, if anything.
    pub(super) fn refusal(&self) -> Option<String> {
        match self {
            HandshakeError::Version { .. }
            | HandshakeError::Build { .. }
            | HandshakeError::World { .. }
            | HandshakeError::RankOutOfRange { .. }
            | HandshakeError::DuplicateRank { .. }
            | HandshakeError::UnexpectedRank { .. }
            | HandshakeError::Plan { .. }
            | HandshakeError::EchoedNonce { .. }
            | HandshakeError::BadProof { .. }
            | HandshakeError::UnexpectedFrame { .. }
            | HandshakeError::NotRegflow { .. } => Some(frame::cut_reason(&self.to_string())),
            _ => None,
        }
    }
}

fn short_plan(fingerprint: &str) -> String {
    match fingerprint.char_indices().nth(12) {
        _ if fingerprint.is_empty() => "(none)".to_string(),
        Some((end, _)) if fingerprint.len() > 16 => format!("{}…", &fingerprint[..end]),
        _ => fingerprint.to_string(),
    }
}

fn peer_or_unknown(peer: &Option<PeerInfo>) -> String {
    peer.as_ref().map_or_else(|| "the peer".to_string(), PeerInfo::to_string)
}
