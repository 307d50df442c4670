//! regflow's wire between nodes: bounded frames ([`frame`]).
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

pub mod frame;
