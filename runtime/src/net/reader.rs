//! The reader of one connection: frames checked against the plan, a `Ready`'s bytes read
//! straight into this node's mirror of the slot, then the message handed to its stream.

use super::{PeerNames, WireCheck};
use crate::arenas::PlanArenas;
use crate::bus::Router;
use crate::collective::NetGroups;
use crate::stream::JobShared;
use crate::sync::Arc;
use crate::RuntimeError;
use regflow_actors::{Body, Message, RegstRef};
use regflow_net::frame::{FrameError, FrameReader, Header, WireBody, WireMessage};
use regflow_plan::{ActorIndex, RegstDescId};
use std::io::{BufRead, BufReader, Read};
use std::sync::atomic::{AtomicBool, Ordering};

/// Read buffer: headers come in small reads; payloads larger than this bypass it.
const READ_BUFFER: usize = 64 * 1024;

pub(super) struct Reader {
    node: u16,
    input: FrameReader<BufReader<Box<dyn Read + Send>>>,
    check: Arc<WireCheck>,
    arenas: Arc<PlanArenas>,
    groups: Arc<NetGroups>,
    shared: Arc<JobShared>,
    router: Router,
    names: PeerNames,
    done: Arc<AtomicBool>,
    /// The peer said `Bye`: its closing the connection is the normal end.
    bye: bool,
}

impl Reader {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        node: u16,
        read: Box<dyn Read + Send>,
        check: Arc<WireCheck>,
        arenas: Arc<PlanArenas>,
        groups: Arc<NetGroups>,
        shared: Arc<JobShared>,
        router: Router,
        names: PeerNames,
        done: Arc<AtomicBool>,
    ) -> Self {
        Self {
            node,
            input: FrameReader::new(BufReader::with_capacity(READ_BUFFER, read)),
            check,
            arenas,
            groups,
            shared,
            router,
            names,
            done,
            bye: false,
        }
    }

    pub(super) fn run(mut self) {
        loop {
            let outcome = match self.input.read_header() {
                Ok(Some(header)) => self.handle(header),
                Ok(None) if self.bye || self.done.load(Ordering::Acquire) => return,
                Ok(None) => Err(Stop::Lost("the connection closed before the node said goodbye".into())),
                Err(e) => Err(Stop::Lost(describe(&e))),
            };
            match outcome {
                Ok(()) => {}
                Err(Stop::Aborted) => return,
                Err(Stop::Lost(message)) => {
                    // After this node's job is over, a peer that vanishes is no error.
                    if !self.done.load(Ordering::Acquire) && !self.bye {
                        let error =
                            RuntimeError::PeerLost { node: self.node, host: self.names.host(self.node), message };
                        self.shared.abort(error, &self.router);
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
                let input = self.input.get_mut();
                self.groups
                    .receive(self.node, group, round, rank, len, |into| read_direct(input, into))
                    .map_err(Stop::Lost)
            }
            Header::Abort { reason } => {
                let error = RuntimeError::PeerFailed { node: self.node, host: self.names.host(self.node), reason };
                self.shared.abort(error, &self.router);
                Err(Stop::Aborted)
            }
            Header::Bye => {
                self.bye = true;
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
        if src_node != self.node || !self.router.hosts(dst_node) {
            return Err(Stop::Lost(format!(
                "it sent a message from an actor of node {src_node} to an actor of node {dst_node}; this connection carries node {} to node {}",
                self.node,
                self.router.hosted_node().unwrap_or(0)
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
                if len != 0 {
                    if len != d.bytes {
                        return Err(Stop::Lost(format!(
                            "it sent {len} bytes for a slot of register '{}', which holds {}",
                            d.name, d.bytes
                        )));
                    }
                    let view = self
                        .arenas
                        .try_view(regst)
                        .ok_or_else(|| Stop::Lost(format!("register '{}' has no mirror on this node", d.name)))?;
                    // SAFETY: this slot of the mirror is written only here, for a new piece,
                    // and the producer sends one only after every consumer here acked the
                    // slot's last piece: nobody on this node reads it meanwhile.
                    let into = unsafe { view.as_mut_slice() };
                    read_direct(self.input.get_mut(), into).map_err(Stop::Lost)?;
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
        match self.router.send(msg) {
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
fn read_direct(reader: &mut BufReader<Box<dyn Read + Send>>, into: &mut [u8]) -> Result<(), String> {
    let buffered = reader.buffer();
    let n = buffered.len().min(into.len());
    into[..n].copy_from_slice(&buffered[..n]);
    reader.consume(n);
    reader.get_mut().read_exact(&mut into[n..]).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => "the connection closed in the middle of a frame (payload)".to_string(),
        _ => describe(&FrameError::Io(e)),
    })
}

fn describe(e: &FrameError) -> String {
    match e {
        FrameError::Io(io) if io.kind() == std::io::ErrorKind::ConnectionReset => {
            "the connection was reset (its process ended?)".into()
        }
        other => other.to_string(),
    }
}
