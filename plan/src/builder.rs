//! `PlanBuilder`: hand-build plans whose two sides of every edge agree by construction.

use super::*;
use regflow_memory::MemoryKind;

/// Builds a [`Plan`] step by step; [`PlanBuilder::build`] validates it.
#[derive(Debug, Default)]
pub struct PlanBuilder {
    plan: Option<Plan>,
}

impl PlanBuilder {
    /// An empty builder.
    pub fn new() -> Self {
        Self { plan: Some(Plan::empty()) }
    }

    fn plan(&mut self) -> &mut Plan {
        self.plan.get_or_insert_with(Plan::empty)
    }

    /// The plan being built, for compiler passes that adjust what they created.
    pub fn plan_mut(&mut self) -> &mut Plan {
        self.plan()
    }

    /// Adds a device of `kind` with this index on `node`.
    pub fn device(&mut self, node: u16, kind: DeviceKind, index: u16) -> DeviceIndex {
        let plan = self.plan();
        plan.devices.push(DeviceDesc { node, kind, index, memory_capacity: None });
        DeviceIndex(plan.devices.len() as u32 - 1)
    }

    /// Limits the bytes a device offers this plan.
    pub fn memory_capacity(&mut self, device: DeviceIndex, bytes: u64) -> &mut Self {
        if let Some(d) = self.plan().devices.get_mut(device.index()) {
            d.memory_capacity = Some(bytes);
        }
        self
    }

    /// Adds a stream of `kind` to `device`.
    pub fn stream(&mut self, device: DeviceIndex, kind: StreamKind) -> StreamIndex {
        let plan = self.plan();
        plan.streams.push(StreamDesc { device, kind });
        StreamIndex(plan.streams.len() as u32 - 1)
    }

    /// Adds an actor bound to `stream`.
    pub fn actor(&mut self, name: &str, stream: StreamIndex, kind: ActorKind) -> ActorIndex {
        let plan = self.plan();
        plan.actors.push(ActorDesc {
            name: name.to_string(),
            stream,
            kind,
            inputs: Vec::new(),
            sim_nanos: None,
            windows: Vec::new(),
        });
        ActorIndex(plan.actors.len() as u32 - 1)
    }

    /// Sets the modeled kernel duration of an actor on a `sim` device.
    pub fn sim_nanos(&mut self, actor: ActorIndex, nanos: u64) -> &mut Self {
        if let Some(a) = self.plan().actors.get_mut(actor.index()) {
            a.sim_nanos = Some(nanos);
        }
        self
    }

    /// Adds a host-memory register descriptor produced by `producer`.
    pub fn regst(&mut self, name: &str, producer: ActorIndex, bytes: u64, register_num: u32) -> RegstDescId {
        let plan = self.plan();
        plan.regst_descs.push(RegstDesc {
            name: name.to_string(),
            producer,
            consumers: Vec::new(),
            register_num,
            bytes,
            memory: MemoryKind::Host,
            preloaded: 0,
            shared_offset: None,
            aliased_slots: false,
            within: None,
            home: None,
        });
        RegstDescId(plan.regst_descs.len() as u32 - 1)
    }

    /// Makes `slots` slots of `desc` start ready (a loop's initial value; see
    /// [`RegstDesc::preloaded`]).
    pub fn preload(&mut self, desc: RegstDescId, slots: u32) -> &mut Self {
        if let Some(d) = self.plan().regst_descs.get_mut(desc.index()) {
            d.preloaded = slots;
        }
        self
    }

    /// Makes `consumer` read `desc` as its next kernel input.
    pub fn consume(&mut self, consumer: ActorIndex, desc: RegstDescId) -> &mut Self {
        let plan = self.plan();
        if let Some(a) = plan.actors.get_mut(consumer.index()) {
            a.inputs.push(desc);
        }
        if let Some(d) = plan.regst_descs.get_mut(desc.index()) {
            d.consumers.push(consumer);
        }
        self
    }

    /// Makes `consumer` read `bytes` bytes from `offset` of each slot of `desc` as its next
    /// kernel input (see [`InputWindow`]).
    pub fn consume_window(&mut self, consumer: ActorIndex, desc: RegstDescId, offset: u64, bytes: u64) -> &mut Self {
        let input = self.plan().actors.get(consumer.index()).map_or(0, |a| a.inputs.len() as u32);
        self.consume(consumer, desc);
        if let Some(a) = self.plan().actors.get_mut(consumer.index()) {
            a.windows.push(InputWindow { input, offset, bytes });
        }
        self
    }

    /// Validates and returns the plan.
    pub fn build(&mut self) -> Result<Plan, PlanError> {
        let plan = self.plan.take().unwrap_or_else(Plan::empty);
        plan.validate()?;
        Ok(plan)
    }
}
