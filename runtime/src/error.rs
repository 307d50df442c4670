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
    /// Another node of a multi-node job failed; this node aborted with it.
    #[error("node {node} ({host}) failed, so this node stopped too: {reason}")]
    PeerFailed {
        /// The failing node.
        node: u16,
        /// Its host.
        host: String,
        /// Its error, as it printed it.
        reason: String,
    },
    /// The connection to another node broke, or it sent what the plan does not allow.
    #[error("lost node {node} ({host}): {message}")]
    PeerLost {
        /// The node.
        node: u16,
        /// Its host.
        host: String,
        /// What happened, as a sentence.
        message: String,
    },
    /// This node could not join the other nodes of a multi-node job.
    #[error("cannot join the cluster as node {node} of {world}: {message}")]
    Cluster {
        /// This node.
        node: u16,
        /// Nodes in the job.
        world: u16,
        /// Why, naming the peer or the master.
        message: String,
    },
    /// The plan names a device that cannot run here: a `cuda` device without this build's
    /// CUDA backend, without the driver, or beyond the devices the driver has.
    #[error("device {device} cannot run here: {reason}; its actors would not run")]
    UnsupportedDevice {
        /// The device's label (`node0/cuda:0`).
        device: String,
        /// What is missing, as a sentence.
        reason: String,
    },
    /// Nothing fired for the watchdog's timeout while pieces were pending. When the program
    /// is part of the deadlock (a push waiting on a full source while nobody reads a full
    /// fetcher, `wait` with a full unread fetcher, an input never fed), the first line says
    /// so and the graph has the user-side nodes.
    #[error("job stalled: {}\n{graph}", graph.cause().unwrap_or_else(|| format!("no actor fired for {idle:?} while pieces were pending")))]
    Stalled {
        /// How long nothing fired.
        idle: Duration,
        /// Who waits on whom (boxed: it is large, and errors travel by value).
        graph: Box<WaitForGraph>,
    },
    /// No actor of that name.
    #[error("no actor named '{name}' in the plan")]
    UnknownActor {
        /// The name asked for.
        name: String,
    },
    /// A typed fetch could not turn what a sink delivered into the value asked for.
    #[error("fetch of output '{output}': {message}")]
    Fetch {
        /// The output (`fetch:0`).
        output: String,
        /// Why.
        message: String,
    },
    /// A variable's final value could not be read back from its register
    /// (`JobBuilder::keep_state`).
    #[error("reading the final value of variable '{variable}': {message}")]
    StateRead {
        /// The variable part (`w`, or `w@1` on a mesh).
        variable: String,
        /// Why.
        message: String,
    },
    /// No feed, fetch or input of that name; the nearest valid names are listed.
    #[error("no {what} named '{name}'{hint}")]
    UnknownName {
        /// What was asked for: `fed source`, `sink`, `input`.
        what: &'static str,
        /// The name asked for.
        name: String,
        /// The nearest valid names, as the end of the sentence.
        hint: String,
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
    /// A variable's value whose dtype or shape differs from the variable's.
    #[error("preload of variable '{variable}': the variable is {expected}, the value given is {got}{hint}")]
    VariableMismatch {
        /// The variable (logical name).
        variable: String,
        /// Its dtype and shape, `f32[5, 3]`.
        expected: String,
        /// The value's.
        got: String,
        /// A note when only the shape differs with the same element count.
        hint: &'static str,
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
    /// A push the job can no longer take: it stopped (with the reason when it has one,
    /// e.g. the watchdog's user-side deadlock) while or before the push waited.
    #[error("push to {feed} failed: {reason}")]
    FeedStopped {
        /// The feed: its input and source, or its source.
        feed: String,
        /// Why the job stopped.
        reason: String,
    },
    /// `Job::wait` found a fetcher only the waiting thread could read, full and unread.
    #[error(
        "Job::wait() would wait for ever: the fetcher of sink '{sink}' holds {unread} unread piece(s) and the sink can deliver no more until they are read; read the fetcher to its end, or drop it, before calling wait()"
    )]
    UnreadFetcher {
        /// The sink.
        sink: String,
        /// Pieces delivered and not read.
        unread: u64,
    },
    /// A plan's registers (a variable, a register) need more memory than a device has.
    #[error("device {device} cannot hold this plan: it needs {bytes} bytes for {what}, and has {available}")]
    DoesNotFit {
        /// The device's label.
        device: String,
        /// What did not fit: the largest registers, by tensor (variable) and register.
        what: String,
        /// Bytes needed.
        bytes: u64,
        /// The memory available, in words (`1048576 bytes (memory_capacity)`).
        available: String,
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
    /// A job setting out of its range.
    #[error("job setting {setting} is {value}: {reason}")]
    Setting {
        /// The setting (the builder method).
        setting: &'static str,
        /// The value given.
        value: String,
        /// What it must be.
        reason: String,
    },
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
    /// Work a stream had queued on its device failed after the stream's actors finished
    /// (a kernel completed at launch for the protocol, nobody off the stream waiting for
    /// it, and ran into an error on the device later).
    #[error("the work queued on {stream} failed after its actors finished: {message}")]
    QueuedWorkFailed {
        /// The stream.
        stream: String,
        /// The device's error.
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

impl RuntimeError {
    /// [`RuntimeError::UnknownName`] for `name`, listing the valid names nearest to it (a
    /// close one first as "did you mean").
    pub(crate) fn unknown_name(what: &'static str, name: &str, valid: &[&str]) -> Self {
        const LISTED: usize = 5;
        let mut hint = String::new();
        if let Some(close) = regflow_kernels::nearest(name, valid) {
            hint.push_str(&format!("; did you mean '{close}'?"));
        }
        if valid.is_empty() {
            hint.push_str(&format!(" (the plan has no {what}s)"));
        } else {
            let mut by_distance: Vec<(usize, &str)> =
                valid.iter().map(|v| (regflow_kernels::edit_distance(name, v), *v)).collect();
            by_distance.sort();
            let nearest: Vec<String> = by_distance.iter().take(LISTED).map(|(_, v)| format!("'{v}'")).collect();
            let more = valid.len().saturating_sub(LISTED);
            let more = if more > 0 { format!(" and {more} more") } else { String::new() };
            hint.push_str(&format!(" (nearest {what}s: {}{more})", nearest.join(", ")));
        }
        Self::UnknownName { what, name: name.to_string(), hint }
    }
}
