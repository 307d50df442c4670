//! The memory plan: one arena per device, every register slot at a known offset, and the
//! bytes per device stated before anything runs.

use super::*;
use regflow_memory::{ArenaLayout, MemoryReport};

/// The arena layout of one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceMemory {
    /// The device.
    pub device: DeviceIndex,
    /// Its label.
    pub label: String,
    /// Descriptors placed in this arena, in layout block order.
    pub descs: Vec<RegstDescId>,
    /// Offsets of their slots.
    pub layout: ArenaLayout,
}

/// The memory plan of a whole plan: where every slot of every register lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanMemory {
    /// One entry per device of the plan, in plan order.
    pub devices: Vec<DeviceMemory>,
    /// For each descriptor: (device entry, block in its layout), or `None` if it owns no memory.
    placement: Vec<Option<(usize, usize)>>,
}

impl PlanMemory {
    /// Offset of a slot inside its device's arena, with the device entry; `None` for a
    /// descriptor that owns no memory (a repeat's output).
    pub fn slot(&self, desc: RegstDescId, slot: u32) -> Option<(usize, u64)> {
        let (device, block) = (*self.placement.get(desc.index())?)?;
        Some((device, self.devices[device].layout.slot_offset(block, slot)))
    }

    /// Bytes per device.
    pub fn report(&self) -> MemoryReport {
        MemoryReport { devices: self.devices.iter().map(|d| (d.label.clone(), d.layout.total_bytes())).collect() }
    }
}

impl Plan {
    /// Lays out every register in its producer's device arena and checks device capacities.
    ///
    /// Registers live on the producer's device. This planner gives every slot its own bytes;
    /// reuse across non-overlapping lifetimes is a later compiler pass.
    pub fn memory(&self) -> Result<PlanMemory, PlanError> {
        let mut per_device: Vec<Vec<RegstDescId>> = vec![Vec::new(); self.devices.len()];
        for i in 0..self.regst_descs.len() {
            let desc = RegstDescId(i as u32);
            if self.owns_memory(desc) {
                per_device[self.device_of(self.regst_descs[i].producer).index()].push(desc);
            }
        }
        let mut placement = vec![None; self.regst_descs.len()];
        let mut devices = Vec::with_capacity(self.devices.len());
        for (d, descs) in per_device.into_iter().enumerate() {
            let label = self.devices[d].label();
            let blocks: Vec<(u64, u32)> = descs
                .iter()
                .map(|r| {
                    let desc = &self.regst_descs[r.index()];
                    (desc.bytes, desc.register_num)
                })
                .collect();
            let layout = ArenaLayout::pack(&blocks)
                .map_err(|e| PlanError::Memory { device: label.clone(), detail: e.to_string() })?;
            if let Some(capacity) = self.devices[d].memory_capacity {
                if layout.total_bytes() > capacity {
                    let mut largest: Vec<&RegstDesc> = descs.iter().map(|r| &self.regst_descs[r.index()]).collect();
                    largest.sort_by_key(|r| std::cmp::Reverse(r.bytes.saturating_mul(u64::from(r.register_num))));
                    let largest = largest
                        .iter()
                        .take(3)
                        .map(|r| format!("'{}' ({} x {} bytes)", r.name, r.register_num, r.bytes))
                        .collect::<Vec<_>>()
                        .join(", ");
                    return Err(PlanError::DoesNotFit {
                        device: label,
                        needed: layout.total_bytes(),
                        capacity,
                        largest,
                    });
                }
            }
            for (block, r) in descs.iter().enumerate() {
                placement[r.index()] = Some((d, block));
            }
            devices.push(DeviceMemory { device: DeviceIndex(d as u32), label, descs, layout });
        }
        Ok(PlanMemory { devices, placement })
    }
}
