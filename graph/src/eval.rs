//! A reference evaluator: runs a graph on the host, op by op, with the ops' own host
//! computations. It is the ground truth for gradient checks and for the compiled plans.

use crate::dsl::{Graph, Tensor, TensorSource};
use crate::plan::{HostArray, HostTensor, HostTensorMut};
use crate::GraphError;

impl Graph {
    /// Evaluates `fetch` given values for inputs (and optionally variables, which otherwise
    /// take their initial value).
    pub fn eval(&self, feeds: &[(Tensor<'_>, HostArray)], fetch: &[Tensor<'_>]) -> Result<Vec<HostArray>, GraphError> {
        let count = self.tensor_count();
        let mut values: Vec<Option<HostArray>> = vec![None; count];
        for (tensor, value) in feeds {
            let info = self.info(tensor.id());
            if !matches!(info.source, TensorSource::Input | TensorSource::Variable { .. }) {
                return Err(GraphError::Feed { name: info.name, message: "is not an input or a variable".into() });
            }
            if value.meta() != info.meta {
                return Err(GraphError::Feed {
                    name: info.name,
                    message: format!("got {}, expected {}", value.meta(), info.meta),
                });
            }
            values[tensor.id().0 as usize] = Some(value.clone());
        }
        // Which tensors the fetches need.
        let nodes = self.nodes();
        let mut needed = vec![false; count];
        for t in fetch {
            needed[t.id().0 as usize] = true;
        }
        for node in nodes.iter().rev() {
            if node.outputs.iter().any(|o| needed[o.0 as usize]) {
                for i in &node.inputs {
                    needed[i.0 as usize] = true;
                }
            }
        }
        for (i, value) in values.iter_mut().enumerate() {
            if !needed[i] || value.is_some() {
                continue;
            }
            let info = self.info(crate::dsl::TensorId(i as u32));
            match info.source {
                TensorSource::Input => return Err(GraphError::MissingFeed(info.name)),
                TensorSource::Variable { init, .. } => *value = Some(init.value(&info.meta)),
                TensorSource::Op { .. } => {}
            }
        }
        for node in &nodes {
            if !node.outputs.iter().any(|o| needed[o.0 as usize]) {
                continue;
            }
            let mut outputs: Vec<HostArray> =
                node.outputs.iter().map(|o| HostArray::zeros(&self.info(*o).meta)).collect();
            {
                let inputs: Vec<HostTensor<'_>> = node
                    .inputs
                    .iter()
                    .map(|i| {
                        values[i.0 as usize].as_ref().map(HostArray::view).ok_or_else(|| GraphError::Kernel {
                            op: node.op.name().into(),
                            message: format!("input tensor {} has no value (broken invariant)", i.0),
                        })
                    })
                    .collect::<Result<_, _>>()?;
                let mut views: Vec<HostTensorMut<'_>> = outputs.iter_mut().map(HostArray::view_mut).collect();
                // bf16 tensors compute widened to f32, as on the job's kernels.
                regflow_kernels::compute_once(&*node.op, &regflow_kernels::HostContext::default(), &inputs, &mut views)
                    .map_err(|message| GraphError::Kernel { op: node.op.name().into(), message })?;
            }
            for (o, value) in node.outputs.iter().zip(outputs) {
                values[o.0 as usize] = Some(value);
            }
        }
        fetch
            .iter()
            .map(|t| {
                values[t.id().0 as usize].clone().ok_or_else(|| GraphError::Kernel {
                    op: "eval".into(),
                    message: format!("fetched tensor '{}' was not computed (broken invariant)", t.name()),
                })
            })
            .collect()
    }
}
