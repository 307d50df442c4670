//! The memory plan: one arena per device, every register slot at a known offset, and the
//! bytes per device stated before anything runs.

use super::*;
use regflow_memory::{ArenaLayout, MemoryReport};

/// The arena layout of one device: a shared region first (registers that share memory
/// across disjoint lifetimes, at the offsets the compiler chose), then every other register
/// with bytes of its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceMemory {
    /// The device.
    pub device: DeviceIndex,
    /// Its label.
    pub label: String,
    /// Descriptors with memory of their own, in layout block order.
    pub descs: Vec<RegstDescId>,
    /// Offsets of their slots, relative to the end of the shared region.
    pub layout: ArenaLayout,
    /// Bytes of the shared region.
    pub shared_bytes: u64,
    /// What the shared registers would take without sharing.
    pub unshared_bytes: u64,
}

impl DeviceMemory {
    /// Bytes of the device's arena.
    pub fn total_bytes(&self) -> u64 {
        self.shared_bytes + self.layout.total_bytes()
    }
}

/// Where one descriptor's memory is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// Block of the device's own layout.
    Own(usize),
    /// Block of the device's own layout holding one slot that is every slot
    /// ([`RegstDesc::aliased_slots`]).
    OneBuffer(usize),
    /// Offset in the shared region.
    Shared(u64),
    /// Bytes from an offset of another register's one buffer (block of the device's own
    /// layout; [`RegstDesc::within`]).
    Within(usize, u64),
}

/// The memory plan of a whole plan: where every slot of every register lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanMemory {
    /// One entry per device of the plan, in plan order.
    pub devices: Vec<DeviceMemory>,
    /// For each descriptor: its device entry and place, or `None` if it owns no memory.
    placement: Vec<Option<(usize, Place)>>,
}

impl PlanMemory {
    /// Offset of a slot inside its device's arena, with the device entry; `None` for a
    /// descriptor that owns no memory (a repeat's output).
    pub fn slot(&self, desc: RegstDescId, slot: u32) -> Option<(usize, u64)> {
        let (device, place) = (*self.placement.get(desc.index())?)?;
        let memory = &self.devices[device];
        Some((
            device,
            match place {
                Place::OneBuffer(block) => memory.shared_bytes + memory.layout.slot_offset(block, 0),
                Place::Own(block) => memory.shared_bytes + memory.layout.slot_offset(block, slot),
                Place::Shared(offset) => offset,
                Place::Within(block, offset) => memory.shared_bytes + memory.layout.slot_offset(block, 0) + offset,
            },
        ))
    }

    /// Bytes per device.
    pub fn report(&self) -> MemoryReport {
        MemoryReport { devices: self.devices.iter().map(|d| (d.label.clone(), d.total_bytes())).collect() }
    }
}

impl Plan {
    /// Lays out every register in its producer's device arena and checks device capacities.
    ///
    /// Registers live on the producer's device. Registers with a `shared_offset` sit in the
    /// device's shared region at that offset (the compiler chose offsets so that registers
    /// live at the same time never overlap); every other slot gets bytes of its own after it,
    /// except a register [`within`](RegstDesc::within) another, whose one slot is bytes of
    /// that one's buffer.
    pub fn memory(&self) -> Result<PlanMemory, PlanError> {
        let mut per_device: Vec<Vec<RegstDescId>> = vec![Vec::new(); self.devices.len()];
        let (mut views, mut guests) = (Vec::new(), Vec::new());
        for i in 0..self.regst_descs.len() {
            let desc = RegstDescId(i as u32);
            if self.regst_descs[i].within.is_some() {
                views.push(desc);
            } else if self.regst_descs[i].home.is_some() {
                guests.push(desc);
            } else if self.owns_memory(desc) {
                per_device[self.device_of(self.regst_descs[i].producer).index()].push(desc);
            }
        }
        let mut placement = vec![None; self.regst_descs.len()];
        let mut devices = Vec::with_capacity(self.devices.len());
        for (d, all) in per_device.into_iter().enumerate() {
            let label = self.devices[d].label();
            let memory_error = |detail: String| PlanError::Memory { device: label.clone(), detail };
            let (shared, descs): (Vec<RegstDescId>, Vec<RegstDescId>) =
                all.into_iter().partition(|r| self.regst_descs[r.index()].shared_offset.is_some());
            let (mut shared_bytes, mut unshared_bytes) = (0u64, 0u64);
            for r in &shared {
                let desc = &self.regst_descs[r.index()];
                let offset = desc.shared_offset.unwrap_or(0);
                if desc.register_num != 1 || !offset.is_multiple_of(regflow_memory::ALIGNMENT as u64) {
                    return Err(memory_error(format!(
                        "register '{}' shares memory at offset {offset} with {} slots: shared registers need one slot at a {}-byte boundary",
                        desc.name,
                        desc.register_num,
                        regflow_memory::ALIGNMENT
                    )));
                }
                // Sizes come from plan files: every sum is checked (a file may say 2^64 - 1).
                let past_2_64 = || memory_error(format!("register '{}' ends past 2^64", desc.name));
                let end = offset.checked_add(desc.bytes).and_then(|end| end.checked_next_multiple_of(64));
                shared_bytes = shared_bytes.max(end.ok_or_else(past_2_64)?);
                unshared_bytes = desc
                    .bytes
                    .checked_next_multiple_of(64)
                    .and_then(|bytes| unshared_bytes.checked_add(bytes))
                    .ok_or_else(past_2_64)?;
                placement[r.index()] = Some((d, Place::Shared(offset)));
            }
            let blocks: Vec<(u64, u32)> = descs
                .iter()
                .map(|r| {
                    let desc = &self.regst_descs[r.index()];
                    (desc.bytes, desc.buffers())
                })
                .collect();
            let layout = ArenaLayout::pack(&blocks).map_err(|e| memory_error(e.to_string()))?;
            let total = shared_bytes.checked_add(layout.total_bytes()).ok_or_else(|| {
                memory_error(format!(
                    "the shared region ({shared_bytes} bytes) and the other slots ({} bytes) together exceed 2^64",
                    layout.total_bytes()
                ))
            })?;
            if let Some(capacity) = self.devices[d].memory_capacity {
                if total > capacity {
                    let mut largest: Vec<&RegstDesc> = descs.iter().map(|r| &self.regst_descs[r.index()]).collect();
                    largest.sort_by_key(|r| std::cmp::Reverse(r.bytes.saturating_mul(u64::from(r.buffers()))));
                    let largest = largest
                        .iter()
                        .take(3)
                        .map(|r| format!("'{}' ({} x {} bytes)", r.name, r.buffers(), r.bytes))
                        .collect::<Vec<_>>()
                        .join(", ");
                    return Err(PlanError::DoesNotFit { device: label, needed: total, capacity, largest });
                }
            }
            for (block, r) in descs.iter().enumerate() {
                let place =
                    if self.regst_descs[r.index()].aliased_slots { Place::OneBuffer(block) } else { Place::Own(block) };
                placement[r.index()] = Some((d, place));
            }
            devices.push(DeviceMemory {
                device: DeviceIndex(d as u32),
                label,
                descs,
                layout,
                shared_bytes,
                unshared_bytes,
            });
        }
        // Registers held in another's buffer first: a part may lie within one of them.
        for guest in guests {
            placement[guest.index()] = Some(self.place_at_home(guest, &placement)?);
        }
        for view in views {
            placement[view.index()] = Some(self.place_within(view, &placement)?);
        }
        Ok(PlanMemory { devices, placement })
    }

    /// The error of register `view`, which says it lies [`within`](RegstDesc::within)
    /// another: names both (the other by its index where the plan has no such register).
    pub(crate) fn within_error(&self, view: RegstDescId, detail: String) -> PlanError {
        let desc = &self.regst_descs[view.index()];
        PlanError::Within { regst: desc.name.clone(), within: self.named(desc.within.map(|w| w.regst)), detail }
    }

    /// The error of register `guest`, which says it is held in another's buffer
    /// ([`RegstDesc::home`]): names both (the other by its index where the plan has no such
    /// register).
    pub(crate) fn home_error(&self, guest: RegstDescId, detail: String) -> PlanError {
        let desc = &self.regst_descs[guest.index()];
        PlanError::Home { regst: desc.name.clone(), home: self.named(desc.home), detail }
    }

    /// The name of register `r` a plan file names, `#index` where there is none, or
    /// nothing where it names none.
    fn named(&self, r: Option<RegstDescId>) -> String {
        r.map_or_else(String::new, |r| {
            self.regst_descs.get(r.index()).map_or_else(|| format!("#{}", r.0), |t| t.name.clone())
        })
    }

    /// Where a register whose buffer is another's ([`RegstDesc::home`]) lies: in that
    /// one's single buffer, which is a buffer of its own, on a cpu device of the same node
    /// and of the same size (a plan file may say anything; what may share it is
    /// [`InPlaceCheck::check_home`](crate::InPlaceCheck::check_home)'s to say).
    fn place_at_home(
        &self,
        guest: RegstDescId,
        placement: &[Option<(usize, Place)>],
    ) -> Result<(usize, Place), PlanError> {
        let desc = &self.regst_descs[guest.index()];
        let Some(home) = desc.home else { unreachable!("called for registers held elsewhere") };
        let error = |detail: String| self.home_error(guest, detail);
        let (target, device, block) = self.one_buffer_of(home, placement).map_err(error)?;
        let (own, there) = (&self.devices[self.device_of(desc.producer).index()], &self.devices[device]);
        if own.kind != DeviceKind::Cpu || there.kind != DeviceKind::Cpu || own.node != there.node {
            return Err(error(format!(
                "it is made on {} and '{}' lives on {}: only cpu devices of one node share memory",
                own.label(),
                target.name,
                there.label()
            )));
        }
        if !desc.aliased_slots || desc.shared_offset.is_some() || desc.within.is_some() || desc.bytes != target.bytes {
            return Err(error(format!(
                "it is not one buffer of '{}''s {} bytes: it has {} bytes, {} slots{}{}",
                target.name,
                target.bytes,
                desc.bytes,
                desc.buffers(),
                if desc.shared_offset.is_some() { ", a shared offset" } else { "" },
                if desc.within.is_some() { ", and lies within another" } else { "" }
            )));
        }
        Ok((device, Place::OneBuffer(block)))
    }

    /// Register `target`, which another names as the buffer it lies in or is held in, with
    /// where that buffer is (device and block); else why it is none, as a phrase that
    /// follows "but".
    fn one_buffer_of(
        &self,
        target: RegstDescId,
        placement: &[Option<(usize, Place)>],
    ) -> Result<(&RegstDesc, usize, usize), String> {
        let Some(desc) = self.regst_descs.get(target.index()) else {
            return Err(format!(
                "the plan has {} registers, so there is no register {}",
                self.regst_descs.len(),
                target.0
            ));
        };
        match placement[target.index()] {
            Some((device, Place::OneBuffer(block))) => Ok((desc, device, block)),
            _ => Err(format!(
                "'{}' does not have one buffer of its own (aliased slots, not shared, not itself held elsewhere)",
                desc.name
            )),
        }
    }

    /// Where a register [`within`](RegstDesc::within) another lies: inside that one's single
    /// buffer, on the same device, as one slot (a plan file may say anything).
    fn place_within(
        &self,
        view: RegstDescId,
        placement: &[Option<(usize, Place)>],
    ) -> Result<(usize, Place), PlanError> {
        let desc = &self.regst_descs[view.index()];
        let Some(within) = desc.within else { unreachable!("called for registers within others") };
        let error = |detail: String| self.within_error(view, detail);
        let (target, device, block) = self.one_buffer_of(within.regst, placement).map_err(error)?;
        // The device that makes the register it lies in (whose buffer may be held on
        // another device of the node, `RegstDesc::home`).
        let device_of_target = self.device_of(target.producer).index();
        let own_device = self.device_of(desc.producer).index();
        if own_device != device_of_target {
            return Err(error(format!(
                "it is written on {} and that register lives on {}",
                self.devices[own_device].label(),
                self.devices[device_of_target].label()
            )));
        }
        one_slot_alone(desc).map_err(error)?;
        match within.offset.checked_add(desc.bytes) {
            Some(end) if end <= target.bytes => Ok((device, Place::Within(block, within.offset))),
            _ => Err(error(format!(
                "its {} bytes from offset {} do not fit in that register's {} bytes",
                desc.bytes, within.offset, target.bytes
            ))),
        }
    }
}

/// A register within another ([`RegstDesc::within`]) is one slot that shares memory no
/// other way; else why not, as a phrase that follows "but". The memory plan places by it
/// and [`InPlaceCheck::check_within`](crate::InPlaceCheck::check_within) checks by it, so
/// the compiler, which asks the latter, never marks what the former refuses.
pub(crate) fn one_slot_alone(desc: &RegstDesc) -> Result<(), String> {
    if desc.register_num == 1 && desc.shared_offset.is_none() && !desc.aliased_slots {
        return Ok(());
    }
    Err(format!(
        "it has {} slots{}: a register within another has one slot and no other memory sharing",
        desc.register_num,
        if desc.shared_offset.is_some() || desc.aliased_slots { " and shares memory otherwise" } else { "" }
    ))
}
