//! What a compile returns: the self-contained plan, and the names a program feeds and
//! fetches it by.

use crate::plan::{Plan, TensorMeta};
use crate::sbp::{Mesh, NdSbp};

/// An input of the compiled plan: fed by the user, one value per step.
#[derive(Debug, Clone)]
pub struct CompiledInput {
    /// The input's name in the graph.
    pub name: String,
    /// Its fed source actor (on a mesh, the first device's).
    pub actor: String,
    /// Shape and dtype every value must have.
    pub meta: TensorMeta,
}

/// A variable of the compiled plan (its initializer is in the plan's `variables`).
#[derive(Debug, Clone)]
pub struct CompiledVariable {
    /// The variable's name in the graph (with `@device` in a plan of several devices).
    pub name: String,
    /// The register holding it: a name `JobBuilder::preload` accepts (no other register
    /// of the plan has it).
    pub regst: String,
}

/// A self-contained plan, and the names a program uses to feed and fetch it. Everything a
/// run needs is in `plan` (op configs, initializers, the typed signature); the rest is
/// for the program that compiled it.
///
/// Names: fed sources are `input:<name>`, fetch sinks `fetch:<k>`, op actors
/// `<op>:<node>`. In a plan of several devices every per-device actor and register name
/// ends in `@<device>` (the device's index in the plan); a plan of one device has no such
/// suffix, so one-device names do not depend on which compiler made them.
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
    pub parallel: Option<ParallelInfo>,
}

/// What a parallel plan adds to a [`CompiledGraph`].
#[derive(Debug, Clone)]
pub struct ParallelInfo {
    /// The default mesh (of tensors without a placement of their own).
    pub mesh: Mesh,
    /// Each fed input: its mesh, its layout and, by rank, its source actor and local shape.
    pub inputs: Vec<ParallelInput>,
    /// Each fetch's layout (as the fetch sinks see it before it is made `Broadcast`).
    pub fetch_layouts: Vec<NdSbp>,
    /// With [`ParallelOptions::fetch_parts`](crate::ParallelOptions::fetch_parts): for each
    /// fetch, by rank, the sink reading the device's local value (`fetch:<k>@<rank>`, by
    /// rank even on one device, beside the whole fetch's `fetch:<k>`).
    pub fetch_parts: Vec<Vec<String>>,
    /// Layout of every tensor of the step, by name.
    pub layouts: Vec<(String, NdSbp)>,
    /// Collective groups in the global order: each comm stream issues its own in this order.
    pub collectives: Vec<String>,
    /// Whether the cpu devices' collectives run on their compute streams: what the compiler
    /// made of [`ParallelOptions::collective_streams`](crate::ParallelOptions::collective_streams)
    /// (for `Auto`, on this host).
    pub collectives_on_compute_streams: bool,
    /// Whether the copies a cpu device receives from other devices run on its compute
    /// stream: what the compiler made of
    /// [`ParallelOptions::copy_streams`](crate::ParallelOptions::copy_streams) (for `Auto`,
    /// on this host).
    pub copies_on_compute_streams: bool,
}

/// A fed input of a parallel plan.
#[derive(Debug, Clone)]
pub struct ParallelInput {
    /// The input's name.
    pub name: String,
    /// Its mesh.
    pub mesh: Mesh,
    /// Its layout.
    pub layout: NdSbp,
    /// By rank: the source actor and the local shape it takes.
    pub parts: Vec<(String, TensorMeta)>,
}
