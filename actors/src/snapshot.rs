//! What an actor waits on, for the watchdog's wait-for graph and for counters.

use crate::actor::{Actor, KindState, Lifecycle};
use crate::ActorId;
use regflow_plan::RegstDescId;
use std::fmt;

/// One reason an actor cannot fire right now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WaitReason {
    /// A source that has not been started.
    NotStarted,
    /// A fed source with no piece pushed by the user.
    Feed,
    /// An input with no ready register.
    Input {
        /// The empty input.
        desc: RegstDescId,
        /// Who should produce it.
        producer: ActorId,
    },
    /// An output whose every slot is still held by consumers.
    OutputFull {
        /// The full output.
        desc: RegstDescId,
        /// Its slot count.
        register_num: u32,
        /// Consumers still holding at least one slot.
        holders: Vec<ActorId>,
    },
    /// A repeat that handed its input to all its pieces and waits for them to come back.
    Lent {
        /// Its output.
        desc: RegstDescId,
        /// Pieces not yet given back.
        pieces: u32,
        /// Consumers still holding them.
        holders: Vec<ActorId>,
    },
    /// A sink whose user has not fetched the pieces it was handed.
    Fetch,
    /// Kernels launched and not yet completed.
    Kernel {
        /// How many.
        launches: usize,
    },
}

/// A snapshot of one actor's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActorSnapshot {
    /// Id.
    pub id: ActorId,
    /// Name.
    pub name: String,
    /// Lifecycle.
    pub lifecycle: Lifecycle,
    /// Times fired.
    pub fires: u64,
    /// Everything it waits on (empty if it could fire).
    pub waits: Vec<WaitReason>,
    /// Whether it holds data on its way, not state at rest: a piece ready or being read on
    /// an input that does not close a loop, a kernel in flight, a source with pieces to
    /// produce, a repeat holding its input. A job between steps (a served model waiting for
    /// requests, a trainer preparing its next batch) holds loop state only: idle, not stuck.
    pub holds_data: bool,
}

impl Actor {
    /// Describes what the actor waits on. Allocates: for diagnostics, not the hot path.
    pub fn snapshot(&self) -> ActorSnapshot {
        let mut waits = Vec::new();
        if let KindState::Source { limit, available, .. } = &self.kind {
            if !self.started {
                waits.push(WaitReason::NotStarted);
            } else if limit.is_none() && *available == 0 {
                waits.push(WaitReason::Feed);
            }
        }
        let repeat_holds_input = matches!(self.kind, KindState::Repeat { held: Some(_), .. });
        for input in &self.inputs {
            if input.is_empty() && !input.eord && !repeat_holds_input {
                waits.push(WaitReason::Input { desc: input.desc, producer: input.producer });
            }
        }
        // An acc in mid-group writes into the slot it holds and needs no free one.
        let mid_group = matches!(self.kind, KindState::Acc { position, .. } if position > 0);
        for output in self.outputs.iter().filter(|_| !mid_group) {
            if !output.has_free() {
                let mut holders: Vec<ActorId> =
                    (0..output.register_num).flat_map(|slot| output.holders_of(slot)).collect();
                holders.sort();
                holders.dedup();
                waits.push(WaitReason::OutputFull { desc: output.desc, register_num: output.register_num, holders });
            }
        }
        if let KindState::Repeat { count, held: Some(_), handed, outstanding } = self.kind {
            if handed == count && outstanding > 0 {
                let output = &self.outputs[0];
                let mut holders: Vec<ActorId> =
                    (0..output.register_num).flat_map(|slot| output.holders_of(slot)).collect();
                holders.sort();
                holders.dedup();
                waits.push(WaitReason::Lent { desc: output.desc, pieces: outstanding, holders });
            }
        }
        if let KindState::Sink { credits: Some(0) } = self.kind {
            waits.push(WaitReason::Fetch);
        }
        let launches = self.pending_launches();
        if launches > 0 {
            waits.push(WaitReason::Kernel { launches });
        }
        let holds_data = launches > 0
            || self.inputs.iter().any(|i| !i.loop_carried && (!i.is_empty() || i.in_use > 0))
            || match &self.kind {
                KindState::Source { limit: Some(n), produced, .. } => self.started && produced < n,
                KindState::Source { limit: None, available, .. } => *available > 0,
                KindState::Repeat { held, .. } => held.is_some(),
                _ => false,
            };
        ActorSnapshot {
            id: self.id,
            name: self.name.clone(),
            lifecycle: self.lifecycle,
            fires: self.fires,
            waits,
            holds_data,
        }
    }
}

impl fmt::Display for WaitReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WaitReason::NotStarted => write!(f, "not started"),
            WaitReason::Feed => write!(f, "waits for the user to push a piece"),
            WaitReason::Input { desc, producer } => {
                write!(f, "waits on input {desc}: empty, produced by {producer}")
            }
            WaitReason::OutputFull { desc, register_num, holders } => {
                let holders: Vec<String> = holders.iter().map(ToString::to_string).collect();
                write!(f, "output {desc} is full: all {register_num} slots held by [{}]", holders.join(", "))
            }
            WaitReason::Lent { desc, pieces, holders } => {
                let holders: Vec<String> = holders.iter().map(ToString::to_string).collect();
                write!(f, "waits for {pieces} piece(s) of {desc} to come back from [{}]", holders.join(", "))
            }
            WaitReason::Fetch => write!(f, "waits for the user to fetch the pieces it delivered"),
            WaitReason::Kernel { launches } => {
                write!(f, "{launches} kernel launch(es) not completed")
            }
        }
    }
}
