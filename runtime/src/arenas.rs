//! The memory of a loaded plan: one arena per hosted device, from the arena allocator of
//! the device's kind, a mirror of every register another node produces for this one, and a
//! view per register slot.
//!
//! A job that runs one node of a multi-node plan allocates only its own devices. A register
//! produced on another node and read here gets a *mirror*: `register_num` slots of its size
//! in one host arena of the node, into which the network reader writes the bytes of each
//! piece before the consumer hears of it (see `crate::net`). Consumers read the mirror
//! through the same [`PlanArenas::view`] as any local slot, so kernels never know.

use crate::device::GpuMap;
use crate::RuntimeError;
use regflow_actors::RegstRef;
use regflow_memory::{host_memory_bytes, Arena, ArenaAllocator, ArenaMemory, BufferView, HostAllocator, MemoryReport};
use regflow_plan::{DeviceKind, Plan, PlanMemory, RegstDescId};
use std::collections::HashMap;

/// The memory of one hosted device's arena: host memory for `cpu` and `sim`; for `cuda`,
/// one managed allocation on the GPU (`regflow_cuda::Device::managed`), which kernels read
/// at device speed and the host reads in place (feeds, fetches, host kernels). A `cuda`
/// device that cannot be opened was refused before (`check_devices`).
fn arena_memory(
    device: &regflow_plan::DeviceDesc,
    gpus: &GpuMap,
    label: &str,
    kind: regflow_memory::MemoryKind,
    bytes: u64,
) -> Result<Box<dyn ArenaMemory>, String> {
    match device.kind {
        DeviceKind::Cpu | DeviceKind::Sim => HostAllocator.allocate(label, kind, bytes).map_err(|e| e.to_string()),
        DeviceKind::Cuda => regflow_cuda::Device::open(gpus.ordinal(device.index)?)
            .and_then(|gpu| gpu.managed(label, bytes))
            .map_err(|e| e.to_string()),
    }
}

/// The scratch stream `s` lends its kernels: `bytes` (the most any of them asks,
/// `Kernel::scratch_bytes`) from its device's allocator, made once per job like the
/// arenas and checked with them against the device's memory
/// ([`PlanArenas::check_with_kernels`]); `None` where no kernel asks.
pub(crate) fn stream_scratch(
    plan: &Plan,
    s: usize,
    gpus: &GpuMap,
    bytes: u64,
) -> Result<Option<Box<dyn ArenaMemory>>, RuntimeError> {
    if bytes == 0 {
        return Ok(None);
    }
    let stream = &plan.streams[s];
    let device = &plan.devices[stream.device.index()];
    let kind = match device.kind {
        DeviceKind::Cuda => regflow_memory::MemoryKind::Device,
        DeviceKind::Cpu | DeviceKind::Sim => regflow_memory::MemoryKind::Host,
    };
    let label = format!("{}/{:?}#{s} scratch", device.label(), stream.kind);
    arena_memory(device, gpus, &label, kind, bytes).map(Some).map_err(|why| RuntimeError::DoesNotFit {
        device: device.label(),
        what: format!("the scratch its stream #{s} lends its kernels"),
        bytes,
        available: format!("less: {why}"),
    })
}

/// The bytes device `device` can hold, with how to say so: its `memory_capacity`, else for
/// `cuda` what the driver reports free now, else the host's memory.
fn device_limit(device: &regflow_plan::DeviceDesc, gpus: &GpuMap, host: Option<u64>) -> Option<(u64, String)> {
    if let Some(capacity) = device.memory_capacity {
        return Some((capacity, format!("{capacity} bytes (its memory_capacity)")));
    }
    if device.kind == DeviceKind::Cuda {
        let gpu = gpus.ordinal(device.index).ok().and_then(|o| regflow_cuda::Device::open(o).ok());
        return gpu
            .and_then(|gpu| gpu.free_bytes().ok())
            .map(|free| (free, format!("{free} bytes free on the GPU, as its driver reports")));
    }
    host.map(|host| (host, format!("{host} bytes of host memory")))
}

/// [`RuntimeError::DoesNotFit`] for device `d` of the memory plan: names its three largest
/// registers, with the variable each holds where it holds one.
fn does_not_fit(plan: &Plan, memory: &PlanMemory, d: usize, bytes: u64, available: String) -> RuntimeError {
    let mut registers: Vec<usize> = (0..plan.regst_descs.len())
        .filter(|&r| memory.slot(RegstDescId(r as u32), 0).is_some_and(|(device, _)| device == d))
        // A register within another, or held in another's buffer, takes no bytes of its own.
        .filter(|&r| plan.regst_descs[r].within.is_none() && plan.regst_descs[r].home.is_none())
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
    /// Each hosted device's limit when the arenas were allocated: `(label, bytes, in words)`
    /// (see `device_limit`), for the check that adds the kernels' own memory.
    limits: Vec<(String, u64, String)>,
}

impl PlanArenas {
    /// Allocates every device's arena exactly as the memory plan says, each from its
    /// device kind's allocator. An arena larger than its device's `memory_capacity` (or,
    /// without one, than the host's memory, where every arena of this build lives), or one
    /// the allocator cannot provide, is [`RuntimeError::DoesNotFit`] naming the device's
    /// largest registers and their tensors, never an abort.
    ///
    /// With `node`, only that node's devices get arenas, and registers produced elsewhere
    /// and read on it get mirrors; slots of other registers have no view.
    pub(crate) fn allocate(
        plan: &Plan,
        memory: &PlanMemory,
        node: Option<u16>,
        gpus: &GpuMap,
    ) -> Result<Self, RuntimeError> {
        let host = host_memory_bytes();
        let hosted = |d: regflow_plan::DeviceIndex| node.is_none_or(|n| plan.devices[d.index()].node == n);
        let mut arenas = Vec::with_capacity(memory.devices.len());
        // Arena index of each memory-plan device entry (`None`: not hosted).
        let mut arena_of = vec![None; memory.devices.len()];
        let mut limits = Vec::new();
        for (d, device) in memory.devices.iter().enumerate() {
            if !hosted(device.device) {
                continue;
            }
            let kind = device
                .descs
                .first()
                .map(|r| plan.regst_descs[r.index()].memory)
                .unwrap_or(regflow_memory::MemoryKind::Host);
            let bytes = device.total_bytes();
            let desc = &plan.devices[device.device.index()];
            let limit = device_limit(desc, gpus, host);
            if let Some((_, available)) = limit.clone().filter(|(limit, _)| bytes > *limit) {
                return Err(does_not_fit(plan, memory, d, bytes, available));
            }
            limits.extend(limit.map(|(bytes, words)| (device.label.clone(), bytes, words)));
            let memory_of = arena_memory(desc, gpus, &device.label, kind, bytes)
                .map_err(|why| does_not_fit(plan, memory, d, bytes, format!("less: {why}")))?;
            let arena = Arena::new(&device.label, kind, memory_of);
            arena_of[d] = Some(arenas.len());
            arenas.push(arena);
        }
        let mirrored = mirrored_descs(plan, node);
        let mirror = mirror_arena(plan, &mirrored, node)?;
        let mut mirror_offset = 0u64;
        let mut views = Vec::new();
        let mut first_view = Vec::with_capacity(plan.regst_descs.len());
        for (d, desc) in plan.regst_descs.iter().enumerate() {
            let id = regflow_plan::RegstDescId(d as u32);
            if mirrored[d] {
                first_view.push(views.len() as u32);
                for _ in 0..desc.register_num {
                    let arena = mirror.as_ref().unwrap_or_else(|| unreachable!("a mirrored register has an arena"));
                    views.push(arena.view(mirror_offset, desc.bytes)?);
                    mirror_offset += desc.bytes;
                }
                continue;
            }
            let local = (0..desc.register_num).map(|slot| memory.slot(id, slot)).collect::<Option<Vec<_>>>();
            // No memory here (a repeat's output, or a register of another node): a
            // sentinel, so a stray lookup panics rather than aliasing the next descriptor.
            // Data refs always name the owner.
            match local.filter(|slots| slots.iter().all(|&(device, _)| arena_of[device].is_some())) {
                Some(slots) if plan.owns_memory(id) => {
                    first_view.push(views.len() as u32);
                    for (device, offset) in slots {
                        let arena = arena_of[device].unwrap_or_else(|| unreachable!("filtered on hosted"));
                        views.push(arenas[arena].view(offset, desc.bytes)?);
                    }
                }
                _ => first_view.push(u32::MAX),
            }
        }
        if let Some(mirror) = mirror {
            arenas.push(mirror);
        }
        let report = memory.report();
        Ok(Self { _arenas: arenas, views, first_view, report, limits })
    }

    /// The bytes of a slot, or `None` where this node has no memory for it.
    pub(crate) fn try_view(&self, regst: RegstRef) -> Option<BufferView> {
        let first = *self.first_view.get(regst.desc.index())?;
        if first == u32::MAX {
            return None;
        }
        self.views.get(first as usize + regst.slot as usize).copied()
    }

    /// The bytes of a slot. Panics on a slot the plan does not have: refs come from
    /// validated plans and the actor protocol, so that would be a broken invariant.
    #[inline]
    pub(crate) fn view(&self, regst: RegstRef) -> BufferView {
        self.views[self.first_view[regst.desc.index()] as usize + regst.slot as usize]
    }

    /// Bytes per device.
    pub(crate) fn report(&self) -> &MemoryReport {
        &self.report
    }

    /// Whether each device still holds its registers once the scratch its streams lend
    /// their kernels (`kernels`, known once the kernels are made, after the arenas) is
    /// added: [`RuntimeError::DoesNotFit`] naming the two amounts and the kernel asking the
    /// most (`largest`, per device label) where it does not. Checked before the scratch is
    /// allocated and before any kernel runs.
    pub(crate) fn check_with_kernels(
        &self,
        kernels: &MemoryReport,
        largest: &HashMap<String, (String, u64)>,
    ) -> Result<(), RuntimeError> {
        for (label, limit, available) in &self.limits {
            let registers = self.report.bytes_of(label).unwrap_or(0);
            let kept = kernels.bytes_of(label).unwrap_or(0);
            if registers.saturating_add(kept) <= *limit {
                continue;
            }
            let most = largest.get(label).map_or(String::new(), |(actor, bytes)| {
                format!("; the most one kernel asks, {bytes} bytes, by actor '{actor}'")
            });
            return Err(RuntimeError::DoesNotFit {
                device: label.clone(),
                what: format!("its registers ({registers} bytes) and its streams' kernel scratch ({kept} bytes{most})"),
                bytes: registers.saturating_add(kept),
                available: available.clone(),
            });
        }
        Ok(())
    }
}

/// Which registers `node` mirrors: produced on another node, read by an actor of this one.
/// A register without memory of its own (a repeat's output) is mirrored too: the bytes
/// land under the name the message carries.
pub(crate) fn mirrored_descs(plan: &Plan, node: Option<u16>) -> Vec<bool> {
    let Some(node) = node else { return vec![false; plan.regst_descs.len()] };
    let node_of = |a: regflow_plan::ActorIndex| plan.devices[plan.device_of(a).index()].node;
    plan.regst_descs
        .iter()
        .map(|desc| node_of(desc.producer) != node && desc.consumers.iter().any(|&c| node_of(c) == node))
        .collect()
}

/// One host arena holding every mirror slot of `node`, or `None` when it mirrors nothing.
fn mirror_arena(plan: &Plan, mirrored: &[bool], node: Option<u16>) -> Result<Option<Arena>, RuntimeError> {
    let bytes: u64 = plan
        .regst_descs
        .iter()
        .zip(mirrored)
        .filter(|(_, &m)| m)
        .map(|(desc, _)| desc.bytes.saturating_mul(u64::from(desc.register_num)))
        .fold(0u64, u64::saturating_add);
    if bytes == 0 && !mirrored.iter().any(|&m| m) {
        return Ok(None);
    }
    let label = format!("node{}/mirrors", node.unwrap_or(0));
    if let Some(host) = host_memory_bytes().filter(|&host| bytes > host) {
        return Err(RuntimeError::DoesNotFit {
            device: label,
            what: "the mirrors of registers other nodes produce for it".into(),
            bytes,
            available: format!("{host} bytes of host memory"),
        });
    }
    Ok(Some(Arena::allocate_with(&HostAllocator, &label, regflow_memory::MemoryKind::Host, bytes)?))
}
