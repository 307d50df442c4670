//! Op actors: every op the step needs becomes one compute actor per device of its mesh,
//! running the op on its local shapes (the op layout inference chose for that rank).
//!
//! A `reshape` of an op's output becomes no actor at all: its output is the input's
//! registers under the new shape (a view). A row-major reshape keeps every element where
//! it is, so the copy it would run only moves bytes; the readers of the output read the
//! producer's registers instead, beside the input's other readers, and the register's
//! lifetime and backpressure follow from all their reads as for any register. (GPT-2's 98
//! reshapes per step copied 25 MB each, 3 ms of a 200 ms f32 step on an H100; with fused
//! attention, whose gradient reads the output a reshape also reads, 12 more copies of
//! 12.5 MB each in bf16.) An op that reads both the input and the output keeps the copy:
//! it would read one register as two of its inputs.

use super::{Lowering, OpActors, ReadOf};
use crate::compile::error::CompileError;
use crate::compile::layout::NdSignature;
use crate::compile::step::Rate;
use crate::dsl::{Node, TensorId, TensorSource};
use crate::plan::{ActorIndex, ActorKind, KernelConf, OpConf, RegstDescId};
use crate::sbp::NdSbp;

/// One compute actor per device for every needed op, its output registers, and its reads:
/// each (tensor, layout) it names once, plus the tick if it reads nothing fed.
pub(crate) fn lower_ops(low: &mut Lowering<'_>) -> Result<(), CompileError> {
    let (facts, layouts) = (low.facts, low.layouts);
    for (n, node) in facts.needed_nodes() {
        let Some(sig) = layouts.signatures.get(&n) else { continue };
        let Some(first) = node.outputs.first() else { continue };
        let mesh = low.placement.mesh_of(*first)?;
        let rate = facts.rate(*first);
        if view_of_input(low, n, node, sig, mesh, rate) {
            continue;
        }
        let (reads, input_map) = distinct_reads(node, sig);
        let actors = op_actors(low, n, node, sig, input_map, mesh, rate)?;
        for (t, layout) in reads {
            low.read(&actors, mesh, rate, ReadOf::Tensor(t, layout));
        }
        if !node.inputs.iter().any(|i| facts.paced(*i)) {
            low.read(&actors, mesh, rate, ReadOf::Tick);
        }
        let forward = node.outputs.iter().any(|o| facts.forward(*o));
        low.op_actors.push(OpActors { actors, mesh, rate, forward, node: n });
    }
    Ok(())
}

/// Makes node `n`'s output the registers of its input, if `n` is a reshape that can be a
/// view: its input is an op's output (not a fed input or a variable, whose registers are
/// the runtime's to name), which no op reads together with the reshape's output, made in
/// the layout the reshape reads it in (no conversion between), at the reshape's rate, and
/// each device's part keeps its bytes (the local op is a reshape of as many elements). Its
/// output must not be fetched or be a variable's update either, nor may the input, so
/// every name the program uses keeps its own register.
fn view_of_input(low: &mut Lowering<'_>, n: usize, node: &Node, sig: &NdSignature, mesh: usize, rate: Rate) -> bool {
    let ([input], [output], [read_layout], [out_layout]) =
        (node.inputs.as_slice(), node.outputs.as_slice(), sig.inputs.as_slice(), sig.outputs.as_slice())
    else {
        return false;
    };
    if node.op.name() != "reshape"
        || !matches!(low.graph.info(*input).source, TensorSource::Op { .. })
        || read_together(low, *input, *output)
        || low.facts.fetch.contains(input)
        || low.facts.fetch.contains(output)
        || low.facts.updates.iter().any(|(_, value)| value == output || value == input)
        || low.facts.rate(*input) != rate
    {
        return false;
    }
    let same_bytes = low.layouts.local.get(&n).is_some_and(|ranks| {
        ranks.iter().all(|(op, local_in, local_out)| {
            op.name() == "reshape"
                && matches!((local_in.as_slice(), local_out.as_slice()), ([i], [o]) if i.bytes() == o.bytes() && i.dtype == o.dtype)
        })
    });
    if !same_bytes {
        return false;
    }
    let Some(regs) = low.regs.get(&(*input, read_layout.clone(), rate, mesh)).cloned() else { return false };
    low.regs.insert((*output, out_layout.clone(), rate, mesh), regs);
    true
}

/// Whether some needed op reads both `a` and `b`.
fn read_together(low: &Lowering<'_>, a: TensorId, b: TensorId) -> bool {
    low.facts.needed_nodes().any(|(_, node)| node.inputs.contains(&a) && node.inputs.contains(&b))
}

/// The (tensor, layout) pairs node `node` reads, each once even if the op names it twice
/// (`x * x`), and for each op input the index of its read.
fn distinct_reads(node: &Node, sig: &NdSignature) -> (Vec<(TensorId, NdSbp)>, Vec<usize>) {
    let mut reads: Vec<(TensorId, NdSbp)> = Vec::new();
    let input_map = node
        .inputs
        .iter()
        .zip(&sig.inputs)
        .map(|(t, l)| match reads.iter().position(|(rt, rl)| rt == t && rl == l) {
            Some(p) => p,
            None => {
                reads.push((*t, l.clone()));
                reads.len() - 1
            }
        })
        .collect();
    (reads, input_map)
}

/// The compute actors of node `n` (on mesh `mesh`, at `rate`: its first output's), by
/// rank, with their output registers recorded as the outputs' forms.
fn op_actors(
    low: &mut Lowering<'_>,
    n: usize,
    node: &Node,
    sig: &NdSignature,
    input_map: Vec<usize>,
    mesh: usize,
    rate: Rate,
) -> Result<Vec<ActorIndex>, CompileError> {
    let size = low.placement.meshes[mesh].size();
    let op_name = node.op.name();
    let mut actors = Vec::with_capacity(size);
    let mut out_regs: Vec<Vec<RegstDescId>> = vec![Vec::with_capacity(size); node.outputs.len()];
    for rank in 0..size {
        let slot = low.placement.slot(mesh, rank);
        let (op, local_in, local_out) =
            low.layouts.local.get(&n).and_then(|ops| ops.get(rank)).cloned().ok_or_else(|| {
                CompileError::invariant(format!("{op_name} (node {n}) has no local op for rank {rank} of its mesh"))
            })?;
        let name = low.on_device(&format!("{op_name}:{n}"), slot);
        let conf = OpConf::new(&*op, local_in, input_map.clone(), local_out.clone());
        let actor = low.b.actor(&name, low.devices[slot].compute, ActorKind::Compute { kernel: KernelConf::Op(conf) });
        let slots = low.register_num(rate, mesh);
        for (k, (o, meta)) in node.outputs.iter().zip(&local_out).enumerate() {
            out_regs[k].push(low.b.regst(&format!("{name}.{}", o.0), actor, meta.bytes() as u64, slots));
        }
        actors.push(actor);
    }
    for ((o, regs), layout) in node.outputs.iter().zip(out_regs).zip(&sig.outputs) {
        low.regs.insert((*o, layout.clone(), rate, mesh), regs.into_iter().map(super::Reg::whole).collect());
    }
    Ok(actors)
}
