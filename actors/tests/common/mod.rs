//! Helpers shared by the actor tests: small plans on one cpu device with three streams.
#![allow(dead_code)] // each test file uses some of them

use regflow_plan::{
    ActorIndex, ActorKind, DeviceKind, Plan, PlanBuilder, RegstDescId, SourcePieces, StreamIndex, StreamKind,
};

/// Streams of a [`Net`].
pub(crate) const STREAMS: usize = 3;

/// Plans on one cpu device with [`STREAMS`] streams; actor `x`'s output is the register
/// `x.out`.
pub(crate) struct Net {
    pub(crate) b: PlanBuilder,
    streams: Vec<StreamIndex>,
}

impl Net {
    pub(crate) fn new() -> Self {
        let mut b = PlanBuilder::new();
        let cpu = b.device(0, DeviceKind::Cpu, 0);
        let streams = (0..STREAMS).map(|_| b.stream(cpu, StreamKind::Compute)).collect();
        Self { b, streams }
    }

    /// Adds actor `name` on stream `s` reading `ins`.
    pub(crate) fn actor(&mut self, name: &str, s: usize, kind: ActorKind, ins: &[RegstDescId]) -> ActorIndex {
        let actor = self.b.actor(name, self.streams[s], kind);
        for &input in ins {
            self.b.consume(actor, input);
        }
        actor
    }

    /// Adds actor `name` on stream `s` reading `ins`, with output `name.out` of `r` slots.
    pub(crate) fn add(&mut self, name: &str, s: usize, kind: ActorKind, ins: &[RegstDescId], r: u32) -> RegstDescId {
        let actor = self.actor(name, s, kind, ins);
        self.b.regst(&format!("{name}.out"), actor, 8, r)
    }

    /// Adds a sink `name` on stream `s` reading `ins`.
    pub(crate) fn sink(&mut self, name: &str, s: usize, ins: &[RegstDescId]) {
        self.actor(name, s, ActorKind::Sink, ins);
    }

    pub(crate) fn build(mut self) -> Plan {
        self.b.build().expect("test plan is valid")
    }
}

/// A source of `n` counted pieces.
pub(crate) fn count(n: u64) -> ActorKind {
    ActorKind::Source { pieces: SourcePieces::Count(n) }
}
