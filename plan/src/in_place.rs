//! When a register's slots may be one buffer that its producer writes in place
//! ([`RegstDesc::aliased_slots`]): the one rule that plan validation enforces and the
//! compiler chooses by.

use super::*;

/// Checks registers against the in-place rule, remembering what reaches the writer it
/// checked last (an optimizer update writes several registers in place, checked one
/// after the other).
#[derive(Debug)]
pub struct InPlaceCheck<'p> {
    plan: &'p Plan,
    index: &'p PlanIndex<'p>,
    /// Per actor, the number of the last search that reached it ([`InPlaceCheck::search`]);
    /// allocated at the first search.
    reached: Vec<u32>,
    /// The latest search's number, and its writer and scope (`true`: the whole plan).
    latest: (u32, Option<(ActorIndex, bool)>),
    stack: Vec<ActorIndex>,
    /// Per actor, its position on its stream where the stream's actors form one chain
    /// within a step ([`chain_positions`]); computed at the first check.
    chained: Option<Vec<Option<u32>>>,
    /// Each collective group's members, collected at the first check of a register within
    /// another.
    groups: Option<std::collections::HashMap<&'p str, Vec<ActorIndex>>>,
}

impl<'p> InPlaceCheck<'p> {
    /// The check over `plan`, indexed by `index`.
    pub fn new(plan: &'p Plan, index: &'p PlanIndex<'p>) -> Self {
        Self { plan, index, reached: Vec::new(), latest: (0, None), stack: Vec::new(), chained: None, groups: None }
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
    fn member_apart(&mut self, group: &str, node: u16) -> Option<ActorIndex> {
        let plan = self.plan;
        let groups = self.groups.get_or_insert_with(|| {
            let mut groups: std::collections::HashMap<&'p str, Vec<ActorIndex>> = std::collections::HashMap::new();
            for (a, actor) in plan.actors.iter().enumerate() {
                if let ActorKind::Compute { kernel: KernelConf::Collective(c) } = &actor.kind {
                    groups.entry(c.group.as_str()).or_default().push(ActorIndex(a as u32));
                }
            }
            groups
        });
        let node_of = |a: &ActorIndex| plan.devices[plan.device_of(*a).index()].node;
        groups.get(group)?.iter().find(|a| node_of(a) != node).copied()
    }

    /// The register within `target` that its producer, an all-gather, reads as its own
    /// part, if it has one ([`RegstDesc::within`]).
    fn gathered_in_place(&self, target: RegstDescId) -> Option<RegstDescId> {
        let producer_index = self.plan.regst_descs[target.index()].producer;
        let producer = &self.plan.actors[producer_index.index()];
        let ActorKind::Compute { kernel: KernelConf::Collective(_) } = producer.kind else { return None };
        let input = *producer.inputs.first()?;
        (self.index.outputs_of(producer_index).first() == Some(&target))
            .then_some(())
            .and(self.plan.regst_descs[input.index()].within.filter(|w| w.regst == target))
            .map(|_| input)
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
        // Shapes come from plan files: every product is checked.
        let row_bytes = conf.shape[1..].iter().try_fold(conf.dtype.size() as u64, |acc, &d| acc.checked_mul(d as u64));
        let part = crate::part_range(conf.shape[0], conf.size.max(1) as usize, conf.rank as usize);
        let own = row_bytes.and_then(|row| {
            let offset = (part.start as u64).checked_mul(row)?;
            Some((offset, offset.checked_add((part.len() as u64).checked_mul(row)?)?))
        });
        let Some((offset, end)) = own else {
            return Err(format!("the all-gather '{}' has a shape {:?} past 2^64 bytes", gather.name, conf.shape));
        };
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
                conf.group, plan.actors[member.index()].name
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
        self.readers_before(within.regst, desc.producer, "the op that writes this part in place,")
    }

    /// Every reader of `regst` other than `writer` runs on `writer`'s stream and reaches it
    /// through registers that are not preloaded: within a step it has read its piece
    /// before `writer` fires and writes over it.
    /// `role` says what `writer` is, before its name.
    ///
    /// Where the stream's actors form one chain (a compiled cpu plan's memory-sharing
    /// chain), a reader is before `writer` if it comes earlier in the chain. Elsewhere the
    /// readers are looked for among `writer`'s ancestors on its own stream first, and among
    /// all its ancestors only where one is missing. A sharded plan has an update per weight
    /// and device, and a search of the whole plan from each made compiling a 16-device GPT
    /// take seconds (BENCHMARKS.md, issue 13, "twentieth").
    fn readers_before(&mut self, regst: RegstDescId, writer: ActorIndex, role: &str) -> Result<(), String> {
        if self.chained.is_none() {
            self.chained = Some(chain_positions(self.plan));
        }
        let chained = self.chained.take().unwrap_or_default();
        let result = self.readers_before_in(regst, writer, role, &chained);
        self.chained = Some(chained);
        result
    }

    /// [`InPlaceCheck::readers_before`] with the chain positions taken out of `self`.
    fn readers_before_in(
        &mut self,
        regst: RegstDescId,
        writer: ActorIndex,
        role: &str,
        chained: &[Option<u32>],
    ) -> Result<(), String> {
        let plan = self.plan;
        let desc = &plan.regst_descs[regst.index()];
        let producer = &plan.actors[writer.index()];
        let chain_order = |reader: ActorIndex| match (chained[reader.index()], chained[writer.index()]) {
            (Some(r), Some(w)) => Some(r < w),
            _ => None,
        };
        let (mut whole, mut searched) = (false, false);
        for reader in desc.consumers.iter().filter(|&&c| c != writer) {
            let actor = &plan.actors[reader.index()];
            if actor.stream != producer.stream {
                return Err(not_before(actor, producer, role));
            }
            if let Some(before) = chain_order(*reader) {
                if before {
                    continue;
                }
                return Err(not_before(actor, producer, role));
            }
            if !searched {
                self.search(writer, whole);
                searched = true;
            }
            let mut before = self.is_reached(*reader);
            if !before && !whole {
                whole = true;
                self.search(writer, whole);
                before = self.is_reached(*reader);
            }
            if !before {
                return Err(not_before(actor, producer, role));
            }
        }
        Ok(())
    }

    /// Marks the actors from which `writer` is reached through registers that are not
    /// preloaded (within a step, they fire before it): through actors of its stream only,
    /// or through any (`whole`). The latest search is reused.
    fn search(&mut self, writer: ActorIndex, whole: bool) {
        if self.latest.1 == Some((writer, whole)) {
            return;
        }
        let plan = self.plan;
        if self.reached.is_empty() {
            self.reached = vec![0; plan.actors.len()];
        }
        if self.latest.0 == u32::MAX {
            self.reached.iter_mut().for_each(|r| *r = 0);
            self.latest.0 = 0;
        }
        let number = self.latest.0 + 1;
        self.latest = (number, Some((writer, whole)));
        let stream = plan.actors[writer.index()].stream;
        self.stack.clear();
        self.stack.push(writer);
        while let Some(a) = self.stack.pop() {
            for input in &plan.actors[a.index()].inputs {
                let desc = &plan.regst_descs[input.index()];
                let p = desc.producer;
                if desc.preloaded == 0
                    && self.reached[p.index()] != number
                    && (whole || plan.actors[p.index()].stream == stream)
                {
                    self.reached[p.index()] = number;
                    self.stack.push(p);
                }
            }
        }
    }

    /// Whether the latest search reached `actor`.
    fn is_reached(&self, actor: ActorIndex) -> bool {
        self.reached[actor.index()] == self.latest.0
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

/// Per actor, its position on the longest path of its stream's actors within a step
/// (each reaching the next through a register that is not preloaded, so each is reached
/// from every actor before it on the path), or `None` off that path. In a compiled cpu plan
/// that path is the memory-sharing chain through every compute actor of the stream; its
/// sources and sinks are off it.
fn chain_positions(plan: &Plan) -> Vec<Option<u32>> {
    let n = plan.actors.len();
    // Within-step edges between actors of one stream.
    let mut indegree = vec![0usize; n];
    let mut successors: Vec<Vec<usize>> = vec![Vec::<usize>::new(); n];
    for desc in plan.regst_descs.iter().filter(|d| d.preloaded == 0) {
        let p = desc.producer.index();
        for c in &desc.consumers {
            if plan.actors[c.index()].stream == plan.actors[p].stream && c.index() != p {
                successors[p].push(c.index());
                indegree[c.index()] += 1;
            }
        }
    }
    // Longest path ending at each actor (Kahn's order over all streams at once), and the
    // actor before it on that path.
    let mut length = vec![1u32; n];
    let mut parent: Vec<Option<usize>> = vec![None; n];
    let mut ready: Vec<usize> = (0..n).filter(|&a| indegree[a] == 0).collect();
    while let Some(a) = ready.pop() {
        for &c in &successors[a] {
            if length[a] + 1 > length[c] {
                length[c] = length[a] + 1;
                parent[c] = Some(a);
            }
            indegree[c] -= 1;
            if indegree[c] == 0 {
                ready.push(c);
            }
        }
    }
    // Per stream, the end of its longest path, walked back.
    let mut end: Vec<Option<usize>> = vec![None; plan.streams.len()];
    for a in 0..n {
        let Some(e) = end.get_mut(plan.actors[a].stream.index()) else { continue };
        if e.is_none_or(|b| length[a] > length[b]) {
            *e = Some(a);
        }
    }
    let mut position = vec![None; n];
    for mut at in end.into_iter().flatten() {
        // A cycle leaves `length` unfinished for its actors; positions then stay None
        // there (validation refuses such plans elsewhere).
        let mut k = length[at];
        loop {
            k -= 1;
            position[at] = Some(k);
            match parent[at] {
                Some(p) if k > 0 => at = p,
                _ => break,
            }
        }
    }
    position
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One stream: a source feeding a chain `a → b → c → d` (zero-byte order registers), a
    /// side actor `e` that only `d` reads, a loop register from `d` back to `a` (preloaded,
    /// not an order within a step), and a second stream with one actor. Positions follow the
    /// longest path; the side actor, and actors whose stream has no longer path, have their
    /// own place on it or none.
    #[test]
    fn positions_follow_each_streams_longest_path() {
        let mut b = PlanBuilder::new();
        let device = b.device(0, DeviceKind::Cpu, 0);
        let (s0, s1) = (b.stream(device, StreamKind::Compute), b.stream(device, StreamKind::Comm));
        let noop = || ActorKind::Compute { kernel: KernelConf::Noop };
        let source = b.actor("source", s0, ActorKind::Source { pieces: SourcePieces::Count(2) });
        let [a, bb, c, d, e] = ["a", "b", "c", "d", "e"].map(|name| b.actor(name, s0, noop()));
        let other = b.actor("other", s1, noop());
        let fed = b.regst("source.out", source, 8, 1);
        b.consume(a, fed).consume(e, fed).consume(other, fed);
        for (from, to) in [(a, bb), (bb, c), (c, d), (e, d)] {
            let r = b.regst(&format!("{}->{}", from.0, to.0), from, 0, 1);
            b.consume(to, r);
        }
        let back = b.regst("d.loop", d, 8, 2);
        b.preload(back, 1);
        b.consume(a, back);
        let plan = b.plan_mut().clone();
        let positions = chain_positions(&plan);
        // source → a → b → c → d is the longest path of stream 0 (five actors).
        let on = |x: ActorIndex| positions[x.index()];
        assert_eq!([on(source), on(a), on(bb), on(c), on(d)], [Some(0), Some(1), Some(2), Some(3), Some(4)]);
        assert_eq!(on(e), None, "a side actor is off the path");
        assert_eq!(on(other), Some(0), "a stream of one actor is its own path");
    }
}
