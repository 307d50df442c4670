//! Nodes over the network: the data plane of a job that runs one node of a multi-node plan.
//!
//! A [`Cluster`] is this node's connections to the other nodes, one per peer, each already
//! through the handshake (same protocol, build and plan, the shared secret proven). The job
//! drives each connection with two threads of its own, never with an async runtime:
//!
//! - a **writer** takes what the stream threads route to that node (actor messages,
//!   collective inputs, an abort, the final bye) from a bounded channel sized from the
//!   plan's register counts, and writes each as one frame. A `Ready` carries the slot's
//!   bytes, written straight from the producer's memory (no copy); a second `Ready` of the
//!   same piece to another consumer on the same node carries none (the bytes are there).
//! - a **reader** reads frames, checks each against the plan (the recipient runs here, the
//!   register connects the two nodes, the slot exists, the length is the register's), reads
//!   a `Ready`'s bytes straight into this node's mirror of the slot, and only then hands the
//!   message to the consumer's stream. A consumer therefore never sees a piece before its
//!   bytes have landed, and the producer's slot is freed only when the consumer's `Ack`
//!   comes back: `register_num` still bounds the pieces in flight across the network, and a
//!   slow consumer slows its producer.
//!
//! Failures end the job on every node: an error here sends `Abort` to every peer (their
//! jobs fail with [`RuntimeError::PeerFailed`] naming this node); a connection that breaks
//! or a frame the plan does not allow fails the job with [`RuntimeError::PeerLost`]. At the
//! end each side sends `Bye`; a connection closing after its peer's bye is the normal end.

mod cluster;
#[cfg(not(loom))]
mod join;
mod reader;
mod record;
mod writer;

pub use cluster::{Cluster, ClusterOptions, PeerLink, Transport, DEFAULT_SILENCE};
#[cfg(not(loom))]
pub use join::ClusterSession;

use crate::arenas::PlanArenas;
use crate::collective::NetGroups;
use crate::send_waits::WaitsOn;
use crate::stream::JobShared;
use crate::sync::Arc;
use crate::RuntimeError;
use regflow_actors::{ActorId, EnvError, Message, PlanIds};
use regflow_plan::{ActorIndex, Plan};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

/// Bytes a collective member hands its writer: its input of one round, in the group's
/// landing buffer, which stays unchanged until the peers have received it (see
/// `collective::net`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawBytes {
    pub(crate) ptr: *const u8,
    pub(crate) len: usize,
}

// SAFETY: an address; the collective protocol keeps the bytes unchanged until written.
unsafe impl Send for RawBytes {}

/// What a stream thread hands the writer of one peer.
#[derive(Debug, Clone)]
pub(crate) enum Outgoing {
    /// An actor message for an actor of that node.
    Actor(Message),
    /// One member's input of one collective round.
    Collective { group: u32, round: u64, rank: u32, bytes: RawBytes },
    /// One chunk of a ring all-reduce, for the successor.
    Ring { group: u32, round: u64, step: u32, bytes: RawBytes },
    /// This node's job failed.
    Abort(String),
    /// This node's job is over: nothing more follows.
    Bye,
    /// This node's watchdog found the job stalled and asks what the peer's actors wait on.
    SnapshotRequest,
    /// What this node's actors wait on (JSON of `watchdog::RemoteStuck`s), for a peer's
    /// wait-for graph.
    Snapshot(Vec<u8>),
}

/// What the watchdog of a node of several needs from the network: the writers, to ask
/// peers for their snapshots and to answer theirs; requests and replies from the readers.
#[derive(Debug)]
pub(crate) struct WatchNet {
    pub(crate) out: Arc<NetOut>,
    /// Peers' requests for this node's snapshot, by the requesting node.
    pub(crate) requests: crossbeam_channel::Receiver<u16>,
    /// Peers' snapshots, by node.
    pub(crate) replies: crossbeam_channel::Receiver<(u16, Vec<crate::watchdog::RemoteStuck>)>,
    /// Each connection's flight recorder (filled once the connections' threads start).
    pub(crate) recorders: Vec<std::sync::Arc<record::FlightRecorder>>,
    /// The collective groups spanning nodes, for their round states and names.
    pub(crate) groups: Option<Arc<NetGroups>>,
}

impl WatchNet {
    /// What the network was doing: each connection's last frames, each spanning
    /// collective's rounds. `descs` names registers by index.
    pub(crate) fn dump(&self, descs: &[String]) -> Vec<String> {
        let names = self.groups.as_ref().map(|g| g.names()).unwrap_or_default();
        let mut lines: Vec<String> = self.recorders.iter().flat_map(|r| r.dump(descs, &names)).collect();
        if let Some(groups) = &self.groups {
            lines.extend(groups.describe());
        }
        lines
    }
}

/// The readers' ends of [`WatchNet`]'s channels.
#[derive(Debug, Clone)]
pub(crate) struct WatchNetSenders {
    pub(crate) requests: crossbeam_channel::Sender<u16>,
    pub(crate) replies: crossbeam_channel::Sender<(u16, Vec<crate::watchdog::RemoteStuck>)>,
}

/// The channels between the readers and the watchdog (bounded: a peer flooding requests
/// loses the extra ones, never blocks a reader).
pub(crate) fn watch_channels(out: Arc<NetOut>) -> (WatchNet, WatchNetSenders) {
    let (requests_tx, requests) = crossbeam_channel::bounded(64);
    let (replies_tx, replies) = crossbeam_channel::bounded(64);
    let watch = WatchNet { out, requests, replies, recorders: Vec::new(), groups: None };
    (watch, WatchNetSenders { requests: requests_tx, replies: replies_tx })
}

/// The sending side every router holds: one bounded channel per peer node.
#[derive(Debug)]
pub(crate) struct NetOut {
    rank: u16,
    /// `peers[node]`: the channel to that node's writer; `None` for this node.
    peers: Vec<Option<crossbeam_channel::Sender<Outgoing>>>,
    /// Disconnected once the job aborts (`JobShared::abort_signal`).
    abort: crossbeam_channel::Receiver<()>,
    /// Where a stream thread that finds a queue full says so, for the watchdog.
    waits: std::sync::Arc<crate::send_waits::SendWaits>,
}

impl NetOut {
    /// Hands `msg` to the writer of its recipient's node. The channel has room for every
    /// message the register counts allow in flight, so this waits only if the plan's bound
    /// is wrong; it never waits past an abort. The thread of plan stream `from`, if given,
    /// says while it waits that it waits on that node ([`crate::send_waits::SendWaits`]).
    pub(crate) fn send_actor(&self, msg: Message, from: Option<usize>) -> Result<(), EnvError> {
        let node = msg.dst.node();
        let Some(Some(peer)) = self.peers.get(node as usize) else {
            return Err(EnvError::NotConnected { dst: msg.dst, node });
        };
        self.send_to(peer, Outgoing::Actor(msg), from.map(|from| (from, node)))
            .map_err(|_| EnvError::Disconnected { dst: msg.dst })
    }

    /// Hands a collective input to the writer of `node`.
    pub(crate) fn send_collective(&self, node: u16, item: Outgoing) -> Result<(), String> {
        let Some(Some(peer)) = self.peers.get(node as usize) else {
            return Err(format!("node {node} is not connected to node {}", self.rank));
        };
        self.send_to(peer, item, None).map_err(|()| format!("the connection to node {node} is closed"))
    }

    /// Queues `item` on `peer`, waiting for room (until an abort) if it is full; a
    /// `waiter` (plan stream, node) says meanwhile that its thread waits on that node.
    fn send_to(
        &self,
        peer: &crossbeam_channel::Sender<Outgoing>,
        item: Outgoing,
        waiter: Option<(usize, u16)>,
    ) -> Result<(), ()> {
        match peer.try_send(item) {
            Ok(()) => Ok(()),
            Err(crossbeam_channel::TrySendError::Disconnected(_)) => Err(()),
            Err(crossbeam_channel::TrySendError::Full(item)) => {
                let _waiting = waiter.map(|(from, node)| self.waits.begin(from, WaitsOn::Node(node)));
                crossbeam_channel::select! {
                    send(peer, item) -> sent => sent.map_err(|_| ()),
                    recv(self.abort) -> _ => Err(()),
                }
            }
        }
    }

    /// Queues `item` for every peer (best effort: a full or closed channel skips that peer).
    pub(crate) fn to_all(&self, item: &Outgoing) {
        for peer in self.peers.iter().flatten() {
            let _ = peer.try_send(item.clone());
        }
    }

    /// Queues `item` for `node` (best effort).
    pub(crate) fn to_node(&self, node: u16, item: Outgoing) {
        if let Some(Some(peer)) = self.peers.get(node as usize) {
            let _ = peer.try_send(item);
        }
    }

    /// The other nodes.
    pub(crate) fn peers(&self) -> Vec<u16> {
        (0..self.peers.len() as u16).filter(|&n| self.peers[n as usize].is_some()).collect()
    }

    /// Tells every peer this node's job failed (best effort: a peer already gone is skipped).
    pub(crate) fn abort_peers(&self, error: &RuntimeError) {
        // A peer's own failure is not echoed back to it; the others still hear of it.
        let reason = regflow_net::frame::cut_reason(&error.to_string());
        for peer in self.peers.iter().flatten() {
            let _ = peer.try_send(Outgoing::Abort(reason.clone()));
        }
    }
}

/// What both threads of one connection share: the peer, the job's state and memory, the
/// connection's flight recorder, and the flags each reads from the other.
#[derive(Clone)]
pub(super) struct Link {
    /// The peer node.
    pub(super) node: u16,
    /// How long the peer may send nothing (`Cluster::with_silence_limit`).
    pub(super) silence: Duration,
    pub(super) recorder: std::sync::Arc<record::FlightRecorder>,
    /// Set when the connection's reader stops (the writer waits for it on a failed send,
    /// to let the reader say why).
    pub(super) reader_stopped: Arc<AtomicBool>,
    pub(super) arenas: Arc<PlanArenas>,
    pub(super) shared: Arc<JobShared>,
    pub(super) router: crate::bus::Router,
    pub(super) names: PeerNames,
    /// Set once this node's job is over: a connection closing after that is no error.
    pub(super) done: Arc<AtomicBool>,
}

impl Link {
    /// The peer's host, for errors.
    pub(super) fn host(&self) -> String {
        self.names.host(self.node)
    }
}

/// Who sits at the other end of each connection, for errors.
#[derive(Debug, Clone)]
pub(crate) struct PeerNames {
    pub(crate) hosts: Vec<String>,
}

impl PeerNames {
    pub(crate) fn host(&self, node: u16) -> String {
        self.hosts.get(node as usize).cloned().unwrap_or_else(|| "?".into())
    }
}

/// What the reader checks frames against: the plan, the hosted actors, the mirrors.
#[derive(Debug)]
pub(crate) struct WireCheck {
    pub(crate) plan: Arc<Plan>,
    /// Plan index of every actor, by raw id.
    pub(crate) by_id: HashMap<u64, ActorIndex>,
    pub(crate) ids: Vec<ActorId>,
    /// Node of each actor.
    pub(crate) node_of: Vec<u16>,
    /// Firings of each actor per step (micro-batches), to tell which step a piece is of.
    pub(crate) per_step: Vec<u64>,
}

impl WireCheck {
    fn new(plan: Arc<Plan>, ids: &PlanIds, per_step: Vec<u64>) -> Self {
        let by_id = ids.actors.iter().enumerate().map(|(a, id)| (id.bits(), ActorIndex(a as u32))).collect();
        let node_of =
            (0..plan.actors.len()).map(|a| plan.devices[plan.device_of(ActorIndex(a as u32)).index()].node).collect();
        Self { plan, by_id, ids: ids.actors.clone(), node_of, per_step }
    }
}

/// A running data plane: the threads of every connection, and how to end them.
#[derive(Debug)]
pub(crate) struct NetPlane {
    out: Arc<NetOut>,
    writers: Vec<(u16, JoinHandle<()>)>,
    readers: Vec<(u16, JoinHandle<()>)>,
    transports: Vec<std::sync::Arc<dyn Transport>>,
    /// Set once this node's job is over: a connection closing after that is no error.
    done: Arc<AtomicBool>,
    /// Rank 0's control plane and this node's control client, kept until the job ends.
    _keep: Option<Box<dyn std::any::Any + Send>>,
    /// Each connection's flight recorder.
    recorders: Vec<std::sync::Arc<record::FlightRecorder>>,
}

/// How long the end of a job waits for its writers to flush their last frames.
const FLUSH_GRACE: Duration = Duration::from_secs(10);

impl NetPlane {
    /// The channels of every peer of `cluster`, before any thread runs; capacity per peer
    /// from [`channel_capacities`].
    pub(crate) fn channels(
        cluster: &Cluster,
        capacities: &[usize],
        abort: crossbeam_channel::Receiver<()>,
        waits: std::sync::Arc<crate::send_waits::SendWaits>,
    ) -> (Arc<NetOut>, Vec<Option<crossbeam_channel::Receiver<Outgoing>>>) {
        let mut senders = Vec::with_capacity(cluster.world() as usize);
        let mut receivers = Vec::with_capacity(cluster.world() as usize);
        for node in 0..cluster.world() {
            if cluster.link(node).is_some() {
                let (tx, rx) = crossbeam_channel::bounded(capacities.get(node as usize).copied().unwrap_or(64));
                senders.push(Some(tx));
                receivers.push(Some(rx));
            } else {
                senders.push(None);
                receivers.push(None);
            }
        }
        (Arc::new(NetOut { rank: cluster.rank(), peers: senders, abort, waits }), receivers)
    }

    /// Starts the reader and writer of every connection.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn start(
        cluster: Cluster,
        out: Arc<NetOut>,
        receivers: Vec<Option<crossbeam_channel::Receiver<Outgoing>>>,
        plan: Arc<Plan>,
        ids: &PlanIds,
        arenas: Arc<PlanArenas>,
        groups: Arc<NetGroups>,
        shared: Arc<JobShared>,
        router: crate::bus::Router,
        watch: WatchNetSenders,
        per_step: Vec<u64>,
    ) -> Result<Self, RuntimeError> {
        let (rank, world, silence) = (cluster.rank(), cluster.world(), cluster.silence());
        let names = PeerNames { hosts: cluster.hosts() };
        let check = Arc::new(WireCheck::new(plan, ids, per_step));
        let done = Arc::new(AtomicBool::new(false));
        let (links, keep) = cluster.into_parts();
        let mut plane = NetPlane {
            out,
            writers: Vec::new(),
            readers: Vec::new(),
            transports: Vec::new(),
            done: done.clone(),
            _keep: keep,
            recorders: Vec::new(),
        };
        let fail = |node: u16, message: String| RuntimeError::Cluster {
            node: rank,
            world,
            message: format!("node {node}: {message}"),
        };
        for (link, receiver) in links.into_iter().zip(receivers) {
            let (Some(link), Some(receiver)) = (link, receiver) else { continue };
            let node = link.rank;
            let transport: std::sync::Arc<dyn Transport> = std::sync::Arc::from(link.transport);
            // Reads wake regularly so the reader can tell a silent peer from a slow one.
            transport.set_read_timeout(Some(reader::SILENCE_POLL)).map_err(|e| fail(node, e.to_string()))?;
            let read_half = transport.reader().map_err(|e| fail(node, e.to_string()))?;
            let write_half = transport.writer().map_err(|e| fail(node, e.to_string()))?;
            plane.transports.push(transport.clone());
            let recorder = std::sync::Arc::new(record::FlightRecorder::new(node));
            plane.recorders.push(recorder.clone());
            let link = Link {
                node,
                silence,
                recorder,
                reader_stopped: Arc::new(AtomicBool::new(false)),
                arenas: arenas.clone(),
                shared: shared.clone(),
                router: router.clone(),
                names: names.clone(),
                done: done.clone(),
            };
            let writer = writer::Writer::new(link.clone(), write_half, receiver, &check);
            plane.writers.push((node, spawn(format!("regflow-net-w{node}"), move || writer.run())?));
            let reader = reader::Reader::new(link, read_half, check.clone(), groups.clone(), watch.clone());
            plane.readers.push((node, spawn(format!("regflow-net-r{node}"), move || reader.run())?));
        }
        Ok(plane)
    }

    /// Each connection's flight recorder.
    pub(crate) fn recorders(&self) -> Vec<std::sync::Arc<record::FlightRecorder>> {
        self.recorders.clone()
    }

    /// Ends the data plane after this node's job is over (ended or failed): every writer
    /// sends `Bye` after what it still holds and stops; then the connections close and the
    /// readers stop. Bounded: a writer stuck on a peer that reads nothing is left behind
    /// after [`FLUSH_GRACE`].
    pub(crate) fn finish(&mut self) {
        for peer in self.out.peers.iter().flatten() {
            let _ = peer.send_timeout(Outgoing::Bye, FLUSH_GRACE);
        }
        let deadline = std::time::Instant::now() + FLUSH_GRACE;
        for (node, handle) in self.writers.drain(..) {
            while !handle.is_finished() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(2));
            }
            if handle.is_finished() {
                let _ = handle.join();
            } else {
                tracing::warn!(node, "the writer to node {node} did not flush within {FLUSH_GRACE:?}; leaving it");
            }
        }
        // The readers go on until each peer closes (after its bye): closing with unread
        // bytes would reset the connection and could drop this node's bye in flight.
        self.done.store(true, Ordering::Release);
        for transport in &self.transports {
            transport.close_write();
        }
        let deadline = std::time::Instant::now() + FLUSH_GRACE;
        while self.readers.iter().any(|(_, h)| !h.is_finished()) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        for transport in &self.transports {
            transport.close();
        }
        for (_, handle) in self.readers.drain(..) {
            let _ = handle.join();
        }
    }
}

impl Drop for NetPlane {
    fn drop(&mut self) {
        if !self.writers.is_empty() || !self.readers.is_empty() {
            self.finish();
        }
    }
}

/// Starts a connection thread named `name`.
fn spawn(name: String, body: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>, RuntimeError> {
    std::thread::Builder::new()
        .name(name.clone())
        .spawn(body)
        .map_err(|e| RuntimeError::Spawn { thread: name, message: e.to_string() })
}

/// Per peer node: how many frames the stream threads may have queued for its writer at
/// once. Each register crossing to that node has at most `register_num` pieces in flight
/// per consumer there (a `Ready` each), and as many `Ack`s come back the other way; one
/// `Eord` per consumer; two collective rounds per member; plus room for the abort and bye.
pub(crate) fn channel_capacities(plan: &Plan, node: u16, world: u16) -> Vec<usize> {
    let node_of = |a: ActorIndex| plan.devices[plan.device_of(a).index()].node;
    let mut capacity = vec![16usize; world as usize];
    for desc in &plan.regst_descs {
        let producer = node_of(desc.producer);
        for &consumer in &desc.consumers {
            let consumer_node = node_of(consumer);
            if producer == consumer_node {
                continue;
            }
            let per_edge = desc.register_num as usize + 1;
            if producer == node {
                capacity[consumer_node as usize] += per_edge;
            } else if consumer_node == node {
                capacity[producer as usize] += per_edge;
            }
        }
    }
    for actor in &plan.actors {
        if let regflow_plan::ActorKind::Compute { kernel: regflow_plan::KernelConf::Collective(_) } = &actor.kind {
            for c in capacity.iter_mut() {
                *c += 2;
            }
        }
    }
    capacity
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::send_waits::SendWaits;
    use regflow_actors::Body;

    #[test]
    fn a_stream_waiting_for_room_in_a_nodes_queue_names_the_node_until_the_abort() {
        let (tx, _writer) = crossbeam_channel::bounded(1);
        let (abort_tx, abort) = crossbeam_channel::bounded::<()>(1);
        let waits = std::sync::Arc::new(SendWaits::new(3, abort.clone()));
        let out = NetOut { rank: 0, peers: vec![None, Some(tx)], abort, waits: waits.clone() };
        let dst = ActorId::new(1, 0, 0, 0).expect("small ids fit");
        let msg = Message { dst, src: dst, body: Body::ActDone };
        out.send_actor(msg, Some(2)).expect("room for one");
        assert_eq!(waits.waiting_on(2), None, "the first frame found room");
        std::thread::scope(|scope| {
            let sender = scope.spawn(|| out.send_actor(msg, Some(2)));
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while waits.waiting_on(2).is_none() {
                assert!(std::time::Instant::now() < deadline, "the second send never said it waits");
                std::thread::yield_now();
            }
            assert_eq!(waits.waiting_on(2), Some(WaitsOn::Node(1)), "stream 2 waits on node 1's queue");
            drop(abort_tx);
            assert_eq!(
                sender.join().expect("the sender does not panic"),
                Err(EnvError::Disconnected { dst }),
                "the abort ends the wait"
            );
        });
        assert_eq!(waits.waiting_on(2), None, "no longer waiting");
        assert_eq!(waits.count(), 0, "a node's queue is not a lane");
    }
}
