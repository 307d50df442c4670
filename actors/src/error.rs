//! Errors of the actor protocol; each names the actor and the values involved.

use crate::{ActorId, EnvError};

/// A protocol violation or a failure inside an actor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ActorError {
    /// A message this actor cannot take.
    #[error("actor '{name}' ({id}): unexpected message: {detail}")]
    Unexpected {
        /// Actor name.
        name: String,
        /// Actor id.
        id: ActorId,
        /// What arrived and why it does not fit.
        detail: String,
    },
    /// Pieces arrived out of order or out of step between inputs.
    #[error("actor '{name}' ({id}): pieces out of order: {detail}")]
    PieceOrder {
        /// Actor name.
        name: String,
        /// Actor id.
        id: ActorId,
        /// Which register and which pieces.
        detail: String,
    },
    /// The environment failed to send or launch.
    #[error("actor '{name}' ({id}): {source}")]
    Env {
        /// Actor name.
        name: String,
        /// Actor id.
        id: ActorId,
        /// The failure.
        source: EnvError,
    },
}
