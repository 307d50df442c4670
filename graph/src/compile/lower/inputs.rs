//! Sources: a dataset source or fed sources on every device of an input's mesh, and the
//! tick a device paces its unpaced actors with (made on a device when one asks for it).

use super::{Lowering, Reg};
use crate::compile::compiled::{CompiledInput, ParallelInput};
use crate::compile::error::CompileError;
use crate::compile::step::Rate;
use crate::dsl::{TensorId, TensorSource};
use crate::plan::{ActorKind, InputSignature, KernelConf, RegstDescId, SourcePieces, TensorPart};
use crate::sbp::part_region;

/// Sources for every input the step reads.
pub(crate) fn lower_inputs(low: &mut Lowering<'_>) -> Result<(), CompileError> {
    dataset_sources(low)?;
    let fed: Vec<TensorId> = low
        .facts
        .needed_tensors()
        .filter(|t| matches!(low.graph.info(*t).source, TensorSource::Input) && !low.facts.dataset.contains(t))
        .collect();
    for t in fed {
        fed_source(low, t)?;
    }
    Ok(())
}

/// One dataset source per device of the dataset's mesh, with one register per input: each
/// reads whole batches (the inputs are produced `Broadcast`) and its readers cut their part.
fn dataset_sources(low: &mut Lowering<'_>) -> Result<(), CompileError> {
    let Some(dataset) = &low.options.dataset else { return Ok(()) };
    let ids = low.facts.dataset.clone();
    let Some(first) = ids.first() else { return Err(CompileError::EmptyDataset) };
    // Placement checked that the dataset's inputs share this mesh.
    let mesh = low.placement.mesh_of(*first)?;
    let size = low.placement.meshes[mesh].size();
    let slots = low.register_num(Rate::Micro, mesh).max(low.options.input_register_num);
    let mut regs = vec![Vec::with_capacity(size); ids.len()];
    for rank in 0..size {
        let slot = low.placement.slot(mesh, rank);
        let name = low.on_device("dataset", slot);
        let stream = low.io_stream(slot);
        let source = low.b.actor(&name, stream, ActorKind::Source { pieces: dataset.source.clone() });
        for (k, id) in ids.iter().enumerate() {
            let bytes = low.graph.info(*id).meta.bytes() as u64;
            let name = low.on_device(&low.name(*id), slot);
            regs[k].push(low.b.regst(&name, source, bytes, slots));
        }
    }
    for (id, r) in ids.iter().zip(regs) {
        let layout = low.produced(*id)?;
        low.regs.insert((*id, layout, Rate::Micro, mesh), r.into_iter().map(Reg::whole).collect());
    }
    Ok(())
}

/// One fed source per device of input `t`'s mesh, each taking its part of every value.
fn fed_source(low: &mut Lowering<'_>, t: TensorId) -> Result<(), CompileError> {
    let info = low.graph.info(t);
    let produced = low.produced(t)?;
    let mesh = low.placement.mesh_of(t)?;
    let m = low.placement.meshes[mesh].clone();
    let slots = low.register_num(Rate::Micro, mesh).max(low.options.input_register_num);
    let (mut parts, mut regs, mut fed_parts) = (Vec::new(), Vec::new(), Vec::new());
    for rank in 0..m.size() {
        let slot = low.placement.slot(mesh, rank);
        let local = low.local_meta(t, &produced, mesh, rank);
        let actor_name = low.on_device(&format!("input:{}", info.name), slot);
        let stream = low.io_stream(slot);
        let source = low.b.actor(&actor_name, stream, ActorKind::Source { pieces: SourcePieces::Fed });
        let regst_name = low.on_device(&info.name, slot);
        regs.push(low.b.regst(&regst_name, source, local.bytes() as u64, slots));
        parts.push((actor_name, local));
        let region = part_region(&info.meta.shape, &produced, &m, &m.coords(rank));
        fed_parts.push(TensorPart { actor: source, region });
    }
    low.b.plan_mut().signature.inputs.push(InputSignature {
        name: info.name.clone(),
        meta: info.meta.clone(),
        parts: fed_parts,
    });
    let first_actor = parts
        .first()
        .map(|(name, _)| name.clone())
        .ok_or_else(|| CompileError::invariant(format!("input '{}' is on a mesh of no devices", info.name)))?;
    low.out.inputs.push(CompiledInput { name: info.name.clone(), actor: first_actor, meta: info.meta.clone() });
    low.out.parallel_inputs.push(ParallelInput {
        name: info.name,
        layout: produced.clone(),
        parts,
        mesh: (*m).clone(),
    });
    low.regs.insert((t, produced, Rate::Micro, mesh), regs.into_iter().map(Reg::whole).collect());
    Ok(())
}

/// Device `slot`'s tick, made when the first reader asks for it: a no-op actor reading the
/// pacing input and writing a zero-byte register, so a fed register is not held by every
/// unpaced actor of every device. On the pacing input's mesh a device takes its own
/// rank's piece; off that mesh, the mesh's first device's.
pub(super) fn make_tick(low: &mut Lowering<'_>, slot: usize) -> Result<RegstDescId, CompileError> {
    let tick = low.facts.tick;
    let tick_mesh = low.placement.mesh_of(tick)?;
    let form = (tick, low.produced(tick)?, Rate::Micro, tick_mesh);
    let sources = low
        .regs
        .get(&form)
        .ok_or_else(|| CompileError::invariant(format!("the pacing input '{}' has no source", low.name(tick))))?;
    let on_mesh = (0..sources.len()).find(|&rank| low.placement.slot(tick_mesh, rank) == slot);
    let source = match on_mesh {
        Some(rank) => sources.get(rank),
        None => sources.first(),
    };
    let source = *source.ok_or_else(|| {
        CompileError::invariant(format!("the pacing input '{}' has no source for device slot {slot}", low.name(tick)))
    })?;
    let name = low.on_device("tick", slot);
    let actor = low.b.actor(&name, low.devices[slot].compute, ActorKind::Compute { kernel: KernelConf::Noop });
    low.consume_reg(actor, source)?;
    let home = low.placement.home[slot];
    let slots = low.register_num(Rate::Micro, home).max(low.options.input_register_num);
    Ok(low.b.regst(&format!("{name}.out"), actor, 0, slots))
}
