//! Why a request or a model failed, as sentences naming the input, the values and the limit.

use regflow_runtime::RuntimeError;
use std::sync::Arc;
use std::time::Duration;

/// Why a request got no answer, or a model could not be built.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ServeError {
    /// The request queue is full: the model is answering as fast as it can. Retry later
    /// (HTTP 429).
    #[error("the model is overloaded: {queued} request(s) already wait in its queue of {capacity}")]
    Overloaded {
        /// Requests waiting when this one came.
        queued: usize,
        /// The queue's bound.
        capacity: usize,
    },
    /// The request's deadline passed before its answer (HTTP 504). A request whose deadline
    /// passed while it waited in the queue never reached the model.
    #[error("the request's deadline of {deadline:?} passed {when}")]
    DeadlineExceeded {
        /// The deadline the request was given, counted from its submission.
        deadline: Duration,
        /// Where it was: `in the queue, before it ran` (it never used compute) or `before its answer came` (the caller stopped waiting; it may have run).
        when: &'static str,
    },
    /// The caller gave up (the future was dropped) before the answer.
    #[error("the request was cancelled before its answer")]
    Cancelled,
    /// An input that the model does not have, or one missing.
    #[error("{0}")]
    BadInput(String),
    /// The model was shut down, or its job stopped: every later request gets this.
    #[error("the model is not serving: {0}")]
    Stopped(String),
    /// The plan cannot be served as asked.
    #[error("cannot serve this plan: {0}")]
    Setup(String),
    /// The runtime failed while building or running the model's job.
    #[error(transparent)]
    Runtime(Arc<RuntimeError>),
}

impl From<RuntimeError> for ServeError {
    fn from(error: RuntimeError) -> Self {
        ServeError::Runtime(Arc::new(error))
    }
}

impl ServeError {
    /// A short name of the kind, for metrics labels and HTTP bodies (`overloaded`,
    /// `deadline_exceeded`, `cancelled`, `bad_input`, `stopped`, `setup`, `runtime`).
    pub fn kind(&self) -> &'static str {
        match self {
            ServeError::Overloaded { .. } => "overloaded",
            ServeError::DeadlineExceeded { .. } => "deadline_exceeded",
            ServeError::Cancelled => "cancelled",
            ServeError::BadInput(_) => "bad_input",
            ServeError::Stopped(_) => "stopped",
            ServeError::Setup(_) => "setup",
            ServeError::Runtime(_) => "runtime",
        }
    }
}
