//! Reading a finished job's variables back (`JobBuilder::keep_state`): every loop
//! register's last value, gathered from each device's part into whole logical tensors.
//!
//! Which slot holds the last value: a register's slots are taken from a FIFO of free slots
//! (`regflow_actors` `OutputState`), and a slot goes back to it when its last consumer
//! acks. Every consumer reads and acks its pieces in order, and the producer completes
//! them in order, so slots come back in piece order and piece `n` always lands in slot
//! `n % register_num`. The preloaded pieces are `0..preloaded`; each firing of the
//! producer writes the next one, so after `fires` firings the last value is piece
//! `preloaded + fires - 1`.

use crate::arenas::PlanArenas;
use crate::stream::ActorStats;
use crate::RuntimeError;
use regflow_plan::{HostArray, Plan, TensorMeta, VariableDesc};
use std::collections::HashMap;

/// The slot of a register of `register_num` slots, `preloaded` of them preloaded, that
/// holds the last value once its producer fired `fires` times; `None` when it never held
/// one (no preloaded slot and no firing).
pub(crate) fn last_slot(register_num: u32, preloaded: u32, fires: u64) -> Option<u32> {
    let pieces = u64::from(preloaded) + fires;
    let last = pieces.checked_sub(1)?;
    Some((last % u64::from(register_num.max(1))) as u32)
}

/// The logical name of a variable part (`w@1` is part of `w`).
pub(crate) fn logical_name(name: &str) -> &str {
    name.split('@').next().unwrap_or(name)
}

/// One part of a variable as a device of this job held it when the job ended: what a
/// rank writes to its shard of a sharded checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct StatePart {
    /// The logical name of the variable (`w` for the part `w@1`).
    pub variable: String,
    /// Shape and dtype of the whole (logical) variable.
    pub meta: TensorMeta,
    /// Where the part starts in each dimension of the whole.
    pub offsets: Vec<usize>,
    /// The part's value (its shape is the part's).
    pub value: HostArray,
}

/// What a finished job read back of its variables: the whole ones and every part.
pub(super) struct ReadState {
    /// Every variable whose parts all ran here, whole.
    pub(super) wholes: Vec<(String, HostArray)>,
    /// Every part held here that no device before it in the plan holds too.
    pub(super) parts: Vec<StatePart>,
}

/// The key of a part: two parts of the same key hold the same elements.
type PartKey<'p> = (&'p str, &'p [usize], &'p [usize]);

/// Every variable of `plan` whose parts all ran in this job, as whole logical tensors in
/// the order of the plan's variables, and every part this job held. Called after every
/// stream thread has ended and before the arenas are freed.
///
/// A part held by several devices (a `Broadcast` replica) is kept only by the first of
/// them in the plan's device order, over the whole plan: of all the nodes' jobs, exactly
/// one reports it. A zero part (a `Partial` summand another device holds) is left out.
pub(super) fn read_variables(
    plan: &Plan,
    arenas: &PlanArenas,
    actors: &[ActorStats],
) -> Result<ReadState, RuntimeError> {
    let fires: HashMap<&str, u64> = actors.iter().map(|a| (a.name.as_str(), a.fires)).collect();
    let device_of = |variable: &VariableDesc| {
        let desc = &plan.regst_descs[variable.regst.index()];
        plan.streams[plan.actors[desc.producer.index()].stream.index()].device.index()
    };
    let mut first_holder: HashMap<PartKey<'_>, usize> = HashMap::new();
    for variable in plan.variables.iter().filter(|v| !v.region.zeros) {
        let holder = first_holder
            .entry((logical_name(&variable.name), &variable.region.offsets, &variable.region.shape))
            .or_insert(usize::MAX);
        *holder = (*holder).min(device_of(variable));
    }
    let mut kept: Vec<(usize, StatePart)> = Vec::new();
    // Two parts of one key on the same device: the first one only.
    let mut seen: std::collections::HashSet<PartKey<'_>> = Default::default();
    let mut order: Vec<&str> = Vec::new();
    let mut wholes: HashMap<&str, Option<HostArray>> = HashMap::new();
    for variable in &plan.variables {
        let name = logical_name(&variable.name);
        let whole = wholes.entry(name).or_insert_with(|| {
            order.push(name);
            Some(HostArray::zeros(&variable.meta))
        });
        let desc = &plan.regst_descs[variable.regst.index()];
        let producer = &plan.actors[desc.producer.index()].name;
        // A part on a node this job does not run: the variable is not whole here.
        let Some(&fired) = fires.get(producer.as_str()) else {
            *whole = None;
            continue;
        };
        if variable.region.zeros {
            continue;
        }
        let fail = |message: String| RuntimeError::StateRead { variable: variable.name.clone(), message };
        // A constant variable's every slot holds its value.
        let last = if variable.constant { Some(0) } else { last_slot(desc.register_num, desc.preloaded, fired) };
        let slot = last.ok_or_else(|| fail(format!("its register '{}' never held a value", desc.name)))?;
        let view = arenas.view(regflow_actors::RegstRef { desc: variable.regst, slot });
        // SAFETY: every stream thread has ended (the caller joined them): nothing writes
        // the arena any more.
        let bytes = unsafe { view.as_slice() };
        let meta = TensorMeta::new(variable.region.shape.clone(), variable.meta.dtype);
        let part = host_array(&meta, bytes).map_err(fail)?;
        if let Some(whole) = whole {
            whole.set_region(&variable.region.offsets, &part);
        }
        let device = device_of(variable);
        let part_key: PartKey<'_> = (name, &variable.region.offsets, &variable.region.shape);
        if first_holder.get(&part_key) == Some(&device) && seen.insert(part_key) {
            let offsets = variable.region.offsets.clone();
            let part = StatePart { variable: name.to_string(), meta: variable.meta.clone(), offsets, value: part };
            kept.push((device, part));
        }
    }
    // Device order, and the plan's variable order within a device.
    kept.sort_by_key(|(device, _)| *device);
    let wholes =
        order.into_iter().filter_map(|name| wholes.remove(name).flatten().map(|v| (name.to_string(), v))).collect();
    Ok(ReadState { wholes, parts: kept.into_iter().map(|(_, part)| part).collect() })
}

/// The tensor of `meta` whose little-endian bytes are `bytes`; an error saying both sizes
/// when they do not match.
pub(crate) fn host_array(meta: &TensorMeta, bytes: &[u8]) -> Result<HostArray, String> {
    HostArray::from_le_bytes(meta, bytes)
        .map_err(|_| format!("{} bytes do not hold a {meta} tensor ({} bytes)", bytes.len(), meta.bytes()))
}

#[cfg(test)]
mod tests {
    use super::{host_array, last_slot};
    use regflow_plan::{DType, HostArray, TensorMeta};

    #[test]
    fn the_last_value_is_in_the_slot_of_the_last_piece() {
        // Two slots, one preloaded: the initial value in slot 0, step 0's in slot 1, ...
        assert_eq!(last_slot(2, 1, 0), Some(0));
        assert_eq!(last_slot(2, 1, 1), Some(1));
        assert_eq!(last_slot(2, 1, 4), Some(0));
        assert_eq!(last_slot(3, 1, 4), Some(1));
        assert_eq!(last_slot(3, 2, 2), Some(0));
        assert_eq!(last_slot(1, 0, 0), None);
    }

    #[test]
    fn bytes_become_the_tensor_they_encode_or_say_why_not() {
        let value = HostArray::f64([2], vec![1.5, -2.0]).unwrap();
        assert_eq!(host_array(&value.meta(), &value.to_le_bytes()).unwrap(), value);
        let err = host_array(&TensorMeta::new([3], DType::F32), &[0; 8]).unwrap_err();
        assert_eq!(err, "8 bytes do not hold a f32[3] tensor (12 bytes)");
    }
}
