//! The watchdog: when pieces are pending and no actor has fired for a while, it asks every
//! stream what its actors wait on and aborts the job with the wait-for graph. A job never
//! hangs silently.

use crate::bus::Router;
use crate::inbox::Envelope;
use crate::stream::JobShared;
use crate::sync::{Arc, Ordering};
use crate::RuntimeError;
use regflow_actors::{ActorId, ActorSnapshot, Lifecycle, WaitReason};
use std::collections::HashMap;
use std::fmt;
use std::time::{Duration, Instant};

/// One thing a stuck actor waits on, in plan names.
#[derive(Debug, Clone, PartialEq, Eq)]
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

/// Who waits on whom when a job stalls.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WaitForGraph {
    /// Actors not done.
    pub actors: Vec<StuckActor>,
    /// Streams that did not answer the watchdog (blocked outside the protocol).
    pub silent_streams: Vec<String>,
    /// A cycle of actors each waiting on the next, if there is one.
    pub cycle: Option<Vec<String>>,
}

impl WaitForGraph {
    /// Edges `(waiter, waited on, register)`.
    pub fn edges(&self) -> Vec<(String, String, String)> {
        let mut edges = Vec::new();
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
                    _ => {}
                }
            }
        }
        edges
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
        for start in self.actors.iter().map(|a| a.name.as_str()) {
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
        if let Some(cycle) = &self.cycle {
            writeln!(f, "  deadlock cycle: {}", cycle.join(" -> "))?;
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
    /// Plan streams this job runs.
    pub(crate) hosted: Vec<usize>,
}

impl Names {
    fn actor(&self, id: ActorId) -> String {
        self.actors.get(&id).cloned().unwrap_or_else(|| id.to_string())
    }

    fn graph(&self, snapshots: &[(usize, Vec<ActorSnapshot>)], silent: Vec<String>) -> WaitForGraph {
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
        let mut graph = WaitForGraph { actors, silent_streams: silent, cycle: None };
        graph.cycle = graph.find_cycle();
        graph
    }
}

/// Runs until `stop` closes; checks every `timeout / 4`.
pub(crate) fn watch(
    shared: Arc<JobShared>,
    router: Router,
    names: Names,
    timeout: Duration,
    stop: crossbeam_channel::Receiver<()>,
    snapshots: crossbeam_channel::Receiver<(usize, Vec<ActorSnapshot>)>,
) {
    let tick = (timeout / 4).max(Duration::from_millis(1));
    // A kernel that runs longer than the timeout counts as stuck, like a collective that
    // never returns: the timeout is the user's statement of how long a firing may take.
    let fires = |shared: &JobShared| -> u64 { shared.probes.iter().map(|p| p.fires.load(Ordering::Relaxed)).sum() };
    let mut last_fires = fires(&shared);
    let mut last_progress = Instant::now();
    loop {
        if !matches!(stop.recv_timeout(tick), Err(crossbeam_channel::RecvTimeoutError::Timeout)) {
            return;
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
        while snapshots.try_recv().is_ok() {}
        router.broadcast(Envelope::Snapshot);
        let mut answers: Vec<(usize, Vec<ActorSnapshot>)> = Vec::new();
        let deadline = Instant::now() + tick.max(Duration::from_millis(200));
        let live: Vec<usize> =
            names.hosted.iter().copied().filter(|&s| !shared.probes[s].exited.load(Ordering::Acquire)).collect();
        while answers.len() < live.len() {
            match snapshots.recv_deadline(deadline) {
                Ok(answer) => answers.push(answer),
                Err(_) => break,
            }
        }
        let now_fires = fires(&shared);
        if now_fires != last_fires {
            (last_fires, last_progress) = (now_fires, Instant::now());
            continue;
        }
        let all: Vec<&ActorSnapshot> = answers.iter().flat_map(|(_, list)| list).collect();
        let pending = all.iter().any(|s| s.holds_pieces);
        // A sink whose user has not fetched what it delivered holds finished results:
        // the job waits on its consumer, and aborting would lose them.
        let excused = all.iter().any(|s| s.waits.contains(&WaitReason::Fetch));
        let silent: Vec<String> = live
            .iter()
            .filter(|s| !answers.iter().any(|(a, _)| a == *s) && !shared.probes[**s].exited.load(Ordering::Acquire))
            .map(|&s| {
                let in_kernel = shared.probes[s].in_kernel.load(Ordering::Relaxed);
                match in_kernel.checked_sub(1).and_then(|bits| names.actors.iter().find(|(id, _)| id.bits() == bits)) {
                    Some((_, actor)) => format!("{} (busy in the kernel of '{actor}')", names.streams[s]),
                    None => names.streams[s].clone(),
                }
            })
            .collect();
        if (pending && !excused) || !silent.is_empty() {
            answers.sort_by_key(|(s, _)| *s);
            let graph = names.graph(&answers, silent);
            shared.abort(RuntimeError::Stalled { idle, graph }, &router);
            return;
        }
        last_progress = Instant::now();
    }
}
