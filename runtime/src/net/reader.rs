//! The reader of one connection: frames checked against the plan, a `Ready`'s bytes read
//! straight into this node's mirror of the slot, then the message handed to its stream.

use super::{Link, WireCheck};
use crate::collective::NetGroups;
use crate::sync::Arc;
use crate::RuntimeError;
use regflow_actors::{Body, Message, RegstRef};
use regflow_net::frame::{FrameError, FrameReader, Header, WireBody, WireMessage};
use regflow_plan::{ActorIndex, RegstDescId};
use std::io::{BufRead, BufReader, Read};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Read buffer: headers come in small reads; payloads larger than this bypass it.
const READ_BUFFER: usize = 64 * 1024;

/// How often a reader waiting for a frame wakes to check how long its peer has been
/// silent (the socket's read timeout; see `NetPlane::start`).
pub(super) const SILENCE_POLL: Duration = Duration::from_millis(500);
/// The largest snapshot a peer may send (JSON of what its stuck actors wait on).
const MAX_SNAPSHOT_BYTES: u64 = 64 << 20;

/// Before a peer's first frame (its job may still be starting), the silence it is allowed
/// is this many times the limit.
const START_SILENCE_FACTOR: u32 = 6;

pub(super) struct Reader {
    link: Link,
    input: Input,
    check: Arc<WireCheck>,
    groups: Arc<NetGroups>,
    /// The peer said `Bye`: its closing the connection is the normal end.
    bye: bool,
    /// When the last frame (of any kind) arrived; `None` before the first.
    heard: Option<Instant>,
    /// The firings the peer's last heartbeat reported.
    peer_fires: u64,
    /// The latest step (from 1) of a piece or collective round the peer sent here.
    last_step: Option<u64>,
    started: Instant,
    /// Where snapshot requests and replies go (the watchdog).
    watch: super::WatchNetSenders,
}

impl Reader {
    pub(super) fn new(
        link: Link,
        read: Box<dyn Read + Send>,
        check: Arc<WireCheck>,
        groups: Arc<NetGroups>,
        watch: super::WatchNetSenders,
    ) -> Self {
        Self {
            link,
            input: FrameReader::new(BufReader::with_capacity(READ_BUFFER, read)),
            check,
            groups,
            bye: false,
            heard: None,
            peer_fires: 0,
            last_step: None,
            started: Instant::now(),
            watch,
        }
    }

    /// Waits until bytes of the next frame are there: `Ok(false)` at the end of the stream.
    /// Wakes every `SILENCE_POLL` to check the peer has not been silent for too long.
    fn await_frame(&mut self) -> Result<bool, Stop> {
        loop {
            match self.input.get_mut().fill_buf() {
                Ok(bytes) => return Ok(!bytes.is_empty()),
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    if self.bye || self.link.done.load(Ordering::Acquire) {
                        continue;
                    }
                    let (since, limit) = match self.heard {
                        Some(at) => (at, self.link.silence),
                        None => (self.started, self.link.silence * START_SILENCE_FACTOR),
                    };
                    if since.elapsed() >= limit {
                        return Err(Stop::Lost(format!(
                            "it sent nothing for {:.0} s, not even a heartbeat (its last frame said it had fired {} \
                             times): its process is stuck or the network between the nodes is down",
                            since.elapsed().as_secs_f64(),
                            self.peer_fires
                        )));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Stop::Lost(describe(&FrameError::Io(e)))),
            }
        }
    }

    pub(super) fn run(mut self) {
        let stopped = self.link.reader_stopped.clone();
        self.read_frames();
        stopped.store(true, Ordering::Release);
    }

    fn read_frames(&mut self) {
        loop {
            let outcome = match self.await_frame() {
                Ok(true) => match self.input.read_header() {
                    Ok(Some(header)) => {
                        self.heard = Some(Instant::now());
                        self.link.recorder.record(false, &header);
                        self.handle(header)
                    }
                    Ok(None) => Ok(()),
                    Err(e) => Err(Stop::Lost(describe(&e))),
                },
                Ok(false) if self.bye || self.link.done.load(Ordering::Acquire) => return,
                Ok(false) => Err(Stop::Lost("the connection closed before the node said goodbye".into())),
                Err(stop) => Err(stop),
            };
            match outcome {
                Ok(()) => {}
                Err(Stop::Aborted) => return,
                Err(Stop::Lost(message)) => {
                    // After this node's job is over, a peer that vanishes is no error.
                    if !self.link.done.load(Ordering::Acquire) && !self.bye {
                        // The connection's last frames go with the error.
                        let descs: Vec<String> = self.check.plan.regst_descs.iter().map(|d| d.name.clone()).collect();
                        let record = self.link.recorder.dump(&descs, &self.groups.names()).join("\n");
                        let step = match self.last_step {
                            Some(step) => format!("; the last it sent this node was of step {step}"),
                            None => "; it had sent this node nothing of any step".to_string(),
                        };
                        let message = format!("{message}{step}\n{record}");
                        let error = RuntimeError::PeerLost { node: self.link.node, host: self.link.host(), message };
                        self.link.shared.abort(error, &self.link.router);
                    }
                    return;
                }
            }
        }
    }

    fn handle(&mut self, header: Header) -> Result<(), Stop> {
        match header {
            Header::Actor(msg) => self.actor(msg),
            Header::Collective { group, round, rank, len } => {
                if let Some(actor) = self.groups.member_actor(group, rank) {
                    let per_step = self.check.per_step.get(actor).copied().unwrap_or(1).max(1);
                    let step = round / per_step + 1;
                    self.last_step = Some(self.last_step.map_or(step, |s| s.max(step)));
                }
                let (input, silence) = (&mut self.input, self.link.silence);
                self.groups
                    .receive(self.link.node, group, round, rank, len, |into| read_payload(input, into, silence))
                    .map_err(Stop::Lost)
            }
            Header::Ring { group, round, step, len } => {
                let (input, silence) = (&mut self.input, self.link.silence);
                self.groups
                    .receive_ring(self.link.node, group, round, step, len, |into| read_payload(input, into, silence))
                    .map_err(Stop::Lost)
            }
            Header::Abort { reason } => {
                let error = RuntimeError::PeerFailed { node: self.link.node, host: self.link.host(), reason };
                self.link.shared.abort(error, &self.link.router);
                Err(Stop::Aborted)
            }
            Header::Bye => {
                self.bye = true;
                Ok(())
            }
            Header::Heartbeat { fires } => {
                self.peer_fires = fires;
                Ok(())
            }
            Header::SnapshotRequest => {
                // A node without a watchdog does not answer; the asker waits a bounded time.
                let _ = self.watch.requests.try_send(self.link.node);
                Ok(())
            }
            Header::Snapshot { len } => {
                if len > MAX_SNAPSHOT_BYTES {
                    return Err(Stop::Lost(format!(
                        "it sent a {len}-byte snapshot; snapshots are at most {MAX_SNAPSHOT_BYTES} bytes"
                    )));
                }
                let mut json = vec![0u8; len as usize];
                read_payload(&mut self.input, &mut json, self.link.silence).map_err(Stop::Lost)?;
                let actors = serde_json::from_slice(&json)
                    .map_err(|e| Stop::Lost(format!("it sent a snapshot that does not parse: {e}")))?;
                let _ = self.watch.replies.try_send((self.link.node, actors));
                Ok(())
            }
            other => Err(Stop::Lost(format!("it sent a {} frame in the middle of the job", other.kind()))),
        }
    }

    /// Checks an actor message against the plan, lands its bytes, routes it.
    fn actor(&mut self, wire: WireMessage) -> Result<(), Stop> {
        let check = &self.check;
        let plan = &check.plan;
        let actor = |raw: u64, role: &str| -> Result<ActorIndex, Stop> {
            check.by_id.get(&raw).copied().ok_or_else(|| {
                Stop::Lost(format!("it sent a message naming {role} {raw:#x}, which is no actor of the plan"))
            })
        };
        let (dst, src) = (actor(wire.dst, "recipient")?, actor(wire.src, "sender")?);
        let (dst_node, src_node) = (check.node_of[dst.index()], check.node_of[src.index()]);
        if src_node != self.link.node || !self.link.router.hosts(dst_node) {
            return Err(Stop::Lost(format!(
                "it sent a message from an actor of node {src_node} to an actor of node {dst_node}; this connection carries node {} to node {}",
                self.link.node,
                self.link.router.hosted_node().unwrap_or(0)
            )));
        }
        let desc_of = |d: u32| -> Result<&regflow_plan::RegstDesc, Stop> {
            plan.regst_descs
                .get(d as usize)
                .ok_or_else(|| Stop::Lost(format!("it named register {d}; the plan has {}", plan.regst_descs.len())))
        };
        let (dst_name, src_name) = (&plan.actors[dst.index()].name, &plan.actors[src.index()].name);
        let body = match wire.body {
            WireBody::Ready { desc, slot, piece, len } => {
                let d = desc_of(desc)?;
                if d.producer != src || !d.consumers.contains(&dst) || slot >= d.register_num {
                    return Err(Stop::Lost(format!(
                        "it handed slot {slot} of register '{}' from '{src_name}' to '{dst_name}'; the plan has no such edge or slot",
                        d.name
                    )));
                }
                let regst = RegstRef { desc: RegstDescId(desc), slot };
                let per_step = check.per_step.get(src.index()).copied().unwrap_or(1).max(1);
                let step = piece.saturating_sub(u64::from(d.preloaded)) / per_step + 1;
                self.last_step = Some(self.last_step.map_or(step, |s| s.max(step)));
                if len != 0 {
                    if len != d.bytes {
                        return Err(Stop::Lost(format!(
                            "it sent {len} bytes for a slot of register '{}', which holds {}",
                            d.name, d.bytes
                        )));
                    }
                    let view = self
                        .link
                        .arenas
                        .try_view(regst)
                        .ok_or_else(|| Stop::Lost(format!("register '{}' has no mirror on this node", d.name)))?;
                    // SAFETY: this slot of the mirror is written only here, for a new piece,
                    // and the producer sends one only after every consumer here acked the
                    // slot's last piece: nobody on this node reads it meanwhile.
                    let into = unsafe { view.as_mut_slice() };
                    read_payload(&mut self.input, into, self.link.silence).map_err(Stop::Lost)?;
                }
                Body::Ready { regst, piece, data: regst }
            }
            WireBody::Ack { desc, slot } => {
                let d = desc_of(desc)?;
                if d.producer != dst || !d.consumers.contains(&src) || slot >= d.register_num {
                    return Err(Stop::Lost(format!(
                        "it acknowledged slot {slot} of register '{}' from '{src_name}' to '{dst_name}'; the plan has no such edge or slot",
                        d.name
                    )));
                }
                Body::Ack { regst: RegstRef { desc: RegstDescId(desc), slot } }
            }
            WireBody::Eord { desc } => {
                let d = desc_of(desc)?;
                if d.producer != src || !d.consumers.contains(&dst) {
                    return Err(Stop::Lost(format!(
                        "it ended register '{}' from '{src_name}' to '{dst_name}'; the plan has no such edge",
                        d.name
                    )));
                }
                Body::Eord { desc: RegstDescId(desc) }
            }
        };
        let msg = Message { dst: check.ids[dst.index()], src: check.ids[src.index()], body };
        match self.link.router.send(msg) {
            Ok(()) => Ok(()),
            // The recipient's stream has ended: the job is over or aborting.
            Err(_) => Err(Stop::Aborted),
        }
    }
}

/// Why the reader stops.
enum Stop {
    /// The job aborted (the peer's abort, or this node's).
    Aborted,
    /// The connection broke or carried what the plan does not allow.
    Lost(String),
}

/// Reads a payload into `into`: what the buffer already holds, then the rest straight from
/// the socket into its place (a buffered read would copy the bytes a second time).
/// A payload read in place; `silence` bounds a stall in its middle (the socket's read
/// timeout only wakes the reader to check on its peer).
fn read_payload(input: &mut Input, into: &mut [u8], silence: Duration) -> Result<(), String> {
    input.read_payload_within(into, silence).map_err(|e| describe(&e))
}

/// The reading side of a connection.
type Input = FrameReader<BufReader<Box<dyn Read + Send>>>;

fn describe(e: &FrameError) -> String {
    match e {
        FrameError::Io(io) if io.kind() == std::io::ErrorKind::ConnectionReset => {
            "the connection was reset (its process ended?)".into()
        }
        other => other.to_string(),
    }
}
