//! Variables: per device a loop register holding its part, produced once per step by its
//! update (by the update itself, by the last step of its boxing when it is made in another
//! layout, or by an `assign` copy of it when the step reads it too) and preloaded with its
//! initial value, so step k + 1 reads what step k wrote. A variable nobody updates is a constant register: every
//! slot holds its value from the job's start, handed out each step by a no-op paced by the
//! tick, so a forward plan copies no weights per piece.
//!
//! A loop register has two slots: the update of step k writes the value of step k + 1
//! into the other slot while step k's readers may still hold theirs, and piece numbers
//! keep every reader on its own step's value; two slots are not staleness. Where the
//! compiler fixes a cpu device's order and every other reader of step k's value runs
//! before the update, memory sharing makes the two slots one buffer the update writes in
//! place (`RegstDesc::aliased_slots`, `compile/share.rs`); a weight made by the all-gather
//! of its sharded update's parts becomes one buffer too, the update writing its rows in
//! place (`RegstDesc::within`, `share.rs`'s `gather_in_place`).

use super::{Lowering, ReadOf, Reg};
use crate::compile::error::CompileError;
use crate::dsl::{TensorId, TensorSource};
use crate::plan::{ActorIndex, ActorKind, Init, KernelConf, RegstDescId, VariableDesc};
use crate::sbp::{part_region, NdSbp};

/// The loop registers of every variable the step needs.
pub(crate) fn lower_variables(low: &mut Lowering<'_>) -> Result<(), CompileError> {
    let variables: Vec<(TensorId, Init)> = low
        .facts
        .needed_tensors()
        .filter_map(|t| match low.graph.info(t).source {
            TensorSource::Variable { init, .. } => Some((t, init)),
            _ => None,
        })
        .collect();
    for (t, init) in variables {
        let layout = low.produced(t)?;
        let mesh = low.placement.mesh_of(t)?;
        let regs = match low.facts.update_of(t) {
            Some(new) => {
                let direct =
                    if writes_loop_directly(low, t, new, mesh)? { direct_loop(low, new, &layout, mesh)? } else { None };
                match direct {
                    Some(regs) => regs,
                    None => assign_loop(low, t, new, &layout, mesh)?,
                }
            }
            None => constant_value(low, t, &layout, mesh)?,
        };
        let constant = low.facts.update_of(t).is_none();
        let m = low.placement.meshes[mesh].clone();
        let info = low.graph.info(t);
        for (rank, (state, _)) in regs.iter().enumerate() {
            let slot = low.placement.slot(mesh, rank);
            low.out.variables.push(VariableDesc {
                name: low.on_device(&info.name, slot),
                regst: *state,
                meta: info.meta.clone(),
                init: init.clone(),
                region: part_region(&info.meta.shape, &layout, &m, &m.coords(rank)),
                constant,
            });
        }
        let rate = low.facts.rate(t);
        low.regs.insert((t, layout, rate, mesh), regs.iter().map(|(_, value)| Reg::whole(*value)).collect());
    }
    Ok(())
}

/// Whether the update of variable `t` can write its loop register itself: the new value
/// is made on the variable's mesh at its rate, and only the next step reads it. If this
/// step reads it too (the step counter, read by the schedule), an `assign` copy feeds the
/// loop instead.
///
/// A new value made in another layout (a weight updated shard by shard, ZeRO style, and
/// all-gathered) qualifies too: its boxing then writes the loop register, so the gathered
/// weight is not copied once more by an `assign` (on the digits MLP's dp2 with sharded
/// AdamW state that copy took 2 ms per step and device, and the variable's memory twice).
fn writes_loop_directly(low: &Lowering<'_>, t: TensorId, new: TensorId, mesh: usize) -> Result<bool, CompileError> {
    let facts = low.facts;
    Ok(matches!(low.graph.info(new).source, TensorSource::Op { .. })
        && low.placement.mesh_of(new)? == mesh
        && facts.rate(new) == facts.rate(t)
        && !facts.read_in_step(new))
}

/// The update's registers in the variable's layout become the loop: its own, or those the
/// last step of its boxing writes (made here, before the reads are connected: nothing else
/// reads the new value in this step). Two slots, one preloaded. By rank: `(loop register,
/// register readers take)`, the same register. `None` where the value in the variable's
/// layout is a window of another register (a `B -> S(0)` part read in place), which
/// cannot be a loop: an `assign` copies it then.
fn direct_loop(
    low: &mut Lowering<'_>,
    new: TensorId,
    layout: &NdSbp,
    mesh: usize,
) -> Result<Option<Vec<(RegstDescId, RegstDescId)>>, CompileError> {
    let regs = low.registers(new, layout, low.facts.rate(new), mesh)?;
    if regs.iter().any(|r| r.window.is_some()) {
        return Ok(None);
    }
    for reg in &regs {
        let desc = &mut low.b.plan_mut().regst_descs[reg.desc.index()];
        desc.register_num = desc.register_num.max(2);
        low.b.preload(reg.desc, 1);
    }
    Ok(Some(regs.into_iter().map(|r| (r.desc, r.desc)).collect()))
}

/// An `assign` copy per device reads the new value (in the variable's form) and writes the
/// loop register.
fn assign_loop(
    low: &mut Lowering<'_>,
    t: TensorId,
    new: TensorId,
    layout: &NdSbp,
    mesh: usize,
) -> Result<Vec<(RegstDescId, RegstDescId)>, CompileError> {
    let size = low.placement.meshes[mesh].size();
    let mut actors = Vec::with_capacity(size);
    let mut regs = Vec::with_capacity(size);
    for rank in 0..size {
        let (actor, reg, _) = loop_copy(low, "assign", t, layout, mesh, rank);
        actors.push(actor);
        regs.push((reg, reg));
    }
    let rate = low.facts.rate(t);
    low.read(&actors, mesh, rate, ReadOf::Tensor(new, layout.clone()));
    Ok(regs)
}

/// A variable nobody updates: per device a register whose every slot holds its part
/// from the job's start (`VariableDesc::constant`; nothing ever writes it), handed out
/// once per step by a no-op actor paced by the tick. No copy per step: a forward plan's
/// weights are read where they were written. By rank: `(register, register)`.
fn constant_value(
    low: &mut Lowering<'_>,
    t: TensorId,
    layout: &NdSbp,
    mesh: usize,
) -> Result<Vec<(RegstDescId, RegstDescId)>, CompileError> {
    let rate = low.facts.rate(t);
    let size = low.placement.meshes[mesh].size();
    let name = low.name(t);
    let mut actors = Vec::with_capacity(size);
    let mut regs = Vec::with_capacity(size);
    for rank in 0..size {
        let slot = low.placement.slot(mesh, rank);
        let bytes = low.local_meta(t, layout, mesh, rank).bytes() as u64;
        let actor_name = low.on_device(&format!("variable:{name}"), slot);
        let actor =
            low.b.actor(&actor_name, low.devices[slot].compute, ActorKind::Compute { kernel: KernelConf::Noop });
        let reg = low.b.regst(&low.on_device(&name, slot), actor, bytes, low.register_num(rate, mesh));
        actors.push(actor);
        regs.push((reg, reg));
    }
    low.read(&actors, mesh, rate, ReadOf::Tick);
    Ok(regs)
}

/// The copy actor `role:<variable>` on rank `rank` of `mesh` and the two-slot loop
/// register it writes (named after the variable, one slot preloaded with its initial
/// value): `(actor, loop register, bytes of the variable's part)`.
fn loop_copy(
    low: &mut Lowering<'_>,
    role: &str,
    t: TensorId,
    layout: &NdSbp,
    mesh: usize,
    rank: usize,
) -> (ActorIndex, RegstDescId, u64) {
    let name = low.name(t);
    let slot = low.placement.slot(mesh, rank);
    let bytes = low.local_meta(t, layout, mesh, rank).bytes() as u64;
    let actor_name = low.on_device(&format!("{role}:{name}"), slot);
    let actor = low.b.actor(&actor_name, low.devices[slot].compute, ActorKind::Compute { kernel: KernelConf::Copy });
    let reg = low.b.regst(&low.on_device(&name, slot), actor, bytes, 2);
    low.b.preload(reg, 1);
    (actor, reg, bytes)
}
