//! When a register's slots may be one buffer that its producer writes in place
//! ([`RegstDesc::aliased_slots`]): the one rule that plan validation enforces and the
//! compiler chooses by.

use super::*;
use std::collections::HashMap;

/// Checks registers against the in-place rule, remembering what reaches each producer
/// (an optimizer update writes several registers in place).
#[derive(Debug)]
pub struct InPlaceCheck<'p> {
    plan: &'p Plan,
    index: &'p PlanIndex<'p>,
    ancestors: HashMap<ActorIndex, Vec<bool>>,
}

impl<'p> InPlaceCheck<'p> {
    /// The check over `plan`, indexed by `index`.
    pub fn new(plan: &'p Plan, index: &'p PlanIndex<'p>) -> Self {
        Self { plan, index, ancestors: HashMap::new() }
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
        let dtype = output.and_then(|o| conf.outputs.get(o)).map(|m| m.dtype);
        if !matches!(dtype, Some(DType::F32 | DType::F64)) {
            return Err(format!(
                "its producer '{}' writes it as {}: in-place updates are built for f32 and f64 values",
                producer.name,
                dtype.map_or_else(|| "nothing".to_string(), |d| d.to_string())
            ));
        }
        let before = self.ancestors.entry(desc.producer).or_insert_with(|| ancestors_in_step(plan, desc.producer));
        for reader in desc.consumers.iter().filter(|&&c| c != desc.producer) {
            let actor = &plan.actors[reader.index()];
            if actor.stream != producer.stream || !before[reader.index()] {
                return Err(format!(
                    "nothing makes its reader '{}' read a piece before its producer '{}' writes the next over it \
                     (the reader must run on the producer's stream and reach it through registers that are not preloaded)",
                    actor.name, producer.name
                ));
            }
        }
        Ok(())
    }
}

/// The actors from which `actor` is reached through registers that are not preloaded
/// (within a step, they fire before it), `actor` itself excluded.
fn ancestors_in_step(plan: &Plan, actor: ActorIndex) -> Vec<bool> {
    let mut reached = vec![false; plan.actors.len()];
    let mut stack = vec![actor];
    while let Some(a) = stack.pop() {
        for input in &plan.actors[a.index()].inputs {
            let desc = &plan.regst_descs[input.index()];
            if desc.preloaded == 0 && !reached[desc.producer.index()] {
                reached[desc.producer.index()] = true;
                stack.push(desc.producer);
            }
        }
    }
    reached
}
