//! Layouts: the SBP signature of every op on every mesh axis. Pinned layouts are kept;
//! otherwise each op takes the signature whose input boxing moves the fewest bytes, then
//! the one that leaves each device the least to compute, then the first listed. On one
//! device (`Scope::OneDevice`) pins are ignored and everything is `Broadcast`.

use super::boxing;
use super::error::{CompileError, NoSignature};
use super::options::{ParallelOptions, Scope};
use super::placement::Placement;
use super::step::StepFacts;
use crate::dsl::{Graph, Node, TensorId, TensorSource};
use crate::ops::{LocalContext, OpDef};
use crate::plan::TensorMeta;
use crate::sbp::{local_region, Mesh, NdSbp, Sbp, SbpSignature};
use std::collections::HashMap;
use std::sync::Arc;

/// How many bytes moved cost as much as one arithmetic operation: a core does tens of
/// GFLOP/s in a product, and an in-process collective moves a few GB/s per member.
const BYTES_PER_FLOP: f64 = 0.1;

/// An op's layouts on every mesh axis.
#[derive(Debug, Clone)]
pub(crate) struct NdSignature {
    /// Layout of each input.
    pub inputs: Vec<NdSbp>,
    /// Layout of each output.
    pub outputs: Vec<NdSbp>,
}

/// Layouts of the tensors of one step.
#[derive(Debug, Default)]
pub(crate) struct Layouts {
    /// Layout each tensor is produced in.
    pub produced: HashMap<TensorId, NdSbp>,
    /// Layout consumers see (after a `follow` conversion).
    pub visible: HashMap<TensorId, NdSbp>,
    /// The signature of each op node.
    pub signatures: HashMap<usize, NdSignature>,
    /// The op each device of a node's mesh runs, by rank, with its local shapes (made
    /// while checking the signature fits).
    pub local: HashMap<usize, Vec<LocalOp>>,
}

fn describe_inputs(graph: &Graph, node: &Node, layouts: &HashMap<TensorId, NdSbp>, mesh: &Mesh) -> Vec<String> {
    node.inputs
        .iter()
        .map(|i| {
            let meta = graph.info(*i).meta;
            match layouts.get(i) {
                Some(l) => format!("{meta} ({})", l.describe(mesh)),
                None => meta.to_string(),
            }
        })
        .collect()
}

/// One device's op with its local inputs and outputs.
pub(crate) type LocalOp = (Arc<dyn OpDef>, Vec<TensorMeta>, Vec<TensorMeta>);

/// The op one device runs under `signature`, after checking that it computes the local
/// shapes the layouts say. `None` in the result means the op itself.
pub(crate) fn localize(
    op: &Arc<dyn OpDef>,
    logical_inputs: &[TensorMeta],
    logical_outputs: &[TensorMeta],
    signature: &NdSignature,
    mesh: &Mesh,
    coords: &[usize],
) -> Result<LocalOp, String> {
    let region = |meta: &TensorMeta, layout: &NdSbp| {
        let (shape, offsets) = local_region(&meta.shape, layout, mesh, coords);
        (TensorMeta { shape, dtype: meta.dtype }, offsets)
    };
    let (local_inputs, input_offsets): (Vec<_>, Vec<_>) =
        logical_inputs.iter().zip(&signature.inputs).map(|(m, l)| region(m, l)).unzip();
    let (local_outputs, output_offsets): (Vec<_>, Vec<_>) =
        logical_outputs.iter().zip(&signature.outputs).map(|(m, l)| region(m, l)).unzip();
    let ctx = LocalContext {
        logical_inputs,
        logical_outputs,
        local_inputs: &local_inputs,
        local_outputs: &local_outputs,
        input_offsets: &input_offsets,
        output_offsets: &output_offsets,
        input_layouts: &signature.inputs,
        output_layouts: &signature.outputs,
    };
    let local = op.localize(&ctx)?.unwrap_or_else(|| op.clone());
    let inferred = local.infer(&local_inputs)?;
    if inferred != local_outputs {
        let list = |v: &[TensorMeta]| v.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
        return Err(format!(
            "on its parts [{}] it computes [{}], but the layouts need [{}]",
            list(&local_inputs),
            list(&inferred),
            list(&local_outputs)
        ));
    }
    Ok((local, local_inputs, local_outputs))
}

/// Layout inference under way: the graph, where its tensors live and what is known so far.
struct Inference<'a> {
    graph: &'a Graph,
    placement: &'a Placement,
    /// Whether the graph's pinned layouts count (not on one device).
    pins: bool,
    /// `tensor -> like`: `tensor` takes `like`'s layout.
    follow: HashMap<TensorId, TensorId>,
    /// Whether optimizer state left to the compiler may be sharded in process
    /// ([`ParallelOptions::shard_states_in_process`], in a step where it applies).
    shard_states: bool,
    /// Where outputs are going: a variable's next value goes to the variable's layout, a
    /// followed tensor to its leader's.
    destination: HashMap<TensorId, NdSbp>,
    layouts: Layouts,
}

/// Layouts: chooses a signature for every op the step needs, and the layout of every
/// tensor it makes or reads.
pub(crate) fn infer(
    graph: &Graph,
    facts: &StepFacts,
    placement: &Placement,
    options: &ParallelOptions,
    scope: Scope,
) -> Result<Layouts, CompileError> {
    let mut inference = Inference {
        graph,
        placement,
        pins: scope == Scope::Placements,
        follow: options.follow.iter().copied().collect(),
        shard_states: options.shard_states_in_process
            && options.reuse_memory
            && facts.micro_batches == 1
            && scope == Scope::Placements,
        destination: HashMap::new(),
        layouts: Layouts::default(),
    };
    inference.sources(facts)?;
    inference.destinations(facts, &options.follow);
    for (n, node) in facts.needed_nodes() {
        if node.outputs.is_empty() {
            continue;
        }
        let (sig, ops) = inference.choose(n, node)?;
        for (o, layout) in node.outputs.iter().zip(&sig.outputs) {
            inference.layouts.produced.insert(*o, layout.clone());
            let seen = match inference.follow.get(o) {
                Some(like) => inference.layouts.visible.get(like).cloned().unwrap_or_else(|| layout.clone()),
                None => layout.clone(),
            };
            inference.layouts.visible.insert(*o, seen);
        }
        inference.layouts.signatures.insert(n, sig);
        inference.layouts.local.insert(n, ops);
    }
    Ok(inference.layouts)
}

impl Inference<'_> {
    /// The layout pinned on `t`, if pins count.
    fn pin(&self, t: TensorId) -> Option<NdSbp> {
        if self.pins {
            self.graph.pinned_layout(t)
        } else {
            None
        }
    }

    /// Inputs and variables: pinned, following what they are pinned to follow, or
    /// Broadcast. A dataset source reads whole batches on every device; its inputs are cut
    /// locally, so they are made Broadcast.
    fn sources(&mut self, facts: &StepFacts) -> Result<(), CompileError> {
        for id in facts.needed_tensors() {
            let info = self.graph.info(id);
            if matches!(info.source, TensorSource::Op { .. }) {
                continue;
            }
            let mesh = self.placement.mesh(id)?;
            let ndim = mesh.ndim();
            let pinned = match self.pin(id) {
                Some(pin) => Some(pin),
                None => self.sharded_state(id, facts)?,
            };
            let layout = pinned
                .or_else(|| self.follow.get(&id).and_then(|like| self.pin(*like)))
                .unwrap_or_else(|| NdSbp::broadcast(ndim));
            layout.check(mesh, &info.meta.shape).map_err(|reason| CompileError::LayoutDoesNotFit {
                tensor: info.name.clone(),
                meta: info.meta.to_string(),
                reason,
            })?;
            if matches!(info.source, TensorSource::Variable { .. }) && layout.0.contains(&Sbp::Partial) {
                return Err(CompileError::PartialVariable {
                    tensor: info.name.clone(),
                    meta: info.meta.to_string(),
                    layout: layout.describe(mesh),
                });
            }
            let made = if facts.dataset.contains(&id) { NdSbp::broadcast(ndim) } else { layout.clone() };
            self.layouts.produced.insert(id, made);
            self.layouts.visible.insert(id, layout);
        }
        Ok(())
    }

    /// `S(0)` for an optimizer state sharded in process
    /// ([`ParallelOptions::shard_states_in_process`]): a variable that is not trainable and
    /// follows a trainable one (as [`ParallelOptions::train`] makes every state follow its
    /// parameter), not pinned itself, its parameter replicated and not fetched, on a one-axis mesh
    /// of two or more cpu devices of one node, where every device's rows start on a 64-byte
    /// boundary (so its update writes them in place, where the all-gather puts them).
    fn sharded_state(&self, id: TensorId, facts: &StepFacts) -> Result<Option<NdSbp>, CompileError> {
        let Some(&param) = self.follow.get(&id).filter(|_| self.shard_states) else { return Ok(None) };
        let trainable = |t: TensorId| match self.graph.info(t).source {
            TensorSource::Variable { trainable, .. } => Some(trainable),
            _ => None,
        };
        // The parameter replicated: pinned so, or left to the compiler (which replicates it).
        let replicated = self.pin(param).is_none_or(|pin| pin.0.iter().all(|s| *s == Sbp::Broadcast));
        if trainable(id) != Some(false) || trainable(param) != Some(true) || !replicated {
            return Ok(None);
        }
        if facts.fetch.contains(&param) {
            return Ok(None);
        }
        let (mesh, meta) = (self.placement.mesh(id)?, self.graph.info(id).meta);
        let devices = mesh.devices();
        let one_node = devices.iter().all(|d| d.kind == crate::plan::DeviceKind::Cpu && d.node == devices[0].node);
        let (Some(&rows), true) = (meta.shape.0.first(), mesh.ndim() == 1 && mesh.size() > 1 && one_node) else {
            return Ok(None);
        };
        let row_bytes = meta.bytes() / rows.max(1);
        let aligned = (0..mesh.size())
            .all(|r| (crate::plan::part_range(rows, mesh.size(), r).start * row_bytes).is_multiple_of(64));
        Ok((rows >= mesh.size() && aligned && *self.placement.mesh(param)? == *mesh)
            .then(|| NdSbp(vec![Sbp::Split(0)])))
    }

    /// Where outputs are going: a variable's next value goes to the variable's layout, a
    /// followed tensor to its leader's.
    fn destinations(&mut self, facts: &StepFacts, follow: &[(TensorId, TensorId)]) {
        for (variable, new) in &facts.updates {
            if let Some(l) = self.layouts.visible.get(variable) {
                self.destination.insert(*new, l.clone());
            }
        }
        for (t, like) in follow {
            if let Some(l) = self.layouts.visible.get(like) {
                self.destination.entry(*t).or_insert_with(|| l.clone());
            }
        }
    }

    /// The cheapest signature of node `n` that fits its pins and its devices' local
    /// shapes, with the op each device runs.
    fn choose(&self, n: usize, node: &Node) -> Result<(NdSignature, Vec<LocalOp>), CompileError> {
        let in_metas: Vec<TensorMeta> = node.inputs.iter().map(|i| self.graph.info(*i).meta).collect();
        let out_metas: Vec<TensorMeta> = node.outputs.iter().map(|o| self.graph.info(*o).meta).collect();
        let mesh: &Mesh = match node.outputs.first() {
            Some(first) => self.placement.mesh(*first)?,
            None => return Err(CompileError::invariant(format!("node {n} has no outputs to place"))),
        };
        // All-Broadcast first: on a tie it wins, so nothing gets split only to be gathered
        // again by a consumer that needs it whole.
        let mut one_axis = vec![SbpSignature::broadcast(in_metas.len(), out_metas.len())];
        one_axis.extend(node.op.sbp_signatures(&in_metas, &out_metas));
        one_axis.retain(|s| s.inputs.len() == in_metas.len() && s.outputs.len() == out_metas.len());
        let pins: Vec<Option<NdSbp>> = node.outputs.iter().map(|o| self.pin(*o)).collect();
        let mut candidates = self.candidates(node, mesh, &one_axis, &pins, (&in_metas, &out_metas))?;
        candidates.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let mut closest = None;
        for (_, _, sig) in candidates {
            let fits: Result<Vec<LocalOp>, String> = (0..mesh.size())
                .map(|rank| localize(&node.op, &in_metas, &out_metas, &sig, mesh, &mesh.coords(rank)))
                .collect();
            match fits {
                Ok(ops) => return Ok((sig, ops)),
                Err(e) => {
                    closest.get_or_insert(e);
                }
            }
        }
        let pinned: Vec<String> = pins
            .iter()
            .enumerate()
            .filter_map(|(k, p)| p.as_ref().map(|p| format!("output {k}: {}", p.describe(mesh))))
            .collect();
        let listed: Vec<String> = one_axis.iter().map(ToString::to_string).collect();
        Err(CompileError::NoSignature(Box::new(NoSignature {
            op: node.op.name().to_string(),
            node: n,
            inputs: describe_inputs(self.graph, node, &self.layouts.visible, mesh),
            pinned: pinned.join("; "),
            signatures: listed.join(", "),
            partial_pinned: pins.iter().flatten().any(|p| p.0.contains(&Sbp::Partial)),
            closest,
        })))
    }

    /// Every combination of one-axis signatures that gives the pinned outputs, with its
    /// cost and its index among the combinations (the tie-breaker).
    fn candidates(
        &self,
        node: &Node,
        mesh: &Mesh,
        one_axis: &[SbpSignature],
        pins: &[Option<NdSbp>],
        (in_metas, out_metas): (&[TensorMeta], &[TensorMeta]),
    ) -> Result<Vec<(f64, usize, NdSignature)>, CompileError> {
        let ndim = mesh.ndim();
        let input_layouts: Vec<&NdSbp> = node
            .inputs
            .iter()
            .map(|i| {
                self.layouts
                    .visible
                    .get(i)
                    .ok_or_else(|| CompileError::UnknownLayout { tensor: self.graph.info(*i).name })
            })
            .collect::<Result<_, _>>()?;
        let mut candidates = Vec::new();
        for index in 0..one_axis.len().pow(ndim as u32) {
            let mut pick = index;
            let mut sig = NdSignature {
                inputs: vec![NdSbp(Vec::with_capacity(ndim)); in_metas.len()],
                outputs: vec![NdSbp(Vec::with_capacity(ndim)); out_metas.len()],
            };
            for _ in 0..ndim {
                let s = &one_axis[pick % one_axis.len()];
                pick /= one_axis.len();
                for (l, x) in sig.inputs.iter_mut().zip(&s.inputs) {
                    l.0.push(*x);
                }
                for (l, x) in sig.outputs.iter_mut().zip(&s.outputs) {
                    l.0.push(*x);
                }
            }
            if pins.iter().zip(&sig.outputs).any(|(pin, out)| pin.as_ref().is_some_and(|p| p != out)) {
                continue;
            }
            let mut moved = 0.0;
            for ((from, to), (meta, input)) in
                input_layouts.iter().zip(&sig.inputs).zip(in_metas.iter().zip(&node.inputs))
            {
                moved += self.input_cost(from, to, meta, self.placement.mesh(*input)?, mesh);
            }
            // Outputs with a known destination (a variable's next value, a tensor that
            // follows another's layout) also pay for their way there.
            let onward: f64 = node
                .outputs
                .iter()
                .zip(&sig.outputs)
                .zip(out_metas)
                .filter_map(|((o, out), meta)| {
                    self.destination
                        .get(o)
                        .filter(|to| to.0.len() == out.0.len())
                        .map(|to| boxing::cost(out, to, meta.bytes() as f64, mesh.shape()))
                })
                .sum();
            // What one device computes: replicating a product on every device is not free.
            let coords = vec![0; ndim];
            let local = |metas: &[TensorMeta], layouts: &[NdSbp]| -> Vec<TensorMeta> {
                metas
                    .iter()
                    .zip(layouts)
                    .map(|(m, l)| TensorMeta { shape: local_region(&m.shape, l, mesh, &coords).0, dtype: m.dtype })
                    .collect()
            };
            let work = node.op.flops(&local(in_metas, &sig.inputs), &local(out_metas, &sig.outputs)) * BYTES_PER_FLOP;
            candidates.push((moved + onward + work, index, sig));
        }
        Ok(candidates)
    }

    /// Bytes moved to bring an input made in `from` on `source` to `to` on `mesh`.
    fn input_cost(&self, from: &NdSbp, to: &NdSbp, meta: &TensorMeta, source: &Mesh, mesh: &Mesh) -> f64 {
        let bytes = meta.bytes() as f64;
        if *source == *mesh {
            boxing::cost(from, to, bytes, mesh.shape())
        } else if source.shape() == mesh.shape() {
            // Boxed on the source mesh, then copied device by device.
            boxing::cost(from, to, bytes, mesh.shape()) + bytes
        } else {
            // Made whole on the source mesh, copied to every device, cut there.
            boxing::cost(from, &NdSbp::broadcast(source.ndim()), bytes, source.shape()) + bytes * mesh.size() as f64
        }
    }
}
