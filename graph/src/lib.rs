//! The logical side of regflow: this issue provides the [`plan`] module, the physical plan
//! of actors, register descriptors, streams and memory that the runtime executes.
//!
//! The DSL, autodiff, SBP and the compiler that produce plans arrive in later issues; until
//! then plans are built by hand with [`plan::PlanBuilder`] or loaded from JSON.
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

pub mod plan;
