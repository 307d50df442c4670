//! The compiler: lowers one step of a logical graph (its fetches and variable updates) to
//! a self-contained [`Plan`](crate::plan::Plan) of actors. There is one compiler:
//! [`Graph::compile`] is [`Graph::compile_parallel`] on a mesh of one device, with the
//! graph's placements and pinned layouts ignored.
//!
//! It is a pipeline of passes, run in this order by [`compile_step`] over the facts of
//! the step ([`step`]: what it needs, what changes with the inputs, the rate of each
//! tensor, the input that paces it):
//!
//! 1. **placement** ([`placement`]): the mesh of every tensor, the meshes in pipeline
//!    order with their stages, and the plan's devices;
//! 2. **layouts** ([`layout`]): the SBP signature of every op on every mesh axis;
//! 3. **lowering** ([`lower`]): per device, a source for every input (and a tick), a
//!    compute actor for every op, a loop register for every variable, a sink for every
//!    fetch; what each actor reads is recorded, not yet connected;
//! 4. **boxing** ([`connect`]): every read is connected to its tensor in the layout, rate
//!    and mesh the reader needs: collectives and local slices, copies across stages, and
//!    rate adapters for micro-batches, made once per form;
//! 5. **pipeline adapters** ([`adapters`]): the GPipe gate of each stage;
//! 6. **buckets** ([`bucket`]): small weight-gradient all-reduces, and ZeRO's small
//!    reduce-scatters and all-gathers, merge into one collective per bucket;
//! 7. **collective order** ([`collective_order`]): every comm stream issues its
//!    collectives in one global order (on `cpu` devices, that of one step's estimated
//!    schedule, [`schedule`]);
//! 8. **discards** ([`lower::discard_unread`]): every register nobody reads gets a reader;
//! 9. **memory sharing** ([`share`]): one-slot registers whose lifetimes do not overlap
//!    share memory;
//! 10. **emit** ([`emit`]): the validated plan and the names it is fed and fetched by;
//! 11. **progress** ([`progress`]): the proof that the plan runs: its actors, run serially
//!     for two steps, all finish (a wait-for cycle the register counts allow is an error).
//!
//! Data, tensor and ZeRO-style parallelism are all layouts of the same graph: inputs
//! `S(0)` and weights `B` give data parallelism (the weight gradients come out `P` and are
//! all-reduced); weights `S(0)` with their optimizer state give ZeRO (all-gather before
//! use, reduce-scatter of gradients); column- then row-split weights give Megatron.
//! Pipeline parallelism is placement: a tensor moved to another mesh crosses a stage edge
//! (copy actors), micro-batches are pieces, and register counts per stage give 1F1B.
//!
//! Inputs become fed (or dataset) sources, every op a compute actor running its op on its
//! local shapes, fetches sinks, and every variable a loop-carried register preloaded with
//! its initial value and produced by its update, so step k + 1 reads what step k wrote.
//! A variable nobody updates is a *constant* register instead: every slot holds its value
//! from the job's start and a no-op hands it out, so no step copies it. Ops that read
//! nothing fed (constants, the step counter) and those no-ops read their device's *tick*,
//! made from the first input, so they run once per step and end when the inputs end.

mod adapters;
pub(crate) mod boxing;
mod bucket;
mod collective_order;
mod compiled;
mod connect;
mod emit;
mod error;
mod fold_casts;
mod fold_norm_grads;
mod fold_norm_inputs;
mod fold_table_grads;
mod fuse_casts;
mod fuse_norms;
mod fuse_updates;
mod layout;
mod lower;
mod options;
mod placement;
mod progress;
mod schedule;
mod share;
mod step;

pub use compiled::{CompiledGraph, CompiledInput, CompiledVariable, ParallelInfo, ParallelInput};
pub use error::{CompileError, NoSignature};
pub use options::{
    Accumulate, CollectiveStreams, CompileOptions, CopyStreams, DatasetInputs, ParallelOptions, PipelineSchedule,
};

use crate::dsl::{Graph, Tensor};
use crate::GraphError;
use lower::Lowering;
use options::Scope;
use step::StepFacts;

impl Graph {
    /// Lowers one step (`fetch`, plus `updates` as `(variable, next value)`) to a plan on
    /// one device of kind `options.device`. The graph's placements and pinned layouts are
    /// ignored: every tensor is whole on that device.
    pub fn compile(
        &self,
        fetch: &[Tensor<'_>],
        updates: &[(Tensor<'_>, Tensor<'_>)],
        options: &CompileOptions,
    ) -> Result<CompiledGraph, GraphError> {
        Ok(compile_step(self, fetch, updates, &options.on_one_device()?, Scope::OneDevice)?)
    }

    /// Lowers one step (`fetch`, plus `updates` as `(variable, next value)`) onto the
    /// devices of every placement it uses (`options.mesh` for tensors without one).
    /// Fetches are delivered whole (made `Broadcast`) by sinks on the first device of
    /// their mesh; with micro-batches, once per micro-batch.
    pub fn compile_parallel(
        &self,
        fetch: &[Tensor<'_>],
        updates: &[(Tensor<'_>, Tensor<'_>)],
        options: &ParallelOptions,
    ) -> Result<CompiledGraph, GraphError> {
        Ok(compile_step(self, fetch, updates, options, Scope::Placements)?)
    }
}

/// Refuses `check_finite` on a step that scales its loss dynamically: its scaler expects
/// gradients to overflow now and then and skips those steps, which the check would stop
/// the job at instead.
fn check_finite_without_loss_scaling(
    graph: &Graph,
    updates: &[(Tensor<'_>, Tensor<'_>)],
    options: &ParallelOptions,
) -> Result<(), CompileError> {
    if !options.check_finite {
        return Ok(());
    }
    let updated: std::collections::HashSet<_> = updates.iter().map(|(_, new)| new.id()).collect();
    let scales = graph
        .nodes()
        .into_iter()
        .any(|n| n.op.name() == "loss_scale_update" && n.outputs.iter().any(|o| updated.contains(o)));
    if scales {
        return Err(CompileError::CheckFiniteWithLossScaling);
    }
    Ok(())
}

/// The compiler's driver: runs the passes in order.
fn compile_step(
    graph: &Graph,
    fetch: &[Tensor<'_>],
    updates: &[(Tensor<'_>, Tensor<'_>)],
    options: &ParallelOptions,
    scope: Scope,
) -> Result<CompiledGraph, CompileError> {
    options.check()?;
    check_finite_without_loss_scaling(graph, updates, options)?;
    let facts = StepFacts::new(graph, fetch, updates, options)?;
    let placement = placement::place(graph, &facts, &options.mesh, scope)?;
    let layouts = layout::infer(graph, &facts, &placement, options, scope)?;
    let on_compute = options.collective_streams.on_compute(&placement.devices, placement.stages, facts.micro_batches);
    let lower = |on_compute| lower_step(graph, &facts, &placement, &layouts, options, scope, on_compute);
    match lower(on_compute) {
        // The compiler chose the compute streams for devices that turned out to exchange
        // more than collectives (meshes of one stage over different devices): the plan
        // cannot block them, so it keeps the comm streams.
        Err(CompileError::Plan(regflow_plan::PlanError::Collective { .. }))
            if on_compute && options.collective_streams.chosen_by_compiler() =>
        {
            lower(false)
        }
        compiled => compiled,
    }
}

/// Lowers a placed and laid-out step to a plan, its collectives on the cpu devices'
/// compute streams where `collectives_on_compute` says so.
fn lower_step(
    graph: &Graph,
    facts: &StepFacts,
    placement: &placement::Placement,
    layouts: &layout::Layouts,
    options: &ParallelOptions,
    scope: Scope,
    collectives_on_compute: bool,
) -> Result<CompiledGraph, CompileError> {
    let mut low = Lowering::new(graph, facts, placement, layouts, options, collectives_on_compute);
    lower::lower_inputs(&mut low)?;
    lower::lower_ops(&mut low)?;
    lower::lower_variables(&mut low)?;
    lower::lower_fetches(&mut low)?;
    connect::connect(&mut low)?;
    adapters::gate_gpipe_backward(&mut low);
    bucket::bucket_gradients(&mut low);
    fuse_updates::fuse_updates(&mut low);
    fuse_norms::fuse_norms(&mut low);
    // Before the cast groups: a cast it folds never joins one, and the groups are then
    // made of the casts that are left.
    fold_casts::fold_casts(&mut low);
    // After fold_casts, which may have made the sum read its 16-bit operand as it is.
    fold_table_grads::fold_table_grads(&mut low);
    // After fold_casts, which gives the residual gradients' sums their 16-bit copies.
    fold_norm_grads::fold_norm_grads(&mut low);
    // After fold_casts, which makes the residual adds read their 16-bit operands.
    fold_norm_inputs::fold_norm_inputs(&mut low);
    fuse_casts::fuse_casts(&mut low);
    // One step's estimated schedule orders the collectives and the memory-sharing chains of
    // a cpu plan ([`schedule`]); a pipeline's micro-batches interleave in ways one step does
    // not show, so they keep the graph's orders, as do other devices.
    let starts = (facts.micro_batches == 1 && schedule::applies_to(low.b.plan_mut()))
        .then(|| {
            let flops = schedule::actor_flops(&low);
            schedule::estimate_starts(low.b.plan_mut(), &flops)
        })
        .flatten();
    let collectives = collective_order::order_collectives(&mut low, starts.as_deref());
    lower::discard_unread(&mut low)?;
    if options.reuse_memory && facts.micro_batches == 1 {
        let constants: Vec<_> = low.out.variables.iter().filter(|v| v.constant).map(|v| v.regst).collect();
        share::share_memory(&mut low.b, &constants, starts.as_deref())?;
    } else if options.reuse_memory {
        share::write_updates_in_place(&mut low.b);
    }
    let compiled = emit::emit(low, collectives, scope)?;
    progress::prove(&compiled.plan, options)?;
    Ok(compiled)
}
