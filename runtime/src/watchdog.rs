//! The watchdog: when pieces are pending and no actor has fired for a while, it asks every
//! stream what its actors wait on and aborts the job with the wait-for graph. A job never
//! hangs silently.
//!
//! In a job that runs one node of several, the graph spans the nodes: before it aborts,
//! the watchdog asks every peer for what its actors wait on (`SnapshotRequest`), waits a
//! bounded time for the answers, and adds them, so a cycle through actors of several nodes
//! is found and named. Each watchdog also answers its peers' requests.

use crate::bus::Router;
use crate::inbox::Envelope;
use crate::job::UserWaits;
use crate::net::WatchNet;
use crate::send_waits::WaitsOn;
use crate::stream::JobShared;
use crate::sync::{Arc, Ordering};
use crate::RuntimeError;
use regflow_actors::{ActorId, ActorSnapshot, Lifecycle, WaitReason};
use std::collections::HashMap;
use std::fmt;
use std::time::{Duration, Instant};

/// One thing a stuck actor waits on, in plan names.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Wait {
    /// A source not started.
    NotStarted,
    /// A fed source waiting for the user to push.
    Feed,
    /// A sink waiting for the user to fetch.
    Fetch,
    /// An empty input.
    Input {
        /// Register descriptor name.
        regst: String,
        /// Its producer's name.
        producer: String,
    },
    /// An output whose every slot is held.
    OutputFull {
        /// Register descriptor name.
        regst: String,
        /// Its slot count.
        register_num: u32,
        /// Names of the consumers holding slots.
        holders: Vec<String>,
    },
    /// A repeat waiting for the pieces it handed out.
    Lent {
        /// Register descriptor name.
        regst: String,
        /// Pieces not yet given back.
        pieces: u32,
        /// Names of the consumers holding them.
        holders: Vec<String>,
    },
    /// Kernels in flight.
    Kernel {
        /// How many.
        launches: usize,
    },
}

/// An actor that is not done, and what it waits on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StuckActor {
    /// Name.
    pub name: String,
    /// Id.
    pub id: ActorId,
    /// Its stream.
    pub stream: String,
    /// Running or zombie.
    pub lifecycle: Lifecycle,
    /// Times it fired.
    pub fires: u64,
    /// What it waits on.
    pub waits: Vec<Wait>,
}

/// A stuck actor as one node tells another (its waits already in plan names).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(crate) struct RemoteStuck {
    name: String,
    stream: String,
    lifecycle: String,
    fires: u64,
    waits: Vec<Wait>,
}

impl RemoteStuck {
    fn from_local(actor: &StuckActor) -> Self {
        Self {
            name: actor.name.clone(),
            stream: actor.stream.clone(),
            lifecycle: format!("{:?}", actor.lifecycle),
            fires: actor.fires,
            waits: actor.waits.clone(),
        }
    }

    /// As a stuck actor of the graph, its id found by name in the plan (every node has it).
    fn into_stuck(self, names: &Names) -> StuckActor {
        let id = names.actors.iter().find(|(_, n)| **n == self.name).map(|(id, _)| *id);
        let lifecycle = if self.lifecycle == "Zombie" { Lifecycle::Zombie } else { Lifecycle::Running };
        StuckActor {
            id: id.unwrap_or_else(|| ActorId::new(0, 0, 0, 0).unwrap_or_else(|| unreachable!("0 fits every field"))),
            name: self.name,
            stream: self.stream,
            lifecycle,
            fires: self.fires,
            waits: self.waits,
        }
    }
}

/// What the program embedding the job is doing or holding when it stalls: the user-side
/// nodes of the wait-for graph.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UserWait {
    /// A push waiting for a free buffer: the source holds all its pieces.
    Push {
        /// The feed, as messages name it (`input 'x' (source 'input:x')`, `source 'src'`).
        feed: String,
        /// The fed source actor.
        source: String,
        /// Pieces the source holds before a push waits.
        buffers: u64,
        /// How long the push has waited.
        blocked_for: Duration,
    },
    /// A fetcher whose sink has used every credit, and that nobody is reading.
    Unread {
        /// The sink actor.
        sink: String,
        /// Pieces delivered and not read (or read and still held).
        pieces: u64,
        /// Whether the program took the fetcher (`Job::fetcher`).
        taken: bool,
    },
    /// A thread of the program waiting in [`crate::Fetcher::recv`] for a piece.
    Recv {
        /// The sink whose fetcher it reads.
        sink: String,
    },
    /// An input (or fed source) never pushed to while others were.
    NeverFed {
        /// The input's name (the source's, for a plan without a signature).
        input: String,
        /// The inputs that got pieces, with how many.
        others: Vec<(String, u64)>,
    },
    /// `Job::wait` is running: it waits for every actor to finish.
    JobWait,
}

impl UserWait {
    /// The node's name in edges and cycles; actors are named by their plan names.
    pub fn node(&self) -> String {
        match self {
            UserWait::Push { feed, .. } => format!("push to {feed}"),
            UserWait::Unread { sink, .. } => format!("fetcher of '{sink}'"),
            UserWait::Recv { sink } => format!("recv on '{sink}'"),
            UserWait::NeverFed { input, .. } => format!("feed of '{input}'"),
            UserWait::JobWait => "Job::wait()".into(),
        }
    }
}

/// A stream thread that waits for room to send: in its lane to another stream thread, or
/// in its queue to the connection to another node (a message that found it full). It
/// answers no snapshot meanwhile, and none of its actors can fire until the other side
/// takes an envelope or a frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FullLane {
    /// The waiting stream.
    pub stream: String,
    /// Who has not taken what the stream sent.
    pub waits_on: RoomFrom,
    /// The waiting stream's actors (their thread waits with them).
    pub actors: Vec<String>,
}

/// Who must take what a [`FullLane`]'s stream sent before it can send again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RoomFrom {
    /// The thread of this stream, which has not taken the lane's envelopes.
    Stream(String),
    /// The writer of the connection to this node, which has not taken the queue's frames
    /// (the peer does not read them, or the connection is stuck).
    Connection {
        /// The node the connection leads to.
        node: u16,
    },
}

impl RoomFrom {
    /// Its node name in edges and cycles: a stream as [`FullLane::node`] names it, a
    /// connection as `connection to node N`.
    pub fn node(&self) -> String {
        match self {
            RoomFrom::Stream(stream) => FullLane::node(stream),
            RoomFrom::Connection { node } => format!("connection to node {node}"),
        }
    }
}

impl FullLane {
    /// A stream's node name in edges and cycles.
    pub fn node(stream: &str) -> String {
        format!("stream {stream}")
    }
}

/// Who waits on whom when a job stalls.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WaitForGraph {
    /// Actors not done.
    pub actors: Vec<StuckActor>,
    /// Streams that did not answer the watchdog (blocked outside the protocol).
    pub silent_streams: Vec<String>,
    /// Silent streams whose thread waits for room to send: in a lane to another stream, or
    /// in the queue to another node's connection.
    pub full_lanes: Vec<FullLane>,
    /// What the program's threads wait on or hold: blocked pushes, unread fetchers, inputs
    /// never fed, `Job::wait`.
    pub user: Vec<UserWait>,
    /// A cycle of nodes (actors, and user-side nodes named by [`UserWait::node`]) each
    /// waiting on the next, if there is one.
    pub cycle: Option<Vec<String>>,
    /// In a job that runs one node of several: each connection's last frames (its flight
    /// recorder) and each collective across nodes' rounds, one line each.
    pub network: Vec<String>,
}

impl WaitForGraph {
    /// Edges `(waiter, waited on, what)`: between actors `what` is the register; edges
    /// through the program use user-side node names ([`UserWait::node`]) and say `push`
    /// (a push waits on its source), `fetch` (a sink waits on its fetcher), `not reading`
    /// (an unread fetcher waits on the program's thread blocked in a push, in another
    /// fetcher's `recv` or in `Job::wait`), `recv` (a reading thread waits on its sink) or
    /// `end` (`Job::wait` waits on a sink to finish). A stream whose thread waits for room
    /// ([`FullLane`], nodes named by [`FullLane::node`]) waits on the other stream (`full
    /// lane`) or on the connection to the other node (`full queue`, named by
    /// [`RoomFrom::node`]), and its actors wait on it (`its thread`).
    pub fn edges(&self) -> Vec<(String, String, String)> {
        let mut edges = Vec::new();
        for lane in &self.full_lanes {
            let stream = FullLane::node(&lane.stream);
            let what = match lane.waits_on {
                RoomFrom::Stream(_) => "full lane",
                RoomFrom::Connection { .. } => "full queue",
            };
            edges.push((stream.clone(), lane.waits_on.node(), what.into()));
            for actor in &lane.actors {
                edges.push((actor.clone(), stream.clone(), "its thread".into()));
            }
        }
        for actor in &self.actors {
            for wait in &actor.waits {
                match wait {
                    Wait::Input { regst, producer } => {
                        edges.push((actor.name.clone(), producer.clone(), regst.clone()))
                    }
                    Wait::OutputFull { regst, holders, .. } | Wait::Lent { regst, holders, .. } => {
                        for holder in holders {
                            edges.push((actor.name.clone(), holder.clone(), regst.clone()));
                        }
                    }
                    Wait::Fetch => {
                        for fetcher in self
                            .user
                            .iter()
                            .filter(|u| matches!(u, UserWait::Unread { sink, .. } if *sink == actor.name))
                        {
                            edges.push((actor.name.clone(), fetcher.node(), "fetch".into()));
                        }
                    }
                    _ => {}
                }
            }
        }
        let busy: Vec<&UserWait> = self
            .user
            .iter()
            .filter(|u| matches!(u, UserWait::Push { .. } | UserWait::Recv { .. } | UserWait::JobWait))
            .collect();
        for node in &self.user {
            match node {
                UserWait::Push { source, .. } => edges.push((node.node(), source.clone(), "push".into())),
                UserWait::Unread { .. } => {
                    for thread in &busy {
                        edges.push((node.node(), thread.node(), "not reading".into()));
                    }
                }
                UserWait::JobWait => {
                    for sink in self.actors.iter().filter(|a| a.waits.contains(&Wait::Fetch)) {
                        edges.push((node.node(), sink.name.clone(), "end".into()));
                    }
                }
                UserWait::Recv { sink } => edges.push((node.node(), sink.clone(), "recv".into())),
                UserWait::NeverFed { .. } => {}
            }
        }
        edges
    }

    /// The stall's cause in one sentence when the program is part of it: a push waiting
    /// while nobody reads a full fetcher (a deadlock through the user), `Job::wait` with a
    /// full unread fetcher, an input never fed.
    pub fn cause(&self) -> Option<String> {
        let unread = self.user.iter().find_map(|u| match u {
            UserWait::Unread { sink, pieces, taken } => Some((sink, pieces, taken)),
            _ => None,
        });
        let fetcher = |(sink, pieces, taken): (&String, &u64, &bool)| {
            let never = if *taken { "" } else { " (never taken)" };
            format!("the fetcher of sink '{sink}'{never} holds {pieces} unread piece(s)")
        };
        let push = self.user.iter().find_map(|u| match u {
            UserWait::Push { feed, buffers, .. } => Some((feed, buffers)),
            _ => None,
        });
        if let (Some((feed, buffers)), Some(unread)) = (push, unread) {
            return Some(format!(
                "user-side deadlock: the program is blocked pushing to {feed}, whose {buffers} buffer(s) are full, while {} that nobody reads, so the job cannot take the push; fetch from another thread, or push fewer pieces ahead of your fetches",
                fetcher(unread)
            ));
        }
        let recv = self.user.iter().find_map(|u| match u {
            UserWait::Recv { sink } => Some(sink),
            _ => None,
        });
        if let (Some(reading), Some(unread)) = (recv, unread) {
            return Some(format!(
                "user-side deadlock: the program waits for a piece of sink '{reading}' while {} that nobody reads; read each fetcher on a thread of its own",
                fetcher(unread)
            ));
        }
        if let (true, Some(unread)) = (self.user.contains(&UserWait::JobWait), unread) {
            return Some(format!(
                "Job::wait() waits for the job while {}; read the fetcher to its end, or drop it, before calling wait()",
                fetcher(unread)
            ));
        }
        self.user.iter().find_map(|u| match u {
            UserWait::NeverFed { input, others } => {
                let others: Vec<String> = others.iter().map(|(name, n)| format!("'{name}' got {n}")).collect();
                Some(format!("input '{input}' was never fed: 0 pieces pushed while {}", others.join(", ")))
            }
            _ => None,
        })
    }

    /// The stuck actor with this name.
    pub fn actor(&self, name: &str) -> Option<&StuckActor> {
        self.actors.iter().find(|a| a.name == name)
    }

    fn find_cycle(&self) -> Option<Vec<String>> {
        let edges = self.edges();
        let mut next: HashMap<&str, Vec<&str>> = HashMap::new();
        for (from, to, _) in &edges {
            next.entry(from.as_str()).or_default().push(to.as_str());
        }
        let mut starts: Vec<String> = self.user.iter().map(UserWait::node).collect();
        starts.extend(self.full_lanes.iter().map(|lane| FullLane::node(&lane.stream)));
        for start in starts.iter().map(String::as_str).chain(self.actors.iter().map(|a| a.name.as_str())) {
            // Depth-first from `start`, looking for a way back to it.
            let mut stack = vec![(start, 0usize)];
            let mut seen = vec![start];
            while let Some(&mut (node, ref mut i)) = stack.last_mut() {
                let succs = next.get(node).map(Vec::as_slice).unwrap_or(&[]);
                if let Some(&succ) = succs.get(*i) {
                    *i += 1;
                    if succ == start {
                        let mut path: Vec<String> = stack.iter().map(|(n, _)| n.to_string()).collect();
                        path.push(start.to_string());
                        return Some(path);
                    }
                    if !seen.contains(&succ) {
                        seen.push(succ);
                        stack.push((succ, 0));
                    }
                } else {
                    stack.pop();
                }
            }
        }
        None
    }
}

impl fmt::Display for Wait {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Wait::NotStarted => write!(f, "not started"),
            Wait::Feed => write!(f, "waits for the user to push a piece"),
            Wait::Fetch => write!(f, "waits for the user to fetch delivered pieces"),
            Wait::Input { regst, producer } => write!(f, "waits on input '{regst}': empty, produced by '{producer}'"),
            Wait::OutputFull { regst, register_num, holders } => {
                write!(f, "output '{regst}' is full: all {register_num} slot(s) held by ['{}']", holders.join("', '"))
            }
            Wait::Lent { regst, pieces, holders } => {
                write!(f, "waits for {pieces} piece(s) of '{regst}' to come back from ['{}']", holders.join("', '"))
            }
            Wait::Kernel { launches } => write!(f, "{launches} kernel(s) in flight"),
        }
    }
}

impl fmt::Display for UserWait {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UserWait::Push { feed, buffers, blocked_for, .. } => {
                write!(f, "a push to {feed} has waited {blocked_for:?}: the source holds all {buffers} of its buffers")
            }
            UserWait::Unread { sink, pieces, taken: true } => {
                write!(f, "the fetcher of sink '{sink}' holds {pieces} unread piece(s) and nobody is reading it")
            }
            UserWait::Unread { sink, pieces, taken: false } => {
                write!(f, "the fetcher of sink '{sink}' was never taken and holds {pieces} unread piece(s)")
            }
            UserWait::NeverFed { input, others } => {
                let others: Vec<String> = others.iter().map(|(name, n)| format!("'{name}' got {n}")).collect();
                write!(f, "input '{input}' was never fed: 0 pieces pushed while {}", others.join(", "))
            }
            UserWait::Recv { sink } => write!(f, "a thread waits in recv() on the fetcher of sink '{sink}'"),
            UserWait::JobWait => write!(f, "Job::wait() is waiting for every actor to finish"),
        }
    }
}

impl fmt::Display for WaitForGraph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "wait-for graph ({} actor(s) not done):", self.actors.len())?;
        for actor in &self.actors {
            writeln!(
                f,
                "  '{}' ({}, {}, {:?}, fired {} times):",
                actor.name, actor.id, actor.stream, actor.lifecycle, actor.fires
            )?;
            for wait in &actor.waits {
                writeln!(f, "    {wait}")?;
            }
        }
        for stream in &self.silent_streams {
            writeln!(f, "  stream {stream} did not answer")?;
        }
        for lane in &self.full_lanes {
            match &lane.waits_on {
                RoomFrom::Stream(to) => writeln!(
                    f,
                    "  stream {} waits for room in its lane to stream {to}, whose thread has not taken the lane's messages",
                    lane.stream
                )?,
                RoomFrom::Connection { node } => writeln!(
                    f,
                    "  stream {} waits for room in its queue to the connection to node {node}, whose writer has not taken the frames",
                    lane.stream
                )?,
            }
        }
        for node in &self.user {
            writeln!(f, "  program: {node}")?;
        }
        if let Some(cycle) = &self.cycle {
            writeln!(f, "  deadlock cycle: {}", cycle.join(" -> "))?;
        }
        for line in &self.network {
            writeln!(f, "  {line}")?;
        }
        Ok(())
    }
}

/// Names the watchdog needs to turn snapshots into a readable graph.
#[derive(Debug)]
pub(crate) struct Names {
    pub(crate) actors: HashMap<ActorId, String>,
    pub(crate) descs: Vec<String>,
    pub(crate) streams: Vec<String>,
    /// Each plan stream's actors.
    pub(crate) stream_actors: Vec<Vec<String>>,
    /// Plan streams this job runs.
    pub(crate) hosted: Vec<usize>,
}

impl Names {
    fn actor(&self, id: ActorId) -> String {
        self.actors.get(&id).cloned().unwrap_or_else(|| id.to_string())
    }

    /// Plan stream `s`, which did not answer, as the graph lists it: with the kernel it is
    /// busy in, or whom it waits on for room to send (`waiting`, as its thread recorded
    /// it), where it says.
    fn silent_stream(&self, shared: &JobShared, s: usize, waiting: Option<WaitsOn>) -> String {
        let in_kernel = shared.probes[s].in_kernel.load(Ordering::Relaxed);
        if let Some((_, actor)) =
            in_kernel.checked_sub(1).and_then(|bits| self.actors.iter().find(|(id, _)| id.bits() == bits))
        {
            return format!("{} (busy in the kernel of '{actor}')", self.streams[s]);
        }
        match waiting {
            Some(WaitsOn::Stream(to)) => format!(
                "{} (waiting for room in its lane to {})",
                self.streams[s],
                self.streams.get(to).map_or("an unknown stream", String::as_str)
            ),
            Some(WaitsOn::Node(node)) => format!(
                "{} (waiting for room in its queue to the connection to node {node}, whose writer has not taken the frames)",
                self.streams[s]
            ),
            None => self.streams[s].clone(),
        }
    }

    /// Plan stream `s`, which did not answer, as a [`FullLane`] if it waits for room to
    /// send (`waits_on`, as its thread recorded it).
    fn full_lane(&self, s: usize, waits_on: Option<WaitsOn>) -> Option<FullLane> {
        let waits_on = match waits_on? {
            WaitsOn::Stream(to) => RoomFrom::Stream(self.streams.get(to)?.clone()),
            WaitsOn::Node(node) => RoomFrom::Connection { node },
        };
        Some(FullLane {
            stream: self.streams.get(s)?.clone(),
            waits_on,
            actors: self.stream_actors.get(s).cloned().unwrap_or_default(),
        })
    }

    fn graph(
        &self,
        snapshots: &[(usize, Vec<ActorSnapshot>)],
        silent: Vec<String>,
        full_lanes: Vec<FullLane>,
        user: Vec<UserWait>,
    ) -> WaitForGraph {
        let mut actors = Vec::new();
        for (stream, list) in snapshots {
            for snap in list.iter().filter(|s| s.lifecycle != Lifecycle::Done) {
                let waits = snap
                    .waits
                    .iter()
                    .map(|w| match w {
                        WaitReason::NotStarted => Wait::NotStarted,
                        WaitReason::Feed => Wait::Feed,
                        WaitReason::Fetch => Wait::Fetch,
                        WaitReason::Input { desc, producer } => {
                            Wait::Input { regst: self.descs[desc.index()].clone(), producer: self.actor(*producer) }
                        }
                        WaitReason::OutputFull { desc, register_num, holders } => Wait::OutputFull {
                            regst: self.descs[desc.index()].clone(),
                            register_num: *register_num,
                            holders: holders.iter().map(|h| self.actor(*h)).collect(),
                        },
                        WaitReason::Lent { desc, pieces, holders } => Wait::Lent {
                            regst: self.descs[desc.index()].clone(),
                            pieces: *pieces,
                            holders: holders.iter().map(|h| self.actor(*h)).collect(),
                        },
                        WaitReason::Kernel { launches } => Wait::Kernel { launches: *launches },
                    })
                    .collect();
                actors.push(StuckActor {
                    name: snap.name.clone(),
                    id: snap.id,
                    stream: self.streams[*stream].clone(),
                    lifecycle: snap.lifecycle,
                    fires: snap.fires,
                    waits,
                });
            }
        }
        let mut graph =
            WaitForGraph { actors, silent_streams: silent, full_lanes, user, cycle: None, network: Vec::new() };
        graph.cycle = graph.find_cycle();
        graph
    }
}

/// How long a stalled watchdog waits for its peers' snapshots.
const PEER_SNAPSHOT_WAIT: Duration = Duration::from_secs(2);

/// What every hosted stream's actors wait on now: (stream, snapshots) per stream that
/// answered within `wait`, and the live streams that did not.
fn collect(
    shared: &JobShared,
    router: &Router,
    names: &Names,
    snapshots: &crossbeam_channel::Receiver<(usize, Vec<ActorSnapshot>)>,
    wait: Duration,
) -> (Vec<(usize, Vec<ActorSnapshot>)>, Vec<usize>) {
    while snapshots.try_recv().is_ok() {}
    router.broadcast(Envelope::Snapshot);
    let mut answers: Vec<(usize, Vec<ActorSnapshot>)> = Vec::new();
    let deadline = Instant::now() + wait;
    let live: Vec<usize> =
        names.hosted.iter().copied().filter(|&s| !shared.probes[s].exited.load(Ordering::Acquire)).collect();
    while answers.len() < live.len() {
        match snapshots.recv_deadline(deadline) {
            Ok(answer) => answers.push(answer),
            Err(_) => break,
        }
    }
    (answers, live)
}

/// Answers a peer's request for this node's snapshot.
fn answer_peer(
    node: u16,
    net: &WatchNet,
    shared: &JobShared,
    router: &Router,
    names: &Names,
    snapshots: &crossbeam_channel::Receiver<(usize, Vec<ActorSnapshot>)>,
    tick: Duration,
) {
    let (mut answers, _) = collect(shared, router, names, snapshots, tick.max(Duration::from_millis(200)));
    answers.sort_by_key(|(s, _)| *s);
    let graph = names.graph(&answers, Vec::new(), Vec::new(), Vec::new());
    let remote: Vec<RemoteStuck> = graph.actors.iter().map(RemoteStuck::from_local).collect();
    if let Ok(json) = serde_json::to_vec(&remote) {
        net.out.to_node(node, crate::net::Outgoing::Snapshot(json));
    }
}

/// The stuck actors of the other nodes, as far as they answer within [`PEER_SNAPSHOT_WAIT`].
fn peer_actors(net: &WatchNet, names: &Names) -> (Vec<StuckActor>, Vec<u16>) {
    while net.replies.try_recv().is_ok() {}
    let peers = net.out.peers();
    net.out.to_all(&crate::net::Outgoing::SnapshotRequest);
    let deadline = Instant::now() + PEER_SNAPSHOT_WAIT;
    let mut answered = Vec::new();
    let mut actors = Vec::new();
    while answered.len() < peers.len() {
        match net.replies.recv_deadline(deadline) {
            Ok((node, remote)) => {
                answered.push(node);
                actors.extend(remote.into_iter().map(|r| r.into_stuck(names)));
            }
            Err(_) => break,
        }
    }
    let silent = peers.into_iter().filter(|p| !answered.contains(p)).collect();
    (actors, silent)
}

/// Runs until `stop` closes; checks every `timeout / 4`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn watch(
    shared: Arc<JobShared>,
    user: std::sync::Arc<UserWaits>,
    router: Router,
    names: Names,
    timeout: Duration,
    stop: crossbeam_channel::Receiver<()>,
    snapshots: crossbeam_channel::Receiver<(usize, Vec<ActorSnapshot>)>,
    net: Option<WatchNet>,
) {
    let tick = (timeout / 4).max(Duration::from_millis(1));
    // A kernel that runs longer than the timeout counts as stuck, like a collective that
    // never returns: the timeout is the user's statement of how long a firing may take.
    let fires = |shared: &JobShared| -> u64 { shared.probes.iter().map(|p| p.fires.load(Ordering::Relaxed)).sum() };
    let mut last_fires = fires(&shared);
    let mut last_progress = Instant::now();
    // Across nodes it also wakes often enough to answer a peer's request for its snapshot
    // well within the peer's wait. (A blocking `select!` here would allocate per tick.)
    let poll = match net {
        Some(_) => tick.min(PEER_SNAPSHOT_WAIT / 8),
        None => tick,
    };
    loop {
        if !matches!(stop.recv_timeout(poll), Err(crossbeam_channel::RecvTimeoutError::Timeout)) {
            return;
        }
        if let Some(net) = &net {
            while let Ok(node) = net.requests.try_recv() {
                answer_peer(node, net, &shared, &router, &names, &snapshots, tick);
            }
        }
        let total = fires(&shared);
        if total != last_fires {
            (last_fires, last_progress) = (total, Instant::now());
            continue;
        }
        let idle = last_progress.elapsed();
        if idle < timeout || shared.aborting.load(Ordering::Acquire) {
            continue;
        }
        let (mut answers, live) = collect(&shared, &router, &names, &snapshots, tick.max(Duration::from_millis(200)));
        let now_fires = fires(&shared);
        if now_fires != last_fires {
            (last_fires, last_progress) = (now_fires, Instant::now());
            continue;
        }
        let all: Vec<&ActorSnapshot> = answers.iter().flat_map(|(_, list)| list).collect();
        // Loop state at rest (variables, step tokens between steps) is not pending work: a
        // job waiting for its next push is idle, however long the program takes.
        let pending = all.iter().any(|s| s.holds_data);
        // A sink whose user has not fetched what it delivered holds finished results: the
        // job waits on its consumer, and aborting would lose them. Unless the consumer is
        // itself waiting on the job (blocked in a push, or in `Job::wait`) and nobody reads
        // the fetcher: that is a deadlock through the user.
        let user_nodes = user.nodes();
        let user_blocked =
            user_nodes.iter().any(|u| matches!(u, UserWait::Push { .. } | UserWait::Recv { .. } | UserWait::JobWait))
                && user_nodes.iter().any(|u| matches!(u, UserWait::Unread { .. }));
        let excused = all.iter().any(|s| s.waits.contains(&WaitReason::Fetch)) && !user_blocked;
        // Streams that did not answer (and did not end): blocked outside the protocol.
        let quiet: Vec<usize> = live
            .iter()
            .copied()
            .filter(|&s| !answers.iter().any(|(a, _)| *a == s) && !shared.probes[s].exited.load(Ordering::Acquire))
            .collect();
        // What each waits on, read once: its line and its full lane say the same.
        let (mut silent, mut full_lanes) = (Vec::new(), Vec::new());
        for &s in &quiet {
            let waiting = shared.send_waits.waiting_on(s);
            silent.push(names.silent_stream(&shared, s, waiting));
            full_lanes.extend(names.full_lane(s, waiting));
        }
        if (pending && !excused) || !silent.is_empty() {
            answers.sort_by_key(|(s, _)| *s);
            let mut graph = names.graph(&answers, silent, full_lanes, user_nodes);
            // The other nodes' stuck actors: the cycle may run through them.
            if let Some(net) = &net {
                let (remote, unanswered) = peer_actors(net, &names);
                graph.actors.extend(remote);
                graph.silent_streams.extend(unanswered.iter().map(|n| format!("node {n} (sent no snapshot)")));
                graph.cycle = graph.find_cycle();
                graph.network = net.dump(&names.descs);
            }
            shared.abort(RuntimeError::Stalled { idle, graph: Box::new(graph) }, &router);
            return;
        }
        last_progress = Instant::now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_streams_each_waiting_for_room_in_the_others_lane_are_a_cycle() {
        let lane = |stream: &str, waits_on: &str, actor: &str| FullLane {
            stream: stream.into(),
            waits_on: RoomFrom::Stream(waits_on.into()),
            actors: vec![actor.into()],
        };
        let mut graph =
            WaitForGraph { full_lanes: vec![lane("a", "b", "x"), lane("b", "a", "y")], ..WaitForGraph::default() };
        graph.cycle = graph.find_cycle();
        assert_eq!(graph.cycle, Some(vec!["stream a".into(), "stream b".into(), "stream a".into()]), "{graph}");
        assert!(graph.edges().contains(&("y".into(), "stream b".into(), "its thread".into())));
        // One stream waiting on a stream that waits on nothing known is no cycle.
        graph.full_lanes.pop();
        assert_eq!(graph.find_cycle(), None, "{graph}");
    }

    #[test]
    fn a_stream_waiting_for_room_in_a_nodes_queue_is_an_edge_to_the_connection() {
        let names = Names {
            actors: HashMap::new(),
            descs: Vec::new(),
            streams: vec!["n0.d0.s0".into(), "n0.d0.s1".into()],
            stream_actors: vec![vec!["send_to_1".into(), "relu".into()], vec!["loss".into()]],
            hosted: vec![0, 1],
        };
        assert_eq!(names.full_lane(0, None), None, "a stream that does not wait for room is no full lane");
        let lane = names.full_lane(0, Some(WaitsOn::Node(1))).expect("a wait on node 1's queue");
        assert_eq!(
            lane,
            FullLane {
                stream: "n0.d0.s0".into(),
                waits_on: RoomFrom::Connection { node: 1 },
                actors: vec!["send_to_1".into(), "relu".into()],
            }
        );
        let mut graph = WaitForGraph { full_lanes: vec![lane], ..WaitForGraph::default() };
        graph.cycle = graph.find_cycle();
        let edges = graph.edges();
        assert_eq!(
            edges,
            vec![
                ("stream n0.d0.s0".into(), "connection to node 1".into(), "full queue".into()),
                ("send_to_1".into(), "stream n0.d0.s0".into(), "its thread".into()),
                ("relu".into(), "stream n0.d0.s0".into(), "its thread".into()),
            ]
        );
        assert_eq!(graph.cycle, None, "the connection waits on nothing this node knows");
        assert!(
            graph.to_string().contains(
                "stream n0.d0.s0 waits for room in its queue to the connection to node 1, whose writer has not taken the frames"
            ),
            "{graph}"
        );
        // A lane to a stream the plan does not have is no full lane (nothing to name).
        assert_eq!(names.full_lane(0, Some(WaitsOn::Stream(7))), None);
        assert_eq!(
            names.full_lane(1, Some(WaitsOn::Stream(0))).map(|lane| lane.waits_on),
            Some(RoomFrom::Stream("n0.d0.s0".into()))
        );
    }
}
