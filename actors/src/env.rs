//! What an actor needs from the outside: a way to send messages and a way to launch its
//! kernel. The runtime implements it with its bus and its device streams.

use crate::{ActorId, Message, RegstRef};

pub use regflow_plan::GroupPosition;

/// One firing, as the kernel sees it.
#[derive(Debug, Clone, Copy)]
pub struct Firing<'a> {
    /// The firing actor.
    pub actor: ActorId,
    /// Piece number of the inputs (for a source: of the outputs).
    pub piece: u64,
    /// Memory of each input, in kernel input order.
    pub inputs: &'a [RegstRef],
    /// Slot of each output, in output order.
    pub outputs: &'a [RegstRef],
    /// Position in an acc group (`index` 0 starts a new sum).
    pub group: GroupPosition,
    /// Whether anyone outside the actor's stream waits for this kernel to complete: a
    /// consumer or producer on another stream (or node), a repeat producer that may hand
    /// the slot on, an acc that may flush its sum, or an older launch of the actor still
    /// pending (completions are reported in launch order). When `false`, every message the
    /// firing sends goes to actors of its own stream, whose kernels the stream runs after
    /// this one, so a device with stream order (`sim`, `cuda`) may report [`Completion::Done`]
    /// at launch and skip the completion event.
    pub completion_wanted: bool,
}

/// How a launch ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completion {
    /// The kernel finished during the call (cpu).
    Done,
    /// The kernel was queued on the stream; an `ActDone` message will follow, in launch order.
    Pending,
}

/// Why a send or launch failed; the actor wraps it with its own name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    /// No route to the recipient's node.
    #[error("cannot reach actor {dst}: node {node} is not connected")]
    NotConnected {
        /// Recipient.
        dst: ActorId,
        /// Its node.
        node: u16,
    },
    /// The recipient's thread has gone (the job is stopping).
    #[error("cannot reach actor {dst}: its stream has stopped")]
    Disconnected {
        /// Recipient.
        dst: ActorId,
    },
    /// The kernel failed.
    #[error("kernel failed: {0}")]
    Kernel(String),
    /// The recipient, an actor of the sender's stream handed the message directly
    /// ([`crate::Actor::accept`]), refused it as a protocol violation; the stream reports
    /// the recipient's own error.
    #[error("actor {dst} refused the message")]
    Refused {
        /// Recipient.
        dst: ActorId,
    },
}

/// Services the runtime gives an actor while it handles a message.
pub trait ActorEnv {
    /// Delivers a message (same thread, other thread or other node).
    fn send(&mut self, msg: Message) -> Result<(), EnvError>;
    /// Runs or queues the actor's kernel for one firing.
    fn launch(&mut self, firing: &Firing<'_>) -> Result<Completion, EnvError>;
}
