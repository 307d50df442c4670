//! Lowering: the plan's devices and streams, and one actor per device for every source,
//! op, variable and fetch of the step, with the registers it writes. What each actor reads
//! is recorded as a [`Read`] of a tensor in a layout, at a rate, on a mesh; the boxing
//! pass connects reads to registers afterwards.

mod discards;
mod fetches;
mod inputs;
mod ops;
mod regs;
mod variables;

pub(crate) use discards::discard_unread;
pub(crate) use fetches::lower_fetches;
pub(crate) use inputs::lower_inputs;
pub(crate) use ops::lower_ops;
pub(crate) use regs::{Reg, WindowOf};
pub(crate) use variables::lower_variables;

use super::collective_order::{Issued, Phase};
use super::compiled::{CompiledInput, ParallelInput};
use super::error::CompileError;
use super::layout::Layouts;
use super::options::{ParallelOptions, PipelineSchedule};
use super::placement::Placement;
use super::step::{Rate, StepFacts};
use crate::dsl::{Graph, TensorId};
use crate::plan::{
    ActorIndex, ActorKind, DeviceIndex, DeviceKind, KernelConf, OpConf, PlanBuilder, RegstDescId, StreamIndex,
    StreamKind, TensorMeta, VariableDesc,
};
use crate::sbp::{local_meta, NdSbp};
use std::collections::HashMap;

/// The form of a tensor a reader needs: in a layout, at a rate, on a mesh (by index). A
/// form has one register per device of the mesh, by rank.
pub(crate) type Form = (TensorId, NdSbp, Rate, usize);

/// What one group of actors (one per rank of `mesh`, or fewer: a fetch sink reads on the
/// first rank only) reads.
#[derive(Debug)]
pub(crate) struct Read {
    /// The readers, by rank.
    pub(crate) actors: Vec<ActorIndex>,
    /// Their mesh.
    pub(crate) mesh: usize,
    /// How often they run.
    pub(crate) rate: Rate,
    /// What they read.
    pub(crate) of: ReadOf,
}

/// The value a [`Read`] takes.
#[derive(Debug)]
pub(crate) enum ReadOf {
    /// A tensor in this layout.
    Tensor(TensorId, NdSbp),
    /// Its device's tick (at the reader's rate): what paces an actor that reads nothing fed.
    Tick,
}

/// The compute actors of one op node, for the pipeline adapters.
#[derive(Debug)]
pub(crate) struct OpActors {
    /// By rank.
    pub(crate) actors: Vec<ActorIndex>,
    pub(crate) mesh: usize,
    pub(crate) rate: Rate,
    /// Whether the fetches need its outputs (a forward op).
    pub(crate) forward: bool,
    pub(crate) node: usize,
}

/// Plan objects of one device.
#[derive(Debug)]
pub(crate) struct DeviceStreams {
    pub(crate) index: DeviceIndex,
    pub(crate) compute: StreamIndex,
    comm: HashMap<Phase, StreamIndex>,
    copy: Option<StreamIndex>,
}

/// What the program gets back besides the plan, gathered while lowering.
#[derive(Debug, Default)]
pub(crate) struct Outputs {
    pub(crate) inputs: Vec<CompiledInput>,
    pub(crate) parallel_inputs: Vec<ParallelInput>,
    pub(crate) fetches: Vec<String>,
    pub(crate) fetch_layouts: Vec<NdSbp>,
    pub(crate) fetch_parts: Vec<Vec<String>>,
    pub(crate) variables: Vec<VariableDesc>,
}

/// The name of a group of `more + 1` merged actors led by one named `lead`: `lead+more`
/// after `prefix`, before the device suffix tools read off the end (`name@slot`), which
/// names on a single device do not have (`adamw_update:24+5@0`).
pub(crate) fn group_name(prefix: &str, lead: &str, more: usize, single_device: bool) -> String {
    match lead.rsplit_once('@').filter(|_| !single_device) {
        Some((base, slot)) => format!("{prefix}{base}+{more}@{slot}"),
        None => format!("{prefix}{lead}+{more}"),
    }
}

/// What a merging pass records as it changes the plan, for [`Lowering::drop_merged`].
pub(crate) struct Merges {
    /// The actor each actor merged into (`None`: not merged; itself: a lead that stays).
    pub(crate) into: Vec<Option<ActorIndex>>,
    /// The registers that go.
    pub(crate) removed_registers: Vec<bool>,
}

impl Merges {
    /// Nothing merged yet in `plan`.
    pub(crate) fn new(plan: &crate::plan::Plan) -> Self {
        Self { into: vec![None; plan.actors.len()], removed_registers: vec![false; plan.regst_descs.len()] }
    }
}

/// The op of actor `a`, which a merging pass planned to change: an op actor (checked when
/// the merge was planned, so anything else is a broken invariant).
pub(crate) fn op_conf_mut(plan: &mut crate::plan::Plan, a: ActorIndex) -> &mut crate::plan::OpConf {
    match &mut plan.actors[a.index()].kind {
        crate::plan::ActorKind::Compute { kernel: crate::plan::KernelConf::Op(conf) } => conf,
        _ => unreachable!("a merged actor's partner is an op actor (checked when the merge was planned)"),
    }
}

/// Appends `register`, of `meta`, to op actor `a`'s inputs: a new actor input that is the
/// op's last input.
pub(crate) fn push_op_input(
    plan: &mut crate::plan::Plan,
    a: ActorIndex,
    register: RegstDescId,
    meta: crate::plan::TensorMeta,
) {
    let actor = &mut plan.actors[a.index()];
    let position = actor.inputs.len();
    actor.inputs.push(register);
    let conf = op_conf_mut(plan, a);
    conf.inputs.push(meta);
    conf.input_map.push(position);
}

/// Makes actor `to` the reader of `register` where actor `from` read it: a read that a
/// merging pass moves into the actor taking `from`'s work over.
pub(crate) fn move_read(plan: &mut crate::plan::Plan, register: RegstDescId, from: ActorIndex, to: ActorIndex) {
    for reader in plan.regst_descs[register.index()].consumers.iter_mut().filter(|c| **c == from) {
        *reader = to;
    }
}

/// Whether actor `actor` reads, directly or through other actors, any of `registers`
/// within a step (preloaded registers, which carry values to the next step, are not
/// followed): whether a merge that makes one of `registers`' makers read what `actor`
/// makes would close a cycle. Searches forward from the registers' readers, cheap where
/// they have few (a layer norm gradient's parameter gradients: the optimizer's part).
pub(crate) fn reads_transitively(
    index: &crate::plan::PlanIndex<'_>,
    actor: ActorIndex,
    registers: &[RegstDescId],
) -> bool {
    let plan = index.plan();
    let readers = |r: &RegstDescId| {
        let desc = &plan.regst_descs[r.index()];
        (desc.preloaded == 0).then_some(desc.consumers.iter().copied()).into_iter().flatten()
    };
    reaches(plan.actors.len(), registers.iter().flat_map(readers), actor, |a| {
        index.outputs_of(a).iter().flat_map(readers)
    })
}

/// Whether any of `registers` is made, directly or through other actors, by actor `actor`
/// within a step (preloaded registers are not followed): the same question as
/// [`reads_transitively`], searched backward from the registers' makers, cheap where they
/// have few (a layer norm's scale and shift: variables).
pub(crate) fn made_by(index: &crate::plan::PlanIndex<'_>, registers: &[RegstDescId], actor: ActorIndex) -> bool {
    let plan = index.plan();
    let maker = |r: &RegstDescId| {
        let desc = &plan.regst_descs[r.index()];
        (desc.preloaded == 0).then_some(desc.producer)
    };
    reaches(plan.actors.len(), registers.iter().filter_map(maker), actor, |a| {
        plan.actors[a.index()].inputs.iter().filter_map(maker)
    })
}

/// Whether a depth-first walk of a plan of `actors` actors from `start`, stepping from
/// each actor to `next(actor)`, meets `target` (each actor visited once).
fn reaches<I: IntoIterator<Item = ActorIndex>>(
    actors: usize,
    start: impl IntoIterator<Item = ActorIndex>,
    target: ActorIndex,
    next: impl Fn(ActorIndex) -> I,
) -> bool {
    let mut seen = vec![false; actors];
    let mut stack: Vec<ActorIndex> = start.into_iter().collect();
    while let Some(a) = stack.pop() {
        if a == target {
            return true;
        }
        if !std::mem::replace(&mut seen[a.index()], true) {
            stack.extend(next(a));
        }
    }
    false
}

/// What `plan_of` makes of each actor of `plan` (a merging pass's plan for it, if any), all
/// planned from one index of the plan as it is, before the pass changes anything.
pub(crate) fn plan_each<T>(
    plan: &crate::plan::Plan,
    plan_of: impl Fn(&crate::plan::PlanIndex<'_>, ActorIndex) -> Option<T>,
) -> Vec<T> {
    let index = crate::plan::PlanIndex::new(plan);
    (0..plan.actors.len()).filter_map(|a| plan_of(&index, ActorIndex(a as u32))).collect()
}

/// Makes `lead` the producer and consumer of every register one of `members` produces or
/// reads (each consumer listed once): the registers of actors merged into one.
pub(crate) fn redirect_registers(plan: &mut crate::plan::Plan, members: &[ActorIndex], lead: ActorIndex) {
    let mut lead_of = vec![None; plan.actors.len()];
    members.iter().for_each(|m| lead_of[m.index()] = Some(lead));
    redirect_to_leads(plan, &lead_of);
}

/// [`redirect_registers`] for many groups in one pass over the registers: every actor `a`
/// with `lead_of[a] = Some(lead)` hands its registers to `lead` (a set by actor, not a
/// search: a device's fused update has a member per parameter, and a plan's buckets are
/// merged by the dozen per device).
pub(crate) fn redirect_to_leads(plan: &mut crate::plan::Plan, lead_of: &[Option<ActorIndex>]) {
    for desc in &mut plan.regst_descs {
        if let Some(lead) = lead_of[desc.producer.index()] {
            desc.producer = lead;
        }
        let mut redirected = false;
        for consumer in desc.consumers.iter_mut() {
            if let Some(lead) = lead_of[consumer.index()] {
                redirected |= *consumer != lead;
                *consumer = lead;
            }
        }
        // Consumers were distinct, so only leads can now be listed twice: keep each once,
        // in place.
        if redirected {
            let mut kept = 0;
            for i in 0..desc.consumers.len() {
                let consumer = desc.consumers[i];
                if !desc.consumers[..kept].contains(&consumer) {
                    desc.consumers[kept] = consumer;
                    kept += 1;
                }
            }
            desc.consumers.truncate(kept);
        }
    }
}

/// Each item's number once the `removed` ones are gone (`None` for those).
fn new_numbers(removed: &[bool]) -> Vec<Option<u32>> {
    let mut next = 0u32;
    removed
        .iter()
        .map(|&gone| {
            let number = (!gone).then_some(next);
            next += u32::from(!gone);
            number
        })
        .collect()
}

/// Drops the items of `items` that `removed` marks, keeping the others' order.
fn retain_kept<T>(items: &mut Vec<T>, removed: &[bool]) {
    let mut index = 0;
    items.retain(|_| {
        index += 1;
        !removed[index - 1]
    });
}

/// The plan under construction and what the passes record on the way.
#[derive(Debug)]
pub(crate) struct Lowering<'a> {
    pub(crate) graph: &'a Graph,
    pub(crate) facts: &'a StepFacts,
    pub(crate) placement: &'a Placement,
    pub(crate) layouts: &'a Layouts,
    pub(crate) options: &'a ParallelOptions,
    /// Whether the cpu devices' collectives run on their compute streams
    /// ([`ParallelOptions::collective_streams`], resolved for this step and host).
    pub(crate) collectives_on_compute: bool,
    /// Copies into a cpu device run on its compute stream, not a copy stream
    /// ([`ParallelOptions::copy_streams`], resolved for this step and host).
    pub(crate) copies_on_compute: bool,
    pub(crate) b: PlanBuilder,
    /// By device slot.
    pub(crate) devices: Vec<DeviceStreams>,
    /// The registers of every form made so far.
    pub(crate) regs: HashMap<Form, Vec<Reg>>,
    /// Where each windowed register came from ([`regs`]).
    pub(crate) windows_of: HashMap<Reg, WindowOf>,
    /// Windows copied out for readers that take whole registers only.
    copies_out: HashMap<Reg, RegstDescId>,
    /// The tick of every device slot that has one (a zero-byte register per micro-batch).
    ticks: Vec<Option<RegstDescId>>,
    /// The per-step tick of device slots that need one.
    pub(crate) step_ticks: HashMap<usize, RegstDescId>,
    /// Reads still to connect, in the order they were made.
    pub(crate) reads: Vec<Read>,
    /// Op actors, for the GPipe gate.
    pub(crate) op_actors: Vec<OpActors>,
    /// Collective actors, for the collective order.
    pub(crate) issued: Vec<Issued>,
    /// Collective groups with their order keys.
    pub(crate) groups: Vec<((usize, usize), String)>,
    /// All-reduces that may join a gradient bucket ([`super::bucket`]).
    pub(crate) bucket_candidates: Vec<super::bucket::Candidate>,
    /// Conversions made so far (boxing steps, copies, repeats): numbers their names.
    pub(crate) conversions: usize,
    pub(crate) out: Outputs,
}

impl<'a> Lowering<'a> {
    /// A plan with every placed device and its compute stream.
    pub(crate) fn new(
        graph: &'a Graph,
        facts: &'a StepFacts,
        placement: &'a Placement,
        layouts: &'a Layouts,
        options: &'a ParallelOptions,
        collectives_on_compute: bool,
    ) -> Self {
        let mut b = PlanBuilder::new();
        let devices: Vec<DeviceStreams> = placement
            .devices
            .iter()
            .map(|d| {
                let index = b.device(d.node, d.kind, d.index);
                let compute = b.stream(index, StreamKind::Compute);
                DeviceStreams { index, compute, comm: HashMap::new(), copy: None }
            })
            .collect();
        Self {
            graph,
            facts,
            placement,
            layouts,
            options,
            collectives_on_compute,
            copies_on_compute: options.copy_streams.on_compute(&placement.devices),
            b,
            devices,
            regs: HashMap::new(),
            windows_of: HashMap::new(),
            copies_out: HashMap::new(),
            ticks: vec![None; placement.devices.len()],
            step_ticks: HashMap::new(),
            reads: Vec::new(),
            op_actors: Vec::new(),
            bucket_candidates: Vec::new(),
            issued: Vec::new(),
            groups: Vec::new(),
            conversions: 0,
            out: Outputs::default(),
        }
    }

    /// Makes `members[0]` one actor running `op` over every member's op: reading every
    /// member's inputs (each register once; a tick no op input maps to comes along),
    /// writing every member's outputs in member order, named after the first member and how
    /// many more (`adamw_update:24+5`); marks each member merged into it in `merged_into`
    /// (the fused updates' and casts' groups). Members that are not op actors leave the
    /// plan unchanged.
    pub(crate) fn merge_op_actors(
        &mut self,
        members: &[ActorIndex],
        op: &dyn regflow_plan::ops::OpAttrs,
        merged_into: &mut [Option<ActorIndex>],
    ) {
        let lead = members[0];
        let plan = self.b.plan_mut();
        let mut inputs: Vec<RegstDescId> = Vec::new();
        // Each register's position among `inputs`: a group has members by the hundred, and
        // the registers they share (learning rate, step, scale, tick) are read by all.
        let mut position_of: HashMap<RegstDescId, usize> = HashMap::new();
        let (mut metas, mut input_map, mut outputs) = (Vec::new(), Vec::new(), Vec::new());
        for &m in members {
            let actor = &plan.actors[m.index()];
            let ActorKind::Compute { kernel: KernelConf::Op(conf) } = &actor.kind else { return };
            let mut position = Vec::with_capacity(actor.inputs.len());
            for &register in &actor.inputs {
                position.push(*position_of.entry(register).or_insert_with(|| {
                    inputs.push(register);
                    inputs.len() - 1
                }));
            }
            metas.extend(conf.inputs.iter().cloned());
            input_map.extend(conf.input_map.iter().map(|&i| position[i]));
            outputs.extend(conf.outputs.iter().cloned());
        }
        let conf = OpConf { op_type: op.op_type().to_string(), attrs: op.attrs(), inputs: metas, input_map, outputs };
        redirect_registers(plan, members, lead);
        let single_device = self.placement.single_device();
        let actor = &mut self.b.plan_mut().actors[lead.index()];
        actor.name = group_name("", &actor.name, members.len() - 1, single_device);
        actor.inputs = inputs;
        actor.kind = ActorKind::Compute { kernel: KernelConf::Op(conf) };
        for &m in members {
            merged_into[m.index()] = Some(lead);
        }
    }

    /// Points the op actors at the actors they were merged into (`merged_into[a]`: `a`'s
    /// group lead, if merged): their ops now run on the lead, and the schedule estimate adds
    /// their costs up there.
    fn retarget_op_actors(&mut self, merged_into: &[Option<ActorIndex>]) {
        for op_actor in self.op_actors.iter_mut().flat_map(|op| op.actors.iter_mut()) {
            *op_actor = merged_into[op_actor.index()].unwrap_or(*op_actor);
        }
    }

    /// Ends a merging pass: points the op actors' lists at the actors others merged into
    /// (`merges.into[a]`, where it names an actor other than `a`), then drops those merged
    /// actors and the removed registers.
    pub(crate) fn drop_merged(&mut self, merges: &Merges) {
        self.retarget_op_actors(&merges.into);
        let removed: Vec<bool> =
            merges.into.iter().enumerate().map(|(a, into)| into.is_some_and(|i| i.index() != a)).collect();
        self.remove_registers(&merges.removed_registers);
        self.remove_actors(&removed);
    }

    /// Drops the `removed` actors from the plan and renumbers every reference to the rest.
    pub(crate) fn remove_actors(&mut self, removed: &[bool]) {
        if !removed.contains(&true) {
            return;
        }
        let new_index = new_numbers(removed);
        let renumber = |a: ActorIndex| new_index[a.index()].map(ActorIndex);
        let plan = self.b.plan_mut();
        retain_kept(&mut plan.actors, removed);
        for desc in &mut plan.regst_descs {
            // A removed actor's registers all moved to the actor it merged into.
            desc.producer = renumber(desc.producer).unwrap_or(desc.producer);
            desc.consumers = desc.consumers.iter().filter_map(|&c| renumber(c)).collect();
        }
        // Sources and sinks are never removed, but may come after removed actors.
        let signature = &mut plan.signature;
        let parts = signature.inputs.iter_mut().flat_map(|input| input.parts.iter_mut().map(|part| &mut part.actor));
        for actor in parts.chain(signature.outputs.iter_mut().map(|output| &mut output.actor)) {
            *actor = renumber(*actor).unwrap_or(*actor);
        }
        self.issued.retain(|i| !removed[i.actor.index()]);
        for issued in &mut self.issued {
            issued.actor = renumber(issued.actor).unwrap_or(issued.actor);
        }
        for op in &mut self.op_actors {
            for actor in &mut op.actors {
                *actor = renumber(*actor).unwrap_or(*actor);
            }
        }
    }

    /// Points every reference to a register `r` with `with[r]` at that register instead:
    /// the actors' inputs, the variables and the lowering's own maps, in one pass for all of
    /// them, so the replaced registers may then be removed ([`Lowering::remove_registers`]).
    /// The new registers' own fields (their readers among them) are the caller's to set; a
    /// new register is not itself replaced.
    pub(crate) fn replace_registers(&mut self, with: &[Option<RegstDescId>]) {
        let new = |r: RegstDescId| with.get(r.index()).copied().flatten().unwrap_or(r);
        let swap = |r: &mut RegstDescId| *r = new(*r);
        let plan = self.b.plan_mut();
        plan.actors.iter_mut().flat_map(|a| a.inputs.iter_mut()).for_each(swap);
        self.out.variables.iter_mut().for_each(|v| swap(&mut v.regst));
        let reg = |r: &Reg| Reg { desc: new(r.desc), window: r.window };
        for regs in self.regs.values_mut() {
            regs.iter_mut().for_each(|r| *r = reg(r));
        }
        self.windows_of = self.windows_of.drain().map(|(r, w)| (reg(&r), w)).collect();
        self.copies_out = self.copies_out.drain().map(|(r, copy)| (reg(&r), new(copy))).collect();
        self.ticks.iter_mut().flatten().for_each(swap);
        self.step_ticks.values_mut().for_each(swap);
    }

    /// Drops the `removed` registers and renumbers every reference to the rest: the actors'
    /// inputs, the variables, and the lowering's own maps (a register merged away, say the
    /// running totals inside a fused chain). No remaining actor may read a removed register
    /// (an actor that did would read `u32::MAX`, which the plan's validation refuses).
    pub(crate) fn remove_registers(&mut self, removed: &[bool]) {
        if !removed.contains(&true) {
            return;
        }
        let new_id = new_numbers(removed);
        let renumber = |r: RegstDescId| new_id.get(r.index()).copied().flatten().map(RegstDescId);
        let kept = |r: RegstDescId| renumber(r).unwrap_or(RegstDescId(u32::MAX));
        let plan = self.b.plan_mut();
        retain_kept(&mut plan.regst_descs, removed);
        for actor in &mut plan.actors {
            actor.inputs.iter_mut().for_each(|r| *r = kept(*r));
        }
        for variable in &mut self.out.variables {
            variable.regst = kept(variable.regst);
        }
        let reg = |r: &Reg| renumber(r.desc).map(|desc| Reg { desc, window: r.window });
        for regs in self.regs.values_mut() {
            *regs = regs.iter().filter_map(reg).collect();
        }
        self.windows_of = self.windows_of.drain().filter_map(|(r, w)| reg(&r).map(|r| (r, w))).collect();
        self.copies_out = self.copies_out.drain().filter_map(|(r, copy)| Some((reg(&r)?, renumber(copy)?))).collect();
        for tick in self.ticks.iter_mut() {
            *tick = tick.and_then(renumber);
        }
        self.step_ticks = self.step_ticks.drain().filter_map(|(slot, r)| Some((slot, renumber(r)?))).collect();
    }

    /// The name of `base` on device `slot`: `base@slot` in a plan of several devices,
    /// `base` in a plan of one (so one-device names do not depend on the compiler).
    pub(crate) fn on_device(&self, base: &str, slot: usize) -> String {
        if self.placement.single_device() {
            base.to_string()
        } else {
            format!("{base}@{slot}")
        }
    }

    /// Tensor `t`'s name.
    pub(crate) fn name(&self, t: TensorId) -> String {
        self.graph.info(t).name
    }

    /// The layout `t` is produced in.
    pub(crate) fn produced(&self, t: TensorId) -> Result<NdSbp, CompileError> {
        self.layouts.produced.get(&t).cloned().ok_or_else(|| CompileError::UnknownLayout { tensor: self.name(t) })
    }

    /// The layout `t`'s consumers see.
    pub(crate) fn visible(&self, t: TensorId) -> Result<NdSbp, CompileError> {
        self.layouts.visible.get(&t).cloned().ok_or_else(|| CompileError::UnknownLayout { tensor: self.name(t) })
    }

    /// `t`'s part on rank `rank` of mesh `mesh` in `layout`.
    pub(crate) fn local_meta(&self, t: TensorId, layout: &NdSbp, mesh: usize, rank: usize) -> TensorMeta {
        let m = &self.placement.meshes[mesh];
        local_meta(&self.graph.info(t).meta, layout, m, &m.coords(rank))
    }

    /// The comm stream of device `slot` for collectives of `phase` (its compute stream on a
    /// cpu device where [`ParallelOptions::collective_streams`] says so).
    pub(crate) fn comm_stream(&mut self, slot: usize, phase: Phase) -> StreamIndex {
        if self.collectives_on_compute && self.placement.devices[slot].kind == crate::plan::DeviceKind::Cpu {
            return self.devices[slot].compute;
        }
        if let Some(s) = self.devices[slot].comm.get(&phase) {
            return *s;
        }
        let s = self.b.stream(self.devices[slot].index, StreamKind::Comm);
        self.devices[slot].comm.insert(phase, s);
        s
    }

    /// The stream of device `slot` that runs the copies it receives from other devices:
    /// its compute stream on a cpu device where [`ParallelOptions::copy_streams`] says so,
    /// else its copy stream.
    pub(crate) fn receiving_stream(&mut self, slot: usize) -> StreamIndex {
        if self.copies_on_compute && self.placement.devices[slot].kind == DeviceKind::Cpu {
            return self.devices[slot].compute;
        }
        self.copy_stream(slot)
    }

    /// The copy stream of device `slot`.
    pub(crate) fn copy_stream(&mut self, slot: usize) -> StreamIndex {
        if let Some(s) = self.devices[slot].copy {
            return s;
        }
        let s = self.b.stream(self.devices[slot].index, StreamKind::Copy);
        self.devices[slot].copy = Some(s);
        s
    }

    /// The stream of device `slot` that exchanges pieces with the host (fed and dataset
    /// sources, fetch sinks): on a `cuda` device its copy stream, so copying a feed in or a fetch
    /// out (and waiting for that copy) never holds the compute stream's thread, which goes
    /// on launching the step's kernels; elsewhere the compute stream, where a feed is a
    /// host copy and an extra thread would only compete for the cores.
    pub(crate) fn io_stream(&mut self, slot: usize) -> StreamIndex {
        match self.placement.devices[slot].kind {
            DeviceKind::Cuda => self.copy_stream(slot),
            DeviceKind::Cpu | DeviceKind::Sim => self.devices[slot].compute,
        }
    }

    /// Slots of a register at `rate` on `mesh`: at micro-batch rate a pipeline stage keeps
    /// `stages - stage` pieces (1F1B: enough for the micro-batches still downstream) or
    /// every micro-batch of a step (GPipe); per-step registers keep the configured count.
    pub(crate) fn register_num(&self, rate: Rate, mesh: usize) -> u32 {
        let base = self.options.activation_register_num.max(1);
        let one_stage = self.placement.stages <= 1 && self.options.schedule == PipelineSchedule::OneForwardOneBackward;
        if rate == Rate::Step || one_stage {
            return base;
        }
        match self.options.schedule {
            PipelineSchedule::OneForwardOneBackward => {
                base.max((self.placement.stages - self.placement.stage[mesh]) as u32)
            }
            PipelineSchedule::GPipe => base.max(self.facts.micro_batches),
        }
    }

    /// Device `slot`'s tick (at micro-batch rate), made on first use.
    pub(crate) fn tick(&mut self, slot: usize) -> Result<RegstDescId, CompileError> {
        match self.ticks.get(slot) {
            Some(Some(tick)) => Ok(*tick),
            Some(None) => {
                let tick = inputs::make_tick(self, slot)?;
                self.ticks[slot] = Some(tick);
                Ok(tick)
            }
            None => Err(CompileError::invariant(format!("device slot {slot} is not a device of the plan"))),
        }
    }

    /// Records that `actors` (by rank of `mesh`, running at `rate`) read `of`.
    pub(crate) fn read(&mut self, actors: &[ActorIndex], mesh: usize, rate: Rate, of: ReadOf) {
        self.reads.push(Read { actors: actors.to_vec(), mesh, rate, of });
    }
}
