//! regflow's wire between nodes.
//!
//! - [`frame`]: bounded frames, the unit of everything sent between nodes;
//! - [`handshake`]: what both ends of a connection check before trusting each other
//!   (protocol, build, world, rank, plan fingerprint, the shared secret);
//! - [`env`]: where a node's rank, world size and master address come from (flags,
//!   torchrun, Slurm, Open MPI, PMI);
//! - [`control`]: the control plane rank 0 hosts: a key-value store and named barriers.
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

pub mod env;
pub mod frame;
pub mod handshake;
