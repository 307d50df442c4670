//! A host session: keeps variable values between steps and runs a graph with the
//! reference evaluator. It is the ground truth the compiled plans are compared with, and
//! a small trainer in its own right.

use crate::dsl::{Graph, Tensor, TensorId, TensorSource};
use crate::optim::TrainStep;
use crate::plan::HostArray;
use crate::GraphError;
use std::collections::HashMap;

/// Variable values of one graph, carried from step to step.
#[derive(Debug)]
pub struct Session<'g> {
    graph: &'g Graph,
    values: HashMap<TensorId, HostArray>,
}

impl<'g> Session<'g> {
    /// A session whose variables start at their initializers.
    pub fn new(graph: &'g Graph) -> Self {
        Self { graph, values: HashMap::new() }
    }

    fn variable_value(&mut self, var: Tensor<'g>) -> Result<&HostArray, GraphError> {
        let info = self.graph.info(var.id());
        let TensorSource::Variable { init, .. } = &info.source else {
            return Err(GraphError::Feed { name: info.name, message: "is not a variable".into() });
        };
        Ok(self.values.entry(var.id()).or_insert_with(|| init.value(&info.meta)))
    }

    /// Its graph.
    pub fn graph(&self) -> &'g Graph {
        self.graph
    }

    /// The current value of a variable.
    pub fn value(&mut self, var: Tensor<'g>) -> Result<HostArray, GraphError> {
        self.variable_value(var).cloned()
    }

    /// Overwrites a variable (loading a checkpoint, tests).
    pub fn set(&mut self, var: Tensor<'g>, value: HostArray) -> Result<(), GraphError> {
        let info = self.graph.info(var.id());
        if !matches!(info.source, TensorSource::Variable { .. }) {
            return Err(GraphError::Feed { name: info.name, message: "is not a variable".into() });
        }
        if value.meta() != info.meta {
            return Err(GraphError::Feed {
                name: info.name,
                message: format!("got {}, expected {}", value.meta(), info.meta),
            });
        }
        self.values.insert(var.id(), value);
        Ok(())
    }

    /// Evaluates `fetch` with the inputs in `feeds` and the current variable values.
    pub fn run(
        &mut self,
        feeds: &[(Tensor<'g>, HostArray)],
        fetch: &[Tensor<'g>],
    ) -> Result<Vec<HostArray>, GraphError> {
        let mut all: Vec<(Tensor<'g>, HostArray)> = feeds.to_vec();
        for i in 0..self.graph.tensor_count() {
            let Some(t) = self.graph.tensor(TensorId(i as u32)) else { continue };
            if matches!(self.graph.info(t.id()).source, TensorSource::Variable { .. })
                && !feeds.iter().any(|(f, _)| f.id() == t.id())
            {
                let value = self.variable_value(t)?.clone();
                all.push((t, value));
            }
        }
        self.graph.eval(&all, fetch)
    }

    /// Runs one training step: returns the loss and assigns every update.
    pub fn step(&mut self, train: &TrainStep<'g>, feeds: &[(Tensor<'g>, HostArray)]) -> Result<f64, GraphError> {
        let mut fetch = vec![train.loss];
        fetch.extend(train.updates.iter().map(|(_, new)| *new));
        let mut values = self.run(feeds, &fetch)?.into_iter();
        let loss = values.next().map(|l| l.to_f64_vec()[0]).unwrap_or(f64::NAN);
        for ((var, _), value) in train.updates.iter().zip(values) {
            self.values.insert(var.id(), value);
        }
        Ok(loss)
    }
}
