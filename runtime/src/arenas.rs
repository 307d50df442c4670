//! The memory of a loaded plan: one arena per device, from the arena allocator of the
//! device's kind, and a view per register slot.

use crate::RuntimeError;
use regflow_actors::RegstRef;
use regflow_memory::{host_memory_bytes, Arena, ArenaAllocator, BufferView, HostAllocator, MemoryError, MemoryReport};
use regflow_plan::{DeviceKind, Plan, PlanMemory, RegstDescId};

/// Where the arenas of devices of `kind` come from: `cpu` and `sim` registers live in host
/// memory. This build has no CUDA backend (a plan with a local `cuda` device is refused
/// before memory is allocated); the host allocator stands in for devices on other nodes,
/// and refuses device memory.
fn allocator_for(kind: DeviceKind) -> &'static dyn ArenaAllocator {
    match kind {
        DeviceKind::Cpu | DeviceKind::Sim | DeviceKind::Cuda => &HostAllocator,
    }
}

/// [`RuntimeError::DoesNotFit`] for device `d` of the memory plan: names its three largest
/// registers, with the variable each holds where it holds one.
fn does_not_fit(plan: &Plan, memory: &PlanMemory, d: usize, bytes: u64, available: String) -> RuntimeError {
    let mut registers: Vec<usize> = (0..plan.regst_descs.len())
        .filter(|&r| memory.slot(RegstDescId(r as u32), 0).is_some_and(|(device, _)| device == d))
        .collect();
    let size = |r: &usize| plan.regst_descs[*r].bytes.saturating_mul(u64::from(plan.regst_descs[*r].register_num));
    registers.sort_by_key(|r| std::cmp::Reverse(size(r)));
    let largest: Vec<String> = registers
        .iter()
        .take(3)
        .map(|&r| {
            let desc = &plan.regst_descs[r];
            let slots = format!("{} x {} bytes", desc.register_num, desc.bytes);
            match plan.variables.iter().find(|v| v.regst.index() == r) {
                Some(variable) => format!("variable '{}' in register '{}' ({slots})", variable.name, desc.name),
                None => format!("register '{}' ({slots})", desc.name),
            }
        })
        .collect();
    RuntimeError::DoesNotFit {
        device: memory.devices[d].label.clone(),
        what: format!("its registers (largest: {})", largest.join(", ")),
        bytes,
        available,
    }
}

/// All memory of a running plan. Allocated once at load; dropped after every thread ends.
#[derive(Debug)]
pub(crate) struct PlanArenas {
    /// Kept alive for the views.
    _arenas: Vec<Arena>,
    /// Every slot's view, descriptor after descriptor: one lookup per firing input.
    views: Vec<BufferView>,
    /// Index in `views` of each descriptor's slot 0; `u32::MAX` for those without memory.
    first_view: Vec<u32>,
    report: MemoryReport,
}

impl PlanArenas {
    /// Allocates every device's arena exactly as the memory plan says, each from its
    /// device kind's allocator. An arena larger than its device's `memory_capacity` (or,
    /// without one, than the host's memory, where every arena of this build lives), or one
    /// the allocator cannot provide, is [`RuntimeError::DoesNotFit`] naming the device's
    /// largest registers and their tensors, never an abort.
    pub(crate) fn allocate(plan: &Plan, memory: &PlanMemory) -> Result<Self, RuntimeError> {
        let host = host_memory_bytes();
        let mut arenas = Vec::with_capacity(memory.devices.len());
        for (d, device) in memory.devices.iter().enumerate() {
            let kind = device
                .descs
                .first()
                .map(|r| plan.regst_descs[r.index()].memory)
                .unwrap_or(regflow_memory::MemoryKind::Host);
            let bytes = device.total_bytes();
            let capacity = plan.devices[device.device.index()].memory_capacity;
            let available = match (capacity, host) {
                (Some(capacity), _) => Some((capacity, format!("{capacity} bytes (its memory_capacity)"))),
                (None, Some(host)) => Some((host, format!("{host} bytes of host memory"))),
                (None, None) => None,
            };
            if let Some((_, available)) = available.filter(|(limit, _)| bytes > *limit) {
                return Err(does_not_fit(plan, memory, d, bytes, available));
            }
            let allocator = allocator_for(plan.devices[device.device.index()].kind);
            let arena = Arena::allocate_with(allocator, &device.label, kind, bytes).map_err(|e| match e {
                MemoryError::AllocationFailed { .. } => {
                    does_not_fit(plan, memory, d, bytes, "less: the allocator could not provide them".into())
                }
                other => RuntimeError::Memory(other),
            })?;
            arenas.push(arena);
        }
        let mut views = Vec::new();
        let mut first_view = Vec::with_capacity(plan.regst_descs.len());
        for (d, desc) in plan.regst_descs.iter().enumerate() {
            let id = regflow_plan::RegstDescId(d as u32);
            // No memory (a repeat's output): a sentinel, so a stray lookup panics rather
            // than aliasing the next descriptor. Data refs always name the owner.
            first_view.push(if plan.owns_memory(id) { views.len() as u32 } else { u32::MAX });
            for slot in 0..desc.register_num {
                if let Some((device, offset)) = memory.slot(id, slot) {
                    views.push(arenas[device].view(offset, desc.bytes)?);
                }
            }
        }
        let report = memory.report();
        Ok(Self { _arenas: arenas, views, first_view, report })
    }

    /// The bytes of a slot. Panics on a slot the plan does not have: refs come from
    /// validated plans and the actor protocol, so that would be a broken invariant.
    pub(crate) fn view(&self, regst: RegstRef) -> BufferView {
        self.views[self.first_view[regst.desc.index()] as usize + regst.slot as usize]
    }

    /// Bytes per device.
    pub(crate) fn report(&self) -> &MemoryReport {
        &self.report
    }
}
