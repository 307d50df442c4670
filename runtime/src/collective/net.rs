//! Collectives whose members live on several nodes: every member's input reaches every
//! node of the group over the network, and each member computes its output from all inputs
//! exactly as in-process (sums in rank order), so results are bitwise those of one process.
//!
//! Each node keeps, per group, two *landing* tables (rounds alternate between them) of one
//! buffer per rank. In round `k` a member copies its input into its own buffer of table
//! `k % 2`, hands that buffer to the writer of every other node of the group, waits until
//! every rank's buffer of the table holds round `k`, and computes. The network reader writes
//! a remote member's round-`k` input into table `k % 2` of this node.
//!
//! Why two tables suffice, with no second barrier: a member publishes round `k + 2` only
//! after finishing round `k + 1`, which needed every member's round-`k + 1` input, which
//! each member publishes only after finishing round `k`. So when any buffer of table
//! `k % 2` is overwritten with round `k + 2`, every member of every node has finished
//! reading round `k` from it, and every writer has sent it (a member's round-`k + 1` input
//! reached the peer only after its round-`k` one, on the same ordered connection).
//!
//! Direct exchange (every input to every node) moves `size - 1` inputs into each node and
//! keeps the rank-order sum, hence bitwise parity with one process; at 2 nodes it is a
//! ring's traffic. An all-reduce of [`RING_MIN_BYTES`] or more over 3 or more nodes with
//! one member each goes around a ring instead (`ring_round`: reduce-scatter, then
//! all-gather; `2 (n - 1) / n` of the tensor per node): its sums run in ring order, within
//! f32 rounding of one process and the same bits on every member. Hierarchical collectives
//! (several members per node reduced locally first) are not built.

use super::layout::Layout;
use super::{PeerInput, Peers};
use crate::kernel::{Kernel, KernelError, KernelIo};
use crate::net::{NetOut, Outgoing, RawBytes};

/// Where a member's input goes to reach another node: the writer of the connection (the
/// loom model hands it to the other node directly).
pub(crate) trait CollectiveSend: Send + Sync {
    /// Queues `item` (a [`Outgoing::Collective`]) for `node`.
    fn send(&self, node: u16, item: Outgoing) -> Result<(), String>;
}

impl CollectiveSend for Arc<NetOut> {
    fn send(&self, node: u16, item: Outgoing) -> Result<(), String> {
        self.send_collective(node, item)
    }
}
use crate::sync::Arc;
use crate::sync::{lock, Condvar, Mutex};
use regflow_plan::{ActorKind, CollectiveConf, KernelConf, Plan};
use std::cell::UnsafeCell;
use std::collections::{BTreeMap, HashMap};

/// Bytes a reader lands before telling the members: an all-reduce sums each chunk while
/// the next one is still on the wire. A multiple of every element size.
const LANDING_CHUNK: usize = 256 * 1024;

/// One rank's landing buffer of one table: an allocation written and read through its
/// address only (never through a reference to the whole, which would alias).
struct Landing {
    ptr: *mut u8,
    len: usize,
    /// Owns the bytes; its heap block does not move when the box does.
    _owner: UnsafeCell<Box<[u8]>>,
    /// Under loom, every write and read of the bytes also touches this cell, so the model
    /// checker reports any write not ordered after the reads of the round before.
    #[cfg(loom)]
    shadow: loom::cell::UnsafeCell<()>,
}

// SAFETY: a landing buffer is written by its rank's member (local) or by the reader of its
// rank's node (remote) only for a new round, and read by members only between that write
// and the next one of the same table; the module docs show the two never overlap.
unsafe impl Sync for Landing {}
// SAFETY: as above; the buffer is a plain heap block.
unsafe impl Send for Landing {}

impl Landing {
    fn zeroed(len: usize) -> Self {
        let mut owner = vec![0u8; len].into_boxed_slice();
        Self {
            ptr: owner.as_mut_ptr(),
            len,
            _owner: UnsafeCell::new(owner),
            #[cfg(loom)]
            shadow: loom::cell::UnsafeCell::new(()),
        }
    }

    /// Marks a write of the bytes (checked under loom; nothing otherwise).
    fn wrote(&self) {
        #[cfg(loom)]
        self.shadow.with_mut(|_| ());
    }

    /// Marks a read of the bytes (checked under loom; nothing otherwise).
    fn read(&self) {
        #[cfg(loom)]
        self.shadow.with(|_| ());
    }

    fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    fn len(&self) -> usize {
        self.len
    }
}

/// What the group's lock guards.
#[derive(Debug)]
struct RoundState {
    /// `filled[t][r]`: `round + 1` of the input rank `r`'s buffer of table `t` holds (0: none).
    filled: [Vec<u64>; 2],
    /// Next round expected from each remote rank (checks the peer keeps the protocol).
    next_remote: Vec<u64>,
    /// `landed[t][r]`: `(round + 1, bytes)` of the input now landing in rank `r`'s buffer
    /// of table `t`: an all-reduce sums each chunk as soon as every rank's has landed.
    landed: [Vec<(u64, usize)>; 2],
    /// Ring all-reduce: `ring_landed[t][step]` is `round + 1` of the chunk in the inbox.
    ring_landed: [Vec<u64>; 2],
    /// Ring all-reduce: the (round, step) the predecessor must send next.
    ring_next: (u64, u32),
    aborted: bool,
}

/// A ring all-reduce's layout on this node (one member per node, at least 3 nodes, inputs
/// of [`RING_MIN_BYTES`] or more): reduce-scatter then all-gather around the ring, each
/// node sending `2 (n - 1) / n` of the tensor instead of `n - 1` times it. Its sums run in
/// ring order, not rank order (within f32 rounding of one process, the same bits on every
/// member: each chunk is summed once, by its owner, then copied around).
struct Ring {
    /// This node's member.
    rank: usize,
    next_node: u16,
    prev_node: u16,
    /// Byte range of each of the `n` chunks.
    chunks: Vec<std::ops::Range<usize>>,
    /// Per table and step: the chunk received from the predecessor.
    inbox: [Vec<Landing>; 2],
    /// Per table and step: the chunk sent to the successor (kept until it is written).
    staging: [Vec<Landing>; 2],
}

/// Smallest input (bytes) a group of 3 or more nodes reduces around a ring; below it the
/// direct exchange (rank-order sums, bitwise those of one process) costs less.
pub(crate) const RING_MIN_BYTES: usize = 256 * 1024;

impl Ring {
    fn steps(&self) -> usize {
        2 * (self.chunks.len() - 1)
    }

    /// The chunk this node sends at `step`, and the one it receives.
    fn chunk_of(&self, step: usize) -> (usize, usize) {
        let (n, r) = (self.chunks.len(), self.rank);
        if step < n - 1 {
            ((r + n - step % n) % n, (r + 2 * n - step - 1) % n)
        } else {
            let s = step - (n - 1);
            ((r + 1 + n - s % n) % n, (r + n - s % n) % n)
        }
    }
}

/// One group spanning nodes, as this node sees it.
pub(crate) struct NetGroup {
    name: String,
    /// Its index on the wire: position among every spanning group's name, sorted.
    wire: u32,
    size: usize,
    /// Node of each rank.
    node_of: Vec<u16>,
    /// Plan actor of each rank.
    actor_of: Vec<usize>,
    /// Other nodes with members: where this node's members send their inputs.
    remote_nodes: Vec<u16>,
    landing: [Vec<Landing>; 2],
    /// Set when the group reduces around a ring.
    ring: Option<Ring>,
    state: Mutex<RoundState>,
    changed: Condvar,
}

impl NetGroup {
    /// Waits, woken by the readers, until `ready` gives a value; once the job aborts, fails
    /// with `waiting`'s account of what was still missing.
    fn wait_for<T>(
        &self,
        mut ready: impl FnMut(&RoundState) -> Option<T>,
        waiting: impl FnOnce(&RoundState) -> String,
    ) -> Result<T, String> {
        let mut state = lock(&self.state);
        loop {
            if let Some(value) = ready(&state) {
                return Ok(value);
            }
            if state.aborted {
                return Err(waiting(&state));
            }
            state = self.changed.wait(state).unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }

    /// "aborted in round k while waiting for rank r (node n), ...", for the ranks `missing`.
    fn missing(&self, round: u64, missing: impl Fn(usize) -> bool) -> String {
        let ranks: Vec<String> =
            (0..self.size).filter(|&r| missing(r)).map(|r| format!("rank {r} (node {})", self.node_of[r])).collect();
        format!("aborted in round {round} while waiting for {}", ranks.join(", "))
    }
}

impl std::fmt::Debug for NetGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetGroup").field("name", &self.name).field("size", &self.size).finish_non_exhaustive()
    }
}

/// Every collective group of the plan with members on this node and on others.
#[derive(Default)]
pub(crate) struct NetGroups {
    groups: Vec<Option<Arc<NetGroup>>>,
    by_name: HashMap<String, u32>,
    out: Option<std::sync::Arc<dyn CollectiveSend>>,
}

impl std::fmt::Debug for NetGroups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetGroups").field("groups", &self.groups).finish_non_exhaustive()
    }
}

impl NetGroups {
    /// The spanning groups of `plan` that `node` takes part in, with landing tables sized
    /// from each rank's input. Every node computes the same wire indices.
    pub(crate) fn new(plan: &Plan, node: u16, out: std::sync::Arc<dyn CollectiveSend>) -> Result<Self, String> {
        let mut members: BTreeMap<&str, Vec<(u16, &CollectiveConf, usize)>> = BTreeMap::new();
        for (a, actor) in plan.actors.iter().enumerate() {
            if let ActorKind::Compute { kernel: KernelConf::Collective(conf) } = &actor.kind {
                let device = plan.device_of(regflow_plan::ActorIndex(a as u32));
                members.entry(conf.group.as_str()).or_default().push((plan.devices[device.index()].node, conf, a));
            }
        }
        let mut groups = Vec::new();
        let mut by_name = HashMap::new();
        let spanning = members.into_iter().filter(|(_, m)| m.iter().any(|(n, _, _)| *n != m[0].0));
        for (wire, (name, members)) in spanning.enumerate() {
            let wire = wire as u32;
            let size = members[0].1.size as usize;
            if !members.iter().any(|(n, _, _)| *n == node) {
                groups.push(None);
                continue;
            }
            let mut node_of = vec![u16::MAX; size];
            let mut actor_of = vec![usize::MAX; size];
            let mut bytes = vec![0usize; size];
            for (n, conf, actor) in &members {
                let rank = conf.rank as usize;
                if rank >= size || conf.size as usize != size {
                    return Err(format!(
                        "collective '{name}': rank {} of size {} does not fit size {size}",
                        conf.rank, conf.size
                    ));
                }
                node_of[rank] = *n;
                actor_of[rank] = *actor;
                bytes[rank] = Layout::new(conf).map_err(|m| format!("collective '{name}': {m}"))?.input_bytes;
            }
            if let Some(r) = node_of.iter().position(|&n| n == u16::MAX) {
                return Err(format!("collective '{name}': rank {r} of {size} has no actor in the plan"));
            }
            let mut remote_nodes: Vec<u16> = node_of.iter().copied().filter(|&n| n != node).collect();
            remote_nodes.sort_unstable();
            remote_nodes.dedup();
            let table = || bytes.iter().map(|&b| Landing::zeroed(b)).collect();
            let ring = ring_layout(members[0].1, &node_of, node, bytes[0]);
            let steps = ring.as_ref().map_or(0, Ring::steps);
            by_name.insert(name.to_string(), wire);
            groups.push(Some(Arc::new(NetGroup {
                name: name.to_string(),
                wire,
                size,
                node_of,
                actor_of,
                remote_nodes,
                landing: [table(), table()],
                ring,
                state: Mutex::new(RoundState {
                    filled: [vec![0; size], vec![0; size]],
                    next_remote: vec![0; size],
                    landed: [vec![(0, 0); size], vec![(0, 0); size]],
                    ring_landed: [vec![0; steps], vec![0; steps]],
                    ring_next: (0, 0),
                    aborted: false,
                }),
                changed: Condvar::new(),
            })));
        }
        Ok(Self { groups, by_name, out: Some(out) })
    }

    /// The plan actor of rank `rank` of spanning group `wire`, if both exist.
    pub(crate) fn member_actor(&self, wire: u32, rank: u32) -> Option<usize> {
        let group = self.groups.get(wire as usize)?.as_ref()?;
        group.actor_of.get(rank as usize).copied().filter(|&a| a != usize::MAX)
    }

    /// Names of the spanning groups by wire index (empty for groups without a member here).
    pub(crate) fn names(&self) -> Vec<String> {
        self.groups.iter().map(|g| g.as_ref().map(|g| g.name.clone()).unwrap_or_default()).collect()
    }

    /// Each spanning group's rounds, one line per group: what every rank has published.
    pub(crate) fn describe(&self) -> Vec<String> {
        self.groups
            .iter()
            .flatten()
            .map(|g| {
                let state = lock(&g.state);
                let ranks: Vec<String> = (0..g.size)
                    .map(|r| {
                        let done = state.filled[0][r].max(state.filled[1][r]);
                        format!("rank {r} (node {}) {} round(s)", g.node_of[r], done)
                    })
                    .collect();
                format!("collective '{}': {}", g.name, ranks.join(", "))
            })
            .collect()
    }

    /// The group `name`, if it spans nodes.
    pub(crate) fn get(&self, name: &str) -> Option<&Arc<NetGroup>> {
        self.by_name.get(name).and_then(|&w| self.groups[w as usize].as_ref())
    }

    /// A member kernel of spanning group `group`.
    pub(super) fn kernel(&self, group: Arc<NetGroup>, layout: Layout) -> Result<Box<dyn Kernel>, String> {
        let out = self
            .out
            .clone()
            .ok_or_else(|| format!("collective '{}' spans nodes but this job has no network", group.name))?;
        if group.node_of[layout.rank] == u16::MAX {
            return Err(format!("rank {} has no node", layout.rank));
        }
        Ok(Box::new(NetCollectiveKernel { peers: vec![PeerInput::empty(); group.size], group, layout, out, round: 0 }))
    }

    /// The reader got rank `rank`'s input of round `round` of group `wire` from `node`:
    /// checks it against the plan and the protocol, then `read`s the `len` bytes into the
    /// landing buffer and tells the waiting members.
    pub(crate) fn receive(
        &self,
        node: u16,
        wire: u32,
        round: u64,
        rank: u32,
        len: u64,
        mut read: impl FnMut(&mut [u8]) -> Result<(), String>,
    ) -> Result<(), String> {
        let Some(Some(group)) = self.groups.get(wire as usize) else {
            return Err(format!("it sent an input of collective group {wire}, which has no member on this node"));
        };
        let r = rank as usize;
        if r >= group.size || group.node_of[r] != node {
            return Err(format!(
                "it sent rank {rank}'s input of collective '{}' (size {}), which is not a rank of node {node}",
                group.name, group.size
            ));
        }
        let table = (round % 2) as usize;
        let landing = &group.landing[table][r];
        if len != landing.len() as u64 {
            return Err(format!(
                "it sent {len} bytes as rank {rank}'s input of collective '{}'; that input has {}",
                group.name,
                landing.len()
            ));
        }
        {
            let state = lock(&group.state);
            if state.next_remote[r] != round {
                return Err(format!(
                    "it sent round {round} of rank {rank} of collective '{}' while round {} was due",
                    group.name, state.next_remote[r]
                ));
            }
        }
        // Chunk by chunk: members read a chunk only after `landed` says it is there.
        let mut at = 0;
        while at < landing.len() {
            let end = (at + LANDING_CHUNK).min(landing.len());
            landing.wrote();
            // SAFETY: see `Landing`: no member reads these bytes before `landed` covers them.
            read(unsafe { std::slice::from_raw_parts_mut(landing.ptr().add(at), end - at) })?;
            at = end;
            let mut state = lock(&group.state);
            state.landed[table][r] = (round + 1, at);
            if at == landing.len() {
                state.filled[table][r] = round + 1;
                state.next_remote[r] = round + 1;
            }
            group.changed.notify_all();
        }
        if landing.len() == 0 {
            let mut state = lock(&group.state);
            state.filled[table][r] = round + 1;
            state.next_remote[r] = round + 1;
            group.changed.notify_all();
        }
        Ok(())
    }

    /// Wakes every member waiting for inputs with an error (the job is aborting).
    pub(crate) fn abort_all(&self) {
        for group in self.groups.iter().flatten() {
            lock(&group.state).aborted = true;
            group.changed.notify_all();
        }
    }
}

/// The ring of a group, when it qualifies: an all-reduce, every member on a node of its
/// own, at least 3 of them, inputs of [`RING_MIN_BYTES`] or more.
fn ring_layout(conf: &CollectiveConf, node_of: &[u16], node: u16, input_bytes: usize) -> Option<Ring> {
    let n = node_of.len();
    let distinct = (0..n).all(|a| (a + 1..n).all(|b| node_of[a] != node_of[b]));
    if !matches!(conf.op, regflow_plan::CollectiveOp::AllReduce | regflow_plan::CollectiveOp::AllReduceBucket { .. })
        || n < 3
        || !distinct
        || input_bytes < RING_MIN_BYTES
    {
        return None;
    }
    let rank = node_of.iter().position(|&m| m == node)?;
    let width = conf.dtype.size();
    let elements = input_bytes / width;
    let chunks: Vec<std::ops::Range<usize>> = (0..n)
        .map(|c| {
            let part = regflow_plan::part_range(elements, n, c);
            part.start * width..part.end * width
        })
        .collect();
    let mut ring = Ring {
        rank,
        next_node: node_of[(rank + 1) % n],
        prev_node: node_of[(rank + n - 1) % n],
        chunks,
        inbox: [Vec::new(), Vec::new()],
        staging: [Vec::new(), Vec::new()],
    };
    for t in 0..2 {
        for step in 0..ring.steps() {
            let (send, receive) = ring.chunk_of(step);
            ring.staging[t].push(Landing::zeroed(ring.chunks[send].len()));
            ring.inbox[t].push(Landing::zeroed(ring.chunks[receive].len()));
        }
    }
    Some(ring)
}

impl NetGroups {
    /// The reader got step `step` of round `round` of ring group `wire` from `node`:
    /// checks it is the predecessor's next chunk, then `read`s it into the inbox.
    pub(crate) fn receive_ring(
        &self,
        node: u16,
        wire: u32,
        round: u64,
        step: u32,
        len: u64,
        mut read: impl FnMut(&mut [u8]) -> Result<(), String>,
    ) -> Result<(), String> {
        let Some(Some(group)) = self.groups.get(wire as usize) else {
            return Err(format!("it sent a ring chunk of collective group {wire}, which has no member on this node"));
        };
        let Some(ring) = &group.ring else {
            return Err(format!(
                "it sent a ring chunk of collective '{}', which is not reduced around a ring",
                group.name
            ));
        };
        if node != ring.prev_node {
            return Err(format!(
                "it sent a ring chunk of collective '{}', but node {} precedes this node in its ring",
                group.name, ring.prev_node
            ));
        }
        {
            let state = lock(&group.state);
            if state.ring_next != (round, step) {
                return Err(format!(
                    "it sent step {step} of round {round} of the ring of collective '{}' while step {} of round {} was due",
                    group.name, state.ring_next.1, state.ring_next.0
                ));
            }
        }
        let table = (round % 2) as usize;
        let inbox = &ring.inbox[table][step as usize];
        if len != inbox.len() as u64 {
            return Err(format!(
                "it sent {len} bytes as step {step} of the ring of collective '{}'; that chunk has {}",
                group.name,
                inbox.len()
            ));
        }
        inbox.wrote();
        // SAFETY: see `Landing`: the member reads this inbox only once `ring_landed` says
        // this round's chunk is there, and the predecessor sends the next round's only
        // after this node has sent its own step of this round (which follows the read).
        read(unsafe { std::slice::from_raw_parts_mut(inbox.ptr(), inbox.len()) })?;
        let mut state = lock(&group.state);
        state.ring_landed[table][step as usize] = round + 1;
        let steps = ring.steps() as u32;
        state.ring_next = if step + 1 == steps { (round + 1, 0) } else { (round, step + 1) };
        group.changed.notify_all();
        Ok(())
    }
}

/// A collective actor's kernel when its group spans nodes.
struct NetCollectiveKernel {
    group: Arc<NetGroup>,
    layout: Layout,
    out: std::sync::Arc<dyn CollectiveSend>,
    /// Rounds done so far.
    round: u64,
    /// The landing table of this round as peer inputs (no allocation per round).
    peers: Vec<PeerInput>,
}

impl std::fmt::Debug for NetCollectiveKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetCollectiveKernel").field("group", &self.group.name).field("rank", &self.layout.rank).finish()
    }
}

impl NetCollectiveKernel {
    /// An all-reduce's output, summed chunk by chunk as every rank's chunk lands (in rank
    /// order, as `Layout::compute` sums: the same bits).
    fn sum_as_landed(&mut self, dtype: regflow_plan::DType, table: usize, output: &mut [u8]) -> Result<(), String> {
        let (group, round) = (&self.group, self.round);
        let total = output.len();
        let mut done = 0;
        while done < total {
            let available = |state: &RoundState, r: usize| -> usize {
                match (state.filled[table][r], state.landed[table][r]) {
                    (filled, _) if filled == round + 1 => total,
                    (_, (landing, bytes)) if landing == round + 1 => bytes,
                    _ => 0,
                }
            };
            let ready = group.wait_for(
                |state| Some((0..group.size).map(|r| available(state, r)).min().unwrap_or(total)).filter(|&n| n > done),
                |state| group.missing(round, |r| available(state, r) < total),
            )?;
            let end = ready.min(total);
            let inputs = &group.landing[table];
            inputs.iter().for_each(Landing::read);
            // SAFETY: bytes `done..end` of every rank's buffer have landed for this round,
            // and nobody writes them until every member is done with the round.
            let part = |r: usize| unsafe { std::slice::from_raw_parts(inputs[r].ptr().add(done), end - done) };
            super::layout::sum_into(dtype, &mut output[done..end], group.size, part);
            done = end;
        }
        self.round += 1;
        Ok(())
    }
}

impl NetCollectiveKernel {
    /// One round: publishes `input`, sends it to the group's other nodes, and computes
    /// `output` from every rank's input of the round.
    fn round(&mut self, input: &[u8], output: &mut [u8]) -> Result<(), String> {
        let group = self.group.clone();
        let (group, rank, round) = (&group, self.layout.rank, self.round);
        let table = (round % 2) as usize;
        let own = &group.landing[table][rank];
        if input.len() != own.len() {
            return Err(format!("got {} input bytes; it needs {}", input.len(), own.len()));
        }
        if let (Some(ring), Some(dtype)) = (&group.ring, self.layout.all_reduce()) {
            return self.ring_round(ring, dtype, input, output);
        }
        // SAFETY: see `Landing`: this member alone writes its buffer, for a new round.
        own.wrote();
        unsafe { std::slice::from_raw_parts_mut(own.ptr(), own.len()) }.copy_from_slice(input);
        {
            let mut state = lock(&group.state);
            state.filled[table][rank] = round + 1;
            group.changed.notify_all();
        }
        for &node in &group.remote_nodes {
            let bytes = RawBytes { ptr: own.ptr(), len: own.len() };
            let item = Outgoing::Collective { group: group.wire, round, rank: rank as u32, bytes };
            self.out.send(node, item)?;
        }
        if let Some(dtype) = self.layout.all_reduce() {
            return self.sum_as_landed(dtype, table, output);
        }
        group.wait_for(
            |state| state.filled[table].iter().all(|&f| f == round + 1).then_some(()),
            |state| group.missing(round, |r| state.filled[table][r] != round + 1),
        )?;
        for (peer, landing) in self.peers.iter_mut().zip(&group.landing[table]) {
            landing.read();
            // SAFETY: filled for this round; nobody writes it until every member is done.
            *peer = PeerInput::new(unsafe { std::slice::from_raw_parts(landing.ptr(), landing.len()) });
        }
        self.layout.compute(Peers::of_inputs(&self.peers), output);
        self.round += 1;
        Ok(())
    }
}

impl NetCollectiveKernel {
    /// One round around the ring: the output accumulates this member's input and the
    /// predecessor's partial sums chunk by chunk (reduce-scatter), then takes the finished
    /// chunks as they come round (all-gather).
    fn ring_round(
        &mut self,
        ring: &Ring,
        dtype: regflow_plan::DType,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<(), String> {
        let (group, round) = (self.group.clone(), self.round);
        let table = (round % 2) as usize;
        let n = ring.chunks.len();
        output.copy_from_slice(input);
        for step in 0..ring.steps() {
            let (send, receive) = ring.chunk_of(step);
            let stage = &ring.staging[table][step];
            stage.wrote();
            // SAFETY: see `Landing`: the staging buffer of a step is rewritten only two
            // rounds later, when the successor has taken this one.
            unsafe { std::slice::from_raw_parts_mut(stage.ptr(), stage.len()) }
                .copy_from_slice(&output[ring.chunks[send].clone()]);
            let bytes = RawBytes { ptr: stage.ptr(), len: stage.len() };
            let item = Outgoing::Ring { group: group.wire, round, step: step as u32, bytes };
            self.out.send(ring.next_node, item)?;
            group.wait_for(
                |state| (state.ring_landed[table][step] == round + 1).then_some(()),
                |_| {
                    format!(
                        "aborted in round {round} at step {step} of {} of the ring, waiting for node {}",
                        ring.steps(),
                        ring.prev_node
                    )
                },
            )?;
            let inbox = &ring.inbox[table][step];
            inbox.read();
            // SAFETY: landed for this round (checked above under the lock).
            let chunk = unsafe { std::slice::from_raw_parts(inbox.ptr(), inbox.len()) };
            let target = &mut output[ring.chunks[receive].clone()];
            if step < n - 1 {
                super::layout::add_into(dtype, target, chunk);
            } else {
                target.copy_from_slice(chunk);
            }
        }
        self.round += 1;
        Ok(())
    }
}

impl Kernel for NetCollectiveKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        if io.overlaps(0, 0) {
            // Plan validation keeps a register within another to groups of one process.
            return Err(KernelError(format!(
                "collective '{}' (rank {} of {}): its input lies inside its output, which groups across nodes do not take",
                self.group.name, self.layout.rank, self.group.size
            )));
        }
        let input = io.input(0);
        let result = self.round(input, io.output(0));
        let (group, rank) = (&self.group, self.layout.rank);
        result.map_err(|m| KernelError(format!("collective '{}' (rank {rank} of {}): {m}", group.name, group.size)))
    }
}

/// Loom models of the landing protocol: two nodes with one member each, the "network" the
/// sending member itself (it lands its input in the other node's table at once, the most
/// eager a reader thread could be). Each landing buffer is shadowed by a loom cell, so a
/// round's input overwriting a buffer a member still reads is reported.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use regflow_plan::{CollectiveOp, DType, DeviceKind, PlanBuilder, StreamKind};
    /// The other node's groups, cleared at the end of a model (the two nodes' sinks point at
    /// each other: left set, the cycle would leak).
    type Slot = std::sync::Arc<std::sync::Mutex<Option<Arc<NetGroups>>>>;

    /// Hands a member's input straight to the other node's groups.
    struct Direct(Slot, u16);

    impl CollectiveSend for Direct {
        fn send(&self, _node: u16, item: Outgoing) -> Result<(), String> {
            let Outgoing::Collective { group, round, rank, bytes } = item else { return Err("not an input".into()) };
            let other = self.0.lock().map_err(|_| "poisoned")?.clone().ok_or("the other node is not ready")?;
            // SAFETY: the sender's landing buffer holds its input unchanged meanwhile.
            let source = unsafe { std::slice::from_raw_parts(bytes.ptr, bytes.len) };
            other.receive(self.1, group, round, rank, bytes.len as u64, |into| {
                // The inputs here are smaller than one chunk: one call lands all of it.
                into.copy_from_slice(&source[..into.len()]);
                Ok(())
            })
        }
    }

    /// An all-reduce (or all-gather) of `elements` f32 over 2 nodes with one cpu device each.
    fn plan(op: CollectiveOp, elements: usize) -> Plan {
        let mut b = PlanBuilder::new();
        for r in 0..2u32 {
            let device = b.device(r as u16, DeviceKind::Cpu, 0);
            let comm = b.stream(device, StreamKind::Comm);
            let conf =
                CollectiveConf { group: "g".into(), rank: r, size: 2, op, dtype: DType::F32, shape: vec![elements] };
            let bytes = |s: Vec<usize>| (s.iter().product::<usize>() * 4) as u64;
            let (input, output) = (bytes(conf.input_shape()), bytes(conf.output_shape()));
            let src = b.actor(
                &format!("in{r}"),
                comm,
                regflow_plan::ActorKind::Source { pieces: regflow_plan::SourcePieces::Fed },
            );
            let x = b.regst(&format!("x{r}"), src, input, 1);
            let c = b.actor(&format!("c{r}"), comm, ActorKind::Compute { kernel: KernelConf::Collective(conf) });
            b.consume(c, x);
            let y = b.regst(&format!("y{r}"), c, output, 1);
            let sink = b.actor(&format!("out{r}"), comm, regflow_plan::ActorKind::Sink);
            b.consume(sink, y);
        }
        b.build().expect("a valid plan")
    }

    fn members(plan: &Plan) -> (Vec<NetCollectiveKernel>, Vec<Slot>) {
        let slots: Vec<Slot> = (0..2).map(|_| Slot::default()).collect();
        let groups: Vec<Arc<NetGroups>> = (0..2u16)
            .map(|node| {
                let sink: std::sync::Arc<dyn CollectiveSend> =
                    std::sync::Arc::new(Direct(slots[1 - node as usize].clone(), node));
                Arc::new(NetGroups::new(plan, node, sink).expect("groups"))
            })
            .collect();
        for (slot, g) in slots.iter().zip(&groups) {
            *slot.lock().expect("unpoisoned") = Some(g.clone());
        }
        let kernels = (0..2u32)
            .map(|r| {
                let g = &groups[r as usize];
                let group = g.get("g").expect("the group spans both nodes").clone();
                let ActorKind::Compute { kernel: KernelConf::Collective(conf) } = &plan.actors[3 * r as usize + 1].kind
                else {
                    panic!("actor 1 of each node is the collective")
                };
                let layout = Layout::new(conf).expect("a layout");
                NetCollectiveKernel {
                    peers: vec![PeerInput::empty(); 2],
                    group,
                    layout,
                    out: g.out.clone().expect("a sink"),
                    round: 0,
                }
            })
            .collect();
        (kernels, slots)
    }

    fn model(f: impl Fn() + Sync + Send + 'static) {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(3);
        builder.check(f);
    }

    fn check(
        op: CollectiveOp,
        elements: usize,
        expected: impl Fn(u32, u64) -> Vec<f32> + Send + Sync + Copy + 'static,
    ) {
        model(move || {
            const ROUNDS: u64 = 3;
            let plan = plan(op, elements);
            let (members, slots) = members(&plan);
            let mut members = members.into_iter();
            let member = |mut kernel: NetCollectiveKernel, rank: u32| {
                move || {
                    let out_len = kernel.layout.output_bytes;
                    for round in 0..ROUNDS {
                        let input: Vec<u8> = (0..kernel.layout.input_bytes / 4)
                            .flat_map(|i| ((10 * round + u64::from(rank) + 1) as f32 + i as f32).to_le_bytes())
                            .collect();
                        let mut output = vec![0u8; out_len];
                        kernel.round(&input, &mut output).expect("a round");
                        let got: Vec<f32> =
                            output.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
                        assert_eq!(got, expected(rank, round), "rank {rank}, round {round}");
                    }
                }
            };
            let (m0, m1) = (members.next().expect("rank 0"), members.next().expect("rank 1"));
            let other = loom::thread::spawn(member(m1, 1));
            member(m0, 0)();
            other.join().expect("rank 1");
            for slot in &slots {
                slot.lock().expect("unpoisoned").take();
            }
        });
    }

    #[test]
    fn loom_all_reduce_across_nodes_lands_each_round_before_it_is_summed_and_after_it_was_read() {
        // Rank r's element i in round k is 10k + r + 1 + i: the sum is 20k + 3 + 2i.
        check(CollectiveOp::AllReduce, 2, |_, k| (0..2).map(|i| (20 * k + 3) as f32 + 2.0 * i as f32).collect());
    }

    #[test]
    fn loom_all_gather_across_nodes_sees_both_parts_of_each_round() {
        // Each rank holds one element (10k + r + 1); both get [10k + 1, 10k + 2].
        check(CollectiveOp::AllGather { dim: 0 }, 2, |_, k| vec![(10 * k + 1) as f32, (10 * k + 2) as f32]);
    }
}
