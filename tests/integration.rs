//! The root crate's integration tests in one binary, one module per file of this folder
//! (`cargo test --test integration boxing::` runs one file's).
//!
//! One binary rather than one per file: each of the 48 linked the whole workspace and
//! compiled its own copies of the same generic code, about 210 s of CPU in a fresh CI
//! build for what two crates compile in half of that. Tests here share a process, so a
//! test that changes process-wide state (the products' backend, the instruction-set cap,
//! environment variables, CUDA dry runs) does not belong here:
//! - `cuda_plans.rs` holds the files whose tests run `cuda` plans on a GPU or, without one,
//!   dry (`regflow::cuda::enable_dry_run` is process-wide; here a `cuda` plan must be
//!   refused, `kernel_registry`);
//! - `steady_state_alloc` installs a counting global allocator for the whole process;
//! - `bad_input` is a crate of its own modules, and `serve_http` (axum, tokio) builds
//!   beside the others.
//!
//! A test that starts this binary again as a child names itself with
//! [`common::rank_args`], which adds the module's path.

// Helpers shared by the modules, each compiled once (each allows its own dead code).
mod common;
#[allow(dead_code)] // the GPT-2 benchmark's and the pipeline examples' parts go unused here
#[path = "../examples/common/gpt.rs"]
mod gpt;
#[path = "common/small_mlp.rs"]
mod small_mlp;
#[path = "common/tiny_gpt_runs.rs"]
mod tiny_gpt_runs;
#[path = "common/tiny_mlp.rs"]
mod tiny_mlp;

mod accumulation;
mod boxing;
mod check_finite;
mod checkpoint;
mod cli;
mod collectives_on_compute;
mod compile_orders;
mod compiled_training;
mod constant_variables;
mod fused_casts;
mod fused_norms;
mod fused_updates;
mod fuzz_loaders;
mod in_place_updates;
mod job_io;
mod kernel_registry;
mod launch;
mod loops;
mod loss_scaling;
mod memory_reuse;
mod mixed_precision;
mod nodes;
mod one_compiler;
mod parallel_errors;
mod parallel_overlap;
mod parallel_random_layouts;
mod parallel_training;
mod pipeline;
mod plan_errors;
mod progress;
mod random_dags;
mod reshape_views;
mod restart;
mod run_plan;
mod sharded_checkpoint;
mod smoke;
mod trace;
mod trace_merge;
mod training_api;
mod user_waits;
mod watchdog;
mod zero_buckets;
