//! The memory of a loaded plan: one arena per device, from the arena allocator of the
//! device's kind, and a view per register slot.

use regflow_actors::RegstRef;
use regflow_memory::{Arena, ArenaAllocator, BufferView, HostAllocator, MemoryError, MemoryReport};
use regflow_plan::{DeviceKind, Plan, PlanMemory};

/// Where the arenas of devices of `kind` come from: `cpu` and `sim` registers live in host
/// memory. This build has no CUDA backend (a plan with a local `cuda` device is refused
/// before memory is allocated); the host allocator stands in for devices on other nodes,
/// and refuses device memory.
fn allocator_for(kind: DeviceKind) -> &'static dyn ArenaAllocator {
    match kind {
        DeviceKind::Cpu | DeviceKind::Sim | DeviceKind::Cuda => &HostAllocator,
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
    /// device kind's allocator.
    pub(crate) fn allocate(plan: &Plan, memory: &PlanMemory) -> Result<Self, MemoryError> {
        let mut arenas = Vec::with_capacity(memory.devices.len());
        for device in &memory.devices {
            let kind = device
                .descs
                .first()
                .map(|r| plan.regst_descs[r.index()].memory)
                .unwrap_or(regflow_memory::MemoryKind::Host);
            let allocator = allocator_for(plan.devices[device.device.index()].kind);
            arenas.push(Arena::allocate_with(allocator, &device.label, kind, device.total_bytes())?);
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
