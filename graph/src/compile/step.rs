//! The step being compiled, as the facts every pass reads: which tensors it needs, which
//! change with the inputs, which the fetches need, how often each is computed, and which
//! input paces it.

use super::error::{nearest, CompileError};
use super::options::ParallelOptions;
use crate::dsl::{ancestors, paced, Graph, Node, Tensor, TensorId, TensorSource};
use std::collections::HashMap;

/// How often a register gets a piece: once per micro-batch or once per optimizer step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Rate {
    Micro,
    Step,
}

/// The logical facts of one step.
#[derive(Debug)]
pub(crate) struct StepFacts {
    /// The graph's op applications, in graph order.
    pub(crate) nodes: Vec<Node>,
    /// The fetched tensors, in fetch order.
    pub(crate) fetch: Vec<TensorId>,
    /// `(variable, its next value)`.
    pub(crate) updates: Vec<(TensorId, TensorId)>,
    /// The inputs a dataset source produces, in its output order.
    pub(crate) dataset: Vec<TensorId>,
    /// The input whose pieces pace the step: the dataset's first, or the first fed input.
    pub(crate) tick: TensorId,
    /// Micro-batches per step (1 without accumulation).
    pub(crate) micro_batches: u32,
    needed: Vec<bool>,
    paced: Vec<bool>,
    forward: Vec<bool>,
    /// Fetched or an input of a needed op.
    read: Vec<bool>,
    rate: Vec<Rate>,
    update_of: HashMap<TensorId, TensorId>,
}

impl StepFacts {
    /// The facts of the step that fetches `fetch` and applies `updates`.
    pub(crate) fn new(
        graph: &Graph,
        fetch: &[Tensor<'_>],
        updates: &[(Tensor<'_>, Tensor<'_>)],
        options: &ParallelOptions,
    ) -> Result<Self, CompileError> {
        let nodes = graph.nodes();
        let count = graph.tensor_count();
        let dataset = dataset_inputs(graph, options)?;
        let roots = fetch.iter().chain(updates.iter().map(|(_, new)| new)).map(|t| t.id());
        // A dataset source produces all of its inputs, read or not.
        let needed = ancestors(&nodes, count, roots.chain(dataset.iter().copied()));
        let is_input = |i: usize| matches!(graph.info(TensorId(i as u32)).source, TensorSource::Input);
        let tick = dataset
            .first()
            .copied()
            .or_else(|| (0..count).find(|&i| needed[i] && is_input(i)).map(|i| TensorId(i as u32)))
            .ok_or(CompileError::NoInput)?;
        let paced = paced(graph, &nodes, count);
        let forward = ancestors(&nodes, count, fetch.iter().map(|t| t.id()));
        let micro_batches = options.micro_batch_count();
        let updated: std::collections::HashSet<TensorId> = updates.iter().map(|(v, _)| v.id()).collect();
        let rate = rates(graph, &nodes, &paced, fetch, &updated, options);
        let mut read = vec![false; count];
        for node in nodes.iter().filter(|node| node.outputs.iter().any(|o| needed[o.0 as usize])) {
            for i in &node.inputs {
                read[i.0 as usize] = true;
            }
        }
        for t in fetch {
            read[t.id().0 as usize] = true;
        }
        Ok(Self {
            fetch: fetch.iter().map(|t| t.id()).collect(),
            updates: updates.iter().map(|(v, new)| (v.id(), new.id())).collect(),
            update_of: updates.iter().map(|(v, new)| (v.id(), new.id())).collect(),
            nodes,
            dataset,
            tick,
            micro_batches,
            needed,
            paced,
            forward,
            read,
            rate,
        })
    }

    /// Whether the step needs tensor `t`.
    pub(crate) fn needed(&self, t: TensorId) -> bool {
        self.needed[t.0 as usize]
    }

    /// The tensors the step needs, in graph order.
    pub(crate) fn needed_tensors(&self) -> impl Iterator<Item = TensorId> + '_ {
        (0..self.needed.len()).filter(|&i| self.needed[i]).map(|i| TensorId(i as u32))
    }

    /// The op applications the step needs (some output is needed), with their node index.
    pub(crate) fn needed_nodes(&self) -> impl Iterator<Item = (usize, &Node)> + '_ {
        self.nodes.iter().enumerate().filter(|(_, node)| node.outputs.iter().any(|o| self.needed(*o)))
    }

    /// Whether `t` changes with the fed inputs (if not, what computes it is paced by a tick).
    pub(crate) fn paced(&self, t: TensorId) -> bool {
        self.paced[t.0 as usize]
    }

    /// Whether the fetches need `t` (the forward pass).
    pub(crate) fn forward(&self, t: TensorId) -> bool {
        self.forward[t.0 as usize]
    }

    /// How often `t` is computed.
    pub(crate) fn rate(&self, t: TensorId) -> Rate {
        self.rate[t.0 as usize]
    }

    /// The next value of variable `t`, if the step updates it.
    pub(crate) fn update_of(&self, t: TensorId) -> Option<TensorId> {
        self.update_of.get(&t).copied()
    }

    /// Whether the step itself reads `t` (fetches it or feeds it to an op it runs).
    pub(crate) fn read_in_step(&self, t: TensorId) -> bool {
        self.read[t.0 as usize]
    }

    /// Where `t`'s value becomes available in graph order: its producing node + 1, or 0
    /// for inputs and variables (the first key of the collective order).
    pub(crate) fn ready_at(&self, graph: &Graph, t: TensorId) -> usize {
        match graph.info(t).source {
            TensorSource::Op { node, .. } => node + 1,
            TensorSource::Input | TensorSource::Variable { .. } => 0,
        }
    }
}

/// The inputs the dataset options name, checked to be inputs of the graph.
fn dataset_inputs(graph: &Graph, options: &ParallelOptions) -> Result<Vec<TensorId>, CompileError> {
    let Some(dataset) = &options.dataset else { return Ok(Vec::new()) };
    if dataset.inputs.is_empty() {
        return Err(CompileError::EmptyDataset);
    }
    let inputs: Vec<String> = (0..graph.tensor_count())
        .map(|i| graph.info(TensorId(i as u32)))
        .filter(|info| matches!(info.source, TensorSource::Input))
        .map(|info| info.name)
        .collect();
    dataset
        .inputs
        .iter()
        .map(|name| {
            graph
                .by_name(name)
                .filter(|t| matches!(graph.info(t.id()).source, TensorSource::Input))
                .map(|t| t.id())
                .ok_or_else(|| CompileError::DatasetInput {
                    name: name.clone(),
                    nearest: nearest(name, inputs.iter().map(String::as_str)),
                })
        })
        .collect()
}

/// The rate of every tensor. With one micro-batch per step everything runs at one rate.
/// Under accumulation a tensor runs per micro-batch if the fetches or the raw gradients
/// need it and it changes with the inputs or is an op output (constants the micro-batches
/// need, such as the loss gradient's seed: paced per step they would wait for a whole
/// step of inputs, which a pipeline's registers cannot hold); fed inputs always do, and so
/// do variables nobody updates (constant registers, handed out without a copy). The rest
/// (updated variables, clipping, the schedule, the updates) runs once per step.
fn rates(
    graph: &Graph,
    nodes: &[Node],
    paced: &[bool],
    fetch: &[Tensor<'_>],
    updated: &std::collections::HashSet<TensorId>,
    options: &ParallelOptions,
) -> Vec<Rate> {
    let count = paced.len();
    let Some(acc) = options.accumulate.as_ref().filter(|a| a.micro_batches > 1) else {
        return vec![Rate::Micro; count];
    };
    let wanted = ancestors(nodes, count, fetch.iter().map(|t| t.id()).chain(acc.gradients.iter().copied()));
    (0..count)
        .map(|i| {
            let id = TensorId(i as u32);
            let source = graph.info(id).source;
            // A variable nobody updates is a constant register handed out without a copy:
            // per micro-batch it costs nothing, and it needs no step's worth of inputs first
            // (paced per step, it waits for a whole step of ticks while the micro-batches
            // that would make them hold the input registers).
            let constant = matches!(source, TensorSource::Variable { .. }) && !updated.contains(&id);
            let micro = matches!(source, TensorSource::Input)
                || wanted[i] && (paced[i] || constant || matches!(source, TensorSource::Op { .. }));
            if micro {
                Rate::Micro
            } else {
                Rate::Step
            }
        })
        .collect()
}
