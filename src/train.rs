//! Training a compiled graph: the state of a finished job as a [`StateDict`] (saved and
//! loaded as safetensors), [`Trainer`] (a loop with a progress bar, evaluations and
//! checkpoints that returns the loss [`History`]) and loss curves as PNG or SVG
//! ([`save_loss_plot`]). The guide below is `docs/training.md`; its code runs as doctests.
//!
#![doc = include_str!("../docs/training.md")]

mod plot;
pub mod sharded;
mod state;
mod trainer;

pub use plot::save_loss_plot;
pub use state::{LoadStateDict, ReportState, Skipped, StateDict};
pub use trainer::{Evaluation, History, Trainer};

use regflow_graph::checkpoint::CheckpointError;
use regflow_plan::TensorMeta;
use regflow_runtime::RuntimeError;

/// An error a hook or a batch closure returns, kept as its sentence.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why training, saving or loading state failed: a sentence naming the step, the variable,
/// the file or the option at fault.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The job failed (its error names the actor, input or output).
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// A checkpoint file could not be written or read.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The job was built without [`JobBuilder::keep_state`](regflow_runtime::JobBuilder::keep_state).
    #[error("the job report holds no state: build the job with JobBuilder::keep_state() to read its variables back")]
    NoState,
    /// A strict load found variables of the plan the state dict has no value for.
    #[error("strict load: the state dict has no value for {} variable(s) of the plan: {}{hint}", .variables.len(), quoted(.variables))]
    MissingVariables {
        /// The variables without a value.
        variables: Vec<String>,
        /// The names in the state dict nearest the first of them (`; did you mean 'w1'?`).
        hint: String,
    },
    /// A strict load found tensors in the state dict that are no variable of the plan.
    #[error("strict load: the state dict holds {} tensor(s) that are no variable of the plan: {}{hint}", .tensors.len(), quoted(.tensors))]
    UnexpectedTensors {
        /// The tensors the plan has no variable for.
        tensors: Vec<String>,
        /// The plan's variables nearest the first of them.
        hint: String,
    },
    /// A value whose dtype or shape is not its variable's (strict or not).
    #[error("variable '{variable}' is {expected}, the state dict's value is {got}")]
    Mismatch {
        /// The variable.
        variable: String,
        /// Its dtype and shape in the plan.
        expected: TensorMeta,
        /// The value's.
        got: TensorMeta,
    },
    /// The batch closure failed.
    #[error("the batch of step {step}: {message}")]
    Batch {
        /// The step.
        step: u64,
        /// What the closure said.
        message: String,
    },
    /// The evaluation hook failed.
    #[error("the evaluation after step {step}: {message}")]
    Eval {
        /// The step.
        step: u64,
        /// What the hook said.
        message: String,
    },
    /// The job delivered fewer losses than the steps it was given.
    #[error("the training job ended after {delivered} of {expected} steps (from step {first}) without an error")]
    EndedEarly {
        /// The first step of the job.
        first: u64,
        /// Losses delivered.
        delivered: u64,
        /// Steps the job was given.
        expected: u64,
    },
    /// A [`Trainer`] option or plan that cannot work, named.
    #[error("trainer: {0}")]
    Options(String),
    /// A sharded checkpoint cannot be saved as asked (a rank outside the world, a directory
    /// that holds a checkpoint already, a part that does not fit its tensor).
    #[error("sharded checkpoint '{path}': {problem}")]
    ShardSave {
        /// The directory or file.
        path: String,
        /// Why.
        problem: String,
    },
    /// Rank 0 waited in vain for other ranks to write their parts of a sharded checkpoint.
    #[error("sharded checkpoint '{path}': rank 0 waited {waited:?} for the parts of rank(s) {missing:?}, which never wrote their rank<r>.json (did they fail, or save into another directory?)")]
    RanksMissing {
        /// The checkpoint directory.
        path: String,
        /// The ranks whose lists never appeared.
        missing: Vec<u32>,
        /// How long rank 0 waited.
        waited: std::time::Duration,
    },
    /// A sharded checkpoint's `index.json` (or a rank's list) is missing, is not JSON or
    /// does not describe a checkpoint.
    #[error("sharded checkpoint index '{path}': {problem}")]
    ShardIndex {
        /// The file.
        path: String,
        /// What is wrong, naming the tensor where one is at fault.
        problem: String,
    },
    /// A shard file is missing, cut short or corrupt, or does not hold what the index says.
    #[error("sharded checkpoint shard '{path}': {problem}")]
    ShardFile {
        /// The file.
        path: String,
        /// What is wrong, naming the tensor where one is at fault.
        problem: String,
    },
    /// No part of a sharded checkpoint holds some elements of a tensor.
    #[error("sharded checkpoint '{path}': no part holds elements {region} of tensor '{tensor}' ({missing} of its {total} elements)")]
    ShardCoverage {
        /// The checkpoint directory.
        path: String,
        /// The tensor.
        tensor: String,
        /// The box that holds every element without a part (`[0..2, 8..16]`).
        region: String,
        /// How many elements have no part.
        missing: usize,
        /// The tensor's elements.
        total: usize,
    },
    /// A plot could not be drawn or written.
    #[error("loss plot '{path}': {message}")]
    Plot {
        /// The file.
        path: String,
        /// Why.
        message: String,
    },
}

/// `'a', 'b'` (the first five, then how many more).
fn quoted(names: &[String]) -> String {
    let listed: Vec<String> = names.iter().take(5).map(|n| format!("'{n}'")).collect();
    let more = if names.len() > 5 { format!(" and {} more", names.len() - 5) } else { String::new() };
    format!("{}{more}", listed.join(", "))
}
