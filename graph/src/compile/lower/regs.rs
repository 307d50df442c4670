//! Registers as readers take them: whole, or a window of each slot (a contiguous part of
//! the tensor the register holds, read in place instead of copied out).
//!
//! A `B -> S(d)` boxing step whose part is one contiguous block of the replicated value
//! (every dimension before `d` has one element, as for `S(0)` of a row-major tensor) makes
//! no actor: its readers read that block of the replicated register
//! ([`InputWindow`](crate::plan::InputWindow)). Under sharded optimizer state this is the
//! cut of every replicated weight to the rows a device updates, which a `take_part` copy
//! made every step. A reader that cannot read a window (an actor that hands whole
//! registers on, such as a repeat, an acc or a sink, or one that already reads the same
//! register) gets the block copied out once per form instead, by a copy actor.

use super::Lowering;
use crate::compile::error::CompileError;
use crate::compile::step::Rate;
use crate::dsl::TensorId;
use crate::plan::{ActorIndex, ActorKind, KernelConf, RegstDescId};

/// A register as a reader takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Reg {
    /// The register.
    pub(crate) desc: RegstDescId,
    /// `(offset, bytes)` of the part read, or `None` for the whole register.
    pub(crate) window: Option<(u64, u64)>,
}

impl Reg {
    /// The whole register `desc`.
    pub(crate) fn whole(desc: RegstDescId) -> Self {
        Self { desc, window: None }
    }

    /// `bytes` bytes from `offset` of this (whole or windowed) register.
    pub(crate) fn part(self, offset: u64, bytes: u64) -> Self {
        let base = self.window.map_or(0, |(o, _)| o);
        Self { desc: self.desc, window: Some((base + offset, bytes)) }
    }
}

/// Where a windowed register came from: what a copy of it needs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WindowOf {
    /// The tensor it holds part of.
    pub(crate) tensor: TensorId,
    pub(crate) rate: Rate,
    pub(crate) mesh: usize,
    /// The device slot of the register.
    pub(crate) slot: usize,
}

impl Lowering<'_> {
    /// Makes `actor` read `reg` as its next input: through a window where it can, else
    /// the window's block copied out (see the module docs).
    pub(crate) fn consume_reg(&mut self, actor: ActorIndex, reg: Reg) -> Result<(), CompileError> {
        let Some((offset, bytes)) = reg.window else {
            return self.consume_whole(actor, reg.desc);
        };
        let plan = self.b.plan_mut();
        let reader = &plan.actors[actor.index()];
        if matches!(reader.kind, ActorKind::Compute { .. }) && !reader.inputs.contains(&reg.desc) {
            self.b.consume_window(actor, reg.desc, offset, bytes);
            return Ok(());
        }
        let whole = self.copied_out(reg)?;
        self.b.consume(actor, whole);
        Ok(())
    }

    /// Makes `actor` read all of `desc`. If it reads a window of `desc` already (an op
    /// taking one tensor in two layouts), that earlier input becomes the window's block
    /// copied out: a reader lists a register once.
    fn consume_whole(&mut self, actor: ActorIndex, desc: RegstDescId) -> Result<(), CompileError> {
        let reader = &self.b.plan_mut().actors[actor.index()];
        let Some(earlier) = reader.inputs.iter().position(|&r| r == desc) else {
            self.b.consume(actor, desc);
            return Ok(());
        };
        let window = reader
            .window(earlier)
            .ok_or_else(|| CompileError::invariant(format!("actor '{}' reads register {desc} twice", reader.name)))?;
        let copy = self.copied_out(Reg { desc, window: Some((window.offset, window.bytes)) })?;
        let plan = self.b.plan_mut();
        let reader = &mut plan.actors[actor.index()];
        reader.inputs[earlier] = copy;
        reader.windows.retain(|w| w.input as usize != earlier);
        // Still a reader of `desc` (now whole), and now of the copy.
        reader.inputs.push(desc);
        plan.regst_descs[copy.index()].consumers.push(actor);
        Ok(())
    }

    /// Whole registers for `regs`: each windowed one copied out (made once per window).
    pub(crate) fn whole_regs(&mut self, regs: &[Reg]) -> Result<Vec<RegstDescId>, CompileError> {
        regs.iter().map(|&reg| if reg.window.is_some() { self.copied_out(reg) } else { Ok(reg.desc) }).collect()
    }

    /// The register a copy actor writes with the window `reg` (made on first use).
    fn copied_out(&mut self, reg: Reg) -> Result<RegstDescId, CompileError> {
        if let Some(&desc) = self.copies_out.get(&reg) {
            return Ok(desc);
        }
        let (Some((offset, bytes)), Some(of)) = (reg.window, self.windows_of.get(&reg).copied()) else {
            return Err(CompileError::invariant(format!("register {} has a window of unknown origin", reg.desc)));
        };
        let name = self.on_device(&format!("cut{}:{}", self.conversions, self.name(of.tensor)), of.slot);
        self.conversions += 1;
        let actor = self.b.actor(&name, self.devices[of.slot].compute, ActorKind::Compute { kernel: KernelConf::Copy });
        self.b.consume_window(actor, reg.desc, offset, bytes);
        if !self.facts.paced(of.tensor) {
            let tick = self.tick_at(of.slot, of.rate)?;
            self.b.consume(actor, tick);
        }
        let slots = self.register_num(of.rate, of.mesh);
        let desc = self.b.regst(&format!("{name}.out"), actor, bytes, slots);
        self.copies_out.insert(reg, desc);
        Ok(desc)
    }
}
