//! The actor protocol of regflow: actor ids, register-slot messages, register slots and the
//! actor state machine with its kinds (source, compute, sink, acc, repeat). No threads and
//! no devices: the runtime drives actors through [`Actor::handle`] and gives them an
//! [`ActorEnv`] to send messages and launch kernels.
//!
//! The protocol (docs/architecture.md): a producer sends `Ready(regst, piece)` to each
//! consumer; a consumer sends `Ack(regst)` back when its kernel no longer reads it; a slot is
//! free again when every consumer has acked. An actor fires when every input has a ready
//! register and every output a free slot, so `register_num` bounds how far a producer runs
//! ahead. Consumers on the producer's own stream are told at launch; others, and the acks to
//! producers, wait for the kernel to complete. After its last piece an actor sends `Eord`,
//! and stays a zombie until every slot it lent is back.
//!
//! A stream may hand a `Ready` or `Ack` between two of its own actors to the recipient's
//! [`Actor::accept`] while the sender fires, instead of queueing it, and run the recipient
//! with [`Actor::resume`] later if it can fire (its turn waits in a [`RunQueue`]);
//! everything else goes to [`Actor::handle`].
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

mod actor;
mod env;
mod error;
mod id;
mod message;
mod progress;
mod regst;
mod ring;
mod run_queue;
mod snapshot;

pub use actor::{Accepted, Actor, Lifecycle};
pub use env::{ActorEnv, Completion, EnvError, Firing, GroupPosition};
pub use error::ActorError;
pub use id::{ActorId, IdError, PlanIds, StreamId, MAX_ACTORS_PER_STREAM, MAX_DEVICES, MAX_STREAMS_PER_DEVICE};
pub use message::{Body, Cmd, Message, RegstRef};
pub use progress::{check_progress, firings_per_step, Deadlock, Progress, ProgressError, WaitEdge};
pub use regst::MAX_CONSUMERS;
pub use run_queue::RunQueue;
pub use snapshot::{ActorSnapshot, WaitReason};
