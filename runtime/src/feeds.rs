//! Typed feeds of a plan's signature: each logical value is checked against the input's
//! shape and dtype, cut into its devices' parts by the regions the plan records, and
//! pushed to each part's fed source.

use crate::{Feeder, Job, RuntimeError};
use regflow_plan::{HostArray, Region, TensorMeta};

/// Typed feeds of every input of a plan's signature.
#[derive(Debug)]
pub struct GraphFeeds {
    inputs: Vec<FedInput>,
}

#[derive(Debug)]
struct FedInput {
    name: String,
    meta: TensorMeta,
    /// Each part's region and its source's feeder.
    parts: Vec<(Region, Feeder)>,
}

impl Job {
    /// Takes the feeders of every input of the plan's signature, for typed pushes of whole
    /// (logical) values.
    pub fn graph_feeds(&mut self) -> Result<GraphFeeds, RuntimeError> {
        let signature = self.plan().signature.inputs.clone();
        let mut inputs = Vec::with_capacity(signature.len());
        for input in signature {
            let mut parts = Vec::with_capacity(input.parts.len());
            for part in input.parts {
                let name = self.plan().actors[part.actor.index()].name.clone();
                parts.push((part.region, self.feeder(&name)?));
            }
            inputs.push(FedInput { name: input.name, meta: input.meta, parts });
        }
        Ok(GraphFeeds { inputs })
    }
}

impl GraphFeeds {
    /// The inputs' names and metas, in the plan's order.
    pub fn inputs(&self) -> impl Iterator<Item = (&str, &TensorMeta)> {
        self.inputs.iter().map(|i| (i.name.as_str(), &i.meta))
    }

    /// Pushes the next value of input `name`.
    pub fn push(&mut self, name: &str, value: &HostArray) -> Result<(), RuntimeError> {
        let Some(input) = self.inputs.iter_mut().find(|i| i.name == name) else {
            let known: Vec<&str> = self.inputs.iter().map(|i| i.name.as_str()).collect();
            return Err(RuntimeError::Feed {
                input: name.to_string(),
                message: format!("the graph has no such input (inputs: {})", known.join(", ")),
            });
        };
        if value.meta() != input.meta {
            return Err(RuntimeError::Feed {
                input: name.to_string(),
                message: format!("got {}, expected {}", value.meta(), input.meta),
            });
        }
        if let [(region, feeder)] = input.parts.as_mut_slice() {
            if !region.zeros && region.shape == input.meta.shape.dims() {
                return feeder.push(&value.to_le_bytes());
            }
        }
        for (region, feeder) in &mut input.parts {
            feeder.push(&region.cut(value).to_le_bytes())?;
        }
        Ok(())
    }

    /// Ends every input: the job finishes once the pushed steps are through.
    pub fn close(&mut self) -> Result<(), RuntimeError> {
        for input in &mut self.inputs {
            for (_, feeder) in &mut input.parts {
                feeder.close()?;
            }
        }
        Ok(())
    }
}
