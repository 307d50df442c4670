//! Op actors: every op the step needs becomes one compute actor per device of its mesh,
//! running the op on its local shapes (the op layout inference chose for that rank).

use super::{Lowering, OpActors, ReadOf};
use crate::compile::error::CompileError;
use crate::compile::layout::NdSignature;
use crate::compile::step::Rate;
use crate::dsl::{Node, TensorId};
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
        low.regs.insert((*o, layout.clone(), rate, mesh), regs);
    }
    Ok(actors)
}
