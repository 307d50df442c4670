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

use super::lower::Lowering;
use crate::plan::{ActorIndex, ActorKind, KernelConf, OpConf, Plan, RegstDescId};
use regflow_plan::ops::{Binary, BinaryKind, OpAttrs, SumSquaresGroup};

/// One link of a chain: its `add` actor, the fused `sum_squares` actors feeding it (one,
/// or two at a chain's head), and its carry register (none when both inputs are squares).
#[derive(Debug, Clone)]
struct Link {
    add: ActorIndex,
    squares: Vec<ActorIndex>,
    carry: Option<RegstDescId>,
}

/// Fuses every chain of a device's squared norm (module docs), unless the options turn it
/// off.
pub(crate) fn fuse_norms(low: &mut Lowering<'_>) {
    if !low.options.fuse_norms {
        return;
    }
    let plan = low.b.plan_mut();
    let outputs_of = outputs_of(plan);
    let links: Vec<Option<Link>> =
        (0..plan.actors.len()).map(|a| link(plan, &outputs_of, ActorIndex(a as u32))).collect();
    // The link each link hands its total to, as that one's carry.
    let next_of = |a: usize| -> Option<usize> {
        let [out] = outputs_of[a].as_slice() else { return None };
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
        let (mut chain, mut at) = (vec![head], head);
        while let Some(n) = next[at] {
            chain.push(n);
            at = n;
        }
        chains.push(chain);
    }
    let (mut removed_actors, mut removed_registers) =
        (vec![false; plan.actors.len()], vec![false; plan.regst_descs.len()]);
    for chain in chains {
        let chain: Vec<Link> = chain.iter().filter_map(|&a| links[a].clone()).collect();
        merge(low, &outputs_of, &chain, &mut removed_actors, &mut removed_registers);
    }
    low.remove_registers(&removed_registers);
    low.remove_actors(&removed_actors);
}

/// Every actor's output registers, in plan order.
fn outputs_of(plan: &Plan) -> Vec<Vec<RegstDescId>> {
    let mut outputs = vec![Vec::new(); plan.actors.len()];
    for (r, desc) in plan.regst_descs.iter().enumerate() {
        outputs[desc.producer.index()].push(RegstDescId(r as u32));
    }
    outputs
}

/// The op an actor runs, when it is a compute actor reading whole registers and writing
/// one.
fn plain_op<'p>(plan: &'p Plan, outputs_of: &[Vec<RegstDescId>], a: ActorIndex) -> Option<&'p OpConf> {
    let actor = &plan.actors[a.index()];
    let ActorKind::Compute { kernel: KernelConf::Op(conf) } = &actor.kind else { return None };
    let whole = actor.windows.is_empty();
    (whole && outputs_of[a.index()].len() == 1 && conf.outputs.len() == 1).then_some(conf)
}

/// Actor `a` as a link (module docs), if it is one.
fn link(plan: &Plan, outputs_of: &[Vec<RegstDescId>], a: ActorIndex) -> Option<Link> {
    let conf = plain_op(plan, outputs_of, a)?;
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
        let squares = plain_op(plan, outputs_of, producer)?;
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

/// Makes the chain's last link its `sum_squares_group` actor (module docs) and marks the
/// rest, and the registers between them, removed.
fn merge(
    low: &mut Lowering<'_>,
    outputs_of: &[Vec<RegstDescId>],
    chain: &[Link],
    removed_actors: &mut [bool],
    removed_registers: &mut [bool],
) {
    let (Some(head), Some(last)) = (chain.first(), chain.last()) else { return };
    let plan = low.b.plan_mut();
    let lead = last.add;
    let Some(out_meta) = plain_op(plan, outputs_of, lead).map(|c| c.outputs[0].clone()) else { return };
    // The group's inputs, with the member that read each until now.
    let (mut inputs, mut metas, mut readers) = (Vec::new(), Vec::new(), Vec::new());
    if let Some(carry) = head.carry {
        inputs.push(carry);
        metas.push(out_meta.clone());
        readers.push(head.add);
    }
    let mut is_member = vec![false; plan.actors.len()];
    for link in chain {
        for &squares in &link.squares {
            let Some(conf) = plain_op(plan, outputs_of, squares) else { return };
            let Some(&gradient) = conf.input_map.first().and_then(|&i| plan.actors[squares.index()].inputs.get(i))
            else {
                return;
            };
            inputs.push(gradient);
            metas.push(conf.inputs[0].clone());
            readers.push(squares);
            is_member[squares.index()] = true;
        }
        is_member[link.add.index()] = true;
    }
    let gradients = readers.len() - usize::from(head.carry.is_some());
    // Inputs no op input maps to (a tick, the step token, an order) pace the members: the
    // group reads each once, after its op inputs. The registers between members go.
    let mut inner = vec![false; plan.regst_descs.len()];
    for m in (0..is_member.len()).filter(|&m| is_member[m] && m != lead.index()) {
        outputs_of[m].iter().for_each(|r| inner[r.index()] = true);
    }
    for m in (0..is_member.len()).filter(|&m| is_member[m]) {
        let actor = &plan.actors[m];
        let ActorKind::Compute { kernel: KernelConf::Op(member) } = &actor.kind else { return };
        for (i, &register) in actor.inputs.iter().enumerate() {
            if !member.input_map.contains(&i) && !inner[register.index()] && !inputs.contains(&register) {
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
    // Every register the group reads: read by the group, once, instead of by members.
    for &register in &inputs {
        let consumers = &mut plan.regst_descs[register.index()].consumers;
        let mut lead_seen = false;
        consumers.retain_mut(|c| {
            if is_member[c.index()] {
                *c = lead;
            }
            *c != lead || !std::mem::replace(&mut lead_seen, true)
        });
    }
    for m in (0..is_member.len()).filter(|&m| is_member[m] && m != lead.index()) {
        removed_actors[m] = true;
        outputs_of[m].iter().for_each(|r| removed_registers[r.index()] = true);
    }
    let more = gradients - 1;
    let actor = &mut plan.actors[lead.index()];
    actor.name = match actor.name.rsplit_once('@').filter(|_| !low.placement.single_device()) {
        Some((base, slot)) => format!("sum_squares_group:{base}+{more}@{slot}"),
        None => format!("sum_squares_group:{}+{more}", actor.name),
    };
    actor.inputs = inputs;
    actor.windows = Vec::new();
    actor.kind = ActorKind::Compute { kernel: KernelConf::Op(conf) };
    // The members' ops now run on the lead (the schedule estimate adds their costs up).
    for op_actor in low.op_actors.iter_mut().flat_map(|op| op.actors.iter_mut()) {
        if is_member[op_actor.index()] {
            *op_actor = lead;
        }
    }
}
