//! Lowering a step onto its devices: registers per (tensor, layout, rate, mesh), boxing
//! actors, copies across placements (pipeline stage edges), rate adapters for
//! micro-batches, register counts per stage, and the per-device order of collectives.

use super::boxing;
use super::layout::{self, Layouts};
use super::{KeepOnFirst, ParallelInfo, ParallelInput, ParallelOptions, PipelineSchedule, TakePart};
use crate::compile::{accumulate_mean, CompiledGraph, CompiledInput, CompiledVariable};
use crate::dsl::{ancestors, paced, Graph, Node, Tensor, TensorId, TensorSource};
use crate::ops::OpDef;
use crate::plan::{
    ActorIndex, ActorKind, CollectiveConf, CollectiveOp, DeviceIndex, InputSignature, KernelConf, OpConf,
    OutputSignature, Plan, PlanBuilder, RegstDescId, SourcePieces, StreamIndex, StreamKind, TensorPart, VariableDesc,
};
use crate::sbp::{local_meta, local_region, part_region, Mesh, MeshDevice, NdSbp, Sbp};
use crate::tensor::TensorMeta;
use crate::GraphError;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// How often a register gets a piece: once per micro-batch or once per optimizer step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Rate {
    Micro,
    Step,
}

/// Registers of a tensor: in a layout, at a rate, on a mesh (by index), one per device.
type Key = (TensorId, NdSbp, Rate, usize);

/// Plan objects of one device.
struct Device {
    desc: MeshDevice,
    index: DeviceIndex,
    compute: StreamIndex,
    comm: HashMap<Phase, StreamIndex>,
    copy: Option<StreamIndex>,
}

/// Which comm stream of its device a collective runs on. A collective holds its stream
/// until its group arrives, so collectives that 1F1B interleaves differently on different
/// stages must not share a stream: forward collectives of micro-batch j + 1 run while
/// backward ones of micro-batch j wait for their gradients. Each phase keeps its own
/// stream (thread) and its own order; per-step collectives (of averaged gradients) a third.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Phase {
    Forward,
    Backward,
    Step,
}

/// A collective actor and its place in its device's order.
struct Issued {
    key: (usize, usize),
    slot: usize,
    phase: Phase,
    actor: ActorIndex,
}

struct Lowering<'a> {
    graph: &'a Graph,
    b: PlanBuilder,
    devices: Vec<Device>,
    meshes: Vec<Arc<Mesh>>,
    /// Pipeline stage of each mesh (its order of first use), and the number of stages.
    stage: Vec<usize>,
    stages: usize,
    mesh_of: HashMap<TensorId, usize>,
    regs: HashMap<Key, Vec<RegstDescId>>,
    rate: HashMap<TensorId, Rate>,
    /// Where each tensor's value becomes available (producing node + 1; 0 for inputs).
    ready_at: HashMap<TensorId, usize>,
    issued: Vec<Issued>,
    groups: Vec<((usize, usize), String)>,
    boxings: usize,
    options: &'a ParallelOptions,
    micro_batches: u32,
    /// Tensors that do not change with the inputs: their boxing and copies also read the tick.
    unpaced: HashSet<TensorId>,
    /// Tensors the fetches need (the forward pass): their collectives run on the forward
    /// comm stream.
    forward: HashSet<TensorId>,
    /// The tick per device slot (a register of the first input), and per-step ticks.
    tick: Vec<RegstDescId>,
    step_tick: HashMap<usize, RegstDescId>,
}

impl Lowering<'_> {
    fn slot(&self, mesh: usize, rank: usize) -> usize {
        let d = self.meshes[mesh].devices()[rank];
        self.devices.iter().position(|x| x.desc == d).unwrap_or(0)
    }

    fn comm_stream(&mut self, slot: usize, phase: Phase) -> StreamIndex {
        if let Some(s) = self.devices[slot].comm.get(&phase) {
            return *s;
        }
        let s = self.b.stream(self.devices[slot].index, StreamKind::Comm);
        self.devices[slot].comm.insert(phase, s);
        s
    }

    fn copy_stream(&mut self, slot: usize) -> StreamIndex {
        if let Some(s) = self.devices[slot].copy {
            return s;
        }
        let s = self.b.stream(self.devices[slot].index, StreamKind::Copy);
        self.devices[slot].copy = Some(s);
        s
    }

    /// Slots of a register at `rate` on `mesh`: at micro-batch rate a pipeline stage keeps
    /// `stages - stage` pieces (1F1B: enough for the micro-batches still downstream) or
    /// every micro-batch of a step (GPipe); per-step registers keep the configured count.
    fn register_num(&self, rate: Rate, mesh: usize) -> u32 {
        let base = self.options.activation_register_num.max(1);
        if rate == Rate::Step || self.stages <= 1 && self.options.schedule == PipelineSchedule::OneForwardOneBackward {
            return base;
        }
        match self.options.schedule {
            PipelineSchedule::OneForwardOneBackward => base.max((self.stages - self.stage[mesh]) as u32),
            PipelineSchedule::GPipe => base.max(self.micro_batches),
        }
    }

    fn tick_for(&mut self, slot: usize, rate: Rate) -> Option<RegstDescId> {
        let tick = *self.tick.get(slot).or(self.tick.first())?;
        if rate == Rate::Micro || self.micro_batches <= 1 {
            return Some(tick);
        }
        if let Some(t) = self.step_tick.get(&slot) {
            return Some(*t);
        }
        let stream = self.devices[slot].compute;
        let acc = self.b.actor(
            &format!("step_tick@{slot}"),
            stream,
            ActorKind::Acc { count: self.micro_batches, kernel: KernelConf::Noop },
        );
        self.b.consume(acc, tick);
        let out = self.b.regst(&format!("step_tick@{slot}.out"), acc, 0, 1);
        self.step_tick.insert(slot, out);
        Some(out)
    }

    fn name(&self, t: TensorId) -> String {
        self.graph.info(t).name
    }

    /// The registers of `t` in `layout` at `rate` on mesh `mesh`: boxing, rate adapters
    /// and copies across placements are made (once) as needed.
    fn read(
        &mut self,
        t: TensorId,
        layout: &NdSbp,
        rate: Rate,
        mesh: usize,
        layouts: &Layouts,
    ) -> Result<Vec<RegstDescId>, String> {
        let key = (t, layout.clone(), rate, mesh);
        if let Some(r) = self.regs.get(&key) {
            return Ok(r.clone());
        }
        let home = *self.mesh_of.get(&t).ok_or_else(|| format!("'{}' has no placement", self.name(t)))?;
        let regs = if home != mesh {
            // A stage edge: box on the source mesh, then copy device by device (or, between
            // meshes of different shapes, copy the whole value and cut it on arrival).
            let same_shape = self.meshes[home].shape() == self.meshes[mesh].shape();
            let there = if same_shape { layout.clone() } else { NdSbp::broadcast(self.meshes[home].ndim()) };
            let source = self.read(t, &there, rate, home, layouts)?;
            let here = if same_shape { layout.clone() } else { NdSbp::broadcast(self.meshes[mesh].ndim()) };
            let copied = self.copy(t, &source, &here, rate, home, mesh)?;
            self.regs.insert((t, here.clone(), rate, mesh), copied.clone());
            if same_shape {
                copied
            } else {
                self.boxed(t, &here, layout, rate, mesh)?
            }
        } else {
            let own = *self.rate.get(&t).unwrap_or(&Rate::Micro);
            let produced =
                layouts.produced.get(&t).cloned().ok_or_else(|| format!("'{}' has no layout", self.name(t)))?;
            let visible = layouts.visible.get(&t).cloned().unwrap_or_else(|| produced.clone());
            match (own, rate) {
                (a, b) if a == b => {
                    if visible != produced {
                        self.boxed(t, &produced, &visible, own, mesh)?;
                    }
                    self.boxed(t, &visible, layout, own, mesh)?
                }
                (Rate::Micro, Rate::Step) => {
                    // Average over the micro-batches first (in the layout it was made in:
                    // the mean of summands is a summand of the mean), then box once per step.
                    let own_regs = self.read(t, &produced, Rate::Micro, mesh, layouts)?;
                    let averaged = self.accumulate(t, &produced, &own_regs, mesh)?;
                    self.regs.insert((t, produced.clone(), Rate::Step, mesh), averaged);
                    self.boxed(t, &produced, layout, Rate::Step, mesh)?
                }
                _ => {
                    // Once per step, handed to every micro-batch, then boxed per micro-batch:
                    // boxing it per step would have to wait for a tick of the whole step
                    // (all its micro-batches' inputs), which the pipeline cannot hold.
                    let stepped = self.read(t, &visible, Rate::Step, mesh, layouts)?;
                    let handed = self.repeat(t, &stepped, mesh)?;
                    self.regs.insert((t, visible.clone(), Rate::Micro, mesh), handed);
                    self.boxed(t, &visible, layout, Rate::Micro, mesh)?
                }
            }
        };
        self.regs.insert(key, regs.clone());
        Ok(regs)
    }

    /// Per-device mean over a step's micro-batches.
    fn accumulate(
        &mut self,
        t: TensorId,
        layout: &NdSbp,
        inputs: &[RegstDescId],
        mesh: usize,
    ) -> Result<Vec<RegstDescId>, String> {
        let meta = self.graph.info(t).meta;
        let m = self.meshes[mesh].clone();
        let mut out = Vec::new();
        for (rank, input) in inputs.iter().enumerate() {
            let slot = self.slot(mesh, rank);
            let name = format!("accumulate:{}@{slot}", self.name(t));
            let a = self.b.actor(
                &name,
                self.devices[slot].compute,
                ActorKind::Acc {
                    count: self.micro_batches,
                    kernel: accumulate_mean(&local_meta(&meta, layout, &m, &m.coords(rank))),
                },
            );
            self.b.consume(a, *input);
            let bytes = local_meta(&meta, layout, &m, &m.coords(rank)).bytes() as u64;
            out.push(self.b.regst(&format!("{name}.out"), a, bytes, self.register_num(Rate::Step, mesh)));
        }
        Ok(out)
    }

    /// Per-device repeat of a per-step value to every micro-batch (no copy).
    fn repeat(&mut self, t: TensorId, inputs: &[RegstDescId], mesh: usize) -> Result<Vec<RegstDescId>, String> {
        let mut out = Vec::new();
        for (rank, input) in inputs.iter().enumerate() {
            let slot = self.slot(mesh, rank);
            let name = format!("repeat{}:{}@{slot}", self.boxings, self.name(t));
            self.boxings += 1;
            let r = self.b.actor(&name, self.devices[slot].compute, ActorKind::Repeat { count: self.micro_batches });
            self.b.consume(r, *input);
            // As many micro-batches as the stage keeps in flight may hold the value at once
            // (the repeat hands out the same register, so more slots cost no memory): with
            // one, the forward of micro-batch j + 1 would wait for the backward of j.
            let bytes = self.b.plan_mut().regst_descs[input.index()].bytes;
            let slots = self.register_num(Rate::Micro, mesh);
            out.push(self.b.regst(&format!("{name}.out"), r, bytes, slots));
        }
        Ok(out)
    }

    /// Copies across placements: one copy actor per destination device, on its copy stream.
    fn copy(
        &mut self,
        t: TensorId,
        source: &[RegstDescId],
        layout: &NdSbp,
        rate: Rate,
        from: usize,
        to: usize,
    ) -> Result<Vec<RegstDescId>, String> {
        let meta = self.graph.info(t).meta;
        let dest = self.meshes[to].clone();
        let same_shape = self.meshes[from].shape() == dest.shape();
        let mut out = Vec::new();
        for rank in 0..dest.size() {
            let slot = self.slot(to, rank);
            let input = if same_shape { source[rank] } else { source[0] };
            let name = format!("copy{}:{}@{slot}", self.boxings, self.name(t));
            self.boxings += 1;
            let stream = self.copy_stream(slot);
            let actor = self.b.actor(&name, stream, ActorKind::Compute { kernel: KernelConf::Copy });
            self.b.consume(actor, input);
            if self.unpaced.contains(&t) {
                if let Some(tick) = self.tick_for(slot, rate) {
                    self.b.consume(actor, tick);
                }
            }
            let bytes = local_meta(&meta, layout, &dest, &dest.coords(rank)).bytes() as u64;
            out.push(self.b.regst(&format!("{name}.out"), actor, bytes, self.register_num(rate, to)));
        }
        Ok(out)
    }

    /// The registers of `t` in `layout`, boxing on `mesh` from those in `from`.
    fn boxed(
        &mut self,
        t: TensorId,
        from: &NdSbp,
        layout: &NdSbp,
        rate: Rate,
        mesh: usize,
    ) -> Result<Vec<RegstDescId>, String> {
        if let Some(r) = self.regs.get(&(t, layout.clone(), rate, mesh)) {
            return Ok(r.clone());
        }
        let mut current = self
            .regs
            .get(&(t, from.clone(), rate, mesh))
            .cloned()
            .ok_or_else(|| format!("tensor '{}' has no registers (broken invariant)", self.name(t)))?;
        let info = self.graph.info(t);
        let shape = self.meshes[mesh].shape().to_vec();
        for step in boxing::steps(from, layout, &shape) {
            current = self.box_step(t, &info.name, &info.meta, &step, &current, rate, mesh)?;
            self.regs.entry((t, step.to.clone(), rate, mesh)).or_insert_with(|| current.clone());
        }
        // Axes of size 1 need no step: the registers are the same.
        self.regs.insert((t, layout.clone(), rate, mesh), current.clone());
        Ok(current)
    }

    #[allow(clippy::too_many_arguments)]
    fn box_step(
        &mut self,
        t: TensorId,
        name: &str,
        meta: &TensorMeta,
        step: &boxing::Step,
        inputs: &[RegstDescId],
        rate: Rate,
        mesh_index: usize,
    ) -> Result<Vec<RegstDescId>, String> {
        let id = self.boxings;
        self.boxings += 1;
        let mesh = self.meshes[mesh_index].clone();
        let axis = step.axis;
        let p = mesh.shape()[axis];
        let (from, to) = (step.from.0[axis], step.to.0[axis]);
        let key = (self.ready_at.get(&t).copied().unwrap_or(0), id);
        let mut outputs = Vec::with_capacity(mesh.size());
        for (rank, input) in inputs.iter().enumerate() {
            let slot = self.slot(mesh_index, rank);
            let coords = mesh.coords(rank);
            let out_meta = local_meta(meta, &step.to, &mesh, &coords);
            // The tensor as the group along `axis` sees it: `axis` taken as Broadcast.
            let mut whole = step.from.clone();
            whole.0[axis] = Sbp::Broadcast;
            let group_shape = local_region(&meta.shape, &whole, &mesh, &coords).0;
            let member = coords[axis];
            let local_op: Option<Arc<dyn OpDef>> = match (from, to) {
                (Sbp::Broadcast, Sbp::Split(dim)) => Some(Arc::new(TakePart { dim, parts: p, index: member })),
                (Sbp::Broadcast, Sbp::Partial) => Some(Arc::new(KeepOnFirst { first: member == 0 })),
                _ => None,
            };
            let actor_name = format!("box{id}:{from}->{to}:{name}@{slot}");
            let actor = match local_op {
                Some(op) => {
                    let in_meta = local_meta(meta, &step.from, &mesh, &coords);
                    let conf = OpConf::new(&*op, vec![in_meta], vec![0], vec![out_meta.clone()]);
                    self.b.actor(
                        &actor_name,
                        self.devices[slot].compute,
                        ActorKind::Compute { kernel: KernelConf::Op(conf) },
                    )
                }
                None => {
                    let op = match (from, to) {
                        (Sbp::Partial, Sbp::Broadcast) => CollectiveOp::AllReduce,
                        (Sbp::Partial, Sbp::Split(dim)) => CollectiveOp::ReduceScatter { dim },
                        (Sbp::Split(dim), Sbp::Broadcast) => CollectiveOp::AllGather { dim },
                        (Sbp::Split(from), Sbp::Split(to)) => CollectiveOp::AllToAll { from, to },
                        _ => return Err(format!("no direct boxing {from} -> {to} (broken invariant)")),
                    };
                    let conf = CollectiveConf {
                        group: format!("box{id}:{name}:{}:{}", mesh.axes()[axis], group_index(&mesh, rank, axis)),
                        rank: member as u32,
                        size: p as u32,
                        op,
                        dtype: meta.dtype,
                        shape: group_shape.0.clone(),
                    };
                    if !self.groups.iter().any(|(_, g)| *g == conf.group) {
                        self.groups.push((key, conf.group.clone()));
                    }
                    let phase = match rate {
                        Rate::Step => Phase::Step,
                        Rate::Micro if self.forward.contains(&t) => Phase::Forward,
                        Rate::Micro => Phase::Backward,
                    };
                    let stream = self.comm_stream(slot, phase);
                    let actor =
                        self.b.actor(&actor_name, stream, ActorKind::Compute { kernel: KernelConf::Collective(conf) });
                    self.issued.push(Issued { key, slot, phase, actor });
                    actor
                }
            };
            self.b.consume(actor, *input);
            if self.unpaced.contains(&t) {
                if let Some(tick) = self.tick_for(slot, rate) {
                    self.b.consume(actor, tick);
                }
            }
            outputs.push(self.b.regst(
                &format!("{actor_name}.out"),
                actor,
                out_meta.bytes() as u64,
                self.register_num(rate, mesh_index),
            ));
        }
        Ok(outputs)
    }

    /// Chains every comm stream's collectives in the global order (when their input is
    /// made), closed by a token back to the first, so every device issues them in one order
    /// step after step (or micro-batch after micro-batch).
    fn order_collectives(&mut self) {
        self.issued.sort_by_key(|i| i.key);
        let mut chains: Vec<((usize, Phase), Vec<ActorIndex>)> = Vec::new();
        for i in &self.issued {
            match chains.iter_mut().find(|(k, _)| *k == (i.slot, i.phase)) {
                Some((_, chain)) => chain.push(i.actor),
                None => chains.push(((i.slot, i.phase), vec![i.actor])),
            }
        }
        for ((slot, phase), chain) in chains {
            if chain.len() < 2 {
                continue;
            }
            for pair in chain.windows(2) {
                let token = self.b.regst(&format!("comm_order@{slot}:{}", pair[0].0), pair[0], 0, 1);
                self.b.consume(pair[1], token);
            }
            let token = self.b.regst(&format!("comm_token@{slot}:{phase:?}"), chain[chain.len() - 1], 0, 1);
            self.b.preload(token, 1);
            self.b.consume(chain[0], token);
        }
    }
}

/// Index of `rank`'s group among the groups along `axis` (its coordinates elsewhere).
fn group_index(mesh: &Mesh, rank: usize, axis: usize) -> usize {
    let coords = mesh.coords(rank);
    coords.iter().zip(mesh.shape()).enumerate().filter(|(a, _)| *a != axis).fold(0, |g, (_, (c, n))| g * n + c)
}

/// The mesh of every tensor the step needs: its placement, or its consumers' (constants,
/// the optimizer's step counter and state), or the default mesh.
fn placements(graph: &Graph, nodes: &[Node], needed: &[bool], default: &Mesh) -> HashMap<TensorId, Arc<Mesh>> {
    let mut mesh: HashMap<TensorId, Arc<Mesh>> = HashMap::new();
    for (i, &is_needed) in needed.iter().enumerate() {
        let id = TensorId(i as u32);
        if let (true, Some(m)) = (is_needed, graph.placement(id)) {
            mesh.insert(id, m);
        }
    }
    for node in nodes.iter().rev() {
        let Some(m) = node.outputs.iter().find_map(|o| mesh.get(o).cloned()) else { continue };
        for i in &node.inputs {
            if needed[i.0 as usize] {
                mesh.entry(*i).or_insert_with(|| m.clone());
            }
        }
    }
    let default = Arc::new(default.clone());
    for (i, &is_needed) in needed.iter().enumerate() {
        if is_needed {
            mesh.entry(TensorId(i as u32)).or_insert_with(|| default.clone());
        }
    }
    // Op outputs follow their (now placed) inputs when they had no placement of their own.
    for node in nodes {
        if node.outputs.iter().any(|o| graph.placement(*o).is_some()) {
            continue;
        }
        if let Some(m) = node.inputs.iter().find_map(|i| graph.placement(*i)) {
            for o in &node.outputs {
                if needed[o.0 as usize] {
                    mesh.insert(*o, m.clone());
                }
            }
        }
    }
    mesh
}

/// Lowers one step: see [`Graph::compile_parallel`].
pub(super) fn compile(
    graph: &Graph,
    fetch: &[Tensor<'_>],
    updates: &[(Tensor<'_>, Tensor<'_>)],
    options: &ParallelOptions,
) -> Result<CompiledGraph, GraphError> {
    let nodes = graph.nodes();
    let count = graph.tensor_count();
    let compile_error = |message: String| GraphError::Op { op: "compile".into(), inputs: vec![], message };
    let needed = ancestors(&nodes, count, fetch.iter().chain(updates.iter().map(|(_, new)| new)).map(|t| t.id()));
    let tensor_mesh = placements(graph, &nodes, &needed, &options.mesh);
    let infer_options = layout::InferOptions {
        meshes: &tensor_mesh,
        follow: &options.follow,
        dataset_inputs: options.dataset.iter().flat_map(|d| d.inputs.iter().map(String::as_str)).collect(),
        updates: updates.iter().map(|(v, new)| (v.id(), new.id())).collect(),
    };
    let layouts = layout::infer(graph, &nodes, &needed, &infer_options)?;
    let layout_of = |t: TensorId| {
        layouts
            .produced
            .get(&t)
            .cloned()
            .ok_or_else(|| compile_error(format!("'{}' has no layout", graph.info(t).name)))
    };

    // Meshes in the order ops first run on them (graph order: the forward pass goes
    // through the stages in order), then any only inputs or variables use: pipeline stages.
    let mut meshes: Vec<Arc<Mesh>> = Vec::new();
    let order: Vec<TensorId> =
        nodes.iter().flat_map(|n| n.outputs.iter().copied()).chain((0..count).map(|i| TensorId(i as u32))).collect();
    for t in &order {
        if let Some(m) = tensor_mesh.get(t) {
            if !meshes.iter().any(|x| **x == **m) {
                meshes.push(m.clone());
            }
        }
    }
    let mesh_of: HashMap<TensorId, usize> =
        tensor_mesh.iter().map(|(t, m)| (*t, meshes.iter().position(|x| **x == **m).unwrap_or(0))).collect();
    // Stages: meshes that share no device with an earlier one start a new stage.
    let mut stage = Vec::with_capacity(meshes.len());
    let mut stages = 0;
    for (i, m) in meshes.iter().enumerate() {
        let shared = (0..i).find(|&j| meshes[j].devices().iter().any(|d| m.devices().contains(d)));
        stage.push(match shared {
            Some(j) => stage[j],
            None => {
                stages += 1;
                stages - 1
            }
        });
    }

    let mut b = PlanBuilder::new();
    let mut devices: Vec<Device> = Vec::new();
    for m in &meshes {
        for d in m.devices() {
            if !devices.iter().any(|x| x.desc == *d) {
                let index = b.device(d.node, d.kind, d.index);
                let compute = b.stream(index, StreamKind::Compute);
                devices.push(Device { desc: *d, index, compute, comm: HashMap::new(), copy: None });
            }
        }
    }
    let micro_batches = options.accumulate.as_ref().map_or(1, |a| a.micro_batches.max(1));
    let mut low = Lowering {
        graph,
        b,
        devices,
        meshes,
        stage,
        stages,
        mesh_of,
        regs: HashMap::new(),
        rate: HashMap::new(),
        ready_at: HashMap::new(),
        issued: Vec::new(),
        groups: Vec::new(),
        boxings: 0,
        options,
        micro_batches,
        unpaced: HashSet::new(),
        forward: HashSet::new(),
        tick: Vec::new(),
        step_tick: HashMap::new(),
    };
    for (n, node) in nodes.iter().enumerate() {
        for o in &node.outputs {
            low.ready_at.insert(*o, n + 1);
        }
    }
    let mut compiled = CompiledGraph {
        plan: Plan::empty(),
        inputs: Vec::new(),
        fetches: Vec::new(),
        variables: Vec::new(),
        parallel: None,
    };
    let mut variables: Vec<VariableDesc> = Vec::new();
    let mut info = ParallelInfo {
        mesh: options.mesh.clone(),
        inputs: Vec::new(),
        fetch_layouts: Vec::new(),
        fetch_parts: Vec::new(),
        layouts: Vec::new(),
        collectives: Vec::new(),
    };

    // Which tensors change with the inputs, and their rates.
    let paced = paced(graph, &nodes, count);
    low.unpaced = (0..count).filter(|&i| !paced[i]).map(|i| TensorId(i as u32)).collect();
    let mut micro = paced.clone();
    if let Some(acc) = options.accumulate.as_ref().filter(|a| a.micro_batches > 1) {
        let wanted = ancestors(&nodes, count, fetch.iter().map(|t| t.id()).chain(acc.gradients.iter().copied()));
        // Constants the micro-batches need (the loss gradient's seed) run per micro-batch
        // too: paced per step they would wait for a whole step of inputs, which the
        // pipeline's registers cannot hold.
        for (i, (m, (&p, &w))) in micro.iter_mut().zip(paced.iter().zip(&wanted)).enumerate() {
            let op_output = matches!(graph.info(TensorId(i as u32)).source, TensorSource::Op { .. });
            *m = w && (p || op_output);
        }
    } else {
        // One piece per step: everything runs at one rate.
        micro = vec![true; count];
    }
    for (i, &m) in micro.iter().enumerate() {
        low.rate.insert(TensorId(i as u32), if m { Rate::Micro } else { Rate::Step });
    }
    let step_rate = |t: TensorId| !micro[t.0 as usize];

    // Inputs: per device a dataset source or a fed source of the local part.
    let mut tick: Option<TensorId> = None;
    if let Some(dataset) = &options.dataset {
        let mut ids = Vec::new();
        for name in &dataset.inputs {
            let t =
                graph.by_name(name).filter(|t| matches!(graph.info(t.id()).source, TensorSource::Input)).ok_or_else(
                    || compile_error(format!("the dataset produces '{name}', which is not an input of the graph")),
                )?;
            ids.push(t.id());
        }
        let mesh = ids.first().and_then(|t| low.mesh_of.get(t).copied()).unwrap_or(0);
        if ids.iter().any(|t| low.mesh_of.get(t) != Some(&mesh)) {
            return Err(compile_error("the dataset's inputs must share one placement".into()));
        }
        let m = low.meshes[mesh].clone();
        let mut regs: Vec<Vec<RegstDescId>> = vec![Vec::new(); ids.len()];
        let slots = low.register_num(Rate::Micro, mesh).max(options.input_register_num);
        for rank in 0..m.size() {
            let slot = low.slot(mesh, rank);
            let source = low.b.actor(
                &format!("dataset@{slot}"),
                low.devices[slot].compute,
                ActorKind::Source { pieces: dataset.source.clone() },
            );
            for (k, id) in ids.iter().enumerate() {
                let meta = graph.info(*id).meta;
                regs[k].push(low.b.regst(
                    &format!("{}@{slot}", graph.info(*id).name),
                    source,
                    meta.bytes() as u64,
                    slots,
                ));
            }
        }
        for (id, r) in ids.iter().zip(regs) {
            low.regs.insert((*id, NdSbp::broadcast(m.ndim()), Rate::Micro, mesh), r);
            tick.get_or_insert(*id);
        }
    }
    for (i, &is_needed) in needed.iter().enumerate() {
        let id = TensorId(i as u32);
        let t_info = graph.info(id);
        if !is_needed || !matches!(t_info.source, TensorSource::Input) {
            continue;
        }
        let produced = layout_of(id)?;
        let mesh = low.mesh_of[&id];
        if low.regs.contains_key(&(id, produced.clone(), Rate::Micro, mesh)) {
            continue;
        }
        let m = low.meshes[mesh].clone();
        let slots = low.register_num(Rate::Micro, mesh).max(options.input_register_num);
        let mut parts = Vec::new();
        let mut regs = Vec::new();
        let mut fed_parts = Vec::new();
        for rank in 0..m.size() {
            let slot = low.slot(mesh, rank);
            let local = local_meta(&t_info.meta, &produced, &m, &m.coords(rank));
            let actor_name = format!("input:{}@{slot}", t_info.name);
            let source =
                low.b.actor(&actor_name, low.devices[slot].compute, ActorKind::Source { pieces: SourcePieces::Fed });
            regs.push(low.b.regst(&format!("{}@{slot}", t_info.name), source, local.bytes() as u64, slots));
            parts.push((actor_name, local));
            let region = part_region(&t_info.meta.shape, &produced, &m, &m.coords(rank));
            fed_parts.push(TensorPart { actor: source, region });
        }
        low.b.plan_mut().signature.inputs.push(InputSignature {
            name: t_info.name.clone(),
            meta: t_info.meta.clone(),
            parts: fed_parts,
        });
        compiled.inputs.push(CompiledInput {
            name: t_info.name.clone(),
            actor: parts[0].0.clone(),
            meta: t_info.meta.clone(),
        });
        info.inputs.push(ParallelInput {
            name: t_info.name.clone(),
            layout: produced.clone(),
            parts,
            mesh: (*m).clone(),
        });
        low.regs.insert((id, produced, Rate::Micro, mesh), regs);
        tick.get_or_insert(id);
    }
    let tick = tick.ok_or_else(|| compile_error("the step reads no input, so nothing paces it".into()))?;
    let tick_mesh = low.mesh_of[&tick];
    let tick_regs = low.regs.get(&(tick, layout_of(tick)?, Rate::Micro, tick_mesh)).cloned().unwrap_or_default();
    // Every device has a tick of its own (a zero-byte register, so a register is not read
    // by every paced op of every device), from the tick of the device at its rank on the
    // tick's mesh (or its first).
    for slot in 0..low.devices.len() {
        let tm = low.meshes[tick_mesh].clone();
        let rank = tm.devices().iter().position(|d| *d == low.devices[slot].desc).unwrap_or(0);
        let source = tick_regs
            .get(rank)
            .copied()
            .or(tick_regs.first().copied())
            .ok_or_else(|| compile_error("no tick (broken invariant)".into()))?;
        let home =
            (0..low.meshes.len()).find(|&m| low.meshes[m].devices().contains(&low.devices[slot].desc)).unwrap_or(0);
        let actor = low.b.actor(
            &format!("tick@{slot}"),
            low.devices[slot].compute,
            ActorKind::Compute { kernel: KernelConf::Noop },
        );
        low.b.consume(actor, source);
        let slots = low.register_num(Rate::Micro, home).max(options.input_register_num);
        let tick = low.b.regst(&format!("tick@{slot}.out"), actor, 0, slots);
        low.tick.push(tick);
    }

    // Forward ops (what the fetches need): under GPipe their stage's backward waits for them.
    let forward = ancestors(&nodes, count, fetch.iter().map(|t| t.id()));
    low.forward = (0..count).filter(|&i| forward[i]).map(|i| TensorId(i as u32)).collect();

    // Ops: one compute actor per device of their mesh, on local shapes.
    struct Pending {
        actors: Vec<ActorIndex>,
        mesh: usize,
        rate: Rate,
        reads: Vec<Option<(TensorId, NdSbp)>>,
        forward: bool,
        node: usize,
    }
    let mut pending: Vec<Pending> = Vec::new();
    let update_of: HashMap<TensorId, TensorId> = updates.iter().map(|(v, new)| (v.id(), new.id())).collect();
    for (n, node) in nodes.iter().enumerate() {
        let Some(sig) = layouts.signatures.get(&n) else { continue };
        let Some(first) = node.outputs.first() else { continue };
        let mesh = low.mesh_of[first];
        let m = low.meshes[mesh].clone();
        let rate = if step_rate(*first) { Rate::Step } else { Rate::Micro };
        let op_name = node.op.name();
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
        let mut actors = Vec::with_capacity(m.size());
        let mut out_regs: Vec<Vec<RegstDescId>> = vec![Vec::new(); node.outputs.len()];
        for rank in 0..m.size() {
            let slot = low.slot(mesh, rank);
            let (op, local_in, local_out) =
                layouts.local.get(&n).and_then(|ops| ops.get(rank)).cloned().ok_or_else(|| {
                    compile_error(format!("{op_name} (node {n}) has no op for rank {rank} (broken invariant)"))
                })?;
            let name = format!("{op_name}:{n}@{slot}");
            let conf = OpConf::new(&*op, local_in, input_map.clone(), local_out.clone());
            let actor =
                low.b.actor(&name, low.devices[slot].compute, ActorKind::Compute { kernel: KernelConf::Op(conf) });
            let slots = low.register_num(rate, mesh);
            for (k, (o, meta)) in node.outputs.iter().zip(&local_out).enumerate() {
                out_regs[k].push(low.b.regst(&format!("{name}.{}", o.0), actor, meta.bytes() as u64, slots));
            }
            actors.push(actor);
        }
        for ((o, regs), layout) in node.outputs.iter().zip(out_regs).zip(&sig.outputs) {
            low.regs.insert((*o, layout.clone(), rate, mesh), regs);
        }
        pending.push(Pending {
            actors,
            mesh,
            rate,
            reads,
            forward: node.outputs.iter().any(|o| forward[o.0 as usize]),
            node: n,
        });
    }

    // Variables: per device a loop register holding its local part, once per step.
    for (i, &is_needed) in needed.iter().enumerate() {
        let id = TensorId(i as u32);
        let t_info = graph.info(id);
        let TensorSource::Variable { init, .. } = &t_info.source else { continue };
        if !is_needed {
            continue;
        }
        let layout = layout_of(id)?;
        let mesh = low.mesh_of[&id];
        let m = low.meshes[mesh].clone();
        let rate = low.rate[&id];
        let mut regs = Vec::with_capacity(m.size());
        match update_of.get(&id) {
            Some(new) => {
                let new_regs = low.read(*new, &layout, rate, mesh, &layouts).map_err(compile_error)?;
                let produced_new = layout_of(*new)?;
                let direct = low.mesh_of.get(new) == Some(&mesh)
                    && produced_new == layout
                    && low.rate.get(new) == Some(&rate)
                    && !fetch.iter().any(|f| f.id() == *new)
                    && !nodes
                        .iter()
                        .enumerate()
                        .any(|(n, node)| layouts.signatures.contains_key(&n) && node.inputs.contains(new))
                    && layouts.visible.get(new) == Some(&layout);
                for (rank, &new_reg) in new_regs.iter().enumerate() {
                    let slot = low.slot(mesh, rank);
                    let local = local_meta(&t_info.meta, &layout, &m, &m.coords(rank));
                    let reg = if direct {
                        let desc = &mut low.b.plan_mut().regst_descs[new_reg.index()];
                        desc.register_num = desc.register_num.max(2);
                        desc.preloaded = 1;
                        new_reg
                    } else {
                        let name = format!("assign:{}@{slot}", t_info.name);
                        let actor = low.b.actor(
                            &name,
                            low.devices[slot].compute,
                            ActorKind::Compute { kernel: KernelConf::Copy },
                        );
                        let reg = low.b.regst(&format!("{}@{slot}", t_info.name), actor, local.bytes() as u64, 2);
                        low.b.preload(reg, 1);
                        low.b.consume(actor, new_reg);
                        reg
                    };
                    compiled.variables.push(CompiledVariable {
                        name: format!("{}@{slot}", t_info.name),
                        regst: low.b.plan_mut().regst_descs[reg.index()].name.clone(),
                    });
                    variables.push(VariableDesc {
                        name: format!("{}@{slot}", t_info.name),
                        regst: reg,
                        meta: t_info.meta.clone(),
                        init: init.clone(),
                        region: part_region(&t_info.meta.shape, &layout, &m, &m.coords(rank)),
                    });
                    regs.push(reg);
                }
            }
            None => {
                for rank in 0..m.size() {
                    let slot = low.slot(mesh, rank);
                    let local = local_meta(&t_info.meta, &layout, &m, &m.coords(rank));
                    let name = format!("variable:{}@{slot}", t_info.name);
                    let actor =
                        low.b.actor(&name, low.devices[slot].compute, ActorKind::Compute { kernel: KernelConf::Copy });
                    let bytes = local.bytes() as u64;
                    let state = low.b.regst(&format!("{}@{slot}", t_info.name), actor, bytes, 2);
                    low.b.preload(state, 1);
                    low.b.consume(actor, state);
                    let value = low.b.regst(
                        &format!("{}@{slot}.value", t_info.name),
                        actor,
                        bytes,
                        low.register_num(rate, mesh),
                    );
                    if let Some(t) = low.tick_for(slot, rate) {
                        low.b.consume(actor, t);
                    }
                    compiled.variables.push(CompiledVariable {
                        name: format!("{}@{slot}", t_info.name),
                        regst: format!("{}@{slot}", t_info.name),
                    });
                    variables.push(VariableDesc {
                        name: format!("{}@{slot}", t_info.name),
                        regst: state,
                        meta: t_info.meta.clone(),
                        init: init.clone(),
                        region: part_region(&t_info.meta.shape, &layout, &m, &m.coords(rank)),
                    });
                    regs.push(value);
                }
            }
        }
        low.regs.insert((id, layout, rate, mesh), regs);
    }

    // Wire every op's reads: boxing, rate adapters and stage copies where needed.
    for p in &pending {
        for read in &p.reads {
            let regs: Vec<RegstDescId> = match read {
                None => (0..p.actors.len())
                    .map(|rank| {
                        let slot = low.slot(p.mesh, rank);
                        low.tick_for(slot, p.rate).ok_or_else(|| compile_error("no tick (broken invariant)".into()))
                    })
                    .collect::<Result<_, _>>()?,
                Some((t, layout)) => low.read(*t, layout, p.rate, p.mesh, &layouts).map_err(compile_error)?,
            };
            for (actor, reg) in p.actors.iter().zip(regs) {
                low.b.consume(*actor, reg);
            }
        }
    }

    // GPipe: a stage's backward waits for all of its step's forward micro-batches.
    if options.schedule == PipelineSchedule::GPipe && micro_batches > 1 {
        for mesh in 0..low.meshes.len() {
            let Some(last_forward) =
                pending.iter().filter(|p| p.mesh == mesh && p.forward && p.rate == Rate::Micro).max_by_key(|p| p.node)
            else {
                continue;
            };
            let last: Vec<ActorIndex> = last_forward.actors.clone();
            let backward: Vec<&Pending> =
                pending.iter().filter(|p| p.mesh == mesh && !p.forward && p.rate == Rate::Micro).collect();
            if backward.is_empty() {
                continue;
            }
            for (rank, actor) in last.iter().enumerate() {
                let slot = low.slot(mesh, rank);
                let compute = low.devices[slot].compute;
                let done = low.b.regst(&format!("forward_done@{slot}:{mesh}"), *actor, 0, 1);
                let gate = low.b.actor(
                    &format!("gpipe_gate@{slot}:{mesh}"),
                    compute,
                    ActorKind::Acc { count: micro_batches, kernel: KernelConf::Noop },
                );
                low.b.consume(gate, done);
                let gated = low.b.regst(&format!("gpipe_gate@{slot}:{mesh}.out"), gate, 0, 1);
                let fan = low.b.actor(
                    &format!("gpipe_fan@{slot}:{mesh}"),
                    compute,
                    ActorKind::Repeat { count: micro_batches },
                );
                low.b.consume(fan, gated);
                let fanned = low.b.regst(&format!("gpipe_fan@{slot}:{mesh}.out"), fan, 0, micro_batches);
                for p in &backward {
                    low.b.consume(p.actors[rank], fanned);
                }
            }
        }
    }

    // Fetches: made whole, read on the first device of their mesh.
    for (k, t) in fetch.iter().enumerate() {
        let id = t.id();
        let mesh = low.mesh_of[&id];
        let rate = low.rate[&id];
        let visible = layouts.visible.get(&id).cloned().unwrap_or(layout_of(id)?);
        let whole =
            low.read(id, &NdSbp::broadcast(low.meshes[mesh].ndim()), rate, mesh, &layouts).map_err(compile_error)?;
        let name = format!("fetch:{k}");
        let slot = low.slot(mesh, 0);
        let sink = low.b.actor(&name, low.devices[slot].compute, ActorKind::Sink);
        low.b.consume(sink, whole[0]);
        low.b.plan_mut().signature.outputs.push(OutputSignature { name: name.clone(), meta: t.meta(), actor: sink });
        compiled.fetches.push(name);
        info.fetch_layouts.push(visible.clone());
        if options.fetch_parts {
            let regs = low.read(id, &visible, rate, mesh, &layouts).map_err(compile_error)?;
            let mut names = Vec::new();
            for (rank, reg) in regs.iter().enumerate() {
                let slot = low.slot(mesh, rank);
                let name = format!("fetch:{k}@{rank}");
                let sink = low.b.actor(&name, low.devices[slot].compute, ActorKind::Sink);
                low.b.consume(sink, *reg);
                names.push(name);
            }
            info.fetch_parts.push(names);
        }
    }
    low.order_collectives();

    // Registers nobody reads still need a reader on their device.
    let devices: Vec<(DeviceIndex, StreamIndex)> = low.devices.iter().map(|d| (d.index, d.compute)).collect();
    crate::compile::discard_unread(&mut low.b, |plan, regst| {
        let producer = plan.regst_descs[regst.index()].producer;
        let device = plan.device_of(producer);
        devices.iter().find(|(d, _)| *d == device).map_or(devices[0].1, |(_, s)| *s)
    });

    let mut groups = low.groups.clone();
    groups.sort_by_key(|(key, _)| *key);
    info.collectives = groups.into_iter().map(|(_, g)| g).collect();
    let mut named: Vec<(String, NdSbp)> =
        layouts.visible.iter().map(|(t, l)| (graph.info(*t).name, l.clone())).collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    info.layouts = named;
    if options.reuse_memory && micro_batches == 1 {
        crate::compile::share::share_memory(&mut low.b).map_err(compile_error)?;
    }
    low.b.plan_mut().variables = variables;
    compiled.plan = low.b.build().map_err(|e| compile_error(e.to_string()))?;
    compiled.parallel = Some(info);
    Ok(compiled)
}
