//! Register slots as one actor sees them: counters of the pieces ready and in use per
//! consumed descriptor, and of the slots taken and lent per produced descriptor.
//!
//! **Slots go round in order.** A producer takes the slots of a register in the cyclic
//! order 0, 1, …, n − 1, 0, … (piece `p` is always in slot `p mod n`), every consumer reads
//! and gives back the pieces of an input in the order they came, and kernels complete in
//! launch order, so a slot is free again only after every older one is. Each queue of
//! slots is therefore a window that two counters describe: no ring of slot numbers, no
//! table of who holds which slot. Every `Ready` and `Ack` still names its slot, and the
//! receiver checks it against the counters, so a message out of order (from a broken
//! peer or a corrupt frame) is an error naming the slot expected, never a silent mix-up.
//! (`bench_actors b1`, callgrind: the rings and the holder table were about a sixth of a
//! firing's instructions.)

use crate::ring::Ring;
use crate::{ActorId, RegstRef};
use regflow_plan::RegstDescId;

pub use regflow_plan::MAX_CONSUMERS;

/// `slot + ahead` in the cyclic order of a register of `slots` slots (`ahead <= slots`).
#[inline(always)]
fn slot_after(slot: u32, ahead: u32, slots: u32) -> u32 {
    let at = slot + ahead;
    match at.checked_sub(slots) {
        Some(wrapped) => wrapped,
        None => at,
    }
}

/// `slot + 1` in the cyclic order of a register of `slots` slots ([`slot_after`] by one,
/// with a comparison where that needs a subtraction: this one runs several times per
/// firing).
#[inline(always)]
fn next_slot(slot: u32, slots: u32) -> u32 {
    if slot + 1 == slots {
        0
    } else {
        slot + 1
    }
}

/// `slot - back` in the cyclic order of a register of `slots` slots (`back <= slots`).
#[inline(always)]
fn slot_before(slot: u32, back: u32, slots: u32) -> u32 {
    match slot.checked_sub(back) {
        Some(s) => s,
        None => slot + slots - back,
    }
}

/// A slot read from an input: which slot to give back, its piece, and what it reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReadyRegst {
    pub(crate) slot: u32,
    pub(crate) piece: u64,
    pub(crate) data: RegstRef,
}

/// One consumed descriptor.
///
/// Of the producer's slots, this actor holds a window: the oldest `in_use` are read by
/// launched firings whose kernels have not completed, the `ready` after them arrived and
/// wait to be read; `read_slot` is the first ready one.
#[derive(Debug, Clone)]
pub(crate) struct InputState {
    pub(crate) desc: RegstDescId,
    pub(crate) producer: ActorId,
    /// Arrived, not yet read; never more than the producer's `register_num` with `in_use`.
    pub(crate) ready: u32,
    /// Read by launched firings whose kernels have not completed.
    pub(crate) in_use: u32,
    /// The slot of the oldest ready piece.
    read_slot: u32,
    /// What each ready piece reads, oldest first, when the producer is a repeat (its
    /// pieces are views of the repeat's own input, not of its slots); else unused (a
    /// piece reads its own slot).
    data: Option<Ring<RegstRef>>,
    /// Piece expected in the next `Ready`.
    pub(crate) next_piece: u64,
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
    /// An input of `register_num` slots; `repeat_fed` when its producer is a repeat.
    pub(crate) fn new(
        desc: RegstDescId,
        producer: ActorId,
        register_num: u32,
        loop_carried: bool,
        repeat_fed: bool,
    ) -> Self {
        Self {
            desc,
            producer,
            ready: 0,
            in_use: 0,
            read_slot: 0,
            data: repeat_fed.then(|| Ring::new(register_num as usize, RegstRef { desc, slot: 0 })),
            next_piece: 0,
            eord: false,
            register_num,
            loop_carried,
            max_held: 0,
        }
    }

    /// Whether no piece waits to be read.
    #[inline(always)]
    pub(crate) fn is_empty(&self) -> bool {
        self.ready == 0
    }

    /// The piece of the oldest ready slot, if any.
    pub(crate) fn front_piece(&self) -> Option<u64> {
        (self.ready > 0).then(|| self.next_piece - u64::from(self.ready))
    }

    /// Why a `Ready` of `slot` for piece `piece` from `src` cannot be taken now, if it
    /// cannot: another producer, after the end, out of order, more slots than the
    /// register has, or not the slot that piece must be in.
    #[inline(always)]
    pub(crate) fn refuses(&self, src: ActorId, slot: u32, piece: u64) -> bool {
        self.producer != src
            || self.eord
            || piece != self.next_piece
            || self.ready + self.in_use >= self.register_num
            || slot != self.arriving_slot()
    }

    /// The slot the next `Ready` must name: the one after the newest ready slot.
    #[inline(always)]
    pub(crate) fn arriving_slot(&self) -> u32 {
        slot_after(self.read_slot, self.ready, self.register_num)
    }

    /// Queues the next piece (the caller checked it with [`InputState::refuses`]), which
    /// reads `data`; counts the input off `unready` if it was empty.
    #[inline(always)]
    pub(crate) fn push_ready(&mut self, data: RegstRef, unready: &mut u32) {
        if self.ready == 0 {
            *unready -= 1;
        }
        self.ready += 1;
        self.next_piece += 1;
        if let Some(ring) = &mut self.data {
            ring.push_back(data);
        }
        let held = self.ready + self.in_use;
        self.max_held = self.max_held.max(held);
    }

    /// Takes the oldest ready slot; counts the input in `unready` if it is now empty.
    #[inline(always)]
    pub(crate) fn pop_ready(&mut self, unready: &mut u32) -> Option<ReadyRegst> {
        if self.ready == 0 {
            return None;
        }
        let slot = self.read_slot;
        let piece = self.next_piece - u64::from(self.ready);
        self.read_slot = next_slot(slot, self.register_num);
        self.ready -= 1;
        if self.ready == 0 {
            *unready += 1;
        }
        let data = match &mut self.data {
            None => RegstRef { desc: self.desc, slot },
            Some(ring) => match ring.pop_front() {
                Some(data) => data,
                None => unreachable!("a repeat-fed input keeps one view per ready piece"),
            },
        };
        Some(ReadyRegst { slot, piece, data })
    }

    /// The slot read last, to give back when no launch reads this input any more: with
    /// none in flight, it is the only slot read and not given back.
    #[inline(always)]
    pub(crate) fn last_read(&self) -> u32 {
        slot_before(self.read_slot, 1, self.register_num)
    }

    /// The slot just read is read by a launch whose kernel has not completed.
    #[inline(always)]
    pub(crate) fn hold_in_use(&mut self) {
        self.in_use += 1;
    }

    /// The oldest launch still reading this input completed: the slot to give back.
    /// Every slot read and not given back is in use (the firing path gives a slot back
    /// at once only when no launch is in flight), so it is the oldest of them.
    #[inline(always)]
    pub(crate) fn release_in_use(&mut self) -> Option<u32> {
        if self.in_use == 0 {
            return None;
        }
        let slot = slot_before(self.read_slot, self.in_use, self.register_num);
        self.in_use -= 1;
        Some(slot)
    }

    pub(crate) fn is_finished(&self) -> bool {
        self.eord && self.ready == 0
    }
}

/// A consumer of a produced descriptor, and the slots it holds: `owed` slots from
/// `next_ack` on, in the cyclic order.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Consumer {
    pub(crate) id: ActorId,
    /// On the producer's stream: told at launch, since stream order makes that safe.
    pub(crate) same_stream: bool,
    /// The slot it gives back next.
    next_ack: u32,
    /// Slots lent to it and not yet given back.
    owed: u32,
}

impl Consumer {
    /// Consumer `id`, holding nothing yet.
    pub(crate) fn new(id: ActorId, same_stream: bool) -> Self {
        Self { id, same_stream, next_ack: 0, owed: 0 }
    }

    /// Whether it holds `slot` of a register of `slots` slots: the slot lies in its
    /// window of `owed` slots from `next_ack`.
    #[inline(always)]
    fn holds(&self, slot: u32, slots: u32) -> bool {
        // How far `slot` lies after `next_ack`.
        slot_before(slot, self.next_ack, slots) < self.owed
    }
}

/// One produced descriptor.
///
/// The `in_flight` slots taken and not yet free are the window that ends before
/// `next_take`, in the cyclic order; the rest are free. Of that window, the newest
/// `uncompleted` were written by launches whose kernels have not completed (kernels
/// complete in launch order), and each consumer holds the slots from its `next_ack` on.
/// A slot is free once it is completed and no consumer holds it, which happens oldest
/// first.
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
    /// The slot the next piece is written into.
    next_take: u32,
    /// The newest taken slots whose kernels have not completed.
    uncompleted: u32,
    /// Per slot, for a register of several consumers: how many still hold it. Empty for
    /// one consumer (or none), whose own window tells whether it holds a slot: the
    /// usual register checks no table.
    holding: Box<[u32]>,
    /// Emitted by launches not yet completed: (slot, piece, data), oldest first.
    pub(crate) launched: Ring<(u32, u64, RegstRef)>,
    pub(crate) next_piece: u64,
    /// The slot the actor's current firing writes.
    pub(crate) firing: u32,
    /// Pieces taken and not yet given back by every consumer.
    pub(crate) in_flight: u32,
    pub(crate) max_in_flight: u32,
}

impl OutputState {
    pub(crate) fn new(desc: RegstDescId, register_num: u32, preloaded: u32, mut consumers: Vec<Consumer>) -> Self {
        let slots = register_num as usize;
        // Stable: plan order within each group.
        consumers.sort_by_key(|c| !c.same_stream);
        let same_stream_consumers = consumers.iter().filter(|c| c.same_stream).count();
        let holding = if consumers.len() > 1 { vec![0; slots] } else { Vec::new() };
        Self {
            desc,
            register_num,
            preloaded,
            consumers,
            same_stream_consumers,
            next_take: 0,
            uncompleted: 0,
            holding: holding.into_boxed_slice(),
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

    #[inline(always)]
    pub(crate) fn has_free(&self) -> bool {
        self.in_flight < self.register_num
    }

    /// Takes the next free slot for a new piece. Until [`OutputState::lend`] it is held
    /// by the producer alone (an acc accumulating into it, a kernel writing it). Counts
    /// the output in `full` if that was its last free slot.
    #[inline(always)]
    pub(crate) fn take(&mut self, completing: bool, full: &mut u32) -> Option<u32> {
        if self.in_flight == self.register_num {
            return None;
        }
        let slot = self.next_take;
        self.next_take = next_slot(slot, self.register_num);
        self.in_flight += 1;
        if self.in_flight == self.register_num {
            *full += 1;
        }
        if completing {
            self.uncompleted += 1;
        }
        self.max_in_flight = self.max_in_flight.max(self.in_flight);
        Some(slot)
    }

    /// The piece in `slot` (the newest taken) is being handed to every consumer: each
    /// holds it until it acks.
    #[inline(always)]
    pub(crate) fn lend(&mut self, slot: u32) {
        // Most registers have one consumer: one add, not a loop.
        match &mut self.consumers[..] {
            [only] => only.owed += 1,
            all => {
                all.iter_mut().for_each(|c| c.owed += 1);
                if let Some(holding) = self.holding.get_mut(slot as usize) {
                    *holding = all.len() as u32;
                }
            }
        }
    }

    /// Records an ack; returns `Ok(true)` if the slot became free (and then counts the
    /// output off `full` if it had no free slot). An ack of a slot the consumer does not
    /// hold, or not of the oldest one it holds, is refused.
    #[inline(always)]
    pub(crate) fn ack(&mut self, slot: u32, from: ActorId, full: &mut u32) -> Result<bool, String> {
        let Some(consumer) = self.consumers.iter_mut().find(|c| c.id == from) else {
            return Err(format!("ack of slot {slot} from {from}, which does not consume it"));
        };
        if consumer.owed == 0 || consumer.next_ack != slot {
            return Err(Self::bad_ack(slot, from, consumer, self.register_num));
        }
        consumer.owed -= 1;
        consumer.next_ack = next_slot(slot, self.register_num);
        // Given back by every consumer: with one, by this ack.
        let given_back = match self.holding.get_mut(slot as usize) {
            None => true,
            Some(holding) => {
                *holding -= 1;
                *holding == 0
            }
        };
        // Every consumer gave back the slots older than this one first, so it is the
        // oldest taken unless an older one waits for its kernel, and then so does this one.
        Ok(given_back && self.in_flight > self.uncompleted && self.release(slot, full))
    }

    #[cold]
    #[inline(never)]
    fn bad_ack(slot: u32, from: ActorId, consumer: &Consumer, register_num: u32) -> String {
        if slot >= register_num {
            format!("ack of slot {slot}, but the register has {register_num} slots")
        } else if consumer.owed == 0 {
            format!("slot {slot} acked by {from}, which does not hold it (acked twice?)")
        } else {
            format!(
                "slot {slot} acked by {from} out of order: it holds {} slot(s) from slot {}, given back oldest first",
                consumer.owed, consumer.next_ack
            )
        }
    }

    /// Marks the slot's kernel complete; returns whether the slot became free (and then
    /// counts the output off `full` if it had no free slot).
    #[inline(always)]
    pub(crate) fn complete(&mut self, slot: u32, full: &mut u32) -> bool {
        debug_assert!(self.uncompleted > 0, "a completion of {slot} with none pending");
        self.uncompleted -= 1;
        // Kernels complete in launch order, so every older slot is complete too: if no
        // consumer holds this one, none holds an older one, and it is the oldest taken.
        let held = match (&self.consumers[..], self.holding.get(slot as usize)) {
            (_, Some(&holding)) => holding > 0,
            ([only], None) => only.holds(slot, self.register_num),
            (_, None) => false,
        };
        !held && self.release(slot, full)
    }

    /// Frees `slot`, the oldest taken (see the module's docs for why it always is).
    #[inline(always)]
    fn release(&mut self, slot: u32, full: &mut u32) -> bool {
        debug_assert_eq!(slot, slot_before(self.next_take, self.in_flight, self.register_num), "oldest slot");
        if self.in_flight == self.register_num {
            *full -= 1;
        }
        self.in_flight -= 1;
        true
    }

    /// Consumers still holding `slot`.
    pub(crate) fn holders_of(&self, slot: u32) -> impl Iterator<Item = ActorId> + '_ {
        let n = self.register_num;
        self.consumers.iter().filter(move |c| c.holds(slot, n)).map(|c| c.id)
    }
}

#[cfg(test)]
mod tests {
    use super::{slot_after, slot_before, Consumer, InputState, OutputState};
    use crate::ActorId;
    use crate::RegstRef;
    use regflow_plan::RegstDescId;

    fn actor(k: u64) -> ActorId {
        ActorId::new(0, 0, 0, k as u32).expect("a small id")
    }

    /// Slots are taken round in order and freed oldest first; acks out of order, twice or
    /// from a stranger are refused with the slot expected.
    #[test]
    fn slots_go_round_in_order_and_acks_are_checked() {
        let consumers = vec![Consumer::new(actor(1), true), Consumer::new(actor(2), false)];
        let mut out = OutputState::new(RegstDescId(0), 3, 0, consumers);
        let mut full = 0;
        let taken: Vec<u32> = (0..3).filter_map(|_| out.take(false, &mut full)).collect();
        assert_eq!(taken, [0, 1, 2]);
        assert_eq!((full, out.take(false, &mut full)), (1, None));
        taken.iter().for_each(|&s| out.lend(s));
        assert_eq!(out.holders_of(1).collect::<Vec<_>>(), [actor(1), actor(2)]);
        assert!(out.ack(1, actor(1), &mut full).unwrap_err().contains("out of order: it holds 3 slot(s) from slot 0"));
        assert!(out.ack(0, actor(3), &mut full).unwrap_err().contains("does not consume it"));
        assert_eq!(out.ack(0, actor(1), &mut full), Ok(false));
        assert_eq!(out.holders_of(0).collect::<Vec<_>>(), [actor(2)]);
        assert_eq!(out.ack(0, actor(2), &mut full), Ok(true));
        assert_eq!((full, out.in_flight), (0, 2));
        assert_eq!(out.take(false, &mut full), Some(0));
        out.lend(0);
        for slot in [1, 2, 0] {
            assert_eq!(out.ack(slot, actor(2), &mut full), Ok(false));
        }
        assert!(out.ack(1, actor(2), &mut full).unwrap_err().contains("acked twice?"));
        for slot in [1, 2, 0] {
            assert_eq!(out.ack(slot, actor(1), &mut full), Ok(true));
        }
        assert_eq!((full, out.in_flight, out.max_in_flight), (0, 0, 3));
    }

    /// With one consumer (no holder table) a slot is free once it is given back and its
    /// kernel completed, in either order, and always the oldest first.
    #[test]
    fn one_consumer_frees_a_slot_after_its_ack_and_its_completion() {
        let mut out = OutputState::new(RegstDescId(0), 2, 0, vec![Consumer::new(actor(1), false)]);
        let mut full = 0;
        for round in 0..3u32 {
            // Two pieces in flight, neither complete: the register is full.
            let (a, b) = (out.take(true, &mut full).unwrap(), out.take(true, &mut full).unwrap());
            assert_eq!((a, b, full), (0, 1, 1), "round {round}");
            out.lend(a);
            out.lend(b);
            assert_eq!(out.holders_of(a).chain(out.holders_of(b)).count(), 2);
            // Acked before completion: still held by its kernel.
            assert_eq!(out.ack(a, actor(1), &mut full), Ok(false));
            assert!(out.holders_of(a).next().is_none());
            assert!(out.complete(a, &mut full), "round {round}");
            assert_eq!((full, out.in_flight), (0, 1));
            // Completed before the ack: free at the ack.
            assert!(!out.complete(b, &mut full));
            assert_eq!(out.ack(b, actor(1), &mut full), Ok(true));
            assert_eq!((full, out.in_flight), (0, 0));
        }
        // An output nobody reads frees its slot at completion.
        let mut lone = OutputState::new(RegstDescId(1), 1, 0, Vec::new());
        let slot = lone.take(true, &mut full).unwrap();
        lone.lend(slot);
        assert!(lone.complete(slot, &mut full));
        assert_eq!(lone.in_flight, 0);
    }

    /// An input takes pieces in their slots' order, refuses one in another slot, and gives
    /// back the oldest in use first; one fed by a repeat reads what each piece names.
    #[test]
    fn an_input_is_a_window_of_its_producers_slots() {
        let (producer, desc) = (actor(7), RegstDescId(3));
        let mut input = InputState::new(desc, producer, 3, false, false);
        let mut unready = 1;
        for piece in 0..2u64 {
            let slot = piece as u32;
            assert!(input.refuses(producer, slot + 1, piece), "slot {} for piece {piece}", slot + 1);
            assert!(!input.refuses(producer, slot, piece));
            input.push_ready(RegstRef { desc, slot }, &mut unready);
        }
        assert_eq!((unready, input.front_piece()), (0, Some(0)));
        for slot in 0..2 {
            let read = input.pop_ready(&mut unready).unwrap();
            assert_eq!((read.slot, read.piece, read.data), (slot, u64::from(slot), RegstRef { desc, slot }));
            input.hold_in_use();
        }
        assert_eq!((unready, input.pop_ready(&mut unready)), (1, None));
        assert!(input.refuses(producer, 2, 3), "piece 3 before piece 2");
        assert!(!input.refuses(producer, 2, 2));
        input.push_ready(RegstRef { desc, slot: 2 }, &mut unready);
        assert!(input.refuses(producer, 0, 3), "a fourth piece with three slots held");
        assert_eq!([input.release_in_use(), input.release_in_use(), input.release_in_use()], [Some(0), Some(1), None]);
        assert_eq!(input.arriving_slot(), 0);
        assert_eq!(input.max_held, 3);

        let mut fed = InputState::new(desc, producer, 2, false, true);
        let view = RegstRef { desc: RegstDescId(9), slot: 1 };
        let mut unready = 1;
        fed.push_ready(view, &mut unready);
        assert_eq!(fed.pop_ready(&mut unready).map(|r| (r.slot, r.data)), Some((0, view)));
    }

    #[test]
    fn a_slot_before_or_after_wraps_round() {
        assert_eq!(slot_before(2, 2, 4), 0);
        assert_eq!(slot_before(1, 2, 4), 3);
        assert_eq!(slot_before(0, 4, 4), 0);
        assert_eq!(slot_after(1, 2, 4), 3);
        assert_eq!(slot_after(3, 2, 4), 1);
        assert_eq!(slot_after(3, 4, 4), 3);
    }
}
