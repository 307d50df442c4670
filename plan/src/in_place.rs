//! When a register's slots may be one buffer that its producer writes in place
//! ([`RegstDesc::aliased_slots`]): the one rule that plan validation enforces and the
//! compiler chooses by.

use super::order::{chain_positions, topological_positions, Reach};
use super::*;

/// Checks registers against the in-place rule, keeping what it learns of the plan's step
/// order between checks (an optimizer update writes several registers in place).
#[derive(Debug)]
pub struct InPlaceCheck<'p> {
    plan: &'p Plan,
    index: &'p PlanIndex<'p>,
    /// The step's order, computed at the first question of what runs before what.
    order: Option<StepOrder>,
    /// Each collective group's members, collected at the first check of a register within
    /// another.
    groups: Option<std::collections::BTreeMap<&'p str, Vec<usize>>>,
    /// Per register that holds others in its buffer ([`RegstDesc::home`]), those others,
    /// collected at the first check that needs them.
    guests: Option<std::collections::BTreeMap<RegstDescId, Vec<RegstDescId>>>,
    /// The collective members of each device by step position, collected at the first
    /// check of a register held once.
    meetings: Option<Meetings>,
}

/// The plan's collective members arranged for [`InPlaceCheck::readers_before_across`]:
/// each group's members, and each device's members by their position in the step order.
#[derive(Debug)]
struct Meetings {
    groups: Vec<Vec<usize>>,
    /// Per device: (step position, member, group index), by position.
    by_device: Vec<Vec<(usize, usize, u32)>>,
}

impl Meetings {
    /// From the plan's `groups` ([`Plan::collective_groups`]) and the step order's
    /// `position`s.
    fn new(plan: &Plan, groups: &std::collections::BTreeMap<&str, Vec<usize>>, position: &[usize]) -> Self {
        let groups: Vec<Vec<usize>> = groups.values().cloned().collect();
        let mut by_device = vec![Vec::new(); plan.devices.len()];
        for (g, members) in groups.iter().enumerate() {
            for &m in members {
                if let Some(list) = by_device.get_mut(plan.device_of(ActorIndex(m as u32)).index()) {
                    list.push((position[m], m, g as u32));
                }
            }
        }
        for list in &mut by_device {
            list.sort_unstable();
        }
        Self { groups, by_device }
    }
}

/// What runs before what within one step: where two actors lie on their stream's chain
/// (a compiled cpu plan's memory-sharing chain), their positions say; elsewhere a search
/// of the registers that are not preloaded does.
#[derive(Debug)]
struct StepOrder {
    successors: Vec<Vec<usize>>,
    position: Vec<usize>,
    chained: Vec<Option<u32>>,
    reach: Reach,
}

impl StepOrder {
    fn new(plan: &Plan) -> Self {
        let successors = plan.within_step_successors();
        let position = topological_positions(&successors);
        Self { chained: chain_positions(plan), reach: Reach::new(successors.len()), successors, position }
    }

    /// Whether `a` reaches `b` through registers that are not preloaded (within a step, it
    /// fires before it).
    fn before(&mut self, plan: &Plan, a: ActorIndex, b: ActorIndex) -> bool {
        match (self.chained[a.index()], self.chained[b.index()]) {
            // Positions on two streams' chains say nothing of each other.
            (Some(x), Some(y)) if plan.actors[a.index()].stream == plan.actors[b.index()].stream => x < y,
            _ => self.reach.reaches(&self.successors, &self.position, a.index(), b.index()),
        }
    }
}

impl<'p> InPlaceCheck<'p> {
    /// The check over `plan`, indexed by `index`.
    pub fn new(plan: &'p Plan, index: &'p PlanIndex<'p>) -> Self {
        Self { plan, index, order: None, groups: None, guests: None, meetings: None }
    }

    /// Whether `regst`'s slots may be one buffer its producer writes in place; else why
    /// not, as a phrase that follows "but" (`its producer 'x' (op 'matmul') does not …`).
    ///
    /// The producer must be a compute actor on a cpu or cuda device whose op pairs the
    /// register, read whole, as an input with it as an output
    /// ([`OpConf::in_place_pairs`]), in f32 or f64 (host kernels widen 16-bit values into
    /// scratch), and the register must not share memory with others. Every other reader of
    /// a piece must have read it before the producer writes the next one over it: it runs
    /// on the producer's stream (a cpu stream runs one firing after the other, a cuda
    /// stream its kernels in launch order) and reaches the producer through registers that
    /// are not preloaded, so within a step the producer fires after it.
    pub fn check(&mut self, regst: RegstDescId) -> Result<(), String> {
        let plan = self.plan;
        let desc = &plan.regst_descs[regst.index()];
        let producer = &plan.actors[desc.producer.index()];
        if desc.shared_offset.is_some() {
            return Err("it also shares memory with other registers".into());
        }
        let device = &plan.devices[plan.streams[producer.stream.index()].device.index()];
        if !matches!(device.kind, DeviceKind::Cpu | DeviceKind::Cuda) {
            return Err(format!(
                "its producer '{}' runs on {}: in-place slots are built for cpu and cuda devices only",
                producer.name,
                device.label()
            ));
        }
        if let Some(view) = self.gathered_in_place(regst) {
            // An all-gather's own part already lies in this buffer: what writes over the
            // piece first is the update that writes that part, so the rule is checked for it.
            let name = &plan.regst_descs[view.index()].name;
            return self
                .check_within(view)
                .map_err(|e| format!("the register within it, '{name}', may not lie there: {e}"));
        }
        let ActorKind::Compute { kernel: KernelConf::Op(conf) } = &producer.kind else {
            return Err(format!(
                "its producer '{}' is a {} actor, not an op that writes in place",
                producer.name,
                producer.kind.name()
            ));
        };
        let output = self.index.outputs_of(desc.producer).iter().position(|&o| o == regst);
        let input = producer.inputs.iter().position(|&i| i == regst);
        if let Some(window) = producer.windows.iter().find(|w| Some(w.input as usize) == input) {
            return Err(format!(
                "its producer '{}' reads it through a window (bytes {}..{}), not whole",
                producer.name,
                window.offset,
                window.offset.saturating_add(window.bytes)
            ));
        }
        let pairs = conf.in_place_pairs();
        let paired =
            input.is_some() && pairs.iter().any(|&(k, o)| Some(o) == output && conf.input_map.get(k).copied() == input);
        if !paired {
            return Err(format!(
                "its producer '{}' (op '{}') does not read it as the input it writes in place{}",
                producer.name,
                conf.op_type,
                match pairs.as_slice() {
                    [] => " (that op writes nothing in place)".to_string(),
                    pairs => format!(" (op input, output pairs it may alias: {pairs:?})"),
                }
            ));
        }
        written_as_f32_or_f64(producer, conf, output)?;
        self.readers_before(regst, desc.producer, "its producer")
    }

    /// A member of collective group `group` on another node than `node`, if any.
    fn member_apart(&mut self, group: &str, node: u16) -> Option<usize> {
        let plan = self.plan;
        plan.member_apart(self.groups.get_or_insert_with(|| plan.collective_groups()), group, node)
    }

    /// The register within `target` that its producer, an all-gather, reads as its own
    /// part, if it has one ([`RegstDesc::within`]).
    pub(crate) fn gathered_in_place(&self, target: RegstDescId) -> Option<RegstDescId> {
        let producer_index = self.plan.regst_descs[target.index()].producer;
        let producer = &self.plan.actors[producer_index.index()];
        let ActorKind::Compute { kernel: KernelConf::Collective(_) } = producer.kind else { return None };
        let input = *producer.inputs.first()?;
        let within = self.plan.regst_descs[input.index()].within?;
        (within.regst == target && self.index.outputs_of(producer_index).first() == Some(&target)).then_some(input)
    }

    /// Whether `view` may be bytes of the register it names ([`RegstDesc::within`]); else
    /// why not, as a phrase that follows "but".
    ///
    /// The one case built: a sharded update writes its part of a weight in place, where the
    /// part lies in the gathered weight, and the all-gather that makes the whole weight reads
    /// it as its own part and copies only the others'. So: the other register (the
    /// gathered weight) has one buffer and is made by an all-gather along dimension 0, on
    /// cpu devices of one node, whose input is `view`, read by nothing else, at exactly its
    /// own part's bytes; `view`'s producer is an op that reads the gathered weight through a
    /// window at those bytes and writes `view` in place over it (f32 or f64); and every
    /// other reader of the gathered weight runs before that op, as [`InPlaceCheck::check`]
    /// asks of a producer, since the op is what first writes over a piece they read.
    pub fn check_within(&mut self, view: RegstDescId) -> Result<(), String> {
        let plan = self.plan;
        let desc = &plan.regst_descs[view.index()];
        let Some(within) = desc.within else { return Err("it names no register to lie within".into()) };
        let Some(target) = plan.regst_descs.get(within.regst.index()) else {
            return Err(format!("the plan has {} registers", plan.regst_descs.len()));
        };
        if !target.aliased_slots || target.shared_offset.is_some() {
            return Err("that register's slots are not one buffer of its own".into());
        }
        super::memory::one_slot_alone(desc)?;
        let gather = &plan.actors[target.producer.index()];
        let conf = match &gather.kind {
            ActorKind::Compute { kernel: KernelConf::Collective(conf) }
                if matches!(conf.op, CollectiveOp::AllGather { dim: 0 }) && !conf.shape.is_empty() =>
            {
                conf
            }
            _ => {
                return Err(format!(
                    "that register's producer '{}' is not an all-gather along dimension 0 (only an all-gather's own part may lie within its output)",
                    gather.name
                ))
            }
        };
        if gather.inputs.first() != Some(&view)
            || desc.consumers.as_slice() != [target.producer]
            || self.index.outputs_of(target.producer).first() != Some(&within.regst)
        {
            return Err(format!(
                "it is not the own part of that register's all-gather '{}' alone: the all-gather must take it as its input and write that register as its output, and nothing else may read it",
                gather.name
            ));
        }
        let Some(own) = conf.own_part_bytes() else {
            return Err(format!("the all-gather '{}' has a shape {:?} past 2^64 bytes", gather.name, conf.shape));
        };
        let (offset, end) = (own.start, own.end);
        if (within.offset, within.offset.checked_add(desc.bytes)) != (offset, Some(end)) {
            return Err(format!(
                "it is bytes {}..{} there, and the all-gather '{}' (rank {} of {}) puts its own part at bytes {offset}..{end}",
                within.offset,
                within.offset.saturating_add(desc.bytes),
                gather.name,
                conf.rank,
                conf.size,
            ));
        }
        let device = &plan.devices[plan.device_of(target.producer).index()];
        if device.kind != DeviceKind::Cpu {
            return Err(format!(
                "the all-gather '{}' runs on {}: gathering in place is built for cpu devices (in-process rendezvous) only",
                gather.name,
                device.label()
            ));
        }
        if let Some(member) = self.member_apart(&conf.group, device.node) {
            return Err(format!(
                "the all-gather's group '{}' has member '{}' on another node: gathering in place is built for groups within one process",
                conf.group, plan.actors[member].name
            ));
        }
        let writer = &plan.actors[desc.producer.index()];
        let ActorKind::Compute { kernel: KernelConf::Op(op) } = &writer.kind else {
            return Err(format!(
                "its producer '{}' is a {} actor, not an op that writes in place",
                writer.name,
                writer.kind.name()
            ));
        };
        let read_at = writer.inputs.iter().position(|&i| i == within.regst).filter(|&k| {
            writer.windows.iter().any(|w| w.input as usize == k && (w.offset, w.bytes) == (within.offset, desc.bytes))
        });
        let output = self.index.outputs_of(desc.producer).iter().position(|&o| o == view);
        let paired = read_at.is_some()
            && op.in_place_pairs().iter().any(|&(k, o)| Some(o) == output && op.input_map.get(k).copied() == read_at);
        if !paired {
            return Err(format!(
                "its producer '{}' (op '{}') does not read that register through a window at the same bytes as the input it writes in place",
                writer.name, op.op_type
            ));
        }
        written_as_f32_or_f64(writer, op, output)?;
        self.readers_before(within.regst, desc.producer, "the op that writes this part in place,")?;
        let (start, end) = (within.offset, within.offset.saturating_add(desc.bytes));
        for other in self.sharing_buffer(within.regst) {
            self.readers_before_across(other, (start, end), desc.producer)?;
        }
        Ok(())
    }

    /// The registers other than `regst` that are its one buffer ([`RegstDesc::home`]):
    /// its home and the home's other guests, or its own guests.
    fn sharing_buffer(&mut self, regst: RegstDescId) -> Vec<RegstDescId> {
        let plan = self.plan;
        let guests = self.guests.get_or_insert_with(|| {
            let mut guests: std::collections::BTreeMap<RegstDescId, Vec<RegstDescId>> = Default::default();
            for (r, desc) in plan.regst_descs.iter().enumerate() {
                if let Some(home) = desc.home {
                    guests.entry(home).or_default().push(RegstDescId(r as u32));
                }
            }
            guests
        });
        let home = plan.regst_descs.get(regst.index()).and_then(|d| d.home).unwrap_or(regst);
        let mut sharing = guests.get(&home).cloned().unwrap_or_default();
        if home != regst {
            sharing.push(home);
        }
        sharing.retain(|&r| r != regst && r.index() < plan.regst_descs.len());
        sharing
    }

    /// Every reader of `other` (a register on another device that is the same buffer as
    /// the one `writer` writes bytes `bytes` of) that may read those bytes has read its
    /// piece before `writer` fires: it reaches a member of some collective group whose
    /// member on `writer`'s device reaches `writer` (members of a group pass its
    /// rendezvous only together, so what runs before one member's round runs before what
    /// runs after another's). A reader that reads `other` only through a window outside
    /// `bytes` (the all-gather's other members' updates, each writing its own part) is no
    /// concern of `writer`'s.
    fn readers_before_across(
        &mut self,
        other: RegstDescId,
        bytes: (u64, u64),
        writer: ActorIndex,
    ) -> Result<(), String> {
        let plan = self.plan;
        let readers = self.readers_of(other);
        let order = self.order.get_or_insert_with(|| StepOrder::new(plan));
        let groups = self.groups.get_or_insert_with(|| plan.collective_groups());
        let meetings = self.meetings.get_or_insert_with(|| Meetings::new(plan, groups, &order.position));
        let writer_device = plan.device_of(writer);
        // Per group, whether its member on the writer's device runs before the writer:
        // asked only of the groups a reader reaches, once each.
        let mut before_writer: Vec<Option<bool>> = vec![None; meetings.groups.len()];
        let readers = readers.into_iter().filter(|&(reader, held)| {
            let actor = &plan.actors[reader.index()];
            let input = actor.inputs.iter().position(|&i| i == held);
            let window = actor.windows.iter().find(|w| Some(w.input as usize) == input);
            !window.is_some_and(|w| w.offset.saturating_add(w.bytes) <= bytes.0 || w.offset >= bytes.1)
        });
        let held = &plan.regst_descs[other.index()];
        for (reader, _) in readers {
            let actor = &plan.actors[reader.index()];
            let reader_device = plan.device_of(reader);
            // The reader's device's members of those groups that the reader reaches (or
            // is): only members after it in the step order can be, nearest first, since
            // the search for a near one is short.
            let members = meetings.by_device.get(reader_device.index()).map_or(&[][..], |list| list.as_slice());
            let from = members.partition_point(|&(p, _, _)| p < order.position[reader.index()]);
            let ordered = members[from..].iter().any(|&(_, m, g)| {
                (m == reader.index() || order.before(plan, reader, ActorIndex(m as u32)))
                    && *before_writer[g as usize].get_or_insert_with(|| {
                        meetings.groups[g as usize].iter().any(|&w| {
                            let w = ActorIndex(w as u32);
                            plan.device_of(w) == writer_device && order.before(plan, w, writer)
                        })
                    })
            });
            if !ordered {
                return Err(format!(
                    "nothing makes '{}' on {}, which reads '{}' (the same bytes, held once for the process), \
                     read them before '{}' on {} writes over them: a collective that both devices take part in \
                     must come after the reader and before the writer",
                    actor.name,
                    plan.devices[reader_device.index()].label(),
                    held.name,
                    plan.actors[writer.index()].name,
                    plan.devices[writer_device.index()].label(),
                ));
            }
        }
        Ok(())
    }

    /// Whether `guest` may be held in the buffer of the register it names
    /// ([`RegstDesc::home`]); else why not, as a phrase that follows "but".
    ///
    /// The one case built: the members of an all-gather along dimension 0 on cpu devices
    /// of one node that gathers in place on every member ([`InPlaceCheck::check_within`])
    /// hold its output once. So `guest` and its home are the outputs of two members of one
    /// such group, on two devices, both gathered in place, and the home is held nowhere
    /// else. That no member's update writes its part while a reader on another device still
    /// reads those bytes is [`InPlaceCheck::check_within`]'s to say, for every member's part;
    /// that no reader reads the weight before every part is written follows from the
    /// all-gather: its members leave their round only together.
    pub fn check_home(&mut self, guest: RegstDescId) -> Result<(), String> {
        let plan = self.plan;
        let desc = &plan.regst_descs[guest.index()];
        let Some(home) = desc.home else { return Err("it names no register to be held in".into()) };
        let Some(target) = plan.regst_descs.get(home.index()) else {
            return Err(format!("the plan has {} registers", plan.regst_descs.len()));
        };
        if home == guest || target.home.is_some() {
            return Err("that register is not a buffer of its own: it is this one, or held elsewhere itself".into());
        }
        let members = [desc.producer, target.producer].map(|p| plan.collective_conf(p.index()));
        let [Some(ours), Some(theirs)] = members else {
            return Err(format!(
                "'{}' and '{}', which make them, are not both members of an all-gather",
                plan.actors[desc.producer.index()].name,
                plan.actors[target.producer.index()].name
            ));
        };
        if ours.group != theirs.group || !matches!(ours.op, CollectiveOp::AllGather { dim: 0 }) {
            return Err(format!(
                "they are made by members of groups '{}' and '{}': only the outputs of one all-gather along dimension 0 share a buffer",
                ours.group, theirs.group
            ));
        }
        if plan.device_of(desc.producer) == plan.device_of(target.producer) {
            return Err("both are made on one device".into());
        }
        // Every member's output is the one buffer, or two members would both copy a third's
        // part into it.
        let groups = self.groups.get_or_insert_with(|| plan.collective_groups());
        let apart = groups.get(ours.group.as_str()).into_iter().flatten().copied().find(|&m| {
            let output = self.index.outputs_of(ActorIndex(m as u32)).first().copied();
            output.is_none_or(|o| o != home && plan.regst_descs[o.index()].home != Some(home))
        });
        if let Some(member) = apart {
            return Err(format!(
                "member '{}' of all-gather group '{}' writes a buffer of its own: the group's members hold their output once or each its own",
                plan.actors[member].name, ours.group
            ));
        }
        for r in [guest, home] {
            if self.gathered_in_place(r).is_none() {
                return Err(format!(
                    "'{}' is not gathered in place (its all-gather's own part does not lie within it)",
                    plan.regst_descs[r.index()].name
                ));
            }
        }
        Ok(())
    }

    /// Every reader of `regst` other than `writer` runs on `writer`'s stream and reaches it
    /// through registers that are not preloaded: within a step it has read its piece
    /// before `writer` fires and writes over it. `role` says what `writer` is, before its
    /// name.
    ///
    /// On a compiled cpu plan the chain positions answer at once: a sharded plan has an
    /// update per weight and device, and a search of the whole plan from each made
    /// compiling a 16-device GPT take seconds (BENCHMARKS.md, issue 13, "twentieth").
    ///
    /// A repeat actor hands its input's bytes on to every micro-batch of a step without
    /// copying (gradient accumulation, pipeline stages), so its readers read `regst`'s
    /// bytes too: they are held to the same rule, through any chain of repeats. That the
    /// repeat itself comes first is not enough: a per-parameter update that does not wait
    /// for the last micro-batch's `dy · wᵀ` would write over `w` before that product reads
    /// it.
    fn readers_before(&mut self, regst: RegstDescId, writer: ActorIndex, role: &str) -> Result<(), String> {
        let plan = self.plan;
        let readers = self.readers_of(regst);
        let order = self.order.get_or_insert_with(|| StepOrder::new(plan));
        let producer = &plan.actors[writer.index()];
        for (reader, _) in readers.into_iter().filter(|&(reader, _)| reader != writer) {
            let actor = &plan.actors[reader.index()];
            if actor.stream != producer.stream || !order.before(plan, reader, writer) {
                return Err(not_before(actor, producer, role));
            }
        }
        Ok(())
    }

    /// Every actor that reads `regst`'s bytes, with the register it reads them through:
    /// `regst`'s consumers, and those of what repeats hand on of it, through any chain of
    /// repeats (a plan file may loop them; each register is looked at once).
    fn readers_of(&self, regst: RegstDescId) -> Vec<(ActorIndex, RegstDescId)> {
        let plan = self.plan;
        let mut readers = Vec::new();
        let mut seen = vec![false; plan.regst_descs.len()];
        let mut holding = vec![regst];
        while let Some(held) = holding.pop() {
            if std::mem::replace(&mut seen[held.index()], true) {
                continue;
            }
            for &reader in &plan.regst_descs[held.index()].consumers {
                if matches!(plan.actors[reader.index()].kind, ActorKind::Repeat { .. }) {
                    holding.extend(self.index.outputs_of(reader).iter().filter(|r| r.index() < seen.len()));
                }
                readers.push((reader, held));
            }
        }
        readers
    }
}

/// Whether `writer`'s op writes its output `output` as f32 or f64: host kernels widen
/// 16-bit values into scratch, so only those are written in place.
fn written_as_f32_or_f64(writer: &ActorDesc, op: &OpConf, output: Option<usize>) -> Result<(), String> {
    let dtype = output.and_then(|o| op.outputs.get(o)).map(|m| m.dtype);
    if matches!(dtype, Some(DType::F32 | DType::F64)) {
        return Ok(());
    }
    Err(format!(
        "its producer '{}' writes it as {}: in-place updates are built for f32 and f64 values",
        writer.name,
        dtype.map_or_else(|| "nothing".to_string(), |d| d.to_string())
    ))
}

/// Why `reader` may read a piece after `writer` wrote over it.
fn not_before(reader: &ActorDesc, writer: &ActorDesc, role: &str) -> String {
    format!(
        "nothing makes its reader '{}' read a piece before {role} '{}' writes the next over it \
         (the reader must run on the stream of '{}' and reach it through registers that are not preloaded)",
        reader.name, writer.name, writer.name
    )
}
