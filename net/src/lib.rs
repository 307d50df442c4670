//! regflow's wire between nodes.
//!
//! - [`frame`]: bounded frames, the unit of everything sent between nodes;
//! - [`handshake`]: what both ends of a connection check before trusting each other
//!   (protocol, build, world, rank, plan fingerprint, the shared secret);
//! - [`env`](mod@env): where a node's rank, world size and master address come from (flags,
//!   torchrun, Slurm, Open MPI, PMI);
//! - [`control`]: the control plane rank 0 hosts: a key-value store and named barriers.
//!
//! A one-rank job on one host: rank 0 hosts the control plane and joins it itself.
//!
//! ```
//! use regflow_net::control::{ControlClient, ControlServer};
//! use regflow_net::handshake::{Identity, Secret};
//! use std::time::Duration;
//!
//! let me = Identity::new(0, 1, "");
//! let server = ControlServer::start("127.0.0.1:0".parse()?, me.clone(), Secret::none())?;
//! let master = server.local_addr().to_string();
//! let mut client = ControlClient::connect(&master, &me, &Secret::none(), Duration::from_secs(5))?;
//! client.set("plan", b"the serialized plan")?;
//! assert_eq!(client.get("plan", Duration::from_secs(5))?, b"the serialized plan");
//! client.barrier("start", Duration::from_secs(5))?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]
// Under `--cfg loom` the control plane (and the async handshake only it uses) is left out.
#![cfg_attr(loom, allow(dead_code))]

// tokio has no network under `--cfg loom` (the runtime's model-checking build); the
// control plane is not part of what loom checks.
#[cfg(not(loom))]
pub mod control;
pub mod env;
pub mod frame;
pub mod handshake;
