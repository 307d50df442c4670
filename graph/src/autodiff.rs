//! Reverse-mode autodiff on the logical graph: `graph.grad(loss, &wrt)` appends the
//! backward ops, built by each op's gradient rule with the same DSL, and returns the
//! gradient tensors. Gradients of a tensor used several times are summed.

use crate::dsl::{Graph, Tensor, TensorId};
use crate::ops::{Fill, GradCtx};
use crate::GraphError;
use std::collections::{HashMap, HashSet};

impl Graph {
    /// Gradients of the scalar `loss` with respect to each tensor of `wrt` (zeros where the
    /// loss does not depend on it).
    pub fn grad<'g>(&'g self, loss: Tensor<'g>, wrt: &[Tensor<'g>]) -> Result<Vec<Tensor<'g>>, GraphError> {
        let loss_meta = loss.meta();
        if loss_meta.shape.numel() != 1 {
            return Err(GraphError::NonScalarLoss(loss_meta.to_string()));
        }
        if !loss_meta.dtype.is_float() {
            return Err(GraphError::NonScalarLoss(format!("{loss_meta} (not a float)")));
        }
        // Only the ops that exist now: the backward ops appended below are not revisited.
        let nodes = self.nodes();
        let mut depends: HashSet<TensorId> = wrt.iter().map(|t| t.id()).collect();
        for node in &nodes {
            if node.inputs.iter().any(|i| depends.contains(i)) {
                depends.extend(node.outputs.iter().copied());
            }
        }
        let mut grads: HashMap<TensorId, Tensor<'g>> = HashMap::new();
        grads.insert(loss.id(), self.apply1(Fill::new(1.0, loss_meta), &[])?);
        for node in nodes.iter().rev() {
            let output_grads: Vec<Option<Tensor<'g>>> = node.outputs.iter().map(|o| grads.get(o).copied()).collect();
            if output_grads.iter().all(Option::is_none) || !node.inputs.iter().any(|i| depends.contains(i)) {
                continue;
            }
            let tensor = |id: TensorId| {
                self.tensor(id).ok_or_else(|| GraphError::Kernel {
                    op: "autodiff".into(),
                    message: format!("tensor {} missing (broken invariant)", id.0),
                })
            };
            let inputs = node.inputs.iter().map(|&i| tensor(i)).collect::<Result<Vec<_>, _>>()?;
            let outputs = node.outputs.iter().map(|&o| tensor(o)).collect::<Result<Vec<_>, _>>()?;
            let ctx = GradCtx { inputs: inputs.clone(), outputs, output_grads };
            let input_grads = node.op.grad(&ctx)?;
            for (index, (input, grad)) in inputs.iter().zip(input_grads).enumerate() {
                if !depends.contains(&input.id()) {
                    continue;
                }
                let Some(grad) = grad else {
                    if input.dtype().is_float() {
                        return Err(GraphError::NoGradient { op: node.op.name().into(), index });
                    }
                    continue;
                };
                // Under mixed precision a gradient rule may give a float input its gradient
                // in another float dtype (an f32 reduction of a bf16 gradient): it is cast
                // to the input's dtype, so every gradient has its tensor's meta.
                let grad = if grad.shape() == input.shape()
                    && grad.dtype() != input.dtype()
                    && grad.dtype().is_float()
                    && input.dtype().is_float()
                {
                    grad.cast(input.dtype())?
                } else {
                    grad
                };
                if grad.meta() != input.meta() {
                    return Err(GraphError::Kernel {
                        op: node.op.name().into(),
                        message: format!(
                            "gradient rule gave input {index} a gradient of {}, but the input is {} (broken invariant)",
                            grad.meta(),
                            input.meta()
                        ),
                    });
                }
                let total = match grads.get(&input.id()) {
                    Some(previous) => previous.add(&grad)?,
                    None => grad,
                };
                grads.insert(input.id(), total);
            }
        }
        wrt.iter()
            .map(|w| match grads.get(&w.id()) {
                Some(g) => Ok(*g),
                None => self.apply1(Fill::new(0.0, w.meta()), &[]),
            })
            .collect()
    }
}
