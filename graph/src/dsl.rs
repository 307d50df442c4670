//! The graph builder: a [`Graph`] holds tensors and op applications; a [`Tensor`] is a
//! cheap handle into it whose op methods (defined next to each op in `ops/`) return
//! `Result`, so a bad shape or dtype is reported where the graph is built.

use crate::autocast::Precision;
use crate::ops::OpDef;
use crate::plan::{DType, Init, Shape, TensorMeta};
use crate::sbp::{Mesh, NdSbp};
use crate::GraphError;
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Arc;

/// Index of a tensor in its graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorId(pub u32);

/// Where a tensor's value comes from.
#[derive(Debug, Clone)]
pub enum TensorSource {
    /// Fed by the user for each step.
    Input,
    /// Persistent state, initialized once.
    Variable {
        /// Initializer.
        init: Init,
        /// Whether optimizers update it.
        trainable: bool,
    },
    /// Output `output` of op application `node`.
    Op {
        /// Index in [`Graph::nodes`].
        node: usize,
        /// Which output.
        output: usize,
    },
}

/// One tensor of a graph.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    /// Shape and dtype.
    pub meta: TensorMeta,
    /// Where its value comes from.
    pub source: TensorSource,
    /// Name (inputs and variables: the user's; op outputs: generated).
    pub name: String,
}

/// One op application.
#[derive(Debug, Clone)]
pub struct Node {
    /// The op.
    pub op: Arc<dyn OpDef>,
    /// Its inputs.
    pub inputs: Vec<TensorId>,
    /// Its outputs.
    pub outputs: Vec<TensorId>,
}

#[derive(Debug, Default)]
struct GraphData {
    tensors: Vec<TensorInfo>,
    nodes: Vec<Node>,
    names: HashSet<String>,
    /// Placement of each tensor that has one (set by `set_layout`/`to_global`, inherited by
    /// op outputs from their inputs); tensors without one go where the compiler puts them.
    placements: HashMap<TensorId, Arc<Mesh>>,
    /// Layouts the user pinned: the tensor's producer must produce exactly this layout.
    pins: HashMap<TensorId, NdSbp>,
    /// The precision ops are applied in (`crate::autocast`).
    precision: Precision,
    /// Each tensor's casts by dtype, so a tensor read by several bf16 ops is cast once.
    casts: HashMap<(TensorId, DType), TensorId>,
}

/// A logical graph under construction. Nodes are appended in a valid evaluation order.
#[derive(Debug, Default)]
pub struct Graph {
    data: RefCell<GraphData>,
}

/// A tensor of a [`Graph`]: a copyable handle.
#[derive(Clone, Copy)]
pub struct Tensor<'g> {
    graph: &'g Graph,
    id: TensorId,
}

impl fmt::Debug for Tensor<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor({}, {})", self.id.0, self.meta())
    }
}

impl Graph {
    /// An empty graph.
    pub fn new() -> Self {
        Self::default()
    }

    fn add_named(&self, name: &str, meta: TensorMeta, source: TensorSource) -> Result<Tensor<'_>, GraphError> {
        let mut data = self.data.borrow_mut();
        if !data.names.insert(name.to_string()) {
            return Err(GraphError::DuplicateName(name.to_string()));
        }
        data.tensors.push(TensorInfo { meta, source, name: name.to_string() });
        Ok(Tensor { graph: self, id: TensorId(data.tensors.len() as u32 - 1) })
    }

    /// A tensor fed by the user for every step. Refused, naming it and its shape, when
    /// its element count or byte size overflows.
    pub fn input(&self, name: &str, shape: impl Into<Shape>, dtype: DType) -> Result<Tensor<'_>, GraphError> {
        let meta = TensorMeta::new(shape, dtype);
        check_size(&format!("input '{name}'"), &meta)?;
        self.add_named(name, meta, TensorSource::Input)
    }

    /// A trainable variable. Refused, naming it and its shape, when its element count or
    /// byte size overflows or its initializer does not fit it.
    pub fn variable(
        &self,
        name: &str,
        shape: impl Into<Shape>,
        dtype: DType,
        init: Init,
    ) -> Result<Tensor<'_>, GraphError> {
        let meta = TensorMeta::new(shape, dtype);
        check_size(&format!("variable '{name}'"), &meta)?;
        init.check(&meta).map_err(|message| GraphError::Op {
            op: "variable".into(),
            inputs: vec![format!("'{name}': {meta}")],
            message,
        })?;
        self.add_named(name, meta, TensorSource::Variable { init, trainable: true })
    }

    /// Marks a variable as trainable (updated by optimizers) or not (state, constants).
    pub fn set_trainable(&self, variable: Tensor<'_>, trainable: bool) {
        if let TensorSource::Variable { trainable: t, .. } =
            &mut self.data.borrow_mut().tensors[variable.id.0 as usize].source
        {
            *t = trainable;
        }
    }

    /// Applies `op` to `inputs`, checking them with its shape rule; returns its outputs.
    pub fn apply(&self, op: impl OpDef + 'static, inputs: &[Tensor<'_>]) -> Result<Vec<Tensor<'_>>, GraphError> {
        self.apply_arc(Arc::new(op), inputs)
    }

    pub(crate) fn apply_arc(&self, op: Arc<dyn OpDef>, inputs: &[Tensor<'_>]) -> Result<Vec<Tensor<'_>>, GraphError> {
        for (index, t) in inputs.iter().enumerate() {
            if !std::ptr::eq(t.graph, self) {
                return Err(GraphError::ForeignTensor { op: op.name().into(), index });
            }
        }
        let inputs = &self.autocast_inputs(&op, inputs)?;
        let metas: Vec<TensorMeta> = inputs.iter().map(|t| t.meta()).collect();
        let outputs = op.infer(&metas).map_err(|message| GraphError::Op {
            op: op.name().into(),
            inputs: metas.iter().map(ToString::to_string).collect(),
            message,
        })?;
        let placement = self.common_placement(op.name(), inputs)?;
        let node = self.data.borrow().nodes.len();
        for (output, meta) in outputs.iter().enumerate() {
            let inputs: Vec<String> = metas.iter().map(ToString::to_string).collect();
            let name = format!("{}{node}:{output} (the result of {}({}))", op.name(), op.name(), inputs.join(", "));
            check_size(&name, meta)?;
        }
        let mut data = self.data.borrow_mut();
        let first = data.tensors.len();
        for (output, meta) in outputs.into_iter().enumerate() {
            let name = format!("{}{}:{}", op.name(), node, output);
            data.tensors.push(TensorInfo { meta, source: TensorSource::Op { node, output }, name });
        }
        let ids: Vec<TensorId> = (first..data.tensors.len()).map(|i| TensorId(i as u32)).collect();
        if let Some(placement) = placement {
            for id in &ids {
                data.placements.insert(*id, placement.clone());
            }
        }
        data.nodes.push(Node { op, inputs: inputs.iter().map(|t| t.id).collect(), outputs: ids.clone() });
        Ok(ids.into_iter().map(|id| Tensor { graph: self, id }).collect())
    }

    /// The precision ops are applied in ([`Graph::mixed_precision`]).
    pub fn precision(&self) -> Precision {
        self.data.borrow().precision
    }

    pub(crate) fn set_precision(&self, precision: Precision) {
        self.data.borrow_mut().precision = precision;
    }

    pub(crate) fn cached_cast(&self, tensor: TensorId, to: DType) -> Option<Tensor<'_>> {
        self.data.borrow().casts.get(&(tensor, to)).map(|&id| Tensor { graph: self, id })
    }

    pub(crate) fn cache_cast(&self, tensor: TensorId, to: DType, cast: TensorId) {
        self.data.borrow_mut().casts.insert((tensor, to), cast);
    }

    /// The placement the inputs of an op share, or an error naming the op, its inputs and
    /// their placements when two differ (moving a tensor is an explicit `to_global`).
    fn common_placement(&self, op: &str, inputs: &[Tensor<'_>]) -> Result<Option<Arc<Mesh>>, GraphError> {
        let data = self.data.borrow();
        let mut common: Option<(usize, &Arc<Mesh>)> = None;
        for (i, t) in inputs.iter().enumerate() {
            let Some(mesh) = data.placements.get(&t.id) else { continue };
            match common {
                None => common = Some((i, mesh)),
                Some((first, other)) if **other != **mesh => {
                    return Err(GraphError::Op {
                        op: op.into(),
                        inputs: inputs.iter().map(|t| data.tensors[t.id.0 as usize].meta.to_string()).collect(),
                        message: format!(
                            "inputs are on different placements: input {first} on {other}, input {i} on {mesh}; \
                             move one with to_global"
                        ),
                    });
                }
                Some(_) => {}
            }
        }
        Ok(common.map(|(_, m)| m.clone()))
    }

    /// Places `tensor` on `mesh` with the layout `layout` (one SBP per mesh axis): its
    /// producer must produce exactly this layout (inputs and variables: how they are fed
    /// and stored). Errors name the tensor, its shape, the mesh axes and the layout.
    pub fn set_layout(&self, tensor: Tensor<'_>, mesh: &Mesh, layout: NdSbp) -> Result<(), GraphError> {
        let meta = tensor.meta();
        // Named before the graph is borrowed mutably below (the name reads the graph).
        let name = tensor.name();
        let error = |message: String| GraphError::Op {
            op: "set_layout".into(),
            inputs: vec![format!("'{name}': {meta}")],
            message,
        };
        layout.check(mesh, &meta.shape).map_err(error)?;
        let mut data = self.data.borrow_mut();
        if let Some(current) = data.placements.get(&tensor.id) {
            if **current != *mesh {
                return Err(error(format!("already placed on {current}, cannot also be on {mesh}")));
            }
        }
        data.placements.insert(tensor.id, Arc::new(mesh.clone()));
        data.pins.insert(tensor.id, layout);
        Ok(())
    }

    /// Moves tensor `id` to `mesh` (a stage edge made by `to_global`), whatever its inputs'.
    pub(crate) fn place(&self, id: TensorId, mesh: Arc<Mesh>) {
        self.data.borrow_mut().placements.insert(id, mesh);
    }

    /// The placement of tensor `id`, if it has one.
    pub fn placement(&self, id: TensorId) -> Option<Arc<Mesh>> {
        self.data.borrow().placements.get(&id).cloned()
    }

    /// The layout pinned on tensor `id`, if any.
    pub fn pinned_layout(&self, id: TensorId) -> Option<NdSbp> {
        self.data.borrow().pins.get(&id).cloned()
    }

    /// Applies a single-output op.
    pub fn apply1(&self, op: impl OpDef + 'static, inputs: &[Tensor<'_>]) -> Result<Tensor<'_>, GraphError> {
        let mut outputs = self.apply(op, inputs)?;
        match outputs.len() {
            1 => Ok(outputs.remove(0)),
            n => Err(GraphError::Kernel { op: "apply1".into(), message: format!("op has {n} outputs, not 1") }),
        }
    }

    /// The tensor with this id.
    pub fn tensor(&self, id: TensorId) -> Option<Tensor<'_>> {
        ((id.0 as usize) < self.data.borrow().tensors.len()).then_some(Tensor { graph: self, id })
    }

    /// The tensor with this name (inputs and variables).
    pub fn by_name(&self, name: &str) -> Option<Tensor<'_>> {
        let data = self.data.borrow();
        data.tensors.iter().position(|t| t.name == name).map(|i| Tensor { graph: self, id: TensorId(i as u32) })
    }

    /// A copy of tensor `id`'s information.
    pub fn info(&self, id: TensorId) -> TensorInfo {
        self.data.borrow().tensors[id.0 as usize].clone()
    }

    /// A copy of the op applications, in evaluation order.
    pub fn nodes(&self) -> Vec<Node> {
        self.data.borrow().nodes.clone()
    }

    /// Number of tensors.
    pub fn tensor_count(&self) -> usize {
        self.data.borrow().tensors.len()
    }

    /// Trainable variables, in creation order.
    pub fn trainable_variables(&self) -> Vec<Tensor<'_>> {
        let data = self.data.borrow();
        (0..data.tensors.len())
            .filter(|&i| matches!(data.tensors[i].source, TensorSource::Variable { trainable: true, .. }))
            .map(|i| Tensor { graph: self, id: TensorId(i as u32) })
            .collect()
    }
}

/// Refuses a tensor whose element count or byte size overflows, naming it (`input 'x'`,
/// `variable 'w'`, `matmul3:0 (the result of ...)`) and its shape.
fn check_size(name: &str, meta: &TensorMeta) -> Result<(), GraphError> {
    meta.check_size().map_err(|_| GraphError::TooLarge {
        tensor: name.to_string(),
        shape: meta.shape.clone(),
        dtype: meta.dtype,
    })
}

/// Which tensors `roots` depend on (themselves included), over `nodes` in graph order:
/// what a step needs, what the fetches need, what the gradients need.
pub(crate) fn ancestors(nodes: &[Node], count: usize, roots: impl IntoIterator<Item = TensorId>) -> Vec<bool> {
    let mut reached = vec![false; count];
    for t in roots {
        reached[t.0 as usize] = true;
    }
    for node in nodes.iter().rev() {
        if node.outputs.iter().any(|o| reached[o.0 as usize]) {
            for i in &node.inputs {
                reached[i.0 as usize] = true;
            }
        }
    }
    reached
}

/// Which tensors change with the fed inputs (the rest: variables, constants, what only
/// they make). An op reading none of them is paced by a tick, or it would have no end.
pub(crate) fn paced(graph: &Graph, nodes: &[Node], count: usize) -> Vec<bool> {
    let mut paced: Vec<bool> =
        (0..count).map(|i| matches!(graph.info(TensorId(i as u32)).source, TensorSource::Input)).collect();
    for node in nodes {
        if node.inputs.iter().any(|i| paced[i.0 as usize]) {
            for o in &node.outputs {
                paced[o.0 as usize] = true;
            }
        }
    }
    paced
}

impl<'g> Tensor<'g> {
    /// Its graph.
    pub fn graph(&self) -> &'g Graph {
        self.graph
    }

    /// Its id.
    pub fn id(&self) -> TensorId {
        self.id
    }

    /// Shape and dtype.
    pub fn meta(&self) -> TensorMeta {
        self.graph.data.borrow().tensors[self.id.0 as usize].meta.clone()
    }

    /// Shape.
    pub fn shape(&self) -> Shape {
        self.meta().shape
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.meta().dtype
    }

    /// Name.
    pub fn name(&self) -> String {
        self.graph.data.borrow().tensors[self.id.0 as usize].name.clone()
    }
}
