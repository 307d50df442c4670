//! A node's connections to the other nodes of its job, made before the job starts.

use crate::RuntimeError;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// A connection to one peer node that carries frames both ways. TCP implements it; an RDMA
/// or UCX transport would too (the data plane only reads and writes bytes in order).
pub trait Transport: Send + Sync + fmt::Debug {
    /// The receiving direction (read by one thread).
    fn reader(&self) -> io::Result<Box<dyn Read + Send>>;
    /// The sending direction (written by one thread).
    fn writer(&self) -> io::Result<Box<dyn Write + Send>>;
    /// Closes both directions: a thread blocked reading or writing returns.
    fn close(&self);
    /// Ends the sending direction only (the peer reads the end of the stream after what
    /// was sent), so this side can still read what the peer sends until it closes.
    fn close_write(&self) {
        self.close();
    }
    /// Bounds each later read by `timeout` (`None`: no bound).
    fn set_read_timeout(&self, _timeout: Option<Duration>) -> io::Result<()> {
        Ok(())
    }
}

impl Transport for TcpStream {
    fn reader(&self) -> io::Result<Box<dyn Read + Send>> {
        Ok(Box::new(self.try_clone()?))
    }

    fn writer(&self) -> io::Result<Box<dyn Write + Send>> {
        Ok(Box::new(self.try_clone()?))
    }

    fn close(&self) {
        let _ = self.shutdown(std::net::Shutdown::Both);
    }

    fn close_write(&self) {
        let _ = self.shutdown(std::net::Shutdown::Write);
    }

    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        TcpStream::set_read_timeout(self, timeout)
    }
}

/// How long a node that cannot start reads what a peer still sends before it closes.
const DRAIN_GRACE: Duration = Duration::from_secs(2);

/// Ends a connection without losing what this side sent last: closes the sending side,
/// then reads (and drops) what the peer still sends until it closes, for at most
/// `grace`. Closing a TCP socket with unread bytes resets the connection, and a reset can
/// discard the last frames in flight to the peer (an abort, a bye) before it reads them.
pub(crate) fn close_gracefully(transport: &dyn Transport, grace: Duration) {
    transport.close_write();
    let deadline = std::time::Instant::now() + grace;
    if let Ok(mut reader) = transport.reader() {
        let mut sink = [0u8; 4096];
        while std::time::Instant::now() < deadline {
            let left = deadline.saturating_duration_since(std::time::Instant::now()).max(Duration::from_millis(1));
            if transport.set_read_timeout(Some(left)).is_err() {
                break;
            }
            match reader.read(&mut sink) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
    }
    transport.close();
}

/// One connected peer.
#[derive(Debug)]
pub struct PeerLink {
    /// The peer's node (rank).
    pub rank: u16,
    /// Its host, for errors.
    pub host: String,
    /// The connection, past its handshake.
    pub transport: Box<dyn Transport>,
}

/// How long a peer may be silent by default (see [`Cluster::with_silence_limit`]).
pub const DEFAULT_SILENCE: Duration = Duration::from_secs(10);

/// How a node joins the others (see [`Cluster::join`]).
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// How long joining may take: reaching the master, every peer, every handshake.
    pub timeout: Duration,
    /// The address this node's data plane listens on (default: loopback, or every
    /// interface when a secret is set).
    pub bind: Option<std::net::IpAddr>,
    /// The cluster's shared secret (default: from `REGFLOW_SECRET` or
    /// `REGFLOW_SECRET_FILE`; none when neither is set, and then only loopback binds).
    pub secret: Option<regflow_net::handshake::Secret>,
    /// How long a peer may send nothing before it counts as lost ([`DEFAULT_SILENCE`]).
    pub silence: Duration,
    /// The port this node's data plane listens on while the nodes connect (default: one
    /// the OS picks; set it where a firewall opens only known ports).
    pub data_port: Option<u16>,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        Self { timeout: Duration::from_secs(60), bind: None, secret: None, silence: DEFAULT_SILENCE, data_port: None }
    }
}

/// This node's connections to every other node of a multi-node job.
///
/// Hand it to [`crate::JobBuilder::cluster`]: the job then runs this node's actors, and
/// registers, collectives and aborts cross to the other nodes over these connections.
pub struct Cluster {
    rank: u16,
    world: u16,
    hosts: Vec<String>,
    links: Vec<Option<PeerLink>>,
    /// What must live as long as the job: rank 0's control plane, the control client.
    pub(super) keep: Option<Box<dyn std::any::Any + Send>>,
    /// How long a peer may send nothing (not even a heartbeat) before it counts as lost.
    pub(super) silence: Duration,
}

impl fmt::Debug for Cluster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cluster")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("hosts", &self.hosts)
            .finish_non_exhaustive()
    }
}

impl Cluster {
    /// A cluster from connections made elsewhere (past their handshakes): `links` holds one
    /// link per other node of `0..world`.
    pub fn from_links(rank: u16, world: u16, host: &str, links: Vec<PeerLink>) -> Result<Self, RuntimeError> {
        let fail = |message: String| RuntimeError::Cluster { node: rank, world, message };
        if rank >= world {
            return Err(fail(format!("rank {rank} is not below the world size {world}")));
        }
        let mut slots: Vec<Option<PeerLink>> = (0..world).map(|_| None).collect();
        let mut hosts = vec![String::new(); world as usize];
        hosts[rank as usize] = host.to_string();
        for link in links {
            let r = link.rank;
            if r >= world || r == rank {
                return Err(fail(format!("a link names node {r}, which is not another node of 0..{world}")));
            }
            if slots[r as usize].is_some() {
                return Err(fail(format!("two links name node {r}")));
            }
            hosts[r as usize] = link.host.clone();
            slots[r as usize] = Some(link);
        }
        if let Some(missing) = (0..world).find(|&n| n != rank && slots[n as usize].is_none()) {
            return Err(fail(format!("no link to node {missing}")));
        }
        Ok(Self { rank, world, hosts, links: slots, keep: None, silence: DEFAULT_SILENCE })
    }

    /// `world` nodes in this process, connected pairwise over loopback TCP: one cluster per
    /// node, in rank order. For tests and benchmarks that run every node on its own thread.
    pub fn loopback(world: u16) -> Result<Vec<Cluster>, RuntimeError> {
        let fail = |message: String| RuntimeError::Cluster { node: 0, world, message };
        let mut links: Vec<Vec<PeerLink>> = (0..world).map(|_| Vec::new()).collect();
        for a in 0..world {
            for b in a + 1..world {
                let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| fail(e.to_string()))?;
                let addr = listener.local_addr().map_err(|e| fail(e.to_string()))?;
                let to_b = TcpStream::connect(addr).map_err(|e| fail(e.to_string()))?;
                let (to_a, _) = listener.accept().map_err(|e| fail(e.to_string()))?;
                for stream in [&to_a, &to_b] {
                    stream.set_nodelay(true).map_err(|e| fail(e.to_string()))?;
                }
                let host = "localhost".to_string();
                links[a as usize].push(PeerLink { rank: b, host: host.clone(), transport: Box::new(to_b) });
                links[b as usize].push(PeerLink { rank: a, host, transport: Box::new(to_a) });
            }
        }
        links.into_iter().enumerate().map(|(r, l)| Cluster::from_links(r as u16, world, "localhost", l)).collect()
    }

    /// How long a peer may send nothing, not even a heartbeat (each node beats every
    /// second when it has nothing else to send), before this node's job fails with
    /// [`RuntimeError::PeerLost`] naming it (default 10 s). A node whose job has not yet
    /// started sends nothing: before a peer's first frame the limit is six times longer.
    pub fn with_silence_limit(mut self, silence: Duration) -> Self {
        self.silence = silence.max(Duration::from_millis(100));
        self
    }

    /// This node.
    pub fn rank(&self) -> u16 {
        self.rank
    }

    /// Nodes in the job.
    pub fn world(&self) -> u16 {
        self.world
    }

    /// Host of each node, by rank.
    pub fn hosts(&self) -> Vec<String> {
        self.hosts.clone()
    }

    pub(crate) fn link(&self, node: u16) -> Option<&PeerLink> {
        self.links.get(node as usize).and_then(Option::as_ref)
    }

    /// The links, and what must outlive the job.
    pub(crate) fn into_parts(self) -> (Vec<Option<PeerLink>>, Option<Box<dyn std::any::Any + Send>>) {
        (self.links, self.keep)
    }

    /// The silence limit (see [`Cluster::with_silence_limit`]).
    pub(crate) fn silence(&self) -> Duration {
        self.silence
    }

    /// Tells every peer this node cannot start its part of the job (its job never ran).
    pub(crate) fn refuse(self, error: &RuntimeError) {
        let reason = regflow_net::frame::cut_reason(&format!("node {} could not start: {error}", self.rank));
        for link in self.links.into_iter().flatten() {
            if let Ok(w) = link.transport.writer() {
                let mut w = regflow_net::frame::FrameWriter::new(w);
                let _ = w.write(&regflow_net::frame::Header::Abort { reason: reason.clone() }, &[]);
                let _ = w.flush();
            }
            close_gracefully(link.transport.as_ref(), DRAIN_GRACE);
        }
    }
}
