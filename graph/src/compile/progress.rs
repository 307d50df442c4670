//! Progress: the proof that an emitted plan runs. The plan's own actors are run serially
//! for two steps (`regflow_actors::check_progress`); a wait-for cycle its register counts
//! allow is a compile error naming the actors, the registers and the option that sizes them.

use super::error::CompileError;
use super::options::ParallelOptions;
use crate::plan::Plan;
use regflow_actors::{check_progress, ProgressError};

/// Two steps go once around every loop (the second reads what the first wrote).
const STEPS: u64 = 2;

/// Checks that `plan` makes progress under `options`.
pub(crate) fn prove(plan: &Plan, options: &ParallelOptions) -> Result<(), CompileError> {
    match check_progress(plan, STEPS) {
        Ok(_) => Ok(()),
        Err(ProgressError::Deadlock(deadlock)) => {
            // Registers on the cycle that a fed source writes: their slots are `input_register_num`.
            let fed = |name: &str| {
                plan.regst_descs.iter().any(|d| {
                    d.name == name
                        && matches!(plan.actors[d.producer.index()].kind, crate::plan::ActorKind::Source { .. })
                })
            };
            let mut inputs: Vec<&str> = deadlock.registers().map(|(r, _)| r).filter(|r| fed(r)).collect();
            inputs.dedup();
            let hint = if inputs.is_empty() {
                format!(
                    "its registers hold `activation_register_num` = {} slot(s) unless the compiler sized them",
                    options.activation_register_num
                )
            } else {
                format!(
                    "the fed input register(s) '{}' hold `input_register_num` = {} slot(s)",
                    inputs.join("', '"),
                    options.input_register_num
                )
            };
            Err(CompileError::WouldDeadlock { report: deadlock.to_string(), hint: Some(hint) })
        }
        Err(other) => Err(CompileError::WouldDeadlock { report: other.to_string(), hint: None }),
    }
}
