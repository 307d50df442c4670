//! The root crate's tests of `cuda` plans, one module per file, in one binary: each runs
//! its plans on a GPU or, without one, dry (`regflow::cuda::enable_dry_run`, process-wide,
//! so they cannot share the process of `integration.rs`, which checks that a `cuda` plan is
//! refused without a GPU). `cargo test --test cuda_plans cuda_training::` runs one file's.

// Helpers shared by the modules, each compiled once (each allows its own dead code).
mod common;
#[allow(dead_code)] // the GPT-2 benchmark's and the pipeline examples' parts go unused here
#[path = "../examples/common/gpt.rs"]
mod gpt;
#[path = "common/tiny_gpt_runs.rs"]
mod tiny_gpt_runs;

mod cuda_invariants;
mod cuda_training;
mod data_source;
mod folded_casts;
mod folded_norms;
mod folded_table_grads;
