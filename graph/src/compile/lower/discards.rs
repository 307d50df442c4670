//! Discarding readers: a register must have a reader, so every register nobody reads
//! (an optimizer state's last value, a dataset input the step ignores) gets a `Discard`
//! actor on its producer's device.

use super::Lowering;
use crate::compile::error::CompileError;
use crate::plan::{ActorKind, RegstDescId};

/// Gives every register nobody reads a discarding reader on its producer's compute stream.
pub(crate) fn discard_unread(low: &mut Lowering<'_>) -> Result<(), CompileError> {
    let plan = low.b.plan_mut();
    let unread: Vec<RegstDescId> = (0..plan.regst_descs.len())
        .filter(|&r| plan.regst_descs[r].consumers.is_empty())
        .map(|r| RegstDescId(r as u32))
        .collect();
    for regst in unread {
        let plan = low.b.plan_mut();
        let device = plan.device_of(plan.regst_descs[regst.index()].producer);
        let stream = low.devices.iter().find(|d| d.index == device).map(|d| d.compute).ok_or_else(|| {
            CompileError::invariant(format!("register {regst} is produced on {device}, which lowering did not create"))
        })?;
        let sink = low.b.actor(&format!("discard:{}", regst.0), stream, ActorKind::Discard);
        low.b.consume(sink, regst);
    }
    Ok(())
}
