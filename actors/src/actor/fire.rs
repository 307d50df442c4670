//! Firing: take the inputs in step and free output slots, launch the kernel, tell
//! same-stream consumers at launch and the others (and the producers) at completion.

use super::{Actor, KindState, Launch};
use crate::{ActorEnv, ActorError, Body, Completion, Firing, GroupPosition, RegstRef};

impl Actor {
    #[inline(always)]
    pub(super) fn fire<E: ActorEnv>(&mut self, env: &mut E) -> Result<(), ActorError> {
        if self.computes {
            return self.fire_compute(env);
        }
        self.fires += 1;
        match self.kind {
            KindState::Repeat { .. } => self.fire_repeat(env),
            _ => self.fire_other(env),
        }
    }

    /// [`Actor::fire`] for a compute actor, which the caller knows it is (`computes`):
    /// `Actor::progress` calls it straight, without `fire`'s look at the kind.
    #[inline(always)]
    pub(super) fn fire_compute<E: ActorEnv>(&mut self, env: &mut E) -> Result<(), ActorError> {
        self.fires += 1;
        self.fire_kind::<true, E>(env)
    }

    /// [`Actor::fire`] for a source, sink or acc: out of line, so that the compute
    /// actors' firing, most of a plan's, stays small where it is inlined.
    #[inline(never)]
    fn fire_other<E: ActorEnv>(&mut self, env: &mut E) -> Result<(), ActorError> {
        self.fire_kind::<false, E>(env)
    }

    /// Fires a compute actor (`COMPUTE`, whose launches always read and emit, one piece
    /// at a time: none of the kind's state to look at) or a source, sink or acc.
    #[inline(always)]
    fn fire_kind<const COMPUTE: bool, E: ActorEnv>(&mut self, env: &mut E) -> Result<(), ActorError> {
        // Consume the front of every input; the pieces must be in step.
        let mut piece = None;
        let first_desc = self.inputs.first().map(|i| i.desc);
        for (input, data) in self.inputs.iter_mut().zip(self.scratch_inputs.iter_mut()) {
            let Some(front) = input.pop_ready(&mut self.unready_inputs) else {
                unreachable!("fired without a ready input")
            };
            if let Some(p) = piece.filter(|&p| p != front.piece) {
                let detail = format!(
                    "input {} is at piece {} while input {} is at piece {p}",
                    input.desc,
                    front.piece,
                    first_desc.map(|d| d.to_string()).unwrap_or_default()
                );
                return Err(ActorError::PieceOrder { name: self.name.clone(), id: self.id, detail });
            }
            piece = Some(front.piece);
            *data = front.data;
        }
        // Decide the group position and which output slots this launch writes.
        let (group, ack_inputs, emit) = match &mut self.kind {
            _ if COMPUTE => (GroupPosition { index: 0, count: 1 }, true, true),
            KindState::Source { available, produced, limit, .. } => {
                piece = Some(*produced);
                *produced += 1;
                if limit.is_none() {
                    *available -= 1;
                }
                (GroupPosition { index: 0, count: 1 }, false, true)
            }
            KindState::Acc { count, position, held } => {
                if *position == 0 {
                    *held = self.outputs[0].take(true, &mut self.full_outputs);
                }
                let group = GroupPosition { index: *position, count: *count };
                *position += 1;
                let emit = *position == *count;
                if emit {
                    *position = 0;
                }
                (group, true, emit)
            }
            KindState::Sink { credits } => {
                if let Some(credits) = credits {
                    *credits -= 1;
                }
                (GroupPosition { index: 0, count: 1 }, true, true)
            }
            _ => (GroupPosition { index: 0, count: 1 }, true, true),
        };
        for (output, regst) in self.outputs.iter_mut().zip(self.scratch_outputs.iter_mut()) {
            let slot = match self.kind {
                KindState::Acc { held: Some(slot), .. } if !COMPUTE => slot,
                _ => match output.take(true, &mut self.full_outputs) {
                    Some(slot) => slot,
                    None => unreachable!("fired without a free output slot"),
                },
            };
            output.firing = slot;
            *regst = RegstRef { desc: output.desc, slot };
        }
        // An acc flushes a partial sum to its consumers when drained without a launch, so
        // each of its launches reports completion where those consumers would wait.
        let emits_now_or_later = emit || (!COMPUTE && matches!(self.kind, KindState::Acc { .. }));
        let completion_wanted =
            !self.pending.is_empty() || (emits_now_or_later && self.outputs_wait) || (ack_inputs && self.inputs_wait);
        let firing = Firing {
            actor: self.id,
            piece: piece.unwrap_or(0),
            inputs: &self.scratch_inputs,
            outputs: &self.scratch_outputs,
            group,
            completion_wanted,
        };
        let completion = env.launch(&firing).map_err(|e| self.env_error(e))?;
        // A kernel that completed during the launch with none older in flight completes
        // here and now: nothing is queued only to be taken right back.
        let at_once = completion == Completion::Done && self.pending.is_empty();
        if at_once {
            if emit {
                // Written and complete: every consumer, on this stream or another, is told
                // now, in one walk per output.
                for o in 0..self.outputs.len() {
                    let (slot, piece, regst) = self.emit_piece(o);
                    self.outputs[o].lend(slot);
                    for consumer in &self.outputs[o].consumers {
                        self.send(env, consumer.id, Body::Ready { regst, piece, data: regst })?;
                    }
                    if self.outputs[o].complete(slot, &mut self.full_outputs) {
                        self.on_slot_freed(env)?;
                    }
                }
            }
            if ack_inputs {
                for i in 0..self.inputs.len() {
                    self.ack_input(env, i, self.inputs[i].last_read())?;
                }
            }
            return Ok(());
        }
        if emit {
            for o in 0..self.outputs.len() {
                let (slot, piece, regst) = self.emit_piece(o);
                self.emit_at_launch(env, o, slot, piece, regst)?;
            }
        }
        for input in &mut self.inputs {
            input.hold_in_use();
        }
        self.pending.push_back(Launch { ack_inputs, emit });
        if completion == Completion::Done {
            self.complete_oldest(env)?;
        }
        Ok(())
    }

    /// Hands the held input (or the next one) to one more output piece, without copying.
    ///
    /// The hand-off is launched on the repeat's stream like a kernel (the runtime runs a
    /// no-op): if the input was written by a kernel on this stream that has not completed,
    /// consumers on other streams must not hear of it before it has, and the stream's
    /// completion order is what tells. Same-stream consumers are told at once, as always.
    #[inline(never)]
    fn fire_repeat<E: ActorEnv>(&mut self, env: &mut E) -> Result<(), ActorError> {
        let KindState::Repeat { count, held, handed, outstanding } = &mut self.kind else {
            unreachable!("fire_repeat on a non-repeat actor")
        };
        if held.is_none() {
            *held = self.inputs[0].pop_ready(&mut self.unready_inputs);
        }
        let Some(input) = *held else { unreachable!("repeat fired without input") };
        let group = GroupPosition { index: *handed, count: *count };
        *handed += 1;
        *outstanding += 1;
        let output = &mut self.outputs[0];
        let Some(slot) = output.take(true, &mut self.full_outputs) else {
            unreachable!("repeat fired without a free slot")
        };
        let piece = output.next_piece;
        output.next_piece += 1;
        // A repeat has exactly one input.
        self.scratch_inputs[0] = input.data;
        // Its input goes back to its producer when the pieces come back, not at completion.
        let completion_wanted = !self.pending.is_empty() || self.outputs_wait;
        let firing =
            Firing { actor: self.id, piece, inputs: &self.scratch_inputs, outputs: &[], group, completion_wanted };
        let completion = env.launch(&firing).map_err(|e| self.env_error(e))?;
        self.emit_at_launch(env, 0, slot, piece, input.data)?;
        self.pending.push_back(Launch { ack_inputs: false, emit: true });
        if completion == Completion::Done {
            self.complete_oldest(env)?;
        }
        Ok(())
    }

    /// Numbers the piece the current firing writes into output `o`: its slot, its piece
    /// and the slot as a register reference.
    #[inline(always)]
    fn emit_piece(&mut self, o: usize) -> (u32, u64, RegstRef) {
        let output = &mut self.outputs[o];
        let (slot, piece) = (output.firing, output.next_piece);
        output.next_piece += 1;
        (slot, piece, RegstRef { desc: output.desc, slot })
    }

    /// An emitting launch whose kernel has not completed: lend the slot to every consumer,
    /// record it until completion, and tell the consumers on this stream now.
    #[inline(always)]
    fn emit_at_launch<E: ActorEnv>(
        &mut self,
        env: &mut E,
        o: usize,
        slot: u32,
        piece: u64,
        data: RegstRef,
    ) -> Result<(), ActorError> {
        let output = &mut self.outputs[o];
        output.lend(slot);
        output.launched.push_back((slot, piece, data));
        self.tell_consumers(env, o, slot, piece, data, true)
    }

    /// Sends `Ready` for output `o`'s `slot` to its consumers on this stream
    /// (`same_stream`) or on other streams (not `same_stream`). Always inlined: its callers
    /// pass `same_stream` as a constant, and most outputs have no consumer in one group.
    #[inline(always)]
    fn tell_consumers<E: ActorEnv>(
        &self,
        env: &mut E,
        o: usize,
        slot: u32,
        piece: u64,
        data: RegstRef,
        same_stream: bool,
    ) -> Result<(), ActorError> {
        let output = &self.outputs[o];
        let regst = RegstRef { desc: output.desc, slot };
        for consumer in output.consumers_on(same_stream) {
            self.send(env, consumer.id, Body::Ready { regst, piece, data })?;
        }
        Ok(())
    }

    /// The oldest launch's kernel completed: tell other-stream consumers and producers.
    pub(super) fn complete_oldest<E: ActorEnv>(&mut self, env: &mut E) -> Result<(), ActorError> {
        let Some(launch) = self.pending.pop_front() else {
            return Err(self.unexpected("ActDone with no kernel in flight".into()));
        };
        if launch.emit {
            for o in 0..self.outputs.len() {
                let Some((slot, piece, data)) = self.outputs[o].launched.pop_front() else {
                    unreachable!("an emitting launch recorded no slot")
                };
                self.finish_output(env, o, slot, piece, data)?;
            }
        }
        if launch.ack_inputs {
            for i in 0..self.inputs.len() {
                let Some(slot) = self.inputs[i].release_in_use() else {
                    unreachable!("a launch that read inputs recorded no slot")
                };
                self.ack_input(env, i, slot)?;
            }
        }
        Ok(())
    }

    /// The kernel that wrote output `o`'s `slot` completed: tell the consumers on other
    /// streams, and free the slot if every consumer already gave it back.
    #[inline(always)]
    fn finish_output<E: ActorEnv>(
        &mut self,
        env: &mut E,
        o: usize,
        slot: u32,
        piece: u64,
        data: RegstRef,
    ) -> Result<(), ActorError> {
        self.tell_consumers(env, o, slot, piece, data, false)?;
        if self.outputs[o].complete(slot, &mut self.full_outputs) {
            self.on_slot_freed(env)?;
        }
        Ok(())
    }

    /// The kernel that read input `i`'s `slot` completed: give the slot back.
    #[inline(always)]
    fn ack_input<E: ActorEnv>(&mut self, env: &mut E, i: usize, slot: u32) -> Result<(), ActorError> {
        let (producer, desc) = (self.inputs[i].producer, self.inputs[i].desc);
        self.send(env, producer, Body::Ack { regst: RegstRef { desc, slot } })
    }

    /// An acc actor that drains mid-group emits the partial sum rather than losing it.
    pub(super) fn flush_partial_group<E: ActorEnv>(&mut self, env: &mut E) -> Result<(), ActorError> {
        let KindState::Acc { position, held, .. } = &mut self.kind else {
            return Ok(());
        };
        if *position == 0 {
            return Ok(());
        }
        *position = 0;
        let Some(slot) = held.take() else {
            return Ok(());
        };
        let output = &mut self.outputs[0];
        let piece = output.next_piece;
        output.next_piece += 1;
        output.lend(slot);
        let regst = RegstRef { desc: output.desc, slot };
        for c in 0..self.outputs[0].consumers.len() {
            let dst = self.outputs[0].consumers[c].id;
            self.send(env, dst, Body::Ready { regst, piece, data: regst })?;
        }
        self.outputs[0].complete(slot, &mut self.full_outputs);
        Ok(())
    }
}
