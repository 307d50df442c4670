//! Fetch sinks: every fetch made whole (`Broadcast`) and read by a sink on the first
//! device of its mesh; with `fetch_parts`, also one sink per device reading its local
//! value.

use super::{Lowering, ReadOf};
use crate::compile::error::CompileError;
use crate::plan::{ActorKind, OutputSignature};
use crate::sbp::NdSbp;

/// The sinks of every fetch, in fetch order, and the plan's output signature.
pub(crate) fn lower_fetches(low: &mut Lowering<'_>) -> Result<(), CompileError> {
    let facts = low.facts;
    for (k, &t) in facts.fetch.iter().enumerate() {
        let mesh = low.placement.mesh_of(t)?;
        let rate = facts.rate(t);
        let visible = low.visible(t)?;
        let name = format!("fetch:{k}");
        let slot = low.placement.slot(mesh, 0);
        let stream = low.io_stream(slot);
        let sink = low.b.actor(&name, stream, ActorKind::Sink);
        let whole = NdSbp::broadcast(low.placement.meshes[mesh].ndim());
        low.read(&[sink], mesh, rate, ReadOf::Tensor(t, whole));
        let meta = low.graph.info(t).meta;
        low.b.plan_mut().signature.outputs.push(OutputSignature { name: name.clone(), meta, actor: sink });
        low.out.fetches.push(name);
        low.out.fetch_layouts.push(visible.clone());
        if low.options.fetch_parts {
            let size = low.placement.meshes[mesh].size();
            let mut sinks = Vec::with_capacity(size);
            let mut names = Vec::with_capacity(size);
            for rank in 0..size {
                let slot = low.placement.slot(mesh, rank);
                let name = format!("fetch:{k}@{rank}");
                let stream = low.io_stream(slot);
                sinks.push(low.b.actor(&name, stream, ActorKind::Sink));
                names.push(name);
            }
            low.read(&sinks, mesh, rate, ReadOf::Tensor(t, visible));
            low.out.fetch_parts.push(names);
        }
    }
    Ok(())
}
