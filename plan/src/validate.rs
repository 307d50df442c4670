//! Load-time checks: a plan that passes them can be run by the actor protocol without a
//! dangling reference, an actor that can never fire, or memory that does not fit.

use super::*;
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::collections::{HashMap, HashSet};

impl Plan {
    /// Parses a JSON plan, checks its schema version, then validates it. An element that
    /// does not deserialize (an unknown device kind, a misspelt field) is named by its
    /// place in the plan (`actor 3 'matmul5'`) as well as by line and column.
    pub fn from_json(text: &str) -> Result<Plan, PlanError> {
        // The version first, skipping the rest without building it (a plan of a big model
        // is a hundred MiB of JSON; a `Value` tree of it costs more than the plan itself).
        #[derive(serde::Deserialize)]
        struct Version {
            schema_version: Option<u64>,
        }
        if !text.trim_start().starts_with('{') {
            return Err(PlanError::Parse(
                "the file is not a JSON object, so it has no `schema_version`: missing field `schema_version`".into(),
            ));
        }
        let version: Version = serde_json::from_str(text).map_err(|e| match e.classify() {
            // Well-formed JSON whose only field read here has the wrong type.
            serde_json::error::Category::Data => {
                PlanError::Parse(format!("`schema_version` must be a whole number such as {PLAN_SCHEMA_VERSION}: {e}"))
            }
            _ => PlanError::Parse(e.to_string()),
        })?;
        let found = version.schema_version.ok_or_else(|| PlanError::Parse("missing field `schema_version`".into()))?;
        if found != u64::from(PLAN_SCHEMA_VERSION) {
            return Err(PlanError::SchemaVersion { found, expected: PLAN_SCHEMA_VERSION });
        }
        // Deserialized from the text so that errors carry a line and column; only a plan
        // that fails is read again as a value, to name the element that does not parse.
        let plan: Plan = serde_json::from_str(text).map_err(|e| {
            let value: Option<Value> = serde_json::from_str(text).ok();
            match value.as_ref().and_then(first_bad_element) {
                Some((element, message)) => PlanError::Element { element, message, line: e.line(), column: e.column() },
                None => PlanError::Parse(e.to_string()),
            }
        })?;
        plan.validate()?;
        Ok(plan)
    }

    /// Checks references, register counts, edge consistency, arities, the signature and
    /// the variables, cycles, collective order and memory.
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.schema_version != PLAN_SCHEMA_VERSION {
            return Err(PlanError::SchemaVersion {
                found: u64::from(self.schema_version),
                expected: PLAN_SCHEMA_VERSION,
            });
        }
        self.check_references()?;
        self.check_edges()?;
        let index = PlanIndex::new(self);
        self.check_arities(&index)?;
        self.check_windows()?;
        self.check_aliased_slots(&index)?;
        self.check_signature(&index)?;
        self.check_variables()?;
        self.check_cycles()?;
        self.check_collective_order()?;
        self.check_blocking_collectives()?;
        self.memory()?;
        Ok(())
    }

    fn check_references(&self) -> Result<(), PlanError> {
        let mut seen = HashSet::new();
        for device in &self.devices {
            if !seen.insert((device.node, device.kind, device.index)) {
                return Err(PlanError::DuplicateDevice { label: device.label() });
            }
        }
        for (i, stream) in self.streams.iter().enumerate() {
            if stream.device.index() >= self.devices.len() {
                return Err(PlanError::UnknownDevice {
                    stream: i as u32,
                    device: stream.device.0,
                    count: self.devices.len(),
                });
            }
        }
        let mut names = HashSet::new();
        for actor in &self.actors {
            if !names.insert(actor.name.as_str()) {
                return Err(PlanError::DuplicateActorName { name: actor.name.clone() });
            }
            if actor.stream.index() >= self.streams.len() {
                return Err(PlanError::UnknownStream {
                    actor: actor.name.clone(),
                    stream: actor.stream.0,
                    count: self.streams.len(),
                });
            }
            for input in &actor.inputs {
                if input.index() >= self.regst_descs.len() {
                    return Err(PlanError::UnknownRegstDesc {
                        owner: format!("actor '{}'", actor.name),
                        desc: input.0,
                        count: self.regst_descs.len(),
                    });
                }
            }
        }
        for desc in &self.regst_descs {
            let owner = || format!("register '{}'", desc.name);
            for actor in std::iter::once(&desc.producer).chain(&desc.consumers) {
                if actor.index() >= self.actors.len() {
                    return Err(PlanError::UnknownActor { owner: owner(), actor: actor.0, count: self.actors.len() });
                }
            }
            if desc.register_num == 0 {
                return Err(PlanError::ZeroRegisterNum {
                    desc: desc.name.clone(),
                    producer: self.actors[desc.producer.index()].name.clone(),
                });
            }
            if desc.register_num > MAX_REGISTER_NUM {
                return Err(PlanError::TooManySlots { desc: desc.name.clone(), register_num: desc.register_num });
            }
            if desc.preloaded > desc.register_num {
                return Err(PlanError::TooManyPreloaded {
                    desc: desc.name.clone(),
                    preloaded: desc.preloaded,
                    register_num: desc.register_num,
                });
            }
        }
        Ok(())
    }

    /// Every register lists each consumer once, every consumer lists the register once
    /// among its inputs, and every input's register lists its reader. Linear in the edges
    /// (a register may have tens of thousands of consumers).
    fn check_edges(&self) -> Result<(), PlanError> {
        let mut listed: HashMap<(RegstDescId, ActorIndex), usize> = HashMap::new();
        for (i, actor) in self.actors.iter().enumerate() {
            for &input in &actor.inputs {
                *listed.entry((input, ActorIndex(i as u32))).or_default() += 1;
            }
        }
        let mut consumed = HashSet::with_capacity(listed.len());
        for (desc_index, desc) in self.regst_descs.iter().enumerate() {
            let desc_id = RegstDescId(desc_index as u32);
            let producer = &self.actors[desc.producer.index()].name;
            if desc.consumers.is_empty() {
                return Err(PlanError::NoConsumer { desc: desc.name.clone(), producer: producer.clone() });
            }
            if desc.consumers.len() > MAX_CONSUMERS {
                return Err(PlanError::TooManyConsumers { desc: desc.name.clone(), count: desc.consumers.len() });
            }
            for &consumer in &desc.consumers {
                let actor = &self.actors[consumer.index()];
                let listed = listed.get(&(desc_id, consumer)).copied().unwrap_or(0);
                let detail = if !consumed.insert((desc_id, consumer)) {
                    Some("the register lists the actor as a consumer twice".to_string())
                } else if listed != 1 {
                    Some(format!(
                        "the register lists the actor as a consumer, but the actor lists it {listed} times in its inputs"
                    ))
                } else {
                    None
                };
                if let Some(detail) = detail {
                    return Err(PlanError::InconsistentEdge {
                        desc: desc.name.clone(),
                        actor: actor.name.clone(),
                        detail,
                    });
                }
            }
        }
        for (i, actor) in self.actors.iter().enumerate() {
            for &input in &actor.inputs {
                if !consumed.contains(&(input, ActorIndex(i as u32))) {
                    let desc = &self.regst_descs[input.index()];
                    return Err(PlanError::InconsistentEdge {
                        desc: desc.name.clone(),
                        actor: actor.name.clone(),
                        detail: "the actor reads the register, but the register does not list it as a consumer".into(),
                    });
                }
            }
        }
        Ok(())
    }

    /// Windows: on compute actors only (other kinds hand whole registers on), one per
    /// input at most, each inside its register.
    fn check_windows(&self) -> Result<(), PlanError> {
        for actor in self.actors.iter().filter(|a| !a.windows.is_empty()) {
            let bad = |detail: String| PlanError::BadWindow { actor: actor.name.clone(), detail };
            if !matches!(actor.kind, ActorKind::Compute { .. }) {
                return Err(bad(format!(
                    "is a {} actor, which hands whole registers on; only compute actors read windows",
                    actor.kind.name()
                )));
            }
            for (k, window) in actor.windows.iter().enumerate() {
                let Some(input) = actor.inputs.get(window.input as usize) else {
                    return Err(bad(format!(
                        "has a window on input {}, but it has {} inputs",
                        window.input,
                        actor.inputs.len()
                    )));
                };
                if actor.windows[..k].iter().any(|w| w.input == window.input) {
                    return Err(bad(format!("has two windows on input {}", window.input)));
                }
                if window.offset % regflow_memory::ALIGNMENT as u64 != 0 {
                    return Err(bad(format!(
                        "has a window at byte {} of input {}: windows start on a multiple of {} bytes, as slots do",
                        window.offset,
                        window.input,
                        regflow_memory::ALIGNMENT
                    )));
                }
                let desc = &self.regst_descs[input.index()];
                if window.offset.checked_add(window.bytes).is_none_or(|end| end > desc.bytes) {
                    return Err(bad(format!(
                        "reads bytes {}..{} of register '{}', which holds {} bytes",
                        window.offset,
                        window.offset.saturating_add(window.bytes),
                        desc.name,
                        desc.bytes
                    )));
                }
            }
        }
        Ok(())
    }

    /// Every register with aliased slots may be one buffer its producer writes in place,
    /// and every register within another may lie there ([`InPlaceCheck`](crate::InPlaceCheck)).
    fn check_aliased_slots(&self, index: &PlanIndex<'_>) -> Result<(), PlanError> {
        let mut rule = crate::InPlaceCheck::new(self, index);
        // Registers within others, then those held in others' buffers, first: their errors
        // name them, not the register they are in.
        for r in (0..self.regst_descs.len()).filter(|&r| self.regst_descs[r].within.is_some()) {
            let view = RegstDescId(r as u32);
            rule.check_within(view).map_err(|detail| self.within_error(view, detail))?;
        }
        for r in (0..self.regst_descs.len()).filter(|&r| self.regst_descs[r].home.is_some()) {
            let guest = RegstDescId(r as u32);
            rule.check_home(guest).map_err(|detail| self.home_error(guest, detail))?;
        }
        for (r, desc) in self.regst_descs.iter().enumerate().filter(|(_, d)| d.aliased_slots) {
            // A weight gathered in place was checked just above, with the register within it.
            if rule.gathered_in_place(RegstDescId(r as u32)).is_some() {
                continue;
            }
            rule.check(RegstDescId(r as u32))
                .map_err(|detail| PlanError::AliasedSlots { regst: desc.name.clone(), detail })?;
        }
        Ok(())
    }

    fn check_arities(&self, index: &PlanIndex<'_>) -> Result<(), PlanError> {
        for (i, actor) in self.actors.iter().enumerate() {
            let outputs = index.outputs_of(ActorIndex(i as u32));
            let (ins, outs) = (actor.inputs.len(), outputs.len());
            let bad =
                |detail: String| PlanError::BadArity { actor: actor.name.clone(), kind: actor.kind.name(), detail };
            match &actor.kind {
                ActorKind::Source { .. } if ins != 0 || outs == 0 => {
                    return Err(bad(format!(
                        "needs no inputs and at least one output, has {ins} inputs and {outs} outputs"
                    )))
                }
                // An actor reading only loop registers ends when they end, which needs each
                // of their producers to read something from outside the loop.
                _ if ins > 0
                    && index.loop_inputs(ActorIndex(i as u32)).iter().all(|&l| l)
                    && actor.inputs.iter().any(|r| {
                        let producer = self.regst_descs[r.index()].producer;
                        index.loop_inputs(producer).iter().all(|&l| l)
                    }) =>
                {
                    return Err(bad(
                        "reads only loop-carried (preloaded) registers: with no input from outside the loop it \
                         would never end"
                            .into(),
                    ))
                }
                ActorKind::Compute { .. } if ins == 0 => {
                    return Err(bad("needs at least one input (a source produces pieces from nothing)".into()))
                }
                ActorKind::Sink | ActorKind::Discard if ins == 0 || outs != 0 => {
                    return Err(bad(format!(
                        "needs at least one input and no outputs, has {ins} inputs and {outs} outputs"
                    )))
                }
                ActorKind::Acc { count, .. } | ActorKind::Repeat { count } => {
                    if ins != 1 || outs != 1 {
                        return Err(bad(format!(
                            "needs exactly one input and one output, has {ins} inputs and {outs} outputs"
                        )));
                    }
                    if *count == 0 {
                        return Err(bad("has count 0: it must be at least 1".into()));
                    }
                    let (input, output) =
                        (&self.regst_descs[actor.inputs[0].index()], &self.regst_descs[outputs[0].index()]);
                    if matches!(actor.kind, ActorKind::Repeat { .. }) && output.preloaded > 0 {
                        return Err(bad(format!(
                            "hands out its input register, so its output '{}' has no memory to preload",
                            output.name
                        )));
                    }
                    if matches!(actor.kind, ActorKind::Repeat { .. }) && input.bytes != output.bytes {
                        return Err(bad(format!(
                            "hands its input register to its consumers, so output '{}' must have the input's {} bytes, not {}",
                            output.name, input.bytes, output.bytes
                        )));
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// For each input of `actor`, whether it closes a loop: its register carries loop state
    /// (preloaded, or handed on by a repeat) and `actor` can reach the register's producer
    /// (along registers, and from a collective member to every member of its group, since
    /// they finish only together).
    /// Such an input carries one value per preloaded slot more than the loop runs; an actor
    /// that merely reads a preloaded register from outside the loop sees every value as an
    /// ordinary input. Linear in the plan's size; for many actors build one [`PlanIndex`].
    pub fn loop_inputs(&self, actor: ActorIndex) -> Vec<bool> {
        PlanIndex::new(self).loop_inputs(actor).to_vec()
    }

    /// Rejects a dependency cycle unless it passes through a preloaded register: without
    /// one, every register on it starts empty and no actor on it could ever fire. Reports
    /// the cycle by actor names. (Edges of preloaded registers are left out of the search.)
    fn check_cycles(&self) -> Result<(), PlanError> {
        let n = self.actors.len();
        let successors = self.within_step_successors();
        // Iterative DFS; state 0 = unvisited, 1 = on the stack, 2 = done.
        let mut state = vec![0u8; n];
        for root in 0..n {
            if state[root] != 0 {
                continue;
            }
            let mut stack: Vec<(usize, usize)> = vec![(root, 0)];
            state[root] = 1;
            while let Some(&mut (node, ref mut next)) = stack.last_mut() {
                if let Some(&succ) = successors[node].get(*next) {
                    *next += 1;
                    match state[succ] {
                        0 => {
                            state[succ] = 1;
                            stack.push((succ, 0));
                        }
                        1 => {
                            let start = stack.iter().position(|&(a, _)| a == succ).unwrap_or(0);
                            let mut path: Vec<String> =
                                stack[start..].iter().map(|&(a, _)| self.actors[a].name.clone()).collect();
                            path.push(self.actors[succ].name.clone());
                            return Err(PlanError::Cycle { path });
                        }
                        _ => {}
                    }
                } else {
                    state[node] = 2;
                    stack.pop();
                }
            }
        }
        Ok(())
    }
}

impl Plan {
    /// Every input's parts are distinct fed sources whose registers hold the part's region
    /// of the input; every output is delivered whole by a sink.
    fn check_signature(&self, index: &PlanIndex<'_>) -> Result<(), PlanError> {
        let mut fed_by: HashMap<ActorIndex, &str> = HashMap::new();
        for input in &self.signature.inputs {
            let bad = |detail: String| PlanError::BadInput { input: input.name.clone(), detail };
            if input.parts.is_empty() {
                return Err(bad("has no parts: no fed source would receive its values".into()));
            }
            for (p, part) in input.parts.iter().enumerate() {
                let Some(actor) = self.actors.get(part.actor.index()) else {
                    return Err(PlanError::UnknownActor {
                        owner: format!("part {p} of input '{}' of the signature", input.name),
                        actor: part.actor.0,
                        count: self.actors.len(),
                    });
                };
                if !matches!(actor.kind, ActorKind::Source { pieces: SourcePieces::Fed }) {
                    return Err(bad(format!(
                        "has part {p} fed to actor '{}', {}; the parts of an input must be fed sources \
                         (`source` with `pieces: fed`)",
                        actor.name,
                        kind_phrase(&actor.kind)
                    )));
                }
                if let Some(other) = fed_by.insert(part.actor, &input.name) {
                    return Err(bad(format!(
                        "has part {p} fed to source '{}', which input '{other}' feeds too",
                        actor.name
                    )));
                }
                let region = &part.region;
                if !region.fits(&input.meta.shape) {
                    return Err(bad(format!(
                        "has part {p} (source '{}') at offsets {:?} of shape {}, which does not fit the input's \
                         shape {}",
                        actor.name,
                        region.offsets,
                        Shape::from(region.shape.as_slice()),
                        input.meta.shape
                    )));
                }
                let bytes = region_bytes(region, input.meta.dtype);
                for output in index.outputs_of(part.actor) {
                    let desc = &self.regst_descs[output.index()];
                    if bytes != Some(desc.bytes) {
                        return Err(bad(format!(
                            "has part {p} {}{} ({}), but register '{}' of source '{}' holds {} bytes",
                            input.meta.dtype,
                            Shape::from(region.shape.as_slice()),
                            bytes_phrase(bytes),
                            desc.name,
                            actor.name,
                            desc.bytes
                        )));
                    }
                }
            }
        }
        for output in &self.signature.outputs {
            let bad = |detail: String| PlanError::BadOutput { output: output.name.clone(), detail };
            let Some(actor) = self.actors.get(output.actor.index()) else {
                return Err(PlanError::UnknownActor {
                    owner: format!("output '{}' of the signature", output.name),
                    actor: output.actor.0,
                    count: self.actors.len(),
                });
            };
            if !matches!(actor.kind, ActorKind::Sink) {
                return Err(bad(format!(
                    "is delivered by actor '{}', {}; an output must be delivered by a sink",
                    actor.name,
                    kind_phrase(&actor.kind)
                )));
            }
            // A sink has at least one input (arities are checked first); it delivers the
            // whole value in its first.
            let Some(first) = actor.inputs.first() else { continue };
            let desc = &self.regst_descs[first.index()];
            let bytes = meta_bytes(&output.meta);
            if bytes != Some(desc.bytes) {
                return Err(bad(format!(
                    "is {} ({}), but sink '{}' reads it from register '{}' of {} bytes",
                    output.meta,
                    bytes_phrase(bytes),
                    actor.name,
                    desc.name,
                    desc.bytes
                )));
            }
        }
        Ok(())
    }

    /// Every variable names a register with preloaded slots, and its region lies in the
    /// variable and fills the register exactly.
    fn check_variables(&self) -> Result<(), PlanError> {
        for variable in &self.variables {
            let bad = |detail: String| PlanError::BadVariable { variable: variable.name.clone(), detail };
            let Some(desc) = self.regst_descs.get(variable.regst.index()) else {
                return Err(PlanError::UnknownRegstDesc {
                    owner: format!("variable '{}'", variable.name),
                    desc: variable.regst.0,
                    count: self.regst_descs.len(),
                });
            };
            if variable.constant {
                // Its slots hold the value for the whole job: nothing may share their bytes
                // or hand them out as loop pieces.
                if desc.shared_offset.is_some() || desc.preloaded != 0 {
                    return Err(bad(format!(
                        "is constant in register '{}', whose slots must hold it alone (not shared, not preloaded)",
                        desc.name
                    )));
                }
            } else if desc.preloaded == 0 {
                return Err(bad(format!(
                    "goes into register '{}', which has no preloaded slots to hold its first value",
                    desc.name
                )));
            }
            let region = &variable.region;
            if !region.fits(&variable.meta.shape) {
                return Err(bad(format!(
                    "has its part at offsets {:?} of shape {}, which does not fit the variable's shape {}",
                    region.offsets,
                    Shape::from(region.shape.as_slice()),
                    variable.meta.shape
                )));
            }
            let bytes = region_bytes(region, variable.meta.dtype);
            if bytes != Some(desc.bytes) {
                return Err(bad(format!(
                    "has its part {}{} ({}), but its register '{}' holds {} bytes",
                    variable.meta.dtype,
                    Shape::from(region.shape.as_slice()),
                    bytes_phrase(bytes),
                    desc.name,
                    desc.bytes
                )));
            }
        }
        Ok(())
    }
}

/// Bytes of a region's elements, `None` if that overflows.
fn region_bytes(region: &Region, dtype: DType) -> Option<u64> {
    region.shape.iter().try_fold(dtype.size() as u64, |bytes, &len| bytes.checked_mul(len as u64))
}

/// Bytes of a tensor, `None` if that overflows.
fn meta_bytes(meta: &TensorMeta) -> Option<u64> {
    meta.shape.dims().iter().try_fold(meta.dtype.size() as u64, |bytes, &len| bytes.checked_mul(len as u64))
}

fn bytes_phrase(bytes: Option<u64>) -> String {
    match bytes {
        Some(bytes) => format!("{bytes} bytes"),
        None => "more bytes than fit in 64 bits".into(),
    }
}

/// `a compute actor`, `a source of 4 counted pieces`, ... for errors.
fn kind_phrase(kind: &ActorKind) -> String {
    match kind {
        ActorKind::Source { pieces: SourcePieces::Fed } => "a fed source".into(),
        ActorKind::Source { pieces: SourcePieces::Count(n) } => format!("a source of {n} counted pieces"),
        ActorKind::Source { pieces: SourcePieces::Custom { kernel, .. } } => {
            format!("a source run by kernel '{kernel}'")
        }
        ActorKind::Source { pieces: SourcePieces::Dataset(d) } => format!("a source reading dataset {}", d.path),
        other => format!("a {} actor", other.name()),
    }
}

/// The first device, stream, actor, register, signature entry or variable of a plan file
/// that does not deserialize, by its place (and name, if it has one), with serde's reason.
fn first_bad_element(plan: &Value) -> Option<(String, String)> {
    fn first_bad<T: DeserializeOwned>(parent: &Value, field: &str, what: &str) -> Option<(String, String)> {
        let items = parent.get(field)?.as_array()?;
        items.iter().enumerate().find_map(|(i, item)| {
            let error = serde_json::from_value::<T>(item.clone()).err()?;
            let element = match item.get("name").and_then(Value::as_str) {
                Some(name) => format!("{what} {i} '{name}'"),
                None => format!("{what} {i}"),
            };
            Some((element, error.to_string()))
        })
    }
    let signature = plan.get("signature");
    first_bad::<DeviceDesc>(plan, "devices", "device")
        .or_else(|| first_bad::<StreamDesc>(plan, "streams", "stream"))
        .or_else(|| first_bad::<ActorDesc>(plan, "actors", "actor"))
        .or_else(|| first_bad::<RegstDesc>(plan, "regst_descs", "register"))
        .or_else(|| signature.and_then(|s| first_bad::<InputSignature>(s, "inputs", "signature input")))
        .or_else(|| signature.and_then(|s| first_bad::<OutputSignature>(s, "outputs", "signature output")))
        .or_else(|| first_bad::<VariableDesc>(plan, "variables", "variable"))
}
