//! The global gradient norm in one actor per device: the chain `Graph::minimize` builds
//! for gradient clipping and loss scaling (`optim.rs`, `squared_global_norm`), a
//! `sum_squares` per gradient and a scalar `add` folding each into the running total,
//! becomes one `sum_squares_group` actor per device and chain (on CUDA a multi-tensor
//! launch pair per 64 gradients instead of two launches per gradient: GPT-2's 196
//! gradients were 391 kernels of 3–20 µs, more launch than work).
//!
//! What fuses: on one stream, an `add` of two scalars (no windows, no other inputs) is a
//! link when an input of it is made by a `sum_squares` actor of the same stream that
//! nothing else reads (its gradient read whole, nothing else read); the other input is the
//! *carry*, the running total so far (or, when both inputs are such squares, the first).
//! Links follow one another when one's output is read by the next alone, as its carry. A
//! chain's last link becomes the group actor: it reads the first link's carry (unless
//! that is a fused `sum_squares` too) and every fused gradient, in the chain's order, and
//! writes the last link's register, which keeps its readers. The other links, the
//! `sum_squares` actors and the registers between them go. The group computes the chain's
//! additions in the chain's order, each rounded as the add it replaces, so the bits are
//! the chain's on the CPU.
//!
//! Layouts need no care: the chain's actors of one device are that device's share of the
//! work whatever the layouts were (split gradients give partial totals, boxed after the
//! chain as before), and a boxing step inside a chain (a pipeline stage's total moved to
//! the next stage) is no `sum_squares` nor `add`, so it ends one chain and its output is
//! the next chain's carry.

use super::lower::{Lowering, Merges};
use crate::plan::{ActorIndex, ActorKind, KernelConf, OpConf, PlanIndex, RegstDescId};
use regflow_plan::ops::{Binary, BinaryKind, OpAttrs, SumSquaresGroup};

/// One link of a chain: its `add` actor, the fused `sum_squares` actors feeding it (one,
/// or two at a chain's head), and its carry register (none when both inputs are squares).
#[derive(Debug, Clone)]
struct Link {
    add: ActorIndex,
    squares: Vec<ActorIndex>,
    carry: Option<RegstDescId>,
}

/// One chain's group, planned from the index before the plan changes: the lead (the last
/// link) takes `conf` and reads `inputs`; the other `members` and the `inner` registers
/// between them go.
#[derive(Debug)]
struct Merge {
    lead: ActorIndex,
    members: Vec<ActorIndex>,
    inputs: Vec<RegstDescId>,
    inner: Vec<RegstDescId>,
    conf: OpConf,
    gradients: usize,
}

/// Fuses every chain of a device's squared norm (module docs), unless the options turn it
/// off.
pub(crate) fn fuse_norms(low: &mut Lowering<'_>) {
    if !low.options.fuse_norms {
        return;
    }
    let plan = low.b.plan_mut();
    let merges: Vec<Merge> = {
        let index = PlanIndex::new(plan);
        chains(&index).iter().filter_map(|chain| plan_merge(&index, chain)).collect()
    };
    if merges.is_empty() {
        return;
    }
    // Each member's lead (the lead's own too): chains are disjoint.
    let mut merged = Merges::new(plan);
    for merge in &merges {
        merge.members.iter().for_each(|m| merged.into[m.index()] = Some(merge.lead));
        merge.inner.iter().for_each(|r| merged.removed_registers[r.index()] = true);
    }
    let single_device = low.placement.single_device();
    for merge in merges {
        apply(plan, merge, &merged.into, single_device);
    }
    low.drop_merged(&merged);
}

/// Every chain of links (module docs), each from its head, as actor indices.
fn chains(index: &PlanIndex<'_>) -> Vec<Vec<Link>> {
    let plan = index.plan();
    let links: Vec<Option<Link>> = (0..plan.actors.len()).map(|a| link(index, ActorIndex(a as u32))).collect();
    // The link each link hands its total to, as that one's carry.
    let next_of = |a: usize| -> Option<usize> {
        let [out] = index.outputs_of(ActorIndex(a as u32)) else { return None };
        let [reader] = plan.regst_descs[out.index()].consumers.as_slice() else { return None };
        let next = links[reader.index()].as_ref()?;
        (next.carry == Some(*out) && plan.actors[reader.index()].stream == plan.actors[a].stream)
            .then_some(reader.index())
    };
    let next: Vec<Option<usize>> = (0..links.len()).map(|a| links[a].as_ref().and_then(|_| next_of(a))).collect();
    let mut has_previous = vec![false; links.len()];
    next.iter().flatten().for_each(|&n| has_previous[n] = true);
    let mut chains = Vec::new();
    for head in (0..links.len()).filter(|&a| links[a].is_some() && !has_previous[a]) {
        let (mut chain, mut at) = (Vec::new(), Some(head));
        while let Some(a) = at {
            chain.extend(links[a].clone());
            at = next[a];
        }
        chains.push(chain);
    }
    chains
}

/// The op an actor runs, when it is a compute actor reading whole registers and writing
/// one.
fn plain_op<'p>(index: &PlanIndex<'p>, a: ActorIndex) -> Option<&'p OpConf> {
    let actor = &index.plan().actors[a.index()];
    let ActorKind::Compute { kernel: KernelConf::Op(conf) } = &actor.kind else { return None };
    let whole = actor.windows.is_empty();
    (whole && index.outputs_of(a).len() == 1 && conf.outputs.len() == 1).then_some(conf)
}

/// Actor `a` as a link (module docs), if it is one.
fn link(index: &PlanIndex<'_>, a: ActorIndex) -> Option<Link> {
    let plan = index.plan();
    let conf = plain_op(index, a)?;
    let actor = &plan.actors[a.index()];
    let dtype = conf.outputs[0].dtype;
    let scalars = conf.inputs.len() == 2
        && conf.inputs.iter().chain(&conf.outputs).all(|m| m.shape.numel() == 1 && m.dtype == dtype);
    if conf.op_type != "binary" || !scalars || !dtype.is_float() || dtype.size() < 4 {
        return None;
    }
    if conf.parse_attrs::<Binary>().ok()? != Binary(BinaryKind::Add) {
        return None;
    }
    let register = |k: usize| conf.input_map.get(k).and_then(|&i| actor.inputs.get(i)).copied();
    let registers = [register(0)?, register(1)?];
    if registers[0] == registers[1] {
        return None;
    }
    // An input made by a `sum_squares` of this stream that this add alone reads.
    let squares_of = |r: RegstDescId| -> Option<ActorIndex> {
        let desc = &plan.regst_descs[r.index()];
        let producer = desc.producer;
        let squares = plain_op(index, producer)?;
        let maker = &plan.actors[producer.index()];
        let fits =
            squares.op_type == "sum_squares" && squares.input_map.len() == 1 && squares.outputs[0].dtype == dtype;
        (fits && maker.stream == actor.stream && desc.consumers == [a]).then_some(producer)
    };
    match (squares_of(registers[0]), squares_of(registers[1])) {
        (Some(first), Some(second)) => Some(Link { add: a, squares: vec![first, second], carry: None }),
        (Some(only), None) => Some(Link { add: a, squares: vec![only], carry: Some(registers[1]) }),
        (None, Some(only)) => Some(Link { add: a, squares: vec![only], carry: Some(registers[0]) }),
        (None, None) => None,
    }
}

/// The group a chain becomes (module docs): its last link the lead, reading the first
/// link's carry (if any), every fused gradient in chain order, and once each the inputs no
/// op input maps to (a tick, the step token: they pace the members).
fn plan_merge(index: &PlanIndex<'_>, chain: &[Link]) -> Option<Merge> {
    let plan = index.plan();
    let (head, last) = (chain.first()?, chain.last()?);
    let lead = last.add;
    let out_meta = plain_op(index, lead)?.outputs[0].clone();
    let (mut inputs, mut metas, mut members) = (Vec::new(), Vec::new(), Vec::new());
    if let Some(carry) = head.carry {
        inputs.push(carry);
        metas.push(out_meta.clone());
    }
    for link in chain {
        for &squares in &link.squares {
            let conf = plain_op(index, squares)?;
            inputs.push(*conf.input_map.first().and_then(|&i| plan.actors[squares.index()].inputs.get(i))?);
            metas.push(conf.inputs[0].clone());
            members.push(squares);
        }
        members.push(link.add);
    }
    let gradients = metas.len() - usize::from(head.carry.is_some());
    let inner: Vec<RegstDescId> =
        members.iter().filter(|&&m| m != lead).flat_map(|&m| index.outputs_of(m).iter().copied()).collect();
    for &m in &members {
        let actor = &plan.actors[m.index()];
        let ActorKind::Compute { kernel: KernelConf::Op(member) } = &actor.kind else { return None };
        for (i, &register) in actor.inputs.iter().enumerate() {
            if !member.input_map.contains(&i) && !inner.contains(&register) && !inputs.contains(&register) {
                inputs.push(register);
            }
        }
    }
    let op = SumSquaresGroup { carried: head.carry.is_some() };
    let conf = OpConf {
        op_type: op.op_type().to_string(),
        attrs: op.attrs(),
        input_map: (0..metas.len()).collect(),
        inputs: metas,
        outputs: vec![out_meta],
    };
    Some(Merge { lead, members, inputs, inner, conf, gradients })
}

/// Makes `merge`'s lead the group actor, read by nothing the members read before it
/// (every register it reads: read by the lead once, instead of by members).
fn apply(plan: &mut crate::plan::Plan, merge: Merge, merged_into: &[Option<ActorIndex>], single_device: bool) {
    let lead = merge.lead;
    for &register in &merge.inputs {
        let consumers = &mut plan.regst_descs[register.index()].consumers;
        let mut lead_seen = false;
        consumers.retain_mut(|c| {
            *c = merged_into[c.index()].filter(|&l| l == lead).unwrap_or(*c);
            *c != lead || !std::mem::replace(&mut lead_seen, true)
        });
    }
    let more = merge.gradients - 1;
    let actor = &mut plan.actors[lead.index()];
    actor.name = super::lower::group_name("sum_squares_group:", &actor.name, more, single_device);
    actor.inputs = merge.inputs;
    actor.windows = Vec::new();
    actor.kind = ActorKind::Compute { kernel: KernelConf::Op(merge.conf) };
}
