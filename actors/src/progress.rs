//! Proof that a plan makes progress: its actors, driven by one thread with kernels that
//! complete at once, run whole steps to the end; otherwise the wait-for cycle that stops them.
//!
//! Why running the real state machine proves it. An actor fires when each input has a
//! ready piece and each output a free slot, and nothing but its own firing consumes its
//! inputs or takes its output slots: once enabled, an actor stays enabled until it fires
//! (the protocol is *persistent*, like a Kahn network with bounded channels). So whether a
//! plan deadlocks does not depend on the order in which threads, devices or kernel times
//! interleave firings; one serial run decides it for every run. And a step is one period
//! of a synchronous-dataflow graph: after every actor has fired its step's share (the
//! repetition vector, from the acc and repeat counts), every register holds what it held
//! at the start, loop registers included, so two steps run to the end (the second one
//! through the loop values the first wrote, then end of data) prove every later step runs.
//!
//! What the check assumes of the program: it feeds every fed source and reads every sink.
//! The user-side waits (a push that blocks while nobody fetches) are the job's watchdog's
//! business, not the plan's.

use crate::{Actor, ActorEnv, ActorError, ActorId, Body, Cmd, Completion, EnvError, Firing, IdError, Lifecycle};
use crate::{Message, PlanIds, WaitReason};
use regflow_plan::{ActorIndex, ActorKind, Plan, PlanIndex, RegstDescId, SourcePieces};
use std::collections::{HashMap, VecDeque};
use std::fmt;

/// Why a plan cannot make progress.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProgressError {
    /// Two actors disagree on how many pieces of a register make a step: whatever the
    /// register counts, one of them would wait forever or leave pieces behind.
    #[error(
        "the plan's rates disagree at register '{regst}': through it, '{through}' makes '{actor}' fire {want} \
         time(s) per step, but other paths make it fire {have} time(s); the acc and repeat counts between them \
         do not match"
    )]
    Rates {
        /// The register.
        regst: String,
        /// The actor whose firings per step disagree.
        actor: String,
        /// The actor on the other side of the register.
        through: String,
        /// Its firings per step through this register (relative to the part's first actor).
        want: String,
        /// Its firings per step through the paths seen before.
        have: String,
    },
    /// The actors stop before the steps are done: a cycle of waits the register counts allow.
    #[error("{0}")]
    Deadlock(Box<Deadlock>),
    /// An actor refused a message: the plan breaks the protocol (pieces out of step).
    #[error("the plan breaks the actor protocol: {0}")]
    Protocol(#[from] ActorError),
    /// The plan does not fit actor ids.
    #[error(transparent)]
    Ids(#[from] IdError),
}

/// A plan that stops: who waits on whom when nothing can fire any more.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deadlock {
    /// Steps the check ran.
    pub steps: u64,
    /// Firings before it stopped.
    pub fired: u64,
    /// Actors not done.
    pub stuck: usize,
    /// The cycle, each actor with what it waits on from the next one; empty if the waits
    /// end at an actor that waits on nothing in the plan.
    pub cycle: Vec<WaitEdge>,
    /// The waits of the first stuck actors when no cycle was found.
    pub waits: Vec<WaitEdge>,
}

/// One wait: `waiter` cannot fire because of `on`, for the reason `why`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WaitEdge {
    /// The actor that waits.
    pub waiter: String,
    /// The actor it waits on.
    pub on: String,
    /// The register, and why (empty input, full output with its slot count).
    pub why: String,
    /// The register it waits through.
    pub regst: String,
    /// That register's slot count.
    pub register_num: u32,
}

impl fmt::Display for Deadlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the plan deadlocks: after {} firing(s) of a {}-step run, {} actor(s) can never fire again",
            self.fired, self.steps, self.stuck
        )?;
        let (label, edges) = if self.cycle.is_empty() { ("waits", &self.waits) } else { ("cycle", &self.cycle) };
        write!(f, "; {label}: ")?;
        for (i, edge) in edges.iter().enumerate() {
            if i > 0 {
                write!(f, "; ")?;
            }
            write!(f, "'{}' {} -> '{}'", edge.waiter, edge.why, edge.on)?;
        }
        Ok(())
    }
}

impl Deadlock {
    /// Registers on the cycle (or in the waits), with their slot counts.
    pub fn registers(&self) -> impl Iterator<Item = (&str, u32)> {
        let edges = if self.cycle.is_empty() { &self.waits } else { &self.cycle };
        edges.iter().map(|e| (e.regst.as_str(), e.register_num))
    }
}

/// What a successful check ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Progress {
    /// Steps run.
    pub steps: u64,
    /// Firings of every actor in that many steps.
    pub fired: u64,
    /// Firings of each plan actor per step (the repetition vector).
    pub per_step: Vec<u64>,
}

/// Checks that `plan` (validated) runs `steps` steps (at least 2 are needed to go once
/// around every loop) to the end: every actor finishes, in a serial run where every kernel
/// completes at once, fed sources get their step's pieces and sinks are always read.
pub fn check_progress(plan: &Plan, steps: u64) -> Result<Progress, ProgressError> {
    let index = PlanIndex::new(plan);
    let per_step = firings_per_step(&index)?;
    let ids = PlanIds::assign(plan)?;
    let slot_of = DenseIds::new(plan, &ids);
    let mut actors: Vec<Actor> = Vec::with_capacity(plan.actors.len());
    for (i, (desc, &firings)) in plan.actors.iter().zip(&per_step).enumerate() {
        let mut actor = Actor::from_plan(&index, &ids, ActorIndex(i as u32));
        if let ActorKind::Source { pieces } = &desc.kind {
            if !matches!(pieces, SourcePieces::Fed) {
                actor.set_source_limit(steps * firings);
            }
        }
        actors.push(actor);
    }
    let mut env = SerialEnv { queue: VecDeque::with_capacity(4 * plan.actors.len()) };
    for (i, actor) in actors.iter().enumerate() {
        let id = actor.id();
        env.queue.push_back(Message { dst: id, src: id, body: Body::Cmd(Cmd::Start) });
        if matches!(plan.actors[i].kind, ActorKind::Source { pieces: SourcePieces::Fed }) {
            for _ in 0..steps * per_step[i] {
                env.queue.push_back(Message { dst: id, src: id, body: Body::Cmd(Cmd::Feed) });
            }
            env.queue.push_back(Message { dst: id, src: id, body: Body::Cmd(Cmd::CloseFeed) });
        }
    }
    while let Some(msg) = env.queue.pop_front() {
        let Some(at) = slot_of.get(msg.dst) else {
            unreachable!("a message to {} which no plan actor has as id", msg.dst)
        };
        actors[at].handle(&msg, &mut env)?;
    }
    let fired = actors.iter().map(Actor::fires).sum();
    let stuck: Vec<usize> = (0..actors.len()).filter(|&i| actors[i].lifecycle() != Lifecycle::Done).collect();
    if stuck.is_empty() {
        return Ok(Progress { steps, fired, per_step });
    }
    Err(ProgressError::Deadlock(Box::new(explain(plan, &actors, &slot_of, &stuck, steps, fired))))
}

/// Plan actor index of an actor id, without hashing: ids number actors per stream in plan
/// order, so a table per (device, stream position) of its actors' plan indices does it.
#[derive(Debug)]
struct DenseIds {
    /// `streams[device][position]`: the plan indices of that stream's actors, in id order.
    streams: Vec<Vec<Vec<usize>>>,
}

impl DenseIds {
    fn new(plan: &Plan, ids: &PlanIds) -> Self {
        let mut streams: Vec<Vec<Vec<usize>>> = vec![Vec::new(); plan.devices.len()];
        for (i, id) in ids.actors.iter().enumerate() {
            let device = &mut streams[id.device() as usize];
            let position = id.stream() as usize;
            if device.len() <= position {
                device.resize(position + 1, Vec::new());
            }
            device[position].push(i);
        }
        Self { streams }
    }

    fn get(&self, id: ActorId) -> Option<usize> {
        self.streams.get(id.device() as usize)?.get(id.stream() as usize)?.get(id.index() as usize).copied()
    }
}

/// Serial environment: kernels complete at once, messages wait in one queue.
#[derive(Debug)]
struct SerialEnv {
    queue: VecDeque<Message>,
}

impl ActorEnv for SerialEnv {
    fn send(&mut self, msg: Message) -> Result<(), EnvError> {
        self.queue.push_back(msg);
        Ok(())
    }

    fn launch(&mut self, _firing: &Firing<'_>) -> Result<Completion, EnvError> {
        Ok(Completion::Done)
    }
}

/// A non-negative fraction, kept reduced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ratio {
    num: u128,
    den: u128,
}

impl Ratio {
    fn new(num: u128, den: u128) -> Self {
        let g = gcd(num, den).max(1);
        Self { num: num / g, den: den / g }
    }

    fn times(self, num: u128, den: u128) -> Self {
        Self::new(self.num * num, self.den * den)
    }
}

impl fmt::Display for Ratio {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.den == 1 {
            write!(f, "{}", self.num)
        } else {
            write!(f, "{}/{}", self.num, self.den)
        }
    }
}

fn gcd(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Output pieces per firing of `kind` (an acc emits once per `count` firings).
fn emitted(kind: &ActorKind) -> (u128, u128) {
    match kind {
        ActorKind::Acc { count, .. } => (1, u128::from((*count).max(1))),
        _ => (1, 1),
    }
}

/// Input pieces per firing of `kind` (a repeat reads one input for `count` firings).
fn read(kind: &ActorKind) -> (u128, u128) {
    match kind {
        ActorKind::Repeat { count } => (1, u128::from((*count).max(1))),
        _ => (1, 1),
    }
}

/// Firings of each actor per step (the plan's repetition vector): the smallest whole numbers that balance every register
/// (producer firings × pieces per firing = consumer firings × pieces read per firing),
/// scaled per connected part of the plan.
pub fn firings_per_step(index: &PlanIndex<'_>) -> Result<Vec<u64>, ProgressError> {
    let plan = index.plan();
    let n = plan.actors.len();
    let mut rate: Vec<Option<Ratio>> = vec![None; n];
    let mut out = vec![0u64; n];
    let name = |a: ActorIndex| plan.actors[a.index()].name.clone();
    let mut edges: Vec<(RegstDescId, usize, Ratio)> = Vec::new();
    for root in 0..n {
        if rate[root].is_some() {
            continue;
        }
        rate[root] = Some(Ratio::new(1, 1));
        let mut part = vec![root];
        let mut queue = VecDeque::from([root]);
        while let Some(a) = queue.pop_front() {
            let here = rate[a].unwrap_or_else(|| unreachable!("queued actors have a rate"));
            let at = ActorIndex(a as u32);
            // Edges to consumers (through each output) and to producers (through each input).
            edges.clear();
            for &r in index.outputs_of(at) {
                let (en, ed) = emitted(&plan.actors[a].kind);
                let pieces = here.times(en, ed);
                for &c in &plan.regst_descs[r.index()].consumers {
                    let (rn, rd) = read(&plan.actors[c.index()].kind);
                    edges.push((r, c.index(), pieces.times(rd, rn)));
                }
            }
            for &r in &plan.actors[a].inputs {
                let (rn, rd) = read(&plan.actors[a].kind);
                let pieces = here.times(rn, rd);
                let p = plan.regst_descs[r.index()].producer.index();
                let (en, ed) = emitted(&plan.actors[p].kind);
                edges.push((r, p, pieces.times(ed, en)));
            }
            for &(r, other, want) in &edges {
                match rate[other] {
                    None => {
                        rate[other] = Some(want);
                        part.push(other);
                        queue.push_back(other);
                    }
                    Some(have) if have == want => {}
                    Some(have) => {
                        let regst = &plan.regst_descs[r.index()];
                        return Err(ProgressError::Rates {
                            regst: regst.name.clone(),
                            actor: name(ActorIndex(other as u32)),
                            through: name(ActorIndex(a as u32)),
                            want: want.to_string(),
                            have: have.to_string(),
                        });
                    }
                }
            }
        }
        // Scale the part to the smallest whole numbers that also make whole groups: an acc
        // fires `count` times per piece it emits, a repeat `count` times per piece it reads.
        let group = |a: usize| match &plan.actors[a].kind {
            ActorKind::Acc { count, .. } | ActorKind::Repeat { count } => u128::from((*count).max(1)),
            _ => 1,
        };
        let lcm = part.iter().fold(1u128, |l, &a| {
            let r = rate[a].unwrap_or_else(|| unreachable!("every actor of the part has a rate"));
            let d = r.times(1, group(a)).den;
            l / gcd(l, d) * d
        });
        let whole = |a: usize| rate[a].map_or(0, |r| r.num * (lcm / r.den));
        let g = part.iter().fold(0u128, |g, &a| gcd(gcd(g, whole(a)), whole(a) / group(a))).max(1);
        for &a in &part {
            out[a] = u64::try_from(whole(a) / g).unwrap_or(u64::MAX);
        }
    }
    Ok(out)
}

/// Describes a stop: the wait-for cycle among the stuck actors, or their waits.
fn explain(plan: &Plan, actors: &[Actor], slot_of: &DenseIds, stuck: &[usize], steps: u64, fired: u64) -> Deadlock {
    let regst_name = |d: RegstDescId| plan.regst_descs[d.index()].name.clone();
    let register_num = |d: RegstDescId| plan.regst_descs[d.index()].register_num;
    let actor_name = |id: &ActorId| slot_of.get(*id).map_or_else(|| id.to_string(), |i| plan.actors[i].name.clone());
    // Wait edges of every stuck actor, in plan order.
    let mut edges: HashMap<usize, Vec<(usize, WaitEdge)>> = HashMap::new();
    for &i in stuck {
        let snapshot = actors[i].snapshot();
        let waiter = plan.actors[i].name.clone();
        let mut list = Vec::new();
        for wait in &snapshot.waits {
            let (on, why, desc): (Vec<ActorId>, String, RegstDescId) = match wait {
                WaitReason::Input { desc, producer } => {
                    (vec![*producer], format!("waits on empty input '{}' from", regst_name(*desc)), *desc)
                }
                WaitReason::OutputFull { desc, register_num, holders } => (
                    holders.clone(),
                    format!("finds all {register_num} slot(s) of its output '{}' held by", regst_name(*desc)),
                    *desc,
                ),
                WaitReason::Lent { desc, pieces, holders } => (
                    holders.clone(),
                    format!("waits for {pieces} lent piece(s) of '{}' from", regst_name(*desc)),
                    *desc,
                ),
                _ => continue,
            };
            for target in on {
                if let Some(t) = slot_of.get(target) {
                    let edge = WaitEdge {
                        waiter: waiter.clone(),
                        on: actor_name(&target),
                        why: why.clone(),
                        regst: regst_name(desc),
                        register_num: register_num(desc),
                    };
                    list.push((t, edge));
                }
            }
        }
        edges.insert(i, list);
    }
    let cycle = find_cycle(stuck, &edges).unwrap_or_default();
    let waits = if cycle.is_empty() {
        stuck.iter().flat_map(|i| edges.get(i).into_iter().flatten().map(|(_, e)| e.clone())).take(8).collect()
    } else {
        Vec::new()
    };
    Deadlock { steps, fired, stuck: stuck.len(), cycle, waits }
}

/// A cycle in the wait-for edges among stuck actors, by depth-first search with colours
/// (linear in the edges).
fn find_cycle(stuck: &[usize], edges: &HashMap<usize, Vec<(usize, WaitEdge)>>) -> Option<Vec<WaitEdge>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Colour {
        White,
        Grey,
        Black,
    }
    let mut colour: HashMap<usize, Colour> = stuck.iter().map(|&i| (i, Colour::White)).collect();
    for &start in stuck {
        if colour.get(&start) != Some(&Colour::White) {
            continue;
        }
        // Stack of (actor, next edge to try); the path is the stack.
        let mut stack: Vec<(usize, usize)> = vec![(start, 0)];
        colour.insert(start, Colour::Grey);
        while let Some(&mut (node, ref mut next)) = stack.last_mut() {
            let list = edges.get(&node).map(Vec::as_slice).unwrap_or(&[]);
            let Some((target, _)) = list.get(*next) else {
                colour.insert(node, Colour::Black);
                stack.pop();
                continue;
            };
            *next += 1;
            match colour.get(target) {
                Some(Colour::White) => {
                    colour.insert(*target, Colour::Grey);
                    stack.push((*target, 0));
                }
                Some(Colour::Grey) => {
                    // The path from `target` to `node`, then back to `target`.
                    let from = stack.iter().position(|(a, _)| a == target).unwrap_or(0);
                    let cycle = stack[from..].iter().map(|&(a, taken)| edges[&a][taken - 1].1.clone()).collect();
                    return Some(cycle);
                }
                _ => {}
            }
        }
    }
    None
}
