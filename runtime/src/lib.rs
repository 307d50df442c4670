//! The regflow runtime: one OS thread per stream, a message bus (local queue, crossbeam
//! inboxes, a remote route), devices behind one trait with asynchronous completion (`cpu`,
//! `sim`), the [`Job`] that runs a plan in-process, the watchdog and Chrome-trace timelines.
//!
//! ```
//! use regflow_plan::{ActorKind, DeviceKind, KernelConf, PlanBuilder, SourcePieces, StreamKind};
//! use regflow_runtime::Job;
//!
//! let mut b = PlanBuilder::new();
//! let cpu = b.device(0, DeviceKind::Cpu, 0);
//! let s = b.stream(cpu, StreamKind::Compute);
//! let src = b.actor("src", s, ActorKind::Source { pieces: SourcePieces::Count(3) });
//! let x = b.regst("src.out", src, 8, 2);
//! let sink = b.actor("sink", s, ActorKind::Sink);
//! b.consume(sink, x);
//! let mut job = Job::local(b.build().unwrap()).unwrap();
//! let fetcher = job.fetcher("sink").unwrap();
//! let pieces: Vec<u64> = std::iter::from_fn(|| fetcher.recv().map(|p| p.piece())).collect();
//! assert_eq!(pieces, [0, 1, 2]);
//! job.wait().unwrap();
//! ```
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

mod activity;
mod arenas;
mod bus;
mod collective;
mod data;
mod device;
mod error;
mod feeds;
mod finite;
mod inbox;
mod io;
mod job;
mod kernel;
mod lane;
mod net;
mod own_memory;
mod send_waits;
mod stream;
mod sync;
mod trace;
mod watchdog;

#[cfg(all(test, loom))]
mod loom_tests;

pub use collective::CollectiveMember;
pub use data::{RecordFile, ShuffledBatches};
pub use error::RuntimeError;
pub use feeds::{GraphFeeds, GraphFetcher, GraphFetches};
pub use io::{Feeder, Fetched, Fetcher};
pub use job::{Job, JobBuilder, JobReport, StatePart, DEFAULT_WATCHDOG, MAX_CPU_THREADS};
pub use kernel::{Kernel, KernelError, KernelFactory, KernelIo, KernelSpec, StreamContext};
#[cfg(not(loom))]
pub use net::ClusterSession;
pub use net::{Cluster, ClusterOptions, PeerLink, Transport, DEFAULT_SILENCE};
pub use regflow_kernels::KernelRegistry;
pub use regflow_net::env::ClusterEnv;
pub use regflow_net::handshake::Secret;
pub use stream::ActorStats;
pub use watchdog::{FullLane, RoomFrom, StuckActor, UserWait, Wait, WaitForGraph};
