//! [`StateDict`]: every variable of a job (weights and optimizer state) by name, read back
//! from a finished job, saved and loaded as safetensors, and preloaded into a new job.

use super::TrainError;
use regflow_graph::checkpoint::{self, suggest};
use regflow_plan::HostArray;
use regflow_runtime::{JobBuilder, JobReport};
use std::path::Path;

/// Named tensors: a job's variables (weights, AdamW moments, the step counter) by the
/// names the graph gave them, in the order they were inserted (a job's: the plan's).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StateDict {
    tensors: Vec<(String, HostArray)>,
}

impl StateDict {
    /// An empty state dict.
    pub fn new() -> Self {
        Self::default()
    }

    /// The state a job built with [`JobBuilder::keep_state`] read when it ended; an error
    /// saying how to ask for it otherwise.
    pub fn from_report(report: &JobReport) -> Result<Self, TrainError> {
        let tensors = report.state.clone().ok_or(TrainError::NoState)?;
        Ok(Self { tensors })
    }

    /// Reads a safetensors file (as [`StateDict::save`] writes it); tensors sorted by name.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, TrainError> {
        Ok(Self { tensors: checkpoint::load(path.as_ref())? })
    }

    /// Writes every tensor to a safetensors file.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), TrainError> {
        Ok(checkpoint::save(path.as_ref(), &self.tensors)?)
    }

    /// The value of `name`.
    pub fn get(&self, name: &str) -> Option<&HostArray> {
        self.tensors.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }

    /// Sets the value of `name`, returning the one it replaces.
    pub fn insert(&mut self, name: impl Into<String>, value: HostArray) -> Option<HostArray> {
        let name = name.into();
        match self.tensors.iter_mut().find(|(n, _)| *n == name) {
            Some((_, old)) => Some(std::mem::replace(old, value)),
            None => {
                self.tensors.push((name, value));
                None
            }
        }
    }

    /// Removes `name`, returning its value.
    pub fn remove(&mut self, name: &str) -> Option<HostArray> {
        let position = self.tensors.iter().position(|(n, _)| n == name)?;
        Some(self.tensors.remove(position).1)
    }

    /// The names, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.iter().map(|(n, _)| n.as_str())
    }

    /// `(name, value)` pairs, in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &HostArray)> {
        self.tensors.iter().map(|(n, v)| (n.as_str(), v))
    }

    /// How many tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether it holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The `(name, value)` pairs.
    pub fn into_tensors(self) -> Vec<(String, HostArray)> {
        self.tensors
    }
}

impl From<Vec<(String, HostArray)>> for StateDict {
    fn from(tensors: Vec<(String, HostArray)>) -> Self {
        let mut state = Self::new();
        for (name, value) in tensors {
            state.insert(name, value);
        }
        state
    }
}

/// `report.state_dict()`: a finished job's variables as a [`StateDict`].
pub trait ReportState {
    /// The final value of every variable, when the job was built with
    /// [`JobBuilder::keep_state`]; [`TrainError::NoState`] otherwise.
    fn state_dict(&self) -> Result<StateDict, TrainError>;
}

impl ReportState for JobReport {
    fn state_dict(&self) -> Result<StateDict, TrainError> {
        StateDict::from_report(self)
    }
}

/// What a non-strict [`LoadStateDict::load_state_dict`] did not load.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Skipped {
    /// Variables of the plan the state dict has no value for: they start from their
    /// initializers.
    pub missing: Vec<String>,
    /// Tensors of the state dict the plan has no variable for: ignored.
    pub unexpected: Vec<String>,
}

impl Skipped {
    /// Whether everything matched.
    pub fn is_empty(&self) -> bool {
        self.missing.is_empty() && self.unexpected.is_empty()
    }
}

impl std::fmt::Display for Skipped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list = |names: &[String]| names.iter().map(|n| format!("'{n}'")).collect::<Vec<_>>().join(", ");
        match (self.missing.is_empty(), self.unexpected.is_empty()) {
            (true, true) => write!(f, "nothing skipped"),
            (false, true) => write!(f, "no value for {}", list(&self.missing)),
            (true, false) => write!(f, "ignored {}", list(&self.unexpected)),
            (false, false) => write!(f, "no value for {}; ignored {}", list(&self.missing), list(&self.unexpected)),
        }
    }
}

/// `Job::builder(plan).load_state_dict(&state, strict)`: preloads a job's variables.
pub trait LoadStateDict: Sized {
    /// Preloads every variable of the plan that `state` has a value for. `strict` refuses
    /// a variable without a value and a tensor that is no variable, listing the nearest
    /// valid names; otherwise those are skipped and returned. A value of another dtype or
    /// shape than its variable is refused either way.
    fn load_state_dict(self, state: &StateDict, strict: bool) -> Result<(Self, Skipped), TrainError>;
}

impl LoadStateDict for JobBuilder {
    fn load_state_dict(mut self, state: &StateDict, strict: bool) -> Result<(Self, Skipped), TrainError> {
        let variables = self.variables();
        let mut skipped = Skipped::default();
        for (name, meta) in &variables {
            match state.get(name) {
                Some(value) if value.meta() != *meta => {
                    return Err(TrainError::Mismatch {
                        variable: name.clone(),
                        expected: meta.clone(),
                        got: value.meta(),
                    })
                }
                Some(_) => {}
                None => skipped.missing.push(name.clone()),
            }
        }
        let known: Vec<&str> = variables.iter().map(|(n, _)| n.as_str()).collect();
        skipped.unexpected = state.names().filter(|n| !known.contains(n)).map(str::to_string).collect();
        if strict {
            // A renamed variable is both missing and unexpected: each names the other first.
            if let Some(first) = skipped.missing.first() {
                let unexpected: Vec<&str> = skipped.unexpected.iter().map(String::as_str).collect();
                let names: Vec<&str> = if unexpected.is_empty() { state.names().collect() } else { unexpected };
                let hint = suggest(first, &names, "tensors");
                return Err(TrainError::MissingVariables { variables: skipped.missing, hint });
            }
            if let Some(first) = skipped.unexpected.first() {
                let hint = suggest(first, &known, "variables");
                return Err(TrainError::UnexpectedTensors { tensors: skipped.unexpected, hint });
            }
        }
        for (name, _) in &variables {
            if let Some(value) = state.get(name) {
                self = self.preload_variable(name, value.clone());
            }
        }
        Ok((self, skipped))
    }
}
