//! Boxing: connects every recorded read to the registers of its tensor in the form the
//! reader needs (layout, rate, mesh). A layout change on a mesh becomes boxing actors (a
//! collective on a comm stream, or a local slice) one mesh axis at a time; a change of
//! mesh (a pipeline stage edge) becomes copy actors on copy streams; a change of rate
//! becomes a rate adapter ([`adapters`](super::adapters)). Every form is made once and
//! shared by all its readers.

use super::boxing::{self, KeepOnFirst, TakePart};
use super::bucket::Candidate;
use super::collective_order::{Issued, Phase};
use super::error::CompileError;
use super::lower::{Lowering, ReadOf, Reg, WindowOf};
use super::step::Rate;
use crate::dsl::TensorId;
use crate::ops::OpDef;
use crate::plan::{ActorKind, CollectiveConf, CollectiveOp, KernelConf, OpConf, RegstDescId};
use crate::sbp::{local_meta, local_region, Mesh, NdSbp, Sbp};
use std::sync::Arc;

/// Boxing: connects every recorded read to its registers (made as needed), one per reader,
/// in the order reads were recorded.
pub(crate) fn connect(low: &mut Lowering<'_>) -> Result<(), CompileError> {
    let reads = std::mem::take(&mut low.reads);
    for read in reads {
        let regs = match &read.of {
            ReadOf::Tick => (0..read.actors.len())
                .map(|rank| low.tick_at(low.placement.slot(read.mesh, rank), read.rate).map(Reg::whole))
                .collect::<Result<Vec<_>, _>>()?,
            ReadOf::Tensor(t, layout) => low.registers(*t, layout, read.rate, read.mesh)?,
        };
        if regs.len() < read.actors.len() {
            return Err(CompileError::invariant(format!(
                "{} readers on mesh {} but {} registers",
                read.actors.len(),
                read.mesh,
                regs.len()
            )));
        }
        for (actor, reg) in read.actors.iter().zip(regs) {
            low.consume_reg(*actor, reg)?;
        }
    }
    Ok(())
}

impl Lowering<'_> {
    /// The registers of `t` in `layout` at `rate` on mesh `mesh`: boxing, rate adapters
    /// and copies across placements are made (once) as needed.
    pub(crate) fn registers(
        &mut self,
        t: TensorId,
        layout: &NdSbp,
        rate: Rate,
        mesh: usize,
    ) -> Result<Vec<Reg>, CompileError> {
        let form = (t, layout.clone(), rate, mesh);
        if let Some(r) = self.regs.get(&form) {
            return Ok(r.clone());
        }
        let home = self.placement.mesh_of(t)?;
        let regs = if home != mesh {
            self.across_stages(t, layout, rate, home, mesh)?
        } else {
            let own = self.facts.rate(t);
            let produced = self.produced(t)?;
            let visible = self.visible(t)?;
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
                    let own_regs = self.registers(t, &produced, Rate::Micro, mesh)?;
                    let own_regs = self.whole_regs(&own_regs)?;
                    let averaged = self.accumulate(t, &produced, &own_regs, mesh);
                    self.regs.insert(
                        (t, produced.clone(), Rate::Step, mesh),
                        averaged.into_iter().map(Reg::whole).collect(),
                    );
                    self.boxed(t, &produced, layout, Rate::Step, mesh)?
                }
                _ => {
                    // Per step into a per-micro-batch reader. Once per step, handed to every micro-batch, then boxed per micro-batch:
                    // boxing it per step would have to wait for a tick of the whole step
                    // (all its micro-batches' inputs), which the pipeline cannot hold.
                    let stepped = self.registers(t, &visible, Rate::Step, mesh)?;
                    let stepped = self.whole_regs(&stepped)?;
                    let handed = self.repeat(t, &stepped, mesh);
                    self.regs
                        .insert((t, visible.clone(), Rate::Micro, mesh), handed.into_iter().map(Reg::whole).collect());
                    self.boxed(t, &visible, layout, Rate::Micro, mesh)?
                }
            }
        };
        self.regs.insert(form, regs.clone());
        Ok(regs)
    }

    /// A stage edge: box on the source mesh, then copy device by device (or, between
    /// meshes of different shapes, copy the whole value and cut it on arrival).
    fn across_stages(
        &mut self,
        t: TensorId,
        layout: &NdSbp,
        rate: Rate,
        home: usize,
        mesh: usize,
    ) -> Result<Vec<Reg>, CompileError> {
        let same_shape = self.placement.meshes[home].shape() == self.placement.meshes[mesh].shape();
        let there = if same_shape { layout.clone() } else { NdSbp::broadcast(self.placement.meshes[home].ndim()) };
        let source = self.registers(t, &there, rate, home)?;
        let here = if same_shape { layout.clone() } else { NdSbp::broadcast(self.placement.meshes[mesh].ndim()) };
        let copied: Vec<Reg> = self.copy(t, &source, &here, rate, home, mesh)?.into_iter().map(Reg::whole).collect();
        self.regs.insert((t, here.clone(), rate, mesh), copied.clone());
        if same_shape {
            Ok(copied)
        } else {
            self.boxed(t, &here, layout, rate, mesh)
        }
    }

    /// Copies across placements: one copy actor per destination device, on the stream that
    /// receives its copies ([`Lowering::receiving_stream`]).
    fn copy(
        &mut self,
        t: TensorId,
        source: &[Reg],
        layout: &NdSbp,
        rate: Rate,
        from: usize,
        to: usize,
    ) -> Result<Vec<RegstDescId>, CompileError> {
        let size = self.placement.meshes[to].size();
        let same_shape = self.placement.meshes[from].shape() == self.placement.meshes[to].shape();
        let mut out = Vec::with_capacity(size);
        for rank in 0..size {
            let slot = self.placement.slot(to, rank);
            let input = *source.get(if same_shape { rank } else { 0 }).ok_or_else(|| {
                CompileError::invariant(format!("'{}' has no register for rank {rank} on its mesh", self.name(t)))
            })?;
            let name = self.on_device(&format!("copy{}:{}", self.conversions, self.name(t)), slot);
            self.conversions += 1;
            let stream = self.receiving_stream(slot);
            let actor = self.b.actor(&name, stream, ActorKind::Compute { kernel: KernelConf::Copy });
            self.consume_reg(actor, input)?;
            if !self.facts.paced(t) {
                let tick = self.tick_at(slot, rate)?;
                self.b.consume(actor, tick);
            }
            let bytes = self.local_meta(t, layout, to, rank).bytes() as u64;
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
    ) -> Result<Vec<Reg>, CompileError> {
        if let Some(r) = self.regs.get(&(t, layout.clone(), rate, mesh)) {
            return Ok(r.clone());
        }
        let mut current = self.regs.get(&(t, from.clone(), rate, mesh)).cloned().ok_or_else(|| {
            CompileError::invariant(format!("'{}' has no registers in {from} to box from", self.name(t)))
        })?;
        let shape = self.placement.meshes[mesh].shape().to_vec();
        for step in boxing::steps(from, layout, &shape) {
            current = self.box_step(t, &step, &current, rate, mesh)?;
            self.regs.entry((t, step.to.clone(), rate, mesh)).or_insert_with(|| current.clone());
        }
        // Axes of size 1 need no step: the registers are the same.
        self.regs.insert((t, layout.clone(), rate, mesh), current.clone());
        Ok(current)
    }

    /// One single-axis boxing step on every device of `mesh`: a local op (taking a part,
    /// keeping a summand on the first member) or a collective over the axis's groups.
    fn box_step(
        &mut self,
        t: TensorId,
        step: &boxing::Step,
        inputs: &[Reg],
        rate: Rate,
        mesh_index: usize,
    ) -> Result<Vec<Reg>, CompileError> {
        let id = self.conversions;
        self.conversions += 1;
        let info = self.graph.info(t);
        let mesh = self.placement.meshes[mesh_index].clone();
        let (from, to) = (step.from.0[step.axis], step.to.0[step.axis]);
        let key = (self.facts.ready_at(self.graph, t), id);
        // Group names start with `box{id}`, so only this step's groups can repeat one.
        let first_group = self.groups.len();
        let mut outputs = Vec::with_capacity(mesh.size());
        let mut collectives = Vec::new();
        for (rank, input) in inputs.iter().enumerate() {
            let slot = self.placement.slot(mesh_index, rank);
            let coords = mesh.coords(rank);
            let out_meta = local_meta(&info.meta, &step.to, &mesh, &coords);
            let member = coords[step.axis];
            let parts = mesh.shape()[step.axis];
            if let (Sbp::Broadcast, Sbp::Split(dim)) = (from, to) {
                let in_meta = local_meta(&info.meta, &step.from, &mesh, &coords);
                if let Some((offset, bytes)) = contiguous_part(&in_meta, dim, parts, member, &out_meta) {
                    // The part is one block of the replicated register: read in place.
                    let reg = input.part(offset, bytes);
                    self.windows_of.insert(reg, WindowOf { tensor: t, rate, mesh: mesh_index, slot });
                    outputs.push(reg);
                    continue;
                }
            }
            let actor_name = self.on_device(&format!("box{id}:{from}->{to}:{}", info.name), slot);
            let local_op: Option<Arc<dyn OpDef>> = match (from, to) {
                (Sbp::Broadcast, Sbp::Split(dim)) => Some(Arc::new(TakePart { dim, parts, index: member })),
                (Sbp::Broadcast, Sbp::Partial) => Some(Arc::new(KeepOnFirst { first: member == 0 })),
                _ => None,
            };
            let actor = match local_op {
                Some(op) => {
                    let in_meta = local_meta(&info.meta, &step.from, &mesh, &coords);
                    let conf = OpConf::new(&*op, vec![in_meta], vec![0], vec![out_meta.clone()]);
                    let kind = ActorKind::Compute { kernel: KernelConf::Op(conf) };
                    self.b.actor(&actor_name, self.devices[slot].compute, kind)
                }
                None => {
                    let conf = self.collective(t, step, &mesh, rank, id)?;
                    if !self.groups[first_group..].iter().any(|(_, g)| *g == conf.group) {
                        self.groups.push((key, conf.group.clone()));
                    }
                    let phase = match rate {
                        Rate::Step => Phase::Step,
                        Rate::Micro if self.facts.forward(t) => Phase::Forward,
                        Rate::Micro => Phase::Backward,
                    };
                    let stream = self.comm_stream(slot, phase);
                    let bytes = (conf.shape.iter().product::<usize>() * conf.dtype.size()) as u64;
                    let op = conf.op;
                    // A part of a ZeRO bucket is one equal block of its tensor's rows.
                    let even = conf.shape.first().is_some_and(|&rows| rows % conf.size.max(1) as usize == 0);
                    let kind = ActorKind::Compute { kernel: KernelConf::Collective(conf) };
                    let actor = self.b.actor(&actor_name, stream, kind);
                    self.issued.push(Issued { key, slot, phase, actor });
                    collectives.push((actor, phase, bytes, op, even));
                    actor
                }
            };
            self.consume_reg(actor, *input)?;
            if !self.facts.paced(t) {
                let tick = self.tick_at(slot, rate)?;
                self.b.consume(actor, tick);
            }
            let slots = self.register_num(rate, mesh_index);
            outputs.push(Reg::whole(self.b.regst(&format!("{actor_name}.out"), actor, out_meta.bytes() as u64, slots)));
        }
        if let Some(&(_, phase, bytes, op, _)) = collectives.first().filter(|_| collectives.len() == inputs.len()) {
            self.bucket_candidates.push(Candidate {
                op,
                even: collectives.iter().all(|&(.., even)| even),
                key,
                tensor: t,
                mesh: mesh_index,
                axis: step.axis,
                rate,
                phase,
                dtype: info.meta.dtype,
                bytes,
                ticked: !self.facts.paced(t),
                actors: collectives.iter().map(|&(actor, ..)| actor).collect(),
            });
        }
        Ok(outputs)
    }

    /// The collective rank `rank` of `mesh` joins for boxing step `step` of `t`: its group
    /// is the devices that differ from it on the step's axis only.
    fn collective(
        &self,
        t: TensorId,
        step: &boxing::Step,
        mesh: &Mesh,
        rank: usize,
        id: usize,
    ) -> Result<CollectiveConf, CompileError> {
        let info = self.graph.info(t);
        let axis = step.axis;
        let (from, to) = (step.from.0[axis], step.to.0[axis]);
        let op = match (from, to) {
            (Sbp::Partial, Sbp::Broadcast) => CollectiveOp::AllReduce,
            (Sbp::Partial, Sbp::Split(dim)) => CollectiveOp::ReduceScatter { dim },
            (Sbp::Split(dim), Sbp::Broadcast) => CollectiveOp::AllGather { dim },
            (Sbp::Split(from), Sbp::Split(to)) => CollectiveOp::AllToAll { from, to },
            _ => return Err(CompileError::invariant(format!("no direct boxing {from} -> {to} for '{}'", info.name))),
        };
        let coords = mesh.coords(rank);
        // The tensor as the group along `axis` sees it: `axis` taken as Broadcast.
        let mut whole = step.from.clone();
        whole.0[axis] = Sbp::Broadcast;
        let group_shape = local_region(&info.meta.shape, &whole, mesh, &coords).0;
        Ok(CollectiveConf {
            group: format!("box{id}:{}:{}:{}", info.name, mesh.axes()[axis], group_index(mesh, rank, axis)),
            rank: coords[axis] as u32,
            size: mesh.shape()[axis] as u32,
            op,
            dtype: info.meta.dtype,
            shape: group_shape.0.clone(),
        })
    }
}

/// `(offset, bytes)` of part `member` of `parts` along `dim` of a row-major tensor of
/// `whole`'s shape, where that part is one contiguous block starting on a slot boundary
/// (every dimension before `dim` has one element, and the offset is a multiple of the
/// alignment registers keep), so a reader can take it in place; `None` otherwise.
fn contiguous_part(
    whole: &crate::plan::TensorMeta,
    dim: usize,
    parts: usize,
    member: usize,
    part: &crate::plan::TensorMeta,
) -> Option<(u64, u64)> {
    let dims = whole.shape.dims();
    if dim >= dims.len() || dims[..dim].iter().any(|&d| d != 1) {
        return None;
    }
    let rows = crate::sbp::part_range(dims[dim], parts, member);
    let row_bytes = (dims[dim + 1..].iter().product::<usize>() * whole.dtype.size()) as u64;
    let (offset, bytes) = (rows.start as u64 * row_bytes, rows.len() as u64 * row_bytes);
    let aligned = offset % regflow_memory::ALIGNMENT as u64 == 0;
    (aligned && bytes == part.bytes() as u64 && part.dtype == whole.dtype).then_some((offset, bytes))
}

/// Index of `rank`'s group among the groups along `axis` (its coordinates elsewhere).
fn group_index(mesh: &Mesh, rank: usize, axis: usize) -> usize {
    let coords = mesh.coords(rank);
    coords.iter().zip(mesh.shape()).enumerate().filter(|(a, _)| *a != axis).fold(0, |g, (_, (c, n))| g * n + c)
}
