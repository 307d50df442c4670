//! Buckets: small collectives of independent tensors merge into one collective per bucket,
//! as PyTorch DDP's gradient buckets and DeepSpeed ZeRO's reduce and all-gather buckets do.
//!
//! Boxing makes one collective per tensor. A collective costs a rendezvous of its group
//! (thread wake-ups on one node, a round trip across nodes) whatever its size, and a model
//! has many small tensors (biases, norms, small projections), so this pass merges them. In
//! the order their inputs are made, candidates that agree on mesh, mesh axis, rate, phase,
//! dtype and op fill a bucket of at most
//! [`ParallelOptions::bucket_bytes`](super::ParallelOptions::bucket_bytes) per device. Each
//! bucket becomes one member per device, reading every part and writing every result; its
//! key in the collective order is its last part's, so it is issued when its last input is
//! made. Larger tensors keep their own collective (the runtime's two-step sum suits them
//! better than a packed copy). Sums are unchanged: each element is still summed over the
//! group in rank order.
//!
//! - **All-reduces** (`P -> B`, data parallelism's gradients) become
//!   [`CollectiveOp::AllReduceBucket`]s. Candidates are tensors no other collective's tensor
//!   depends on (weight gradients: delaying one until its bucket is complete delays only
//!   the updates, or the clipping norm that waits for every gradient anyway), consecutive
//!   in that order.
//! - **Reduce-scatters and all-gathers along dimension 0** (`P -> S(0)`, `S(0) -> B`: ZeRO's
//!   gradients reduced to the rows each device updates, and the updated rows gathered into
//!   the weights) become [`CollectiveOp::ReduceScatterBucket`]s and
//!   [`CollectiveOp::AllGatherBucket`]s, for tensors whose rows divide evenly among the
//!   group (each part is an equal block). Their updates make the gathered weights of the
//!   same step, so the all-reduces' rule would keep every gradient out; instead a bucket
//!   is cut where a collective whose input is made between two of its parts depends on an
//!   earlier part (or where the next part itself does): the bucket, issued at its last
//!   part, would then come after a collective that waits for it.

use super::collective_order::Phase;
use super::lower::Lowering;
use super::step::Rate;
use crate::dsl::Node;
use crate::dsl::{ancestors, TensorId, TensorSource};
use crate::plan::{ActorIndex, ActorKind, CollectiveConf, CollectiveOp, KernelConf, Plan, RegstDescId};
use crate::DType;

/// A collective boxing step made, with what decides whether it can join a bucket.
#[derive(Debug)]
pub(crate) struct Candidate {
    /// What it computes (collectives that cannot join a bucket only count as dependents).
    pub(crate) op: CollectiveOp,
    /// Whether every member's tensor splits into equal blocks along dimension 0.
    pub(crate) even: bool,
    /// Its key in the collective order (when its input is made, creation number).
    pub(crate) key: (usize, usize),
    pub(crate) tensor: TensorId,
    pub(crate) mesh: usize,
    pub(crate) axis: usize,
    pub(crate) rate: Rate,
    pub(crate) phase: Phase,
    pub(crate) dtype: DType,
    /// Bytes of one member's input.
    pub(crate) bytes: u64,
    /// Whether its members read the step's tick.
    pub(crate) ticked: bool,
    /// Its member actors, by rank on the mesh.
    pub(crate) actors: Vec<ActorIndex>,
}

impl Candidate {
    /// What candidates of one bucket share.
    fn kind(&self) -> Kind {
        (self.mesh, self.axis, self.rate, self.phase, self.dtype, self.ticked, self.op)
    }

    /// Whether it can be a part of a ZeRO bucket: a reduce-scatter or all-gather along
    /// dimension 0 in equal blocks.
    fn zero_part(&self) -> bool {
        self.even && matches!(self.op, CollectiveOp::ReduceScatter { dim: 0 } | CollectiveOp::AllGather { dim: 0 })
    }
}

/// The bucket of `parts` tensors that merges collectives of `op`, and its boxing for labels.
fn bucket_of(op: CollectiveOp, parts: u32) -> (CollectiveOp, &'static str) {
    match op {
        CollectiveOp::ReduceScatter { .. } => (CollectiveOp::ReduceScatterBucket { parts }, "P->S(0)"),
        CollectiveOp::AllGather { .. } => (CollectiveOp::AllGatherBucket { parts }, "S(0)->B"),
        _ => (CollectiveOp::AllReduceBucket { parts }, "P->B"),
    }
}

type Kind = (usize, usize, Rate, Phase, DType, bool, CollectiveOp);

/// Merges the bucketable collectives recorded by boxing.
pub(crate) fn bucket_gradients(low: &mut Lowering<'_>) {
    let limit = low.options.bucket_bytes;
    let mut candidates = std::mem::take(&mut low.bucket_candidates);
    if limit == 0 {
        return;
    }
    // An all-reduced tensor that another collective's tensor depends on (an activation
    // gradient under tensor parallelism, a gradient whose norm is all-reduced) stays out
    // of all-reduce buckets: its all-reduce is on the way to another collective, which the
    // collective order may put before the bucket, and which a bucket would at least delay
    // until its last part. A tensor boxed by more than one collective stays out of every
    // bucket: its collective may be one step of several on a 2-D mesh, whose next step
    // reads its output.
    let nodes = &low.facts.nodes;
    let producer_inputs = candidates.iter().flat_map(|c| match low.graph.info(c.tensor).source {
        TensorSource::Op { node, .. } => nodes[node].inputs.clone(),
        TensorSource::Input | TensorSource::Variable { .. } => Vec::new(),
    });
    let upstream = ancestors(nodes, low.graph.tensor_count(), producer_inputs.collect::<Vec<_>>());
    let mut steps = vec![0usize; low.graph.tensor_count()];
    for c in &candidates {
        steps[c.tensor.0 as usize] += 1;
    }
    // A member reading its part through a window keeps its own collective: a bucket's
    // member reads every part whole. (The rule above is the all-reduces'; ZeRO's buckets
    // are cut where a collective waits for one of their parts instead, `zero_buckets`.)
    let plan = low.b.plan_mut();
    let windowed = |c: &Candidate| c.actors.iter().any(|a| !plan.actors[a.index()].windows.is_empty());
    let joins = |c: &Candidate| c.bytes <= limit && steps[c.tensor.0 as usize] == 1 && !windowed(c);
    candidates.sort_by_key(|c| c.key);
    let reach = |root: usize, reached: &mut [bool]| reach_from(nodes, root, reached);
    let mut buckets = zero_buckets(low.graph.tensor_count(), &candidates, &joins, limit, &reach);
    let all_reduces = buckets.len();
    let all_reduce = |c: &&Candidate| c.op == CollectiveOp::AllReduce && joins(c) && !upstream[c.tensor.0 as usize];
    for candidate in candidates.iter().filter(all_reduce) {
        match buckets[all_reduces..].last_mut() {
            Some(bucket)
                if bucket[0].kind() == candidate.kind()
                    && bucket.iter().map(|c| c.bytes).sum::<u64>() + candidate.bytes <= limit =>
            {
                bucket.push(candidate)
            }
            _ => buckets.push(vec![candidate]),
        }
    }
    buckets.retain(|b| b.len() > 1);
    let plan = low.b.plan_mut();
    let actors = plan.actors.len();
    // Each actor's first register, found once: a member's output (merging moves only the
    // members' own registers, so these stay right from bucket to bucket).
    let mut first_output = vec![None; actors];
    for (r, desc) in plan.regst_descs.iter().enumerate().rev() {
        first_output[desc.producer.index()] = Some(RegstDescId(r as u32));
    }
    let mut lead_of = vec![None; actors];
    for (number, bucket) in buckets.iter().enumerate() {
        merge(low, number, bucket, &first_output, &mut lead_of);
    }
    // Every bucket's registers move to its members' leads in one pass.
    super::lower::redirect_to_leads(low.b.plan_mut(), &lead_of);
    let removed: Vec<bool> =
        (0..actors).map(|a| lead_of[a].is_some_and(|lead: ActorIndex| lead.index() != a)).collect();
    low.remove_actors(&removed);
}

/// A bucket being filled: its parts, and every tensor made from theirs.
struct Open<'c> {
    kind: Kind,
    parts: Vec<&'c Candidate>,
    reached: Vec<bool>,
}

/// The ZeRO buckets of `candidates` (every collective boxing made, in key order; `count`
/// tensors in the graph, `reach_from(t, reached)` marks what is made from tensor `t`): per kind,
/// the reduce-scatters or all-gathers along dimension 0 that `joins` lets in, in order, up to
/// `limit` bytes, each bucket cut before the first collective that depends on one of its
/// parts (module docs).
fn zero_buckets<'c>(
    count: usize,
    candidates: &'c [Candidate],
    joins: &dyn Fn(&Candidate) -> bool,
    limit: u64,
    reach_from: &dyn Fn(usize, &mut [bool]),
) -> Vec<Vec<&'c Candidate>> {
    let mut done: Vec<Vec<&Candidate>> = Vec::new();
    let mut open: Vec<Open<'c>> = Vec::new();
    for candidate in candidates {
        // This collective waits for what a bucket's parts make: the bucket must be issued
        // before it, so it takes no later part.
        let (cut, kept): (Vec<Open<'c>>, Vec<Open<'c>>) =
            open.into_iter().partition(|o| o.reached[candidate.tensor.0 as usize]);
        done.extend(cut.into_iter().map(|o| o.parts));
        open = kept;
        if !candidate.zero_part() || !joins(candidate) {
            continue;
        }
        let kind = candidate.kind();
        let at = open.iter().position(|o| o.kind == kind);
        let fits = at.is_some_and(|at| open[at].parts.iter().map(|c| c.bytes).sum::<u64>() + candidate.bytes <= limit);
        let at = match (at, fits) {
            (Some(at), true) => at,
            (at, _) => {
                if let Some(at) = at {
                    done.push(open.remove(at).parts);
                }
                open.push(Open { kind, parts: Vec::new(), reached: vec![false; count] });
                open.len() - 1
            }
        };
        let bucket = &mut open[at];
        bucket.parts.push(candidate);
        reach_from(candidate.tensor.0 as usize, &mut bucket.reached);
    }
    done.extend(open.into_iter().map(|o| o.parts));
    done.retain(|b| b.len() > 1);
    done.sort_by_key(|b| b[0].key);
    done
}

/// Marks in `reached` tensor `root` and every tensor made from it (a part's tensor has no
/// other collective: parts are tensors boxed once). `nodes` are in the order they were
/// made, so one pass suffices.
fn reach_from(nodes: &[Node], root: usize, reached: &mut [bool]) {
    reached[root] = true;
    for node in nodes {
        if node.inputs.iter().any(|i| reached[i.0 as usize]) {
            for o in &node.outputs {
                reached[o.0 as usize] = true;
            }
        }
    }
}

/// Makes each rank's first member of `bucket` the bucket's member on that device, reading
/// and writing every part (`first_output`: each actor's first register), and records
/// every member's lead in `lead_of`, whose registers the caller then redirects.
fn merge(
    low: &mut Lowering<'_>,
    number: usize,
    bucket: &[&Candidate],
    first_output: &[Option<RegstDescId>],
    lead_of: &mut [Option<ActorIndex>],
) {
    let key = bucket.iter().map(|c| c.key).max().unwrap_or(bucket[0].key);
    let names: Vec<String> = bucket.iter().map(|c| low.name(c.tensor)).collect();
    let old_groups: Vec<String> =
        bucket.iter().flat_map(|c| c.actors.iter()).filter_map(|&a| group_of(low.b.plan_mut(), a)).collect();
    let (op, boxing) = bucket_of(bucket[0].op, bucket.len() as u32);
    let label = format!("bucket{number}:{boxing}:{}+{}", names[0], names.len() - 1);
    let mut group_names = Vec::new();
    for rank in 0..bucket[0].actors.len() {
        let members: Vec<ActorIndex> = bucket.iter().map(|c| c.actors[rank]).collect();
        let lead = members[0];
        let slot = low.issued.iter().find(|i| i.actor == lead).map_or(0, |i| i.slot);
        let name = low.on_device(&label, slot);
        let plan = low.b.plan_mut();
        // Each member reads its part first (then, if ticked, the tick) and writes one
        // register. Parts go in the order of those registers: a kernel's outputs are its
        // registers in plan order.
        let mut parts: Vec<(RegstDescId, RegstDescId)> = members
            .iter()
            .map(|&m| (plan.actors[m.index()].inputs[0], first_output[m.index()].unwrap_or(RegstDescId(u32::MAX))))
            .collect();
        parts.sort_by_key(|&(_, output)| output);
        let tick = plan.actors[lead.index()].inputs.get(1).copied();
        // The whole tensors' elements, end to end.
        let elements: usize = members
            .iter()
            .filter_map(|&m| plan.collective_conf(m.index()).map(|c| c.shape.iter().product::<usize>()))
            .sum();
        for &m in &members {
            lead_of[m.index()] = Some(lead);
        }
        let actor = &mut plan.actors[lead.index()];
        actor.name = name;
        actor.inputs = parts.iter().map(|&(input, _)| input).chain(tick).collect();
        if let ActorKind::Compute { kernel: KernelConf::Collective(conf) } = &mut actor.kind {
            let group = format!("{label}:{}", conf.group.rsplit(':').next().unwrap_or("0"));
            group_names.push(group.clone());
            *conf = CollectiveConf { group, op, shape: vec![elements], ..conf.clone() };
        }
        if let Some(issued) = low.issued.iter_mut().find(|i| i.actor == lead) {
            issued.key = key;
        }
    }
    // The members' groups give way to the bucket's.
    low.groups.retain(|(_, g)| !old_groups.contains(g));
    group_names.sort();
    group_names.dedup();
    low.groups.extend(group_names.into_iter().map(|g| (key, g)));
}

fn group_of(plan: &Plan, actor: ActorIndex) -> Option<String> {
    match &plan.actors[actor.index()].kind {
        ActorKind::Compute { kernel: KernelConf::Collective(conf) } => Some(conf.group.clone()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ZeRO candidate of `op` for tensor `t` at key `key`, of `bytes` bytes.
    fn candidate(op: CollectiveOp, t: u32, key: usize, bytes: u64) -> Candidate {
        Candidate {
            op,
            even: true,
            key: (key, key),
            tensor: TensorId(t),
            mesh: 0,
            axis: 0,
            rate: Rate::Micro,
            phase: Phase::Backward,
            dtype: DType::F32,
            bytes,
            ticked: false,
            actors: Vec::new(),
        }
    }

    /// The buckets of `candidates`, as their keys, where `edges` say which tensor is made
    /// from which (directly).
    fn buckets(candidates: &[Candidate], edges: &[(usize, usize)], limit: u64) -> Vec<Vec<usize>> {
        let reach = |root: usize, reached: &mut [bool]| {
            let mut stack = vec![root];
            while let Some(t) = stack.pop() {
                for &(_, to) in edges.iter().filter(|&&(from, _)| from == t) {
                    reached[to] = true;
                    stack.push(to);
                }
            }
        };
        zero_buckets(32, candidates, &|_| true, limit, &reach)
            .into_iter()
            .map(|b| b.iter().map(|c| c.key.0).collect())
            .collect()
    }

    const RS: CollectiveOp = CollectiveOp::ReduceScatter { dim: 0 };
    const AG: CollectiveOp = CollectiveOp::AllGather { dim: 0 };

    /// Gradients a, b, c are reduce-scattered; each weight's update (tensors 10, 11, 12) is
    /// gathered as soon as its gradient is in. A bucket is cut before a collective that
    /// waits for one of its parts: issued at its last part, it would come after it.
    #[test]
    fn a_bucket_is_cut_before_a_collective_that_waits_for_it() {
        let candidates = [
            candidate(RS, 0, 0, 8),
            candidate(AG, 10, 1, 4),
            candidate(RS, 1, 2, 8),
            candidate(RS, 2, 3, 8),
            candidate(AG, 11, 4, 4),
            candidate(AG, 12, 5, 4),
        ];
        let edges = [(0, 10), (1, 11), (2, 12)];
        // {a} is cut by the gather of its update (and a bucket of one is none); {b, c} by
        // that of b's; the gathers, which nothing in between waits for, fill one bucket.
        assert_eq!(buckets(&candidates, &edges, 1 << 20), [vec![1, 4, 5], vec![2, 3]]);
        // Without those dependencies every kind fills one bucket.
        assert_eq!(buckets(&candidates, &[], 1 << 20), [vec![0, 2, 3], vec![1, 4, 5]]);
        // Up to the limit per bucket.
        assert_eq!(buckets(&candidates, &[], 16), [vec![0, 2], vec![1, 4, 5]]);
    }

    /// A part made from an earlier part of the same bucket would wait for the bucket
    /// itself: it starts a new one.
    #[test]
    fn a_part_made_from_another_starts_a_new_bucket() {
        let candidates =
            [candidate(RS, 0, 0, 8), candidate(RS, 1, 1, 8), candidate(RS, 2, 2, 8), candidate(RS, 3, 3, 8)];
        assert_eq!(buckets(&candidates, &[(0, 5), (5, 2)], 1 << 20), [vec![0, 1], vec![2, 3]]);
        // Other ops, uneven parts and other kinds stay out.
        let mut others = [candidate(RS, 0, 0, 8), candidate(RS, 1, 1, 8), candidate(AG, 2, 2, 8)];
        others[1].even = false;
        assert_eq!(buckets(&others, &[], 1 << 20), Vec::<Vec<usize>>::new());
        others[1] = candidate(CollectiveOp::AllReduce, 1, 1, 8);
        others[2] = candidate(RS, 2, 2, 8);
        assert_eq!(buckets(&others, &[], 1 << 20), [vec![0, 2]]);
    }
}
