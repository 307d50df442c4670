//! Gradient buckets: the data-parallel all-reduces of small weight gradients merge into one
//! collective per bucket, as PyTorch DDP's buckets do.
//!
//! Boxing makes one all-reduce per gradient. A collective costs a rendezvous of its group
//! (thread wake-ups on one node, a round trip across nodes) whatever its size, and a model
//! has many small gradients (biases, norms, small projections), so this pass merges them:
//! candidates are all-reduces (`P -> B`) of tensors no other all-reduced tensor depends on
//! (weight gradients: delaying one until its bucket is complete delays only the updates, or
//! the clipping norm that waits for every gradient anyway) of at most
//! [`ParallelOptions::bucket_bytes`](super::ParallelOptions::bucket_bytes) per device. In
//! the order the gradients are made, consecutive candidates that agree on mesh, mesh axis,
//! rate, phase and dtype fill a bucket up to that many bytes. Each bucket becomes one
//! [`CollectiveOp::AllReduceBucket`] member per device, reading every part and writing
//! every sum; its key in the collective order is its last part's, so it is issued when its
//! last gradient is made. Larger gradients keep their own all-reduce (the two-step sum of
//! the runtime suits them better than a packed copy). Sums are unchanged: each element is
//! still summed over the group in rank order.

use super::collective_order::Phase;
use super::lower::Lowering;
use super::step::Rate;
use crate::dsl::{ancestors, TensorId, TensorSource};
use crate::plan::{ActorIndex, ActorKind, CollectiveConf, CollectiveOp, KernelConf, Plan, RegstDescId};
use crate::DType;

/// A collective boxing step made, with what decides whether it can join a bucket.
#[derive(Debug)]
pub(crate) struct Candidate {
    /// Whether it is an all-reduce (the others only count as dependents).
    pub(crate) all_reduce: bool,
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
    fn kind(&self) -> (usize, usize, Rate, Phase, DType, bool) {
        (self.mesh, self.axis, self.rate, self.phase, self.dtype, self.ticked)
    }
}

/// Merges the bucketable all-reduces recorded by boxing.
pub(crate) fn bucket_gradients(low: &mut Lowering<'_>) {
    let limit = low.options.bucket_bytes;
    let mut candidates = std::mem::take(&mut low.bucket_candidates);
    if limit == 0 {
        return;
    }
    // A tensor that another collective's tensor depends on (an activation gradient under
    // tensor parallelism, a gradient whose norm is all-reduced) stays out: its all-reduce
    // is on the way to another collective, which the collective order may put before the
    // bucket, and which a bucket would at least delay until its last part. So does a
    // tensor boxed by more than one collective: its all-reduce may be one step of several
    // on a 2-D mesh, whose next step reads its output.
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
    // A member reading its part through a window keeps its own all-reduce: a bucket's
    // member reads every part whole.
    let plan = low.b.plan_mut();
    let windowed = |c: &Candidate| c.actors.iter().any(|a| !plan.actors[a.index()].windows.is_empty());
    candidates.retain(|c| {
        let t = c.tensor.0 as usize;
        c.all_reduce && c.bytes <= limit && !upstream[t] && steps[t] == 1 && !windowed(c)
    });
    candidates.sort_by_key(|c| c.key);
    let mut buckets: Vec<Vec<Candidate>> = Vec::new();
    for candidate in candidates {
        match buckets.last_mut() {
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
    let mut removed = vec![false; low.b.plan_mut().actors.len()];
    for (number, bucket) in buckets.iter().enumerate() {
        merge(low, number, bucket, &mut removed);
    }
    low.remove_actors(&removed);
}

/// Makes each rank's first member of `bucket` the bucket's member on that device, reading
/// and writing every part, and marks the others `removed`.
fn merge(low: &mut Lowering<'_>, number: usize, bucket: &[Candidate], removed: &mut [bool]) {
    let key = bucket.iter().map(|c| c.key).max().unwrap_or(bucket[0].key);
    let names: Vec<String> = bucket.iter().map(|c| low.name(c.tensor)).collect();
    let old_groups: Vec<String> =
        bucket.iter().flat_map(|c| c.actors.iter()).filter_map(|&a| group_of(low.b.plan_mut(), a)).collect();
    let label = format!("bucket{number}:P->B:{}+{}", names[0], names.len() - 1);
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
            .map(|&m| {
                let output = plan.regst_descs.iter().position(|d| d.producer == m).map(|r| RegstDescId(r as u32));
                (plan.actors[m.index()].inputs[0], output.unwrap_or(RegstDescId(u32::MAX)))
            })
            .collect();
        parts.sort_by_key(|&(_, output)| output);
        let tick = plan.actors[lead.index()].inputs.get(1).copied();
        for &m in &members[1..] {
            removed[m.index()] = true;
        }
        super::lower::redirect_registers(plan, &members, lead);
        let actor = &mut plan.actors[lead.index()];
        actor.name = name;
        actor.inputs = parts.iter().map(|&(input, _)| input).chain(tick).collect();
        if let ActorKind::Compute { kernel: KernelConf::Collective(conf) } = &mut actor.kind {
            let elements = (bucket.iter().map(|c| c.bytes).sum::<u64>() / conf.dtype.size() as u64) as usize;
            let group = format!("{label}:{}", conf.group.rsplit(':').next().unwrap_or("0"));
            group_names.push(group.clone());
            *conf = CollectiveConf {
                group,
                op: CollectiveOp::AllReduceBucket { parts: bucket.len() as u32 },
                shape: vec![elements],
                ..conf.clone()
            };
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
