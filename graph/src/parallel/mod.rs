//! The parallel compiler: lowers one step of a logical graph onto a device mesh. Layouts
//! come from pins and signature choice ([`layout`]); boxing is inserted wherever a consumer
//! needs another layout than its producer made ([`boxing`]); every op becomes one compute
//! actor per device running its op on local shapes, and every collective one actor per
//! member on its device's comm stream.
//!
//! Data, tensor and ZeRO-style parallelism are all layouts of the same graph: inputs
//! `S(0)` and weights `B` give data parallelism (the weight gradients come out `P` and are
//! all-reduced); weights `S(0)` with their optimizer state give ZeRO (all-gather before
//! use, reduce-scatter of gradients); column- then row-split weights give Megatron.
//!
//! Collectives block their comm stream until the whole group has arrived, as NCCL does, so
//! every device must issue them in one order. The compiler orders all collectives by when
//! their input is produced (the producing op's position in the graph, then creation), and
//! chains each device's collectives in that order with zero-byte registers closed by a
//! preloaded step token; [`crate::plan::check_collective_order`] verifies any plan.
//!
//! Not yet here: memory reuse across lifetimes (the one-device compiler's ordering chain
//! would serialize the devices), gradient accumulation and pipeline stages (issue 6).

pub(crate) mod boxing;
mod layout;

use crate::compile::{CompiledGraph, CompiledInput, CompiledKernel, CompiledVariable, DatasetInputs};
use crate::dsl::{Graph, Tensor, TensorId, TensorSource};
use crate::ops::{GradCtx, InputGrads, OpDef};
use crate::plan::{
    ActorIndex, ActorKind, CollectiveConf, CollectiveOp, DeviceKind, KernelConf, Plan, PlanBuilder, RegstDescId,
    SourcePieces, StreamIndex, StreamKind,
};
use crate::sbp::{local_meta, local_region, scatter, Mesh, NdSbp, Sbp, SbpSignature};
use crate::tensor::{HostTensor, HostTensorMut, TensorMeta};
use crate::{GraphError, TrainStep};
pub use boxing::{KeepOnFirst, TakePart};
use std::collections::HashMap;
use std::sync::Arc;

/// Options of the parallel compiler.
#[derive(Debug, Clone)]
pub struct ParallelOptions {
    /// The devices every tensor of the step lives on.
    pub mesh: Mesh,
    /// Slots of the registers of fed inputs.
    pub input_register_num: u32,
    /// Slots of the other registers.
    pub activation_register_num: u32,
    /// Inputs read by a dataset source on every device (each reads whole batches and cuts
    /// its part locally, so the kernel must give every device the same batches).
    pub dataset: Option<DatasetInputs>,
    /// `(tensor, like)`: `tensor` takes `like`'s layout: a variable's pin, or, for an op
    /// output, the layout its consumers see (it is boxed there right after it is made).
    /// Gradients follow their parameters (that boxing *is* the data-parallel all-reduce or
    /// the ZeRO reduce-scatter) and optimizer state follows its parameter.
    pub follow: Vec<(TensorId, TensorId)>,
    /// Also add one sink per device for every fetch, reading the device's local value in
    /// the fetch's own layout ([`ParallelInfo::fetch_parts`]).
    pub fetch_parts: bool,
}

impl ParallelOptions {
    /// Options for `mesh` with the one-device defaults.
    pub fn new(mesh: Mesh) -> Self {
        Self {
            mesh,
            input_register_num: 2,
            activation_register_num: 1,
            dataset: None,
            follow: Vec::new(),
            fetch_parts: false,
        }
    }

    /// Gradients and optimizer state of `step` follow their parameters' layouts.
    pub fn train(mut self, step: &TrainStep<'_>) -> Self {
        self.follow.extend(step.params.iter().zip(&step.raw_grads).map(|(p, g)| (g.id(), p.id())));
        self.follow.extend(step.states.iter().map(|(s, p)| (s.id(), p.id())));
        self
    }
}

/// What a parallel plan adds to a [`CompiledGraph`].
#[derive(Debug, Clone)]
pub struct ParallelInfo {
    /// The mesh.
    pub mesh: Mesh,
    /// Each fed input: its layout and, by rank, its source actor and local shape.
    pub inputs: Vec<ParallelInput>,
    /// Each fetch's layout (as the fetch sinks see it before it is made `Broadcast`).
    pub fetch_layouts: Vec<NdSbp>,
    /// With [`ParallelOptions::fetch_parts`]: for each fetch, by rank, the sink reading the
    /// device's local value.
    pub fetch_parts: Vec<Vec<String>>,
    /// Layout of every tensor of the step, by name.
    pub layouts: Vec<(String, NdSbp)>,
    /// Collective groups in the order every device issues them.
    pub collectives: Vec<String>,
}

/// A fed input of a parallel plan.
#[derive(Debug, Clone)]
pub struct ParallelInput {
    /// The input's name.
    pub name: String,
    /// Its layout.
    pub layout: NdSbp,
    /// By rank: the source actor and the local shape it takes.
    pub parts: Vec<(String, TensorMeta)>,
}

/// `to_global`: the identity, whose output has a pinned layout (boxing goes before it).
#[derive(Debug, Clone, Copy)]
struct ToGlobal;

impl OpDef for ToGlobal {
    fn name(&self) -> &'static str {
        "to_global"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        match inputs {
            [x] => Ok(vec![x.clone()]),
            _ => Err(format!("takes 1 input, got {}", inputs.len())),
        }
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        Ok(vec![Some(ctx.grad()?)])
    }

    fn compute(&self, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
        use crate::tensor::{HostSlice, HostSliceMut};
        match (&inputs[0].data, &mut outputs[0].data) {
            (HostSlice::F32(x), HostSliceMut::F32(o)) => o.copy_from_slice(x),
            (HostSlice::F64(x), HostSliceMut::F64(o)) => o.copy_from_slice(x),
            (HostSlice::I64(x), HostSliceMut::I64(o)) => o.copy_from_slice(x),
            _ => return Err("dtype mismatch (broken invariant)".into()),
        }
        Ok(())
    }

    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let rank = inputs.first().map_or(0, |m| m.shape.rank());
        let mut s: Vec<SbpSignature> = (0..rank).map(|d| SbpSignature::new([Sbp::Split(d)], [Sbp::Split(d)])).collect();
        s.push(SbpSignature::new([Sbp::Partial], [Sbp::Partial]));
        s
    }
}

impl<'g> Tensor<'g> {
    /// This tensor with the layout `layout` on `mesh`: the compiler inserts the boxing
    /// (collectives or local slices) that converts it. Moving to another placement is a
    /// pipeline stage edge, which this compiler does not lower yet.
    pub fn to_global(&self, mesh: &Mesh, layout: NdSbp) -> Result<Tensor<'g>, GraphError> {
        let graph = self.graph();
        let y = graph.apply1(ToGlobal, &[*self])?;
        graph.set_layout(y, mesh, layout)?;
        Ok(y)
    }
}

/// What an op actor reads: a tensor in a layout, or the step's tick (`None`).
type Read = Option<(TensorId, NdSbp)>;

/// Per-device plan objects.
struct Devices {
    compute: Vec<StreamIndex>,
    comm: Vec<Option<StreamIndex>>,
    device: Vec<crate::plan::DeviceIndex>,
}

/// A collective actor and its place in the global order.
struct Issued {
    key: (usize, usize),
    rank: usize,
    actor: ActorIndex,
}

struct Lowering<'a> {
    graph: &'a Graph,
    mesh: &'a Mesh,
    b: PlanBuilder,
    devices: Devices,
    /// Per-rank registers of a tensor in a layout.
    regs: HashMap<(TensorId, NdSbp), Vec<RegstDescId>>,
    /// Where each tensor's value becomes available (the producing node + 1; 0 for inputs).
    ready_at: HashMap<TensorId, usize>,
    kernels: Vec<CompiledKernel>,
    issued: Vec<Issued>,
    groups: Vec<((usize, usize), String)>,
    boxings: usize,
    register_num: u32,
    /// Tensors that do not change with the inputs (variables, constants): their boxing
    /// actors also read the step's tick, or they would run once more than the steps (a
    /// variable's register carries one value more than the loop runs).
    unpaced: std::collections::HashSet<TensorId>,
    /// The tick's register on each device.
    tick: Vec<RegstDescId>,
}

impl Lowering<'_> {
    fn comm_stream(&mut self, rank: usize) -> StreamIndex {
        if let Some(s) = self.devices.comm[rank] {
            return s;
        }
        let s = self.b.stream(self.devices.device[rank], StreamKind::Comm);
        self.devices.comm[rank] = Some(s);
        s
    }

    /// The per-rank registers of `t` in `layout`, boxing from `from` if needed.
    fn boxed(&mut self, t: TensorId, from: &NdSbp, layout: &NdSbp) -> Result<Vec<RegstDescId>, String> {
        if let Some(r) = self.regs.get(&(t, layout.clone())) {
            return Ok(r.clone());
        }
        let mut current = self
            .regs
            .get(&(t, from.clone()))
            .cloned()
            .ok_or_else(|| format!("tensor '{}' has no registers (broken invariant)", self.graph.info(t).name))?;
        let info = self.graph.info(t);
        for step in boxing::steps(from, layout, self.mesh.shape()) {
            current = self.box_step(t, &info.name, &info.meta, &step, &current)?;
            self.regs.entry((t, step.to.clone())).or_insert_with(|| current.clone());
        }
        // Axes of size 1 need no step: the registers are the same.
        self.regs.insert((t, layout.clone()), current.clone());
        Ok(current)
    }

    fn box_step(
        &mut self,
        t: TensorId,
        name: &str,
        meta: &TensorMeta,
        step: &boxing::Step,
        inputs: &[RegstDescId],
    ) -> Result<Vec<RegstDescId>, String> {
        let id = self.boxings;
        self.boxings += 1;
        let axis = step.axis;
        let p = self.mesh.shape()[axis];
        let (from, to) = (step.from.0[axis], step.to.0[axis]);
        let key = (self.ready_at.get(&t).copied().unwrap_or(0), id);
        let mut outputs = Vec::with_capacity(self.mesh.size());
        for (rank, input) in inputs.iter().enumerate() {
            let coords = self.mesh.coords(rank);
            let out_meta = local_meta(meta, &step.to, self.mesh, &coords);
            // The tensor as the group along `axis` sees it: `axis` taken as Broadcast.
            let mut whole = step.from.clone();
            whole.0[axis] = Sbp::Broadcast;
            let group_shape = local_region(&meta.shape, &whole, self.mesh, &coords).0;
            let member = coords[axis];
            let collective = |op: CollectiveOp| CollectiveConf {
                group: format!("box{id}:{name}:{}:{}", self.mesh.axes()[axis], group_index(self.mesh, rank, axis)),
                rank: member as u32,
                size: p as u32,
                op,
                dtype: meta.dtype,
                shape: group_shape.0.clone(),
            };
            let local_op: Option<Arc<dyn OpDef>> = match (from, to) {
                (Sbp::Broadcast, Sbp::Split(dim)) => Some(Arc::new(TakePart { dim, parts: p, index: member })),
                (Sbp::Broadcast, Sbp::Partial) => Some(Arc::new(KeepOnFirst { first: member == 0 })),
                _ => None,
            };
            let actor_name = format!("box{id}:{from}->{to}:{name}@{rank}");
            let actor = match local_op {
                Some(op) => {
                    let in_meta = local_meta(meta, &step.from, self.mesh, &coords);
                    let actor = self.b.actor(
                        &actor_name,
                        self.devices.compute[rank],
                        ActorKind::Compute { kernel: KernelConf::Custom { name: actor_name.clone() } },
                    );
                    self.kernels.push(CompiledKernel {
                        name: actor_name.clone(),
                        op,
                        inputs: vec![in_meta],
                        input_map: vec![0],
                        outputs: vec![out_meta.clone()],
                    });
                    actor
                }
                None => {
                    let op = match (from, to) {
                        (Sbp::Partial, Sbp::Broadcast) => CollectiveOp::AllReduce,
                        (Sbp::Partial, Sbp::Split(dim)) => CollectiveOp::ReduceScatter { dim },
                        (Sbp::Split(dim), Sbp::Broadcast) => CollectiveOp::AllGather { dim },
                        (Sbp::Split(from), Sbp::Split(to)) => CollectiveOp::AllToAll { from, to },
                        _ => return Err(format!("no direct boxing {from} -> {to} (broken invariant)")),
                    };
                    let conf = collective(op);
                    if !self.groups.iter().any(|(_, g)| *g == conf.group) {
                        self.groups.push((key, conf.group.clone()));
                    }
                    let stream = self.comm_stream(rank);
                    let actor =
                        self.b.actor(&actor_name, stream, ActorKind::Compute { kernel: KernelConf::Collective(conf) });
                    self.issued.push(Issued { key, rank, actor });
                    actor
                }
            };
            self.b.consume(actor, *input);
            if self.unpaced.contains(&t) {
                if let Some(tick) = self.tick.get(rank) {
                    self.b.consume(actor, *tick);
                }
            }
            outputs.push(self.b.regst(&format!("{actor_name}.out"), actor, out_meta.bytes() as u64, self.register_num));
        }
        Ok(outputs)
    }

    /// Chains every device's collectives in the global order, closed by a step token.
    fn order_collectives(&mut self) {
        self.issued.sort_by_key(|i| i.key);
        for rank in 0..self.mesh.size() {
            let mine: Vec<ActorIndex> = self.issued.iter().filter(|i| i.rank == rank).map(|i| i.actor).collect();
            if mine.len() < 2 {
                continue;
            }
            for pair in mine.windows(2) {
                let token = self.b.regst(&format!("comm_order@{rank}:{}", pair[0].0), pair[0], 0, 1);
                self.b.consume(pair[1], token);
            }
            let token = self.b.regst(&format!("comm_step_token@{rank}"), mine[mine.len() - 1], 0, 1);
            self.b.preload(token, 1);
            self.b.consume(mine[0], token);
        }
    }
}

/// Index of `rank`'s group among the groups along `axis` (its coordinates elsewhere).
fn group_index(mesh: &Mesh, rank: usize, axis: usize) -> usize {
    let coords = mesh.coords(rank);
    coords.iter().zip(mesh.shape()).enumerate().filter(|(a, _)| *a != axis).fold(0, |g, (_, (c, n))| g * n + c)
}

impl Graph {
    /// Lowers one step (`fetch`, plus `updates` as `(variable, next value)`) onto the
    /// devices of `options.mesh`. Fetches are delivered whole (made `Broadcast`) by sinks
    /// on the first device.
    pub fn compile_parallel(
        &self,
        fetch: &[Tensor<'_>],
        updates: &[(Tensor<'_>, Tensor<'_>)],
        options: &ParallelOptions,
    ) -> Result<CompiledGraph, GraphError> {
        let nodes = self.nodes();
        let count = self.tensor_count();
        let compile_error = |message: String| GraphError::Op { op: "compile".into(), inputs: vec![], message };
        let mesh = &options.mesh;
        let size = mesh.size();
        let mut needed = vec![false; count];
        for t in fetch.iter().chain(updates.iter().map(|(_, new)| new)) {
            needed[t.id().0 as usize] = true;
        }
        for node in nodes.iter().rev() {
            if node.outputs.iter().any(|o| needed[o.0 as usize]) {
                for i in &node.inputs {
                    needed[i.0 as usize] = true;
                }
            }
        }
        let infer_options = layout::InferOptions {
            mesh,
            follow: &options.follow,
            dataset_inputs: options.dataset.iter().flat_map(|d| d.inputs.iter().map(String::as_str)).collect(),
            updates: updates.iter().map(|(v, new)| (v.id(), new.id())).collect(),
        };
        let layouts = layout::infer(self, &nodes, &needed, &infer_options)?;
        let layout_of = |map: &HashMap<TensorId, NdSbp>, t: TensorId| {
            map.get(&t).cloned().ok_or_else(|| compile_error(format!("'{}' has no layout", self.info(t).name)))
        };

        let mut b = PlanBuilder::new();
        let mut devices = Devices { compute: Vec::new(), comm: vec![None; size], device: Vec::new() };
        for d in mesh.devices() {
            let device = b.device(d.node, d.kind, d.index);
            devices.device.push(device);
            devices.compute.push(b.stream(device, StreamKind::Compute));
        }
        let mut low = Lowering {
            graph: self,
            mesh,
            b,
            devices,
            regs: HashMap::new(),
            ready_at: HashMap::new(),
            kernels: Vec::new(),
            issued: Vec::new(),
            groups: Vec::new(),
            boxings: 0,
            register_num: options.activation_register_num,
            unpaced: std::collections::HashSet::new(),
            tick: Vec::new(),
        };
        for (n, node) in nodes.iter().enumerate() {
            for o in &node.outputs {
                low.ready_at.insert(*o, n + 1);
            }
        }
        let mut compiled = CompiledGraph {
            plan: Plan::empty(),
            kernels: Vec::new(),
            inputs: Vec::new(),
            fetches: Vec::new(),
            variables: Vec::new(),
            accumulators: Vec::new(),
            parallel: None,
        };
        let mut info = ParallelInfo {
            mesh: mesh.clone(),
            inputs: Vec::new(),
            fetch_layouts: Vec::new(),
            fetch_parts: Vec::new(),
            layouts: Vec::new(),
            collectives: Vec::new(),
        };

        // Inputs: per device a dataset source or a fed source of the local part.
        let mut tick: Option<TensorId> = None;
        if let Some(dataset) = &options.dataset {
            let mut regs: Vec<Vec<RegstDescId>> = vec![Vec::new(); dataset.inputs.len()];
            let mut ids = Vec::new();
            for name in &dataset.inputs {
                let t =
                    self.by_name(name).filter(|t| matches!(self.info(t.id()).source, TensorSource::Input)).ok_or_else(
                        || compile_error(format!("the dataset produces '{name}', which is not an input of the graph")),
                    )?;
                ids.push(t.id());
            }
            for rank in 0..size {
                let source = low.b.actor(
                    &format!("dataset@{rank}"),
                    low.devices.compute[rank],
                    ActorKind::Source {
                        pieces: SourcePieces::Custom { count: dataset.pieces, kernel: dataset.kernel.clone() },
                    },
                );
                for (k, id) in ids.iter().enumerate() {
                    let meta = self.info(*id).meta;
                    regs[k].push(low.b.regst(
                        &format!("{}@{rank}", self.info(*id).name),
                        source,
                        meta.bytes() as u64,
                        options.input_register_num,
                    ));
                }
            }
            for (id, r) in ids.iter().zip(regs) {
                low.regs.insert((*id, NdSbp::broadcast(mesh.ndim())), r);
                tick.get_or_insert(*id);
            }
        }
        for (i, &is_needed) in needed.iter().enumerate() {
            let id = TensorId(i as u32);
            let t_info = self.info(id);
            let produced = match layouts.produced.get(&id) {
                Some(l) => l.clone(),
                None => continue,
            };
            if !is_needed
                || !matches!(t_info.source, TensorSource::Input)
                || low.regs.contains_key(&(id, produced.clone()))
            {
                continue;
            }
            let mut parts = Vec::new();
            let mut regs = Vec::new();
            for rank in 0..size {
                let local = local_meta(&t_info.meta, &produced, mesh, &mesh.coords(rank));
                let actor_name = format!("input:{}@{rank}", t_info.name);
                let source = low.b.actor(
                    &actor_name,
                    low.devices.compute[rank],
                    ActorKind::Source { pieces: SourcePieces::Fed },
                );
                regs.push(low.b.regst(
                    &format!("{}@{rank}", t_info.name),
                    source,
                    local.bytes() as u64,
                    options.input_register_num,
                ));
                parts.push((actor_name, local));
            }
            compiled.inputs.push(CompiledInput {
                name: t_info.name.clone(),
                actor: parts[0].0.clone(),
                meta: t_info.meta.clone(),
            });
            info.inputs.push(ParallelInput { name: t_info.name.clone(), layout: produced.clone(), parts });
            low.regs.insert((id, produced), regs);
            tick.get_or_insert(id);
        }
        let tick = tick.ok_or_else(|| compile_error("the step reads no input, so nothing paces it".into()))?;
        let tick_layout = layout_of(&layouts.produced, tick)?;
        low.tick = low.regs.get(&(tick, tick_layout.clone())).cloned().unwrap_or_default();

        let mut paced: Vec<bool> =
            (0..count).map(|i| matches!(self.info(TensorId(i as u32)).source, TensorSource::Input)).collect();
        for node in &nodes {
            if node.inputs.iter().any(|i| paced[i.0 as usize]) {
                for o in &node.outputs {
                    paced[o.0 as usize] = true;
                }
            }
        }

        low.unpaced = (0..count).filter(|&i| !paced[i]).map(|i| TensorId(i as u32)).collect();

        // Ops: one compute actor per device, on local shapes.
        // (actor per rank, reads as (tensor, layout) — None = the tick)
        let mut pending: Vec<(Vec<ActorIndex>, Vec<Read>)> = Vec::new();
        let update_of: HashMap<TensorId, TensorId> = updates.iter().map(|(v, new)| (v.id(), new.id())).collect();
        for (n, node) in nodes.iter().enumerate() {
            let Some(sig) = layouts.signatures.get(&n) else { continue };
            let op_name = node.op.name();
            let in_metas: Vec<TensorMeta> = node.inputs.iter().map(|i| self.info(*i).meta).collect();
            let out_metas: Vec<TensorMeta> = node.outputs.iter().map(|o| self.info(*o).meta).collect();
            let mut reads: Vec<Option<(TensorId, NdSbp)>> = Vec::new();
            let input_map: Vec<usize> = node
                .inputs
                .iter()
                .zip(&sig.inputs)
                .map(|(t, l)| {
                    let key = Some((*t, l.clone()));
                    match reads.iter().position(|r| *r == key) {
                        Some(p) => p,
                        None => {
                            reads.push(key);
                            reads.len() - 1
                        }
                    }
                })
                .collect();
            if !node.inputs.iter().any(|i| paced[i.0 as usize]) {
                reads.push(None);
            }
            let mut actors = Vec::with_capacity(size);
            let mut out_regs: Vec<Vec<RegstDescId>> = vec![Vec::new(); node.outputs.len()];
            for rank in 0..size {
                let (op, local_in, local_out) =
                    layout::localize(&node.op, &in_metas, &out_metas, sig, mesh, &mesh.coords(rank)).map_err(
                        |message| GraphError::Op {
                            op: format!("{op_name} (node {n})"),
                            inputs: in_metas.iter().map(ToString::to_string).collect(),
                            message,
                        },
                    )?;
                let name = format!("{op_name}:{n}@{rank}");
                let actor = low.b.actor(
                    &name,
                    low.devices.compute[rank],
                    ActorKind::Compute { kernel: KernelConf::Custom { name: name.clone() } },
                );
                for (k, (o, meta)) in node.outputs.iter().zip(&local_out).enumerate() {
                    out_regs[k].push(low.b.regst(
                        &format!("{name}.{}", o.0),
                        actor,
                        meta.bytes() as u64,
                        options.activation_register_num,
                    ));
                }
                low.kernels.push(CompiledKernel {
                    name,
                    op,
                    inputs: local_in,
                    input_map: input_map.clone(),
                    outputs: local_out,
                });
                actors.push(actor);
            }
            for ((o, regs), layout) in node.outputs.iter().zip(out_regs).zip(&sig.outputs) {
                low.regs.insert((*o, layout.clone()), regs);
            }
            pending.push((actors, reads));
        }

        // Variables: per device a loop register holding its local part.
        for (i, &is_needed) in needed.iter().enumerate() {
            let id = TensorId(i as u32);
            let t_info = self.info(id);
            let TensorSource::Variable { init, .. } = &t_info.source else { continue };
            if !is_needed {
                continue;
            }
            let layout = layout_of(&layouts.produced, id)?;
            let initial = scatter(&init.value(&t_info.meta), &layout, mesh);
            let mut regs = Vec::with_capacity(size);
            match update_of.get(&id) {
                Some(new) => {
                    let new_layout = layout_of(&layouts.visible, *new)?;
                    let produced_new = layout_of(&layouts.produced, *new)?;
                    let new_regs = low.boxed(*new, &produced_new, &layout).map_err(compile_error)?;
                    let read_in_step = fetch.iter().any(|f| f.id() == *new)
                        || nodes
                            .iter()
                            .enumerate()
                            .any(|(n, node)| layouts.signatures.contains_key(&n) && node.inputs.contains(new))
                        || new_layout != layout;
                    for (rank, initial) in initial.iter().enumerate() {
                        let local = local_meta(&t_info.meta, &layout, mesh, &mesh.coords(rank));
                        let reg = if read_in_step || produced_new != layout {
                            let name = format!("assign:{}@{rank}", t_info.name);
                            let actor = low.b.actor(
                                &name,
                                low.devices.compute[rank],
                                ActorKind::Compute { kernel: KernelConf::Copy },
                            );
                            let reg = low.b.regst(&format!("{}@{rank}", t_info.name), actor, local.bytes() as u64, 2);
                            low.b.preload(reg, 1);
                            low.b.consume(actor, new_regs[rank]);
                            reg
                        } else {
                            let desc = &mut low.b.plan_mut().regst_descs[new_regs[rank].index()];
                            desc.register_num = desc.register_num.max(2);
                            desc.preloaded = 1;
                            new_regs[rank]
                        };
                        compiled.variables.push(CompiledVariable {
                            name: format!("{}@{rank}", t_info.name),
                            regst: low.b.plan_mut().regst_descs[reg.index()].name.clone(),
                            initial: initial.to_le_bytes(),
                        });
                        regs.push(reg);
                    }
                }
                None => {
                    let tick_regs = low.regs.get(&(tick, tick_layout.clone())).cloned().unwrap_or_default();
                    for (rank, initial) in initial.iter().enumerate() {
                        let local = local_meta(&t_info.meta, &layout, mesh, &mesh.coords(rank));
                        let name = format!("variable:{}@{rank}", t_info.name);
                        let actor = low.b.actor(
                            &name,
                            low.devices.compute[rank],
                            ActorKind::Compute { kernel: KernelConf::Copy },
                        );
                        let bytes = local.bytes() as u64;
                        let state = low.b.regst(&format!("{}@{rank}", t_info.name), actor, bytes, 2);
                        low.b.preload(state, 1);
                        low.b.consume(actor, state);
                        let value = low.b.regst(
                            &format!("{}@{rank}.value", t_info.name),
                            actor,
                            bytes,
                            options.activation_register_num,
                        );
                        if let Some(t) = tick_regs.get(rank) {
                            low.b.consume(actor, *t);
                        }
                        compiled.variables.push(CompiledVariable {
                            name: format!("{}@{rank}", t_info.name),
                            regst: format!("{}@{rank}", t_info.name),
                            initial: initial.to_le_bytes(),
                        });
                        regs.push(value);
                    }
                }
            }
            low.regs.insert((id, layout), regs);
        }

        // Wire every op's reads, boxing where the op needs another layout.
        for (actors, reads) in pending {
            for read in reads {
                let regs = match read {
                    None => low.regs.get(&(tick, tick_layout.clone())).cloned().unwrap_or_default(),
                    Some((t, layout)) => {
                        let from = layout_of(&layouts.visible, t)?;
                        let produced = layout_of(&layouts.produced, t)?;
                        if from != produced {
                            low.boxed(t, &produced, &from).map_err(compile_error)?;
                        }
                        low.boxed(t, &from, &layout).map_err(compile_error)?
                    }
                };
                for (actor, reg) in actors.iter().zip(regs) {
                    low.b.consume(*actor, reg);
                }
            }
        }

        // Fetches: made whole, read on the first device.
        for (k, t) in fetch.iter().enumerate() {
            let id = t.id();
            let produced = layout_of(&layouts.produced, id)?;
            let visible = layout_of(&layouts.visible, id)?;
            if visible != produced {
                low.boxed(id, &produced, &visible).map_err(compile_error)?;
            }
            let whole = low.boxed(id, &visible, &NdSbp::broadcast(mesh.ndim())).map_err(compile_error)?;
            let name = format!("fetch:{k}");
            let sink = low.b.actor(&name, low.devices.compute[0], ActorKind::Sink);
            low.b.consume(sink, whole[0]);
            compiled.fetches.push(name);
            info.fetch_layouts.push(visible.clone());
            if options.fetch_parts {
                let regs = low.boxed(id, &visible, &visible).map_err(compile_error)?;
                let mut names = Vec::new();
                for (rank, reg) in regs.iter().enumerate() {
                    let name = format!("fetch:{k}@{rank}");
                    let sink = low.b.actor(&name, low.devices.compute[rank], ActorKind::Sink);
                    low.b.consume(sink, *reg);
                    names.push(name);
                }
                info.fetch_parts.push(names);
            }
        }
        low.order_collectives();

        // Registers nobody reads still need a reader on their device.
        let unread: Vec<RegstDescId> = {
            let plan = low.b.plan_mut();
            (0..plan.regst_descs.len())
                .filter(|&r| plan.regst_descs[r].consumers.is_empty())
                .map(|r| RegstDescId(r as u32))
                .collect()
        };
        for regst in unread {
            let producer = low.b.plan_mut().regst_descs[regst.index()].producer;
            let stream = low.b.plan_mut().actors[producer.index()].stream;
            let device = low.b.plan_mut().streams[stream.index()].device;
            let rank = low.devices.device.iter().position(|d| *d == device).unwrap_or(0);
            let sink = low.b.actor(&format!("discard:{}", regst.0), low.devices.compute[rank], ActorKind::Sink);
            low.b.consume(sink, regst);
        }

        let mut groups = low.groups.clone();
        groups.sort_by_key(|(key, _)| *key);
        info.collectives = groups.into_iter().map(|(_, g)| g).collect();
        let mut named: Vec<(String, NdSbp)> =
            layouts.visible.iter().map(|(t, l)| (self.info(*t).name, l.clone())).collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        info.layouts = named;
        compiled.kernels = low.kernels;
        compiled.plan = low.b.build().map_err(|e| compile_error(e.to_string()))?;
        compiled.parallel = Some(info);
        Ok(compiled)
    }
}

/// The device kind of every device of a mesh, if they share one.
pub fn mesh_kind(mesh: &Mesh) -> Option<DeviceKind> {
    let first = mesh.devices().first()?.kind;
    mesh.devices().iter().all(|d| d.kind == first).then_some(first)
}
