//! Layout inference: the SBP signature of every op on every mesh axis. Pinned layouts are
//! kept; otherwise each op takes the signature whose input boxing moves the fewest bytes,
//! then the one that leaves each device the least to compute, then the first listed.

use super::boxing;
use crate::dsl::{Graph, Node, TensorId, TensorSource};
use crate::ops::{LocalContext, OpDef};
use crate::sbp::{local_region, Mesh, NdSbp, Sbp, SbpSignature};
use crate::tensor::TensorMeta;
use crate::GraphError;
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
#[derive(Debug)]
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

/// What layout inference needs of the compile options.
#[derive(Debug)]
pub(crate) struct InferOptions<'a> {
    /// The mesh of every tensor the step needs.
    pub meshes: &'a HashMap<TensorId, Arc<Mesh>>,
    pub follow: &'a [(TensorId, TensorId)],
    pub dataset_inputs: Vec<&'a str>,
    /// `(variable, its next value)`.
    pub updates: Vec<(TensorId, TensorId)>,
}

/// Chooses a signature for every op the step needs.
pub(crate) fn infer(
    graph: &Graph,
    nodes: &[Node],
    needed: &[bool],
    options: &InferOptions<'_>,
) -> Result<Layouts, GraphError> {
    let mesh_of = |t: TensorId| -> Result<&Arc<Mesh>, GraphError> {
        options.meshes.get(&t).ok_or_else(|| GraphError::Kernel {
            op: "layout".into(),
            message: format!("'{}' has no placement (broken invariant)", graph.info(t).name),
        })
    };
    let follow: HashMap<TensorId, TensorId> = options.follow.iter().copied().collect();
    let dataset = &options.dataset_inputs;
    let mut produced: HashMap<TensorId, NdSbp> = HashMap::new();
    let mut visible: HashMap<TensorId, NdSbp> = HashMap::new();
    let layout_error = |name: &str, meta: &TensorMeta, message: String| GraphError::Op {
        op: "layout".into(),
        inputs: vec![format!("'{name}': {meta}")],
        message,
    };

    // Inputs and variables: pinned, following what they are pinned to follow, or Broadcast.
    for (i, &is_needed) in needed.iter().enumerate() {
        let id = TensorId(i as u32);
        let info = graph.info(id);
        if !is_needed || matches!(info.source, TensorSource::Op { .. }) {
            continue;
        }
        let mesh = mesh_of(id)?;
        let ndim = mesh.ndim();
        let layout = graph
            .pinned_layout(id)
            .or_else(|| follow.get(&id).and_then(|like| graph.pinned_layout(*like)))
            .unwrap_or_else(|| NdSbp::broadcast(ndim));
        layout.check(mesh, &info.meta.shape).map_err(|m| layout_error(&info.name, &info.meta, m))?;
        if matches!(info.source, TensorSource::Variable { .. }) && layout.0.contains(&Sbp::Partial) {
            return Err(layout_error(
                &info.name,
                &info.meta,
                format!("a variable cannot be Partial ({}): store it Broadcast or Split", layout.describe(mesh)),
            ));
        }
        // A dataset source reads whole batches on every device; its inputs are cut locally.
        let made = if dataset.contains(&info.name.as_str()) { NdSbp::broadcast(ndim) } else { layout.clone() };
        produced.insert(id, made);
        visible.insert(id, layout);
    }

    // Where outputs are going: a variable's next value goes to the variable's layout, a
    // followed tensor to its leader's.
    let mut destination: HashMap<TensorId, NdSbp> = HashMap::new();
    for (variable, new) in &options.updates {
        if let Some(l) = visible.get(variable) {
            destination.insert(*new, l.clone());
        }
    }
    for (t, like) in options.follow {
        if let Some(l) = visible.get(like) {
            destination.entry(*t).or_insert_with(|| l.clone());
        }
    }

    // Ops, in graph order.
    let mut signatures = HashMap::new();
    let mut local = HashMap::new();
    for (n, node) in nodes.iter().enumerate() {
        if !node.outputs.iter().any(|o| needed[o.0 as usize]) {
            continue;
        }
        let name = node.op.name();
        let in_metas: Vec<TensorMeta> = node.inputs.iter().map(|i| graph.info(*i).meta).collect();
        let out_metas: Vec<TensorMeta> = node.outputs.iter().map(|o| graph.info(*o).meta).collect();
        let Some(first) = node.outputs.first() else { continue };
        let mesh: &Mesh = mesh_of(*first)?;
        let ndim = mesh.ndim();
        // All-Broadcast first: on a tie it wins, so nothing gets split only to be gathered
        // again by a consumer that needs it whole.
        let mut one_axis = vec![SbpSignature::broadcast(in_metas.len(), out_metas.len())];
        one_axis.extend(node.op.sbp_signatures(&in_metas, &out_metas));
        one_axis.retain(|s| s.inputs.len() == in_metas.len() && s.outputs.len() == out_metas.len());
        let pins: Vec<Option<NdSbp>> = node.outputs.iter().map(|o| graph.pinned_layout(*o)).collect();
        let input_layouts: Vec<NdSbp> = node
            .inputs
            .iter()
            .map(|i| {
                visible.get(i).cloned().ok_or_else(|| GraphError::Kernel {
                    op: name.into(),
                    message: format!("input '{}' has no layout (broken invariant)", graph.info(*i).name),
                })
            })
            .collect::<Result<_, _>>()?;
        // Every combination of one-axis signatures, with its cost.
        let mut candidates: Vec<(f64, usize, NdSignature)> = Vec::new();
        let combos = one_axis.len().pow(ndim as u32);
        for index in 0..combos {
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
                let bytes = meta.bytes() as f64;
                let source = mesh_of(*input)?;
                moved += if **source == *mesh {
                    boxing::cost(from, to, bytes, mesh.shape())
                } else if source.shape() == mesh.shape() {
                    // Boxed on the source mesh, then copied device by device.
                    boxing::cost(from, to, bytes, mesh.shape()) + bytes
                } else {
                    // Made whole on the source mesh, copied to every device, cut there.
                    boxing::cost(from, &NdSbp::broadcast(source.ndim()), bytes, source.shape())
                        + bytes * mesh.size() as f64
                };
            }
            // Outputs with a known destination (a variable's next value, a tensor that
            // follows another's layout) also pay for their way there.
            let onward: f64 = node
                .outputs
                .iter()
                .zip(&sig.outputs)
                .zip(&out_metas)
                .filter_map(|((o, out), meta)| {
                    destination
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
            let work = node.op.flops(&local(&in_metas, &sig.inputs), &local(&out_metas, &sig.outputs)) * BYTES_PER_FLOP;
            candidates.push((moved + onward + work, index, sig));
        }
        candidates.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let mut reasons = Vec::new();
        let mut chosen = None;
        for (_, _, sig) in candidates {
            let fits: Result<Vec<LocalOp>, String> = (0..mesh.size())
                .map(|rank| localize(&node.op, &in_metas, &out_metas, &sig, mesh, &mesh.coords(rank)))
                .collect();
            match fits {
                Ok(ops) => {
                    chosen = Some((sig, ops));
                    break;
                }
                Err(e) => reasons.push(e),
            }
        }
        let Some((sig, ops)) = chosen else {
            let pinned: Vec<String> = pins
                .iter()
                .enumerate()
                .filter_map(|(k, p)| p.as_ref().map(|p| format!("output {k}: {}", p.describe(mesh))))
                .collect();
            let listed: Vec<String> = one_axis.iter().map(ToString::to_string).collect();
            let mut message = format!(
                "no SBP signature gives the pinned layout ({}); its signatures on one mesh axis are {}",
                pinned.join("; "),
                listed.join(", ")
            );
            if pins.iter().flatten().any(|p| p.0.contains(&Sbp::Partial)) {
                message.push_str(
                    "; Partial(sum) only comes out of an op that is linear in its Partial inputs: \
                     box the input to Broadcast or Split first (to_global)",
                );
            }
            if let Some(reason) = reasons.first() {
                message.push_str(&format!("; the closest signature fails: {reason}"));
            }
            return Err(GraphError::Op {
                op: format!("{name} (node {n})"),
                inputs: describe_inputs(graph, node, &visible, mesh),
                message,
            });
        };
        for (o, layout) in node.outputs.iter().zip(&sig.outputs) {
            produced.insert(*o, layout.clone());
            let seen = match follow.get(o) {
                Some(like) => visible.get(like).cloned().unwrap_or_else(|| layout.clone()),
                None => layout.clone(),
            };
            visible.insert(*o, seen);
        }
        signatures.insert(n, sig);
        local.insert(n, ops);
    }
    Ok(Layouts { produced, visible, signatures, local })
}
