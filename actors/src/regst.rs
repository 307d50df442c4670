//! Register slots as one actor sees them: a FIFO of ready slots per consumed descriptor,
//! and free slots plus per-slot holders per produced descriptor.

use crate::ring::Ring;
use crate::{ActorId, RegstRef};
use regflow_plan::RegstDescId;

pub use regflow_plan::MAX_CONSUMERS;

/// A slot that arrived ready and waits to be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReadyRegst {
    pub(crate) slot: u32,
    pub(crate) piece: u64,
    pub(crate) data: RegstRef,
}

/// One consumed descriptor.
#[derive(Debug, Clone)]
pub(crate) struct InputState {
    pub(crate) desc: RegstDescId,
    pub(crate) producer: ActorId,
    /// Arrived, not yet read; never longer than the producer's `register_num`.
    pub(crate) ready: Ring<ReadyRegst>,
    /// Read by launched firings whose kernels have not completed, oldest first.
    pub(crate) in_use: Ring<u32>,
    /// Piece expected in the next `Ready`.
    pub(crate) next_piece: u64,
    /// The slot the actor's current firing reads.
    pub(crate) firing: u32,
    pub(crate) eord: bool,
    /// The producer's slot count.
    pub(crate) register_num: u32,
    /// Carries loop state (its register is preloaded): it may hold more pieces than the
    /// loop runs, which the actor gives back without firing when its other inputs end.
    pub(crate) loop_carried: bool,
    /// Most slots of this input this actor held at once (ready or in use).
    pub(crate) max_held: u32,
}

impl InputState {
    pub(crate) fn new(desc: RegstDescId, producer: ActorId, register_num: u32, loop_carried: bool) -> Self {
        let capacity = register_num as usize;
        Self {
            desc,
            producer,
            ready: Ring::new(capacity, ReadyRegst { slot: 0, piece: 0, data: RegstRef { desc, slot: 0 } }),
            in_use: Ring::new(capacity, 0),
            next_piece: 0,
            firing: 0,
            eord: false,
            register_num,
            loop_carried,
            max_held: 0,
        }
    }

    #[inline(always)]
    pub(crate) fn note_held(&mut self) {
        let held = (self.ready.len() + self.in_use.len()) as u32;
        self.max_held = self.max_held.max(held);
    }

    /// Queues a ready slot; counts the input off `unready` if it was empty.
    #[inline(always)]
    pub(crate) fn push_ready(&mut self, regst: ReadyRegst, unready: &mut u32) {
        if self.ready.is_empty() {
            *unready -= 1;
        }
        self.ready.push_back(regst);
    }

    /// Takes the oldest ready slot; counts the input in `unready` if it is now empty.
    #[inline(always)]
    pub(crate) fn pop_ready(&mut self, unready: &mut u32) -> Option<ReadyRegst> {
        let regst = self.ready.pop_front()?;
        if self.ready.is_empty() {
            *unready += 1;
        }
        Some(regst)
    }

    pub(crate) fn is_finished(&self) -> bool {
        self.eord && self.ready.is_empty()
    }
}

/// A consumer of a produced descriptor.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Consumer {
    pub(crate) id: ActorId,
    /// On the producer's stream: told at launch, since stream order makes that safe.
    pub(crate) same_stream: bool,
}

/// Who holds one slot of a produced descriptor.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SlotState {
    /// Consumers that still hold it.
    pub(crate) holding: u32,
    /// Written by a launch whose kernel has not completed.
    pub(crate) completing: bool,
}

/// One produced descriptor.
#[derive(Debug, Clone)]
pub(crate) struct OutputState {
    pub(crate) desc: RegstDescId,
    pub(crate) register_num: u32,
    /// Slots handed out as pieces `0..preloaded` when the actor starts.
    pub(crate) preloaded: u32,
    /// Consumers on the actor's own stream first, then the others (each group in plan
    /// order): a launch tells the first group and its completion the second, each a plain
    /// slice walk with nothing to skip.
    pub(crate) consumers: Vec<Consumer>,
    /// How many of `consumers` run on the actor's own stream (the first ones).
    pub(crate) same_stream_consumers: usize,
    pub(crate) free: Ring<u32>,
    /// Per slot and consumer (`slot * consumers + i`): consumer `i` has not acked it.
    /// A flat table allocated once, so a register may have any number of consumers (an
    /// optimizer's clip factor is read by every update of a device).
    pub(crate) holders: Vec<bool>,
    /// Per slot: who still holds it, side by side in one table.
    pub(crate) slots: Vec<SlotState>,
    /// Emitted by launches not yet completed: (slot, piece, data), oldest first.
    pub(crate) launched: Ring<(u32, u64, RegstRef)>,
    pub(crate) next_piece: u64,
    /// The slot the actor's current firing writes.
    pub(crate) firing: u32,
    /// Pieces taken and not yet given back by every consumer, counted apart from `free`.
    pub(crate) in_flight: u32,
    pub(crate) max_in_flight: u32,
}

impl OutputState {
    pub(crate) fn new(desc: RegstDescId, register_num: u32, preloaded: u32, mut consumers: Vec<Consumer>) -> Self {
        let slots = register_num as usize;
        let table = slots * consumers.len();
        // Stable: plan order within each group.
        consumers.sort_by_key(|c| !c.same_stream);
        let same_stream_consumers = consumers.iter().filter(|c| c.same_stream).count();
        Self {
            desc,
            register_num,
            preloaded,
            consumers,
            same_stream_consumers,
            free: {
                let mut free = Ring::new(slots, 0);
                (0..register_num).for_each(|slot| free.push_back(slot));
                free
            },
            holders: vec![false; table],
            slots: vec![SlotState::default(); slots],
            launched: Ring::new(slots, (0, 0, RegstRef { desc, slot: 0 })),
            next_piece: 0,
            firing: 0,
            in_flight: 0,
            max_in_flight: 0,
        }
    }

    /// The consumers on the actor's own stream (`same_stream`) or on others.
    #[inline(always)]
    pub(crate) fn consumers_on(&self, same_stream: bool) -> &[Consumer] {
        let (same, other) = self.consumers.split_at(self.same_stream_consumers);
        if same_stream {
            same
        } else {
            other
        }
    }

    pub(crate) fn has_free(&self) -> bool {
        !self.free.is_empty()
    }

    /// Takes a free slot for a new piece. Until [`OutputState::lend`] it is held by the
    /// producer alone (an acc accumulating into it, a kernel writing it). Counts the output
    /// in `full` if that was its last free slot.
    #[inline(always)]
    pub(crate) fn take(&mut self, completing: bool, full: &mut u32) -> Option<u32> {
        let slot = self.free.pop_front()?;
        if self.free.is_empty() {
            *full += 1;
        }
        self.slots[slot as usize] = SlotState { holding: 0, completing };
        self.in_flight += 1;
        self.max_in_flight = self.max_in_flight.max(self.in_flight);
        Some(slot)
    }

    /// The piece in `slot` is being handed to every consumer: each holds it until it acks.
    #[inline(always)]
    pub(crate) fn lend(&mut self, slot: u32) {
        let n = self.consumers.len();
        let at = slot as usize * n;
        // Most registers have one consumer: one store, not a call to `memset`.
        match &mut self.holders[at..at + n] {
            [only] => *only = true,
            holders => holders.fill(true),
        }
        self.slots[slot as usize].holding = n as u32;
    }

    /// Records an ack; returns `Ok(true)` if the slot became free (and then counts the
    /// output off `full` if it had no free slot).
    #[inline(always)]
    pub(crate) fn ack(&mut self, slot: u32, from: ActorId, full: &mut u32) -> Result<bool, String> {
        let Some(position) = self.consumers.iter().position(|c| c.id == from) else {
            return Err(format!("ack of slot {slot} from {from}, which does not consume it"));
        };
        if slot >= self.register_num {
            return Err(format!("ack of slot {slot}, but the register has {} slots", self.register_num));
        }
        let held = &mut self.holders[slot as usize * self.consumers.len() + position];
        if !*held {
            return Err(format!("slot {slot} acked by {from}, which does not hold it (acked twice?)"));
        }
        *held = false;
        let state = &mut self.slots[slot as usize];
        state.holding -= 1;
        Ok(state.holding == 0 && !state.completing && self.release(slot, full))
    }

    /// Marks the slot's kernel complete; returns whether the slot became free (and then
    /// counts the output off `full` if it had no free slot).
    #[inline(always)]
    pub(crate) fn complete(&mut self, slot: u32, full: &mut u32) -> bool {
        let state = &mut self.slots[slot as usize];
        state.completing = false;
        state.holding == 0 && self.release(slot, full)
    }

    #[inline(always)]
    fn release(&mut self, slot: u32, full: &mut u32) -> bool {
        if self.free.is_empty() {
            *full -= 1;
        }
        self.free.push_back(slot);
        self.in_flight -= 1;
        true
    }

    /// Consumers still holding `slot`.
    pub(crate) fn holders_of(&self, slot: u32) -> impl Iterator<Item = ActorId> + '_ {
        let n = self.consumers.len();
        let held = &self.holders[slot as usize * n..(slot as usize + 1) * n];
        self.consumers.iter().zip(held).filter(|(_, &h)| h).map(|(c, _)| c.id)
    }
}
