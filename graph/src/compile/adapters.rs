//! Rate and pipeline adapters. Under gradient accumulation a step runs at two rates:
//! per micro-batch (the loss and the gradients) and per step (clipping, the schedule, the
//! updates). Where a reader runs at another rate than the value it reads, an adapter sits
//! between them: an acc actor averages a per-micro-batch value over the step, a repeat
//! actor hands a per-step value to every micro-batch, and a per-step tick (an acc of the
//! tick) paces per-step actors that read nothing fed. The boxing pass makes these on
//! demand. Under the GPipe schedule a gate per stage holds its backward actors until its
//! forward actors have run for every micro-batch of the step ([`gate_gpipe_backward`]).

use super::error::CompileError;
use super::lower::{Lowering, OpActors};
use super::options::PipelineSchedule;
use super::step::Rate;
use crate::dsl::TensorId;
use crate::plan::{ActorIndex, ActorKind, KernelConf, OpConf, RegstDescId, TensorMeta};
use crate::sbp::NdSbp;

impl Lowering<'_> {
    /// Device `slot`'s tick at `rate`: per micro-batch, its tick; per step (with several
    /// micro-batches), an acc of its tick that fires once per step, made once.
    pub(crate) fn tick_at(&mut self, slot: usize, rate: Rate) -> Result<RegstDescId, CompileError> {
        let tick = self.tick(slot)?;
        if rate == Rate::Micro || self.facts.micro_batches <= 1 {
            return Ok(tick);
        }
        if let Some(t) = self.step_ticks.get(&slot) {
            return Ok(*t);
        }
        let name = self.on_device("step_tick", slot);
        let kind = ActorKind::Acc { count: self.facts.micro_batches, kernel: KernelConf::Noop };
        let acc = self.b.actor(&name, self.devices[slot].compute, kind);
        self.b.consume(acc, tick);
        let out = self.b.regst(&format!("{name}.out"), acc, 0, 1);
        self.step_ticks.insert(slot, out);
        Ok(out)
    }

    /// Per device, the mean of `t` (in `layout`) over a step's micro-batches.
    pub(crate) fn accumulate(
        &mut self,
        t: TensorId,
        layout: &NdSbp,
        inputs: &[RegstDescId],
        mesh: usize,
    ) -> Vec<RegstDescId> {
        let mut out = Vec::with_capacity(inputs.len());
        for (rank, input) in inputs.iter().enumerate() {
            let slot = self.placement.slot(mesh, rank);
            let local = self.local_meta(t, layout, mesh, rank);
            let name = self.on_device(&format!("accumulate:{}", self.name(t)), slot);
            let kind = ActorKind::Acc { count: self.facts.micro_batches, kernel: accumulate_mean(&local) };
            let a = self.b.actor(&name, self.devices[slot].compute, kind);
            self.b.consume(a, *input);
            out.push(self.b.regst(
                &format!("{name}.out"),
                a,
                local.bytes() as u64,
                self.register_num(Rate::Step, mesh),
            ));
        }
        out
    }

    /// Per device, a per-step value of `t` handed to every micro-batch (no copy).
    pub(crate) fn repeat(&mut self, t: TensorId, inputs: &[RegstDescId], mesh: usize) -> Vec<RegstDescId> {
        let mut out = Vec::with_capacity(inputs.len());
        for (rank, input) in inputs.iter().enumerate() {
            let slot = self.placement.slot(mesh, rank);
            let name = self.on_device(&format!("repeat{}:{}", self.conversions, self.name(t)), slot);
            self.conversions += 1;
            let r =
                self.b.actor(&name, self.devices[slot].compute, ActorKind::Repeat { count: self.facts.micro_batches });
            self.b.consume(r, *input);
            // As many micro-batches as the stage keeps in flight may hold the value at once
            // (the repeat hands out the same register, so more slots cost no memory): with
            // one, the forward of micro-batch j + 1 would wait for the backward of j.
            let bytes = self.b.plan_mut().regst_descs[input.index()].bytes;
            let slots = self.register_num(Rate::Micro, mesh);
            out.push(self.b.regst(&format!("{name}.out"), r, bytes, slots));
        }
        out
    }
}

/// The kernel of an acc actor averaging a group of micro-batch pieces of `meta`.
pub(crate) fn accumulate_mean(meta: &TensorMeta) -> KernelConf {
    KernelConf::Op(OpConf {
        op_type: crate::plan::ops::ACCUMULATE_MEAN.into(),
        attrs: serde_json::Value::Null,
        inputs: vec![meta.clone()],
        input_map: vec![0],
        outputs: vec![meta.clone()],
    })
}

/// GPipe: on every stage with several micro-batches per step, the backward actors wait
/// for a gate that opens once the stage's last forward actor has run for every
/// micro-batch of the step.
pub(crate) fn gate_gpipe_backward(low: &mut Lowering<'_>) {
    let micro_batches = low.facts.micro_batches;
    if low.options.schedule != PipelineSchedule::GPipe || micro_batches <= 1 {
        return;
    }
    for mesh in 0..low.placement.meshes.len() {
        let micro_on_mesh = |p: &&OpActors| p.mesh == mesh && p.rate == Rate::Micro;
        let Some(last_forward) =
            low.op_actors.iter().filter(micro_on_mesh).filter(|p| p.forward).max_by_key(|p| p.node)
        else {
            continue;
        };
        let last: Vec<ActorIndex> = last_forward.actors.clone();
        let backward: Vec<Vec<ActorIndex>> =
            low.op_actors.iter().filter(micro_on_mesh).filter(|p| !p.forward).map(|p| p.actors.clone()).collect();
        if backward.is_empty() {
            continue;
        }
        for (rank, actor) in last.iter().enumerate() {
            let slot = low.placement.slot(mesh, rank);
            let compute = low.devices[slot].compute;
            let gate_name = format!("{}:{mesh}", low.on_device("gpipe_gate", slot));
            let fan_name = format!("{}:{mesh}", low.on_device("gpipe_fan", slot));
            let done = low.b.regst(&format!("{}:{mesh}", low.on_device("forward_done", slot)), *actor, 0, 1);
            let gate =
                low.b.actor(&gate_name, compute, ActorKind::Acc { count: micro_batches, kernel: KernelConf::Noop });
            low.b.consume(gate, done);
            let gated = low.b.regst(&format!("{gate_name}.out"), gate, 0, 1);
            let fan = low.b.actor(&fan_name, compute, ActorKind::Repeat { count: micro_batches });
            low.b.consume(fan, gated);
            let fanned = low.b.regst(&format!("{fan_name}.out"), fan, 0, micro_batches);
            for actors in &backward {
                low.b.consume(actors[rank], fanned);
            }
        }
    }
}
