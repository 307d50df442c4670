//! Errors of the runtime, wrapping those of the crates below; each names the actor, stream,
//! node or source involved.

use crate::watchdog::WaitForGraph;
use regflow_actors::{ActorError, IdError};
use regflow_memory::MemoryError;
use regflow_plan::PlanError;
use std::time::Duration;

/// Anything that can go wrong loading or running a job.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The plan was rejected at load.
    #[error("invalid plan: {0}")]
    Plan(#[from] PlanError),
    /// The plan does not fit actor ids.
    #[error(transparent)]
    Ids(#[from] IdError),
    /// Memory could not be set up.
    #[error("memory: {0}")]
    Memory(#[from] MemoryError),
    /// An actor failed or saw a protocol violation.
    #[error(transparent)]
    Actor(#[from] ActorError),
    /// A kernel could not be made for an actor.
    #[error("cannot make the kernel of actor '{actor}': {message}")]
    KernelSetup {
        /// The actor.
        actor: String,
        /// Why.
        message: String,
    },
    /// The plan names a device this build has no backend for.
    #[error("device {device} has no backend in this runtime (available device kinds: {available}); its actors would not run")]
    UnsupportedDevice {
        /// The device's label (`node0/cuda:0`).
        device: String,
        /// The kinds this build runs.
        available: String,
    },
    /// Nothing fired for the watchdog's timeout while pieces were pending.
    #[error("job stalled: no actor fired for {idle:?} while pieces were pending\n{graph}")]
    Stalled {
        /// How long nothing fired.
        idle: Duration,
        /// Who waits on whom.
        graph: WaitForGraph,
    },
    /// No actor of that name.
    #[error("no actor named '{name}' in the plan")]
    UnknownActor {
        /// The name asked for.
        name: String,
    },
    /// An actor of another kind than the call needs.
    #[error("actor '{name}' is a {kind} actor; {expected}")]
    WrongKind {
        /// The actor.
        name: String,
        /// Its kind.
        kind: &'static str,
        /// What the call needs.
        expected: &'static str,
    },
    /// The actor is not run by this job (another node's).
    #[error("actor '{name}' runs on node {node}, which this job does not run")]
    NotLocal {
        /// The actor.
        name: String,
        /// Its node.
        node: u16,
    },
    /// A feed of the wrong size.
    #[error("feed for source '{source_name}' has {got} bytes; its register holds {expected}")]
    FeedSize {
        /// The source.
        source_name: String,
        /// Bytes pushed.
        got: usize,
        /// Bytes of its output register.
        expected: u64,
    },
    /// Initial bytes for a register that cannot take them.
    #[error("preload of register '{regst}': {message}")]
    Preload {
        /// The register.
        regst: String,
        /// Why.
        message: String,
    },
    /// A typed feed that does not fit the graph's input.
    #[error("feed for input '{input}': {message}")]
    Feed {
        /// The input.
        input: String,
        /// What does not fit.
        message: String,
    },
    /// A dataset that cannot be read or served.
    #[error("dataset: {message}")]
    Data {
        /// What is wrong.
        message: String,
    },
    /// A push after `close`.
    #[error("feed of source '{source_name}' is closed")]
    FeedClosed {
        /// The source.
        source_name: String,
    },
    /// A feeder or fetcher asked for twice.
    #[error("the {what} of '{name}' was already taken")]
    AlreadyTaken {
        /// `feeder` or `fetcher`.
        what: &'static str,
        /// The actor.
        name: String,
    },
    /// The job has stopped (finished or aborted); `wait` tells why.
    #[error("the job has stopped")]
    Stopped,
    /// A thread could not be started.
    #[error("cannot start thread {thread}: {message}")]
    Spawn {
        /// The thread.
        thread: String,
        /// The OS error.
        message: String,
    },
    /// A stream thread panicked (a bug in a kernel or in regflow).
    #[error("stream thread {stream} panicked: {message}")]
    Panicked {
        /// The stream.
        stream: String,
        /// The panic message.
        message: String,
    },
    /// Writing the timeline failed.
    #[error("writing trace {path}: {message}")]
    Trace {
        /// The file.
        path: String,
        /// The I/O error.
        message: String,
    },
}
