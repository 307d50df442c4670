//! `ActorId`: node, device, stream and index packed into 64 bits, so routing is a bit decode.

use regflow_plan::{ActorIndex, Plan};
use std::fmt;

const INDEX_BITS: u32 = 24;
const STREAM_BITS: u32 = 8;
const DEVICE_BITS: u32 = 16;

/// Most actors one stream can hold.
pub const MAX_ACTORS_PER_STREAM: u32 = 1 << INDEX_BITS;
/// Most streams one device can have.
pub const MAX_STREAMS_PER_DEVICE: u32 = 1 << STREAM_BITS;
/// Most devices one plan can have.
pub const MAX_DEVICES: u32 = 1 << DEVICE_BITS;

/// Identifies an actor: `node:16 | device:16 | stream:8 | index:24`.
///
/// `device` is the plan's device index, `stream` the stream's position among its
/// device's streams, and `index` the actor's position among its stream's actors: the
/// stream thread keeps its actors in a vector indexed by it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ActorId(u64);

/// The (node, device, stream) part of an [`ActorId`]: which thread runs the actor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(u64);

impl ActorId {
    /// Packs the four fields; `None` if one is out of range.
    pub fn new(node: u16, device: u32, stream: u32, index: u32) -> Option<Self> {
        if device >= MAX_DEVICES || stream >= MAX_STREAMS_PER_DEVICE || index >= MAX_ACTORS_PER_STREAM {
            return None;
        }
        Some(Self((u64::from(node) << 48) | (u64::from(device) << 32) | (u64::from(stream) << 24) | u64::from(index)))
    }

    /// Node that runs the actor.
    pub fn node(self) -> u16 {
        (self.0 >> 48) as u16
    }

    /// The plan's device index.
    pub fn device(self) -> u32 {
        ((self.0 >> 32) & 0xffff) as u32
    }

    /// The stream's position among its device's streams.
    pub fn stream(self) -> u32 {
        ((self.0 >> 24) & 0xff) as u32
    }

    /// Position among its stream's actors.
    pub fn index(self) -> u32 {
        (self.0 & 0xff_ffff) as u32
    }

    /// The thread that runs it.
    pub fn stream_id(self) -> StreamId {
        StreamId(self.0 >> INDEX_BITS)
    }

    /// The raw bits.
    pub fn bits(self) -> u64 {
        self.0
    }
}

impl StreamId {
    /// Node of the stream.
    pub fn node(self) -> u16 {
        (self.0 >> (48 - INDEX_BITS)) as u16
    }
}

impl fmt::Debug for ActorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for ActorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "n{}.d{}.s{}.a{}", self.node(), self.device(), self.stream(), self.index())
    }
}

/// The ids of a plan: one per actor, and for each stream its position on its device.
#[derive(Debug, Clone)]
pub struct PlanIds {
    /// `actors[i]` is the id of plan actor `i`.
    pub actors: Vec<ActorId>,
    /// `stream_position[s]` is the position of plan stream `s` among its device's streams.
    pub stream_position: Vec<u32>,
}

/// Why ids could not be assigned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("plan does not fit actor ids: {0}")]
pub struct IdError(pub String);

impl PlanIds {
    /// Assigns ids in plan order: actors of a stream get indices 0, 1, … in the order
    /// they appear. Expects a validated plan.
    pub fn assign(plan: &Plan) -> Result<Self, IdError> {
        if plan.devices.len() as u64 > u64::from(MAX_DEVICES) {
            return Err(IdError(format!("{} devices, at most {MAX_DEVICES}", plan.devices.len())));
        }
        let mut streams_per_device = vec![0u32; plan.devices.len()];
        let mut stream_position = Vec::with_capacity(plan.streams.len());
        for stream in &plan.streams {
            let count = &mut streams_per_device[stream.device.index()];
            if *count >= MAX_STREAMS_PER_DEVICE {
                return Err(IdError(format!(
                    "device {} has more than {MAX_STREAMS_PER_DEVICE} streams",
                    plan.devices[stream.device.index()].label()
                )));
            }
            stream_position.push(*count);
            *count += 1;
        }
        let mut actors_per_stream = vec![0u32; plan.streams.len()];
        let mut actors = Vec::with_capacity(plan.actors.len());
        for actor in &plan.actors {
            let stream = actor.stream.index();
            let device = plan.streams[stream].device;
            let node = plan.devices[device.index()].node;
            let index = actors_per_stream[stream];
            actors_per_stream[stream] += 1;
            let id = ActorId::new(node, device.0, stream_position[stream], index)
                .ok_or_else(|| IdError(format!("stream {stream} has more than {MAX_ACTORS_PER_STREAM} actors")))?;
            actors.push(id);
        }
        Ok(Self { actors, stream_position })
    }

    /// Id of a plan actor.
    pub fn of(&self, actor: ActorIndex) -> ActorId {
        self.actors[actor.index()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_round_trip_through_the_bits() {
        for (node, device, stream, index) in [(0, 0, 0, 0), (65535, 65535, 255, (1 << 24) - 1), (7, 300, 3, 12345)] {
            let id = ActorId::new(node, device, stream, index).unwrap();
            assert_eq!((id.node(), id.device(), id.stream(), id.index()), (node, device, stream, index));
            assert_eq!(id.stream_id().node(), node);
        }
        assert!(ActorId::new(0, 1 << 16, 0, 0).is_none());
        assert!(ActorId::new(0, 0, 256, 0).is_none());
        assert!(ActorId::new(0, 0, 0, 1 << 24).is_none());
    }

    #[test]
    fn same_stream_actors_share_a_stream_id() {
        let a = ActorId::new(1, 2, 3, 4).unwrap();
        let b = ActorId::new(1, 2, 3, 5).unwrap();
        let c = ActorId::new(1, 2, 4, 4).unwrap();
        assert_eq!(a.stream_id(), b.stream_id());
        assert_ne!(a.stream_id(), c.stream_id());
        assert_eq!(a.to_string(), "n1.d2.s3.a4");
    }
}
