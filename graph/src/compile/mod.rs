//! The compiler for one device: lowers a logical graph (a step's fetches and variable
//! updates) to a [`Plan`] of actors. Inputs become fed sources, every op a compute actor
//! running the op's host computation, fetches sinks, and every variable a loop-carried
//! register: preloaded with its initial value and produced by its update op, so step k+1
//! reads what step k wrote.
//!
//! A variable's register has two slots, not the one ARCHITECTURE.md §4 sketches: the update
//! of step k writes the value of step k + 1 into the other slot while step k's readers may
//! still hold theirs, and piece numbers keep every reader on its own step's value. One slot
//! would need the update to write in place over the slot it is reading (an in-place update
//! op is the memory optimization that can come later); two slots are not staleness.
//!
//! Ops that read nothing fed (constants, the step counter) and variables nobody updates
//! also read a *tick*, the register of the first input, so they run once per step and end
//! when the inputs end. Registers are laid out one after
//! another; reuse across lifetimes is the next pass.

pub(crate) mod share;

use crate::dsl::{ancestors, paced, Graph, Tensor, TensorId, TensorSource};
use crate::plan::{
    ActorKind, DeviceKind, InputSignature, KernelConf, OpConf, OutputSignature, Plan, PlanBuilder, Region, RegstDescId,
    SourcePieces, StreamKind, TensorPart, VariableDesc,
};
use crate::tensor::TensorMeta;
use crate::GraphError;
use share::share_memory;
use std::collections::HashMap;

/// Options of the one-device compiler.
#[derive(Debug, Clone)]
pub struct CompileOptions {
    /// The device kind of the plan.
    pub device: DeviceKind,
    /// Slots of the registers of fed inputs (how many steps may be pushed ahead).
    pub input_register_num: u32,
    /// Slots of the other registers.
    pub activation_register_num: u32,
    /// Inputs read by one dataset source actor instead of being fed.
    pub dataset: Option<DatasetInputs>,
    /// Let activation registers whose lifetimes do not overlap share memory (the compute
    /// actors then run in one fixed order, one step at a time). Not combined with
    /// `accumulate`, whose actors run at two rates.
    pub reuse_memory: bool,
    /// Gradient accumulation: the loss and gradients run once per micro-batch, the rest of
    /// the step (clipping, schedule, updates) once per `micro_batches` pieces of input.
    pub accumulate: Option<Accumulate>,
}

/// Gradient accumulation over micro-batches (see [`crate::TrainStep::accumulate`]).
#[derive(Debug, Clone)]
pub struct Accumulate {
    /// Micro-batches per optimizer step.
    pub micro_batches: u32,
    /// The raw gradients: where the micro-batch part of the step ends.
    pub gradients: Vec<TensorId>,
}

/// Inputs a dataset source produces: one source actor with one output register per
/// input, in this order.
#[derive(Debug, Clone)]
pub struct DatasetInputs {
    /// Where the pieces come from: a dataset file the plan names
    /// ([`SourcePieces::Dataset`], so the plan runs by itself) or a kernel the program
    /// registers ([`SourcePieces::Custom`]).
    pub source: SourcePieces,
    /// The graph inputs it produces, in output order.
    pub inputs: Vec<String>,
}

impl Default for CompileOptions {
    fn default() -> Self {
        Self {
            device: DeviceKind::Cpu,
            input_register_num: 2,
            activation_register_num: 1,
            dataset: None,
            reuse_memory: true,
            accumulate: None,
        }
    }
}

/// An input of the compiled plan: fed by the user, one value per step.
#[derive(Debug, Clone)]
pub struct CompiledInput {
    /// The input's name in the graph.
    pub name: String,
    /// Its fed source actor.
    pub actor: String,
    /// Shape and dtype every value must have.
    pub meta: TensorMeta,
}

/// A variable of the compiled plan (its initializer is in the plan's `variables`).
#[derive(Debug, Clone)]
pub struct CompiledVariable {
    /// The variable's name in the graph (with `@device` on a mesh).
    pub name: String,
    /// The register holding it.
    pub regst: String,
}

/// A self-contained plan, and the names a program uses to feed and fetch it. Everything a
/// run needs is in `plan` (op configs, initializers, the typed signature); the rest is
/// for the program that compiled it.
#[derive(Debug, Clone)]
pub struct CompiledGraph {
    /// The plan.
    pub plan: Plan,
    /// The graph's inputs: name, (first) source actor, shape and dtype.
    pub inputs: Vec<CompiledInput>,
    /// Sink actor names, in fetch order.
    pub fetches: Vec<String>,
    /// Variables and the registers that hold them.
    pub variables: Vec<CompiledVariable>,
    /// For a plan compiled onto a mesh: layouts, per-device inputs and collectives.
    pub parallel: Option<crate::ParallelInfo>,
}

impl Graph {
    /// Lowers one step (`fetch`, plus `updates` as `(variable, next value)`) to a plan.
    pub fn compile(
        &self,
        fetch: &[Tensor<'_>],
        updates: &[(Tensor<'_>, Tensor<'_>)],
        options: &CompileOptions,
    ) -> Result<CompiledGraph, GraphError> {
        let nodes = self.nodes();
        let count = self.tensor_count();
        let compile_error = |message: String| GraphError::Op { op: "compile".into(), inputs: vec![], message };
        // Which tensors the step needs.
        let needed = ancestors(&nodes, count, fetch.iter().chain(updates.iter().map(|(_, new)| new)).map(|t| t.id()));
        let update_of: HashMap<TensorId, TensorId> = updates.iter().map(|(v, new)| (v.id(), new.id())).collect();

        let mut b = PlanBuilder::new();
        let device = b.device(0, options.device, 0);
        let stream = b.stream(device, StreamKind::Compute);
        let mut regst_of: HashMap<TensorId, RegstDescId> = HashMap::new();
        // (actor, whether it runs once per micro-batch, the tensors it reads)
        let mut pending_consumers: Vec<(crate::plan::ActorIndex, bool, Vec<TensorId>)> = Vec::new();
        let mut compiled = CompiledGraph {
            plan: Plan::empty(),
            inputs: Vec::new(),
            fetches: Vec::new(),
            variables: Vec::new(),
            parallel: None,
        };
        let mut variables: Vec<VariableDesc> = Vec::new();

        // Inputs: a dataset source for those it produces, fed sources for the others. The
        // first input is every step's tick.
        let mut tick: Option<TensorId> = None;
        if let Some(dataset) = &options.dataset {
            let source = b.actor("dataset", stream, ActorKind::Source { pieces: dataset.source.clone() });
            for name in &dataset.inputs {
                let t =
                    self.by_name(name).filter(|t| matches!(self.info(t.id()).source, TensorSource::Input)).ok_or_else(
                        || compile_error(format!("the dataset produces '{name}', which is not an input of the graph")),
                    )?;
                let info = self.info(t.id());
                let regst = b.regst(&info.name, source, info.meta.bytes() as u64, options.input_register_num);
                regst_of.insert(t.id(), regst);
                tick.get_or_insert(t.id());
            }
        }
        for (i, &is_needed) in needed.iter().enumerate() {
            let id = TensorId(i as u32);
            let info = self.info(id);
            if !is_needed || !matches!(info.source, TensorSource::Input) || regst_of.contains_key(&id) {
                continue;
            }
            let actor_name = format!("input:{}", info.name);
            let source = b.actor(&actor_name, stream, ActorKind::Source { pieces: SourcePieces::Fed });
            let regst = b.regst(&info.name, source, info.meta.bytes() as u64, options.input_register_num);
            regst_of.insert(id, regst);
            b.plan_mut().signature.inputs.push(InputSignature {
                name: info.name.clone(),
                meta: info.meta.clone(),
                parts: vec![TensorPart { actor: source, region: Region::whole(&info.meta.shape) }],
            });
            compiled.inputs.push(CompiledInput { name: info.name.clone(), actor: actor_name, meta: info.meta.clone() });
            tick.get_or_insert(id);
        }
        let tick = tick.ok_or_else(|| compile_error("the step reads no input, so nothing paces it".into()))?;

        // Which tensors change with the fed inputs: an op reading none of them (a constant,
        // the step counter) is paced by the tick instead, or it would have no end.
        let paced = paced(self, &nodes, count);

        // Rates under gradient accumulation: a tensor is per micro-batch if it changes with
        // the inputs and the fetches or the raw gradients need it; the rest is per step.
        let accumulate = options.accumulate.as_ref().filter(|a| a.micro_batches > 1);
        let mut micro = vec![true; count];
        if let Some(acc) = accumulate {
            let wanted = ancestors(&nodes, count, fetch.iter().map(|t| t.id()).chain(acc.gradients.iter().copied()));
            for (m, (&p, &w)) in micro.iter_mut().zip(paced.iter().zip(&wanted)) {
                *m = p && w;
            }
        }
        let step_tick = TensorId(u32::MAX);

        // Op nodes: one compute actor each; variables become the outputs of their updates.
        let mut actor_of_node = HashMap::new();
        for (n, node) in nodes.iter().enumerate() {
            if !node.outputs.iter().any(|o| needed[o.0 as usize]) {
                continue;
            }
            let name = format!("{}:{n}", node.op.name());
            // An actor reads each register once, even if the op names a tensor twice (x * x).
            let mut reads: Vec<TensorId> = Vec::new();
            let input_map: Vec<usize> = node
                .inputs
                .iter()
                .map(|t| match reads.iter().position(|r| r == t) {
                    Some(p) => p,
                    None => {
                        reads.push(*t);
                        reads.len() - 1
                    }
                })
                .collect();
            let op = OpConf::new(
                &*node.op,
                node.inputs.iter().map(|i| self.info(*i).meta).collect(),
                input_map,
                node.outputs.iter().map(|o| self.info(*o).meta).collect(),
            );
            let actor = b.actor(&name, stream, ActorKind::Compute { kernel: KernelConf::Op(op) });
            actor_of_node.insert(n, actor);
            let node_micro = node.outputs.iter().any(|o| micro[o.0 as usize]);
            if !node.inputs.iter().any(|i| paced[i.0 as usize]) {
                reads.push(if accumulate.is_some() && !node_micro { step_tick } else { tick });
            }
            pending_consumers.push((actor, node_micro, reads));
            for &o in &node.outputs {
                let meta = self.info(o).meta;
                let regst =
                    b.regst(&format!("{name}.{}", o.0), actor, meta.bytes() as u64, options.activation_register_num);
                regst_of.insert(o, regst);
            }
        }

        // Variables.
        for (i, &is_needed) in needed.iter().enumerate() {
            let id = TensorId(i as u32);
            let info = self.info(id);
            let TensorSource::Variable { init, .. } = &info.source else { continue };
            if !is_needed {
                continue;
            }
            let init = init.clone();
            let regst = match update_of.get(&id) {
                Some(new) => {
                    let new_regst = *regst_of.get(new).ok_or_else(|| {
                        compile_error(format!("the update of '{}' is not computed by an op", info.name))
                    })?;
                    // Step k reads the variable as piece k of its loop register and the new
                    // value as piece k + 1. If only the next step reads the new value (weights),
                    // the update writes the loop register itself; if this step reads it too
                    // (the step counter, read by the schedule), an `assign` copy feeds the loop.
                    let read_in_step = fetch.iter().any(|f| f.id() == *new)
                        || nodes
                            .iter()
                            .enumerate()
                            .any(|(n, node)| actor_of_node.contains_key(&n) && node.inputs.contains(new));
                    if read_in_step {
                        let name = format!("assign:{}", info.name);
                        let actor = b.actor(&name, stream, ActorKind::Compute { kernel: KernelConf::Copy });
                        let regst = b.regst(&info.name, actor, info.meta.bytes() as u64, 2);
                        b.preload(regst, 1);
                        pending_consumers.push((actor, accumulate.is_none(), vec![*new]));
                        regst
                    } else {
                        let desc = &mut b_plan_regst(&mut b, new_regst);
                        desc.register_num = desc.register_num.max(2);
                        desc.preloaded = 1;
                        new_regst
                    }
                }
                None => {
                    // A constant: a copy loop paced by the tick. The loop register carries
                    // one value more than the steps; readers get an ordinary register with
                    // one value per step, written by the same copy.
                    let name = format!("variable:{}", info.name);
                    let actor = b.actor(&name, stream, ActorKind::Compute { kernel: KernelConf::Copy });
                    let bytes = info.meta.bytes() as u64;
                    let state = b.regst(&info.name, actor, bytes, 2);
                    b.preload(state, 1);
                    b.consume(actor, state);
                    let value = b.regst(&format!("{}.value", info.name), actor, bytes, options.activation_register_num);
                    let pace = if accumulate.is_some() { step_tick } else { tick };
                    pending_consumers.push((actor, accumulate.is_none(), vec![pace]));
                    compiled.variables.push(CompiledVariable { name: info.name.clone(), regst: info.name.clone() });
                    variables.push(VariableDesc {
                        name: info.name.clone(),
                        regst: state,
                        meta: info.meta.clone(),
                        init,
                        region: Region::whole(&info.meta.shape),
                    });
                    regst_of.insert(id, value);
                    continue;
                }
            };
            compiled
                .variables
                .push(CompiledVariable { name: info.name.clone(), regst: b_plan_regst(&mut b, regst).name.clone() });
            variables.push(VariableDesc {
                name: info.name.clone(),
                regst,
                meta: info.meta.clone(),
                init,
                region: Region::whole(&info.meta.shape),
            });
            regst_of.insert(id, regst);
        }

        // Variables and constants run per step under accumulation.
        for (i, m) in micro.iter_mut().enumerate() {
            if matches!(self.info(TensorId(i as u32)).source, TensorSource::Variable { .. }) {
                *m = accumulate.is_none();
            }
        }
        let mut adapters: HashMap<(TensorId, bool), RegstDescId> = HashMap::new();
        for (actor, consumer_micro, reads) in pending_consumers {
            for t in reads {
                let regst = if t == step_tick {
                    let k = accumulate.map(|a| a.micro_batches).unwrap_or(1);
                    *adapters.entry((t, false)).or_insert_with(|| {
                        let acc = b.actor("step_tick", stream, ActorKind::Acc { count: k, kernel: KernelConf::Noop });
                        let tick_regst = regst_of[&tick];
                        b.consume(acc, tick_regst);
                        b.regst("step_tick.out", acc, 0, 1)
                    })
                } else {
                    let own = *regst_of.get(&t).ok_or_else(|| {
                        compile_error(format!("tensor '{}' has no register (broken invariant)", self.info(t).name))
                    })?;
                    match (accumulate, micro[t.0 as usize], consumer_micro) {
                        (Some(acc), true, false) => {
                            // Per micro-batch into a per-step reader: the mean over the group.
                            let meta = self.info(t).meta;
                            *adapters.entry((t, true)).or_insert_with(|| {
                                let name = format!("accumulate:{}", self.info(t).name);
                                let a = b.actor(
                                    &name,
                                    stream,
                                    ActorKind::Acc { count: acc.micro_batches, kernel: accumulate_mean(&meta) },
                                );
                                b.consume(a, own);
                                b.regst(&format!("{name}.out"), a, meta.bytes() as u64, 1)
                            })
                        }
                        (Some(acc), false, true) => {
                            // Per step into a per-micro-batch reader: the same value k times.
                            *adapters.entry((t, false)).or_insert_with(|| {
                                let name = format!("repeat:{}", self.info(t).name);
                                let r = b.actor(&name, stream, ActorKind::Repeat { count: acc.micro_batches });
                                b.consume(r, own);
                                b.regst(&format!("{name}.out"), r, self.info(t).meta.bytes() as u64, 1)
                            })
                        }
                        _ => own,
                    }
                };
                b.consume(actor, regst);
            }
        }
        for (k, t) in fetch.iter().enumerate() {
            let name = format!("fetch:{k}");
            let sink = b.actor(&name, stream, ActorKind::Sink);
            let regst = *regst_of.get(&t.id()).ok_or_else(|| compile_error(format!("cannot fetch '{}'", t.name())))?;
            b.consume(sink, regst);
            b.plan_mut().signature.outputs.push(OutputSignature { name: name.clone(), meta: t.meta(), actor: sink });
            compiled.fetches.push(name);
        }
        // Op outputs nobody reads (e.g. an optimizer state's last value) still need a reader.
        discard_unread(&mut b, |_, _| stream);
        b.plan_mut().variables = variables;
        if options.reuse_memory && accumulate.is_none() {
            share_memory(&mut b).map_err(compile_error)?;
        }
        compiled.plan = b.build().map_err(|e| compile_error(e.to_string()))?;
        Ok(compiled)
    }
}

/// The kernel of an acc actor averaging a group of micro-batch pieces of `meta`.
pub(crate) fn accumulate_mean(meta: &TensorMeta) -> KernelConf {
    KernelConf::Op(OpConf {
        op_type: crate::plan::ops::ACCUMULATE_MEAN.into(),
        attrs: serde_json::Value::Null,
        inputs: vec![meta.clone()],
        input_map: vec![0],
        outputs: vec![meta.clone()],
    })
}

/// Gives every register nobody reads a discarding reader, on the stream
/// `stream_of(plan, register)` says (a register must have a reader).
pub(crate) fn discard_unread(b: &mut PlanBuilder, stream_of: impl Fn(&Plan, RegstDescId) -> crate::plan::StreamIndex) {
    let plan = b.plan_mut();
    let unread: Vec<RegstDescId> = (0..plan.regst_descs.len())
        .filter(|&r| plan.regst_descs[r].consumers.is_empty())
        .map(|r| RegstDescId(r as u32))
        .collect();
    for regst in unread {
        let name = format!("discard:{}", regst.0);
        let stream = stream_of(b.plan_mut(), regst);
        let sink = b.actor(&name, stream, ActorKind::Discard);
        b.consume(sink, regst);
    }
}

/// A descriptor of the plan under construction (the builder keeps the plan private to
/// guarantee consistency; the compiler adjusts register counts and preloads and offsets on
/// descriptors it created itself).
fn b_plan_regst(b: &mut PlanBuilder, regst: RegstDescId) -> &mut crate::plan::RegstDesc {
    &mut b.plan_mut().regst_descs[regst.index()]
}
