//! The actor state machine: act when every input has a ready register and every output a
//! free slot; tell consumers and producers when the kernel completes; forward end of data
//! once drained; linger as a zombie until every slot is back.

mod fire;

use crate::regst::{Consumer, InputState, OutputState, ReadyRegst};
use crate::ring::Ring;
use crate::{ActorEnv, ActorError, ActorId, Body, Cmd, EnvError, Message, PlanIds, RegstRef};
use regflow_plan::{ActorIndex, ActorKind, PlanIndex, RegstDescId, SourcePieces};

/// What [`Actor::accept`] did with a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accepted {
    /// Taken; the actor can fire now: run [`Actor::resume`] (once, however many messages
    /// said so).
    Runnable,
    /// Taken; the actor still waits for something else.
    Taken,
    /// Not taken: deliver it with [`Actor::handle`], after what is already queued.
    Declined,
}

/// Where an actor is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifecycle {
    /// Taking messages and firing.
    Running,
    /// Drained and `Eord` sent; waiting for its consumers to give back its last slots.
    Zombie,
    /// Finished (or stopped): it sends nothing more.
    Done,
}

/// Kind-specific state.
///
/// `repr(u8)`: an explicit tag byte. The default layout hides the tag in a niche of a
/// field, which every `match` (several per firing) decodes with a few instructions more.
#[derive(Debug, Clone)]
#[repr(u8)]
pub(crate) enum KindState {
    Source {
        limit: Option<u64>,
        available: u64,
        closed: bool,
        produced: u64,
    },
    Compute,
    /// `credits`: pieces the user may still be handed before fetching; `None` is unbounded.
    Sink {
        credits: Option<u64>,
    },
    Acc {
        count: u32,
        position: u32,
        held: Option<u32>,
    },
    Repeat {
        count: u32,
        held: Option<ReadyRegst>,
        handed: u32,
        outstanding: u32,
    },
}

/// What a launch must do when its kernel completes.
#[derive(Debug, Clone, Copy)]
struct Launch {
    ack_inputs: bool,
    emit: bool,
}

/// One actor. Owned by its stream thread; driven only through [`Actor::handle`].
#[derive(Debug)]
pub struct Actor {
    pub(crate) id: ActorId,
    pub(crate) name: String,
    pub(crate) kind: KindState,
    pub(crate) inputs: Vec<InputState>,
    pub(crate) outputs: Vec<OutputState>,
    pending: Ring<Launch>,
    pub(crate) started: bool,
    pub(crate) lifecycle: Lifecycle,
    /// Done because of a Stop, not because it finished.
    stopped: bool,
    /// Inputs (not loop-carried) whose producer sent `Eord`: until one has, the actor
    /// cannot be drained.
    ended_inputs: usize,
    /// Inputs with no ready slot: the actor's inputs are all ready when this is 0.
    unready_inputs: u32,
    /// Outputs with no free slot: every output has a free slot when this is 0.
    full_outputs: u32,
    /// Whether the actor ends when its inputs end (every kind but a source, unless all
    /// its inputs close loops): then it cannot be drained while `ended_inputs` is 0.
    ends_by_inputs: bool,
    /// Some output has a consumer on another stream: an emitting launch must report its
    /// completion (an acc's every launch: it may flush a partial sum without one).
    outputs_wait: bool,
    /// Some input must be given back only once the kernel completed: its producer is on
    /// another stream, or is a repeat (which hands the slot back to its own producer as
    /// soon as the slot returns, possibly across streams).
    inputs_wait: bool,
    /// What the current firing reads (one entry per input) and writes (one per output):
    /// allocated once with the actor and overwritten in place by every firing, so a
    /// firing allocates nothing and needs no length bookkeeping. (The slots it takes are
    /// kept with each input and output, `firing`, read where those are read anyway.)
    scratch_inputs: Box<[RegstRef]>,
    scratch_outputs: Box<[RegstRef]>,
    /// Input and output positions by register, sorted, for an actor with more than
    /// [`SCAN_MAX`] of them (a fused optimizer update reads and writes hundreds): a message
    /// finds its register by binary search, not by a scan that would make each step cost
    /// the square of the parameter count. Empty for the usual few, which a scan finds faster.
    input_lookup: Box<[(RegstDescId, u32)]>,
    output_lookup: Box<[(RegstDescId, u32)]>,
    pub(crate) fires: u64,
    /// The kind is [`KindState::Compute`], kept apart from the kind's tag: the firing path
    /// tests it with one comparison, where a `match` on the tag compiles to a jump table
    /// (an indirect jump, several times per firing).
    computes: bool,
}

/// Most inputs (outputs) an actor finds a message's register among by a scan.
const SCAN_MAX: usize = 8;

/// `(register, position)` of each of `descs`, sorted by register, if there are more than
/// [`SCAN_MAX`]; else empty.
fn lookup(descs: impl ExactSizeIterator<Item = RegstDescId>) -> Box<[(RegstDescId, u32)]> {
    if descs.len() <= SCAN_MAX {
        return Box::new([]);
    }
    let mut table: Vec<(RegstDescId, u32)> = descs.enumerate().map(|(k, d)| (d, k as u32)).collect();
    table.sort_unstable();
    table.into_boxed_slice()
}

/// The position of `desc` in `table` (see [`lookup`]). Out of line: the usual actor with a
/// few registers scans, and its message path stays as small as before.
#[inline(never)]
fn look_up(table: &[(RegstDescId, u32)], desc: RegstDescId) -> Option<usize> {
    table.binary_search_by_key(&desc, |&(d, _)| d).ok().map(|k| table[k].1 as usize)
}

/// The position of register `desc` among `items` (an actor's inputs or outputs, whose
/// register `desc_of` reads): a scan of the usual few, a binary search of their sorted
/// `table` past [`SCAN_MAX`].
#[inline(always)]
fn position_of<T>(
    items: &[T],
    table: &[(RegstDescId, u32)],
    desc: RegstDescId,
    desc_of: impl Fn(&T) -> RegstDescId,
) -> Option<usize> {
    if items.len() > SCAN_MAX {
        look_up(table, desc)
    } else {
        items.iter().position(|item| desc_of(item) == desc)
    }
}

/// [`position_of`], returning the item itself: the scan's find hands back a reference
/// that needs no second bounds check, as indexing by the found position would.
#[inline(always)]
fn find_mut<'a, T>(
    items: &'a mut [T],
    table: &[(RegstDescId, u32)],
    desc: RegstDescId,
    desc_of: impl Fn(&T) -> RegstDescId,
) -> Option<&'a mut T> {
    if items.len() > SCAN_MAX {
        look_up(table, desc).and_then(|k| items.get_mut(k))
    } else {
        items.iter_mut().find(|item| desc_of(item) == desc)
    }
}

impl Actor {
    /// Builds actor `index` of the indexed plan. The plan must be validated and `ids`
    /// assigned from it. Looks its edges up in `indexed` (no scan of the plan's registers), so
    /// building every actor is linear in the plan's size.
    pub fn from_plan(indexed: &PlanIndex<'_>, ids: &PlanIds, index: ActorIndex) -> Self {
        let plan = indexed.plan();
        let loop_inputs = indexed.loop_inputs(index);
        let desc = &plan.actors[index.index()];
        let id = ids.of(index);
        let inputs: Vec<InputState> = desc
            .inputs
            .iter()
            .zip(loop_inputs)
            .map(|(&r, &closes_loop)| {
                let regst = &plan.regst_descs[r.index()];
                let repeat_fed = matches!(plan.actors[regst.producer.index()].kind, ActorKind::Repeat { .. });
                InputState::new(r, ids.of(regst.producer), regst.register_num, closes_loop, repeat_fed)
            })
            .collect();
        let outputs: Vec<OutputState> = indexed
            .outputs_of(index)
            .iter()
            .map(|&r| {
                let regst = &plan.regst_descs[r.index()];
                let consumers = regst
                    .consumers
                    .iter()
                    .map(|&c| {
                        let cid = ids.of(c);
                        Consumer::new(cid, cid.stream_id() == id.stream_id())
                    })
                    .collect();
                OutputState::new(r, regst.register_num, regst.preloaded, consumers)
            })
            .collect();
        let inputs_wait = desc.inputs.iter().zip(&inputs).any(|(r, input)| {
            let producer = plan.regst_descs[r.index()].producer;
            input.producer.stream_id() != id.stream_id()
                || matches!(plan.actors[producer.index()].kind, ActorKind::Repeat { .. })
        });
        let outputs_wait = outputs.iter().any(|o: &OutputState| !o.consumers_on(false).is_empty());
        let kind = match &desc.kind {
            ActorKind::Source { pieces } => KindState::Source {
                limit: match *pieces {
                    SourcePieces::Count(n) | SourcePieces::Custom { count: n, .. } => Some(n),
                    SourcePieces::Dataset(ref d) => Some(d.pieces),
                    SourcePieces::Fed => None,
                },
                available: 0,
                closed: false,
                produced: 0,
            },
            ActorKind::Compute { .. } => KindState::Compute,
            ActorKind::Sink | ActorKind::Discard => KindState::Sink { credits: None },
            ActorKind::Acc { count, .. } => KindState::Acc { count: *count, position: 0, held: None },
            ActorKind::Repeat { count } => KindState::Repeat { count: *count, held: None, handed: 0, outstanding: 0 },
        };
        // Every launch holds at least one slot until it completes, so this bounds `pending`.
        let max_pending: usize = inputs.iter().map(|i| i.register_num as usize).sum::<usize>()
            + outputs.iter().map(|o| o.register_num as usize).sum::<usize>()
            + 1;
        let placeholder = RegstRef { desc: RegstDescId(0), slot: 0 };
        let computes = matches!(kind, KindState::Compute);
        let full_outputs = outputs.iter().filter(|o| !o.has_free()).count() as u32;
        let ends_by_inputs =
            !matches!(kind, KindState::Source { .. }) && !inputs.iter().all(|i: &InputState| i.loop_carried);
        Self {
            id,
            name: desc.name.clone(),
            kind,
            ends_by_inputs,
            outputs_wait,
            inputs_wait,
            unready_inputs: inputs.len() as u32,
            full_outputs,
            scratch_inputs: vec![placeholder; inputs.len()].into_boxed_slice(),
            scratch_outputs: vec![placeholder; outputs.len()].into_boxed_slice(),
            input_lookup: lookup(inputs.iter().map(|i| i.desc)),
            output_lookup: lookup(outputs.iter().map(|o| o.desc)),
            inputs,
            outputs,
            pending: Ring::new(max_pending, Launch { ack_inputs: false, emit: false }),
            started: false,
            lifecycle: Lifecycle::Running,
            stopped: false,
            ended_inputs: 0,
            fires: 0,
            computes,
        }
    }

    /// Moves the actor's state into memory the calling thread allocates now, and frees
    /// what it had. A job builds every actor on one thread, in plan order, so the small
    /// allocations of neighbours in a chain lie side by side whatever stream they run
    /// on, and two stream threads writing their own actors' slot tables wrote the same
    /// cache lines (false sharing: in `bench_actors b2` the loads of an actor's outputs and
    /// consumers were a fifth of the stream threads' samples). A stream thread calls this
    /// once for each of its actors before the first message, so the state of each stream
    /// lies in memory of its own (its thread's allocator arena). The values are unchanged.
    pub fn reallocate(&mut self) {
        let copy = Self {
            id: self.id,
            name: self.name.clone(),
            kind: self.kind.clone(),
            inputs: self.inputs.clone(),
            outputs: self.outputs.clone(),
            pending: self.pending.clone(),
            started: self.started,
            lifecycle: self.lifecycle,
            stopped: self.stopped,
            ended_inputs: self.ended_inputs,
            unready_inputs: self.unready_inputs,
            full_outputs: self.full_outputs,
            ends_by_inputs: self.ends_by_inputs,
            outputs_wait: self.outputs_wait,
            inputs_wait: self.inputs_wait,
            scratch_inputs: self.scratch_inputs.clone(),
            scratch_outputs: self.scratch_outputs.clone(),
            input_lookup: self.input_lookup.clone(),
            output_lookup: self.output_lookup.clone(),
            fires: self.fires,
            computes: self.computes,
        };
        *self = copy;
    }

    /// The actor's id.
    pub fn id(&self) -> ActorId {
        self.id
    }

    /// The actor's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Where it is in its life.
    pub fn lifecycle(&self) -> Lifecycle {
        self.lifecycle
    }

    /// Makes a sink hand the user at most `credits` pieces ahead of the user's fetches
    /// (each [`Cmd::Fetched`] gives one back). Sinks are unbounded by default.
    pub fn set_sink_credits(&mut self, credits: u64) {
        if let KindState::Sink { credits: c } = &mut self.kind {
            *c = Some(credits);
        }
    }

    /// Makes a source with a piece limit (counted, custom, dataset) produce `pieces`
    /// instead: the progress check runs a plan for a few steps, not for its whole length.
    pub(crate) fn set_source_limit(&mut self, pieces: u64) {
        if let KindState::Source { limit: Some(limit), .. } = &mut self.kind {
            *limit = pieces;
        }
    }

    /// Launches whose kernels have not completed.
    pub fn pending_launches(&self) -> usize {
        self.pending.len()
    }

    /// How many times it has fired.
    pub fn fires(&self) -> u64 {
        self.fires
    }

    /// Most pieces each output had in flight at once, with its `register_num`.
    pub fn max_in_flight(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.outputs.iter().map(|o| (o.max_in_flight, o.register_num))
    }

    /// Most slots of each input this actor held at once, with the producer's `register_num`.
    pub fn max_held(&self) -> impl Iterator<Item = (u32, usize)> + '_ {
        self.inputs.iter().map(|i| (i.max_held, i.register_num as usize))
    }

    /// Handles one message, fires as often as it can, and returns its lifecycle after.
    ///
    /// The hot path (a `Ready` or an `Ack` to a running actor: two per firing) is small and
    /// inlined into the stream's dispatch loop; everything else goes out of line.
    #[inline(always)]
    pub fn handle<E: ActorEnv>(&mut self, msg: &Message, env: &mut E) -> Result<Lifecycle, ActorError> {
        if self.lifecycle == Lifecycle::Running {
            match msg.body {
                Body::Ready { regst, piece, data } => self.on_ready(msg.src, regst, piece, data)?,
                Body::Ack { regst } => self.on_ack(msg.src, regst, env)?,
                _ => return self.handle_other(msg, env),
            }
            self.progress(env)?;
            return Ok(self.lifecycle);
        }
        self.handle_other(msg, env)
    }

    /// Takes a `Ready` or `Ack` from an actor of the same stream straight into the slot
    /// state, without running the actor: the stream calls it while another actor of the
    /// stream is firing, instead of queueing the message, and runs this actor later with
    /// [`Actor::resume`] if the answer is [`Accepted::Runnable`].
    ///
    /// Only a running actor takes them, and a repeat actor takes no `Ack` (a slot coming
    /// back makes it send one of its own); everything else is [`Accepted::Declined`] and must
    /// go to [`Actor::handle`] in message order. Taking a message early is safe because the
    /// protocol does not depend on the order of messages between different pairs of actors
    /// (those of other streams arrive in any order), and between one pair they keep their
    /// order: a recipient declines only once it stopped running, and then declines all.
    #[inline(always)]
    pub fn accept(&mut self, msg: &Message) -> Result<Accepted, ActorError> {
        if self.lifecycle != Lifecycle::Running {
            return Ok(Accepted::Declined);
        }
        match msg.body {
            Body::Ready { regst, piece, data } => self.on_ready(msg.src, regst, piece, data)?,
            Body::Ack { regst } if !matches!(self.kind, KindState::Repeat { .. }) => {
                self.take_ack(msg.src, regst)?;
            }
            _ => return Ok(Accepted::Declined),
        }
        // What `handle` would do next: fire, or check whether the actor is drained (or a
        // `Ready` came after another input ended, an error that check reports); the usual
        // actor, none of whose inputs ended, has only the first to do.
        Ok(if self.can_fire() || self.may_be_drained() { Accepted::Runnable } else { Accepted::Taken })
    }

    /// Fires as often as it can (after [`Actor::accept`] said [`Accepted::Runnable`]) and
    /// returns its lifecycle after. Harmless at any time: an actor with nothing to do
    /// does nothing.
    #[inline(always)]
    pub fn resume<E: ActorEnv>(&mut self, env: &mut E) -> Result<Lifecycle, ActorError> {
        self.progress(env)?;
        Ok(self.lifecycle)
    }

    /// [`Actor::handle`] for every message but a `Ready` or `Ack` to a running actor.
    #[inline(never)]
    fn handle_other<E: ActorEnv>(&mut self, msg: &Message, env: &mut E) -> Result<Lifecycle, ActorError> {
        if self.lifecycle == Lifecycle::Done {
            // After a Stop anything may still arrive; after a normal finish only the user's
            // late fetches may: every slot is back and every input ended, so anything else
            // is a protocol violation.
            return match msg.body {
                _ if self.stopped => Ok(Lifecycle::Done),
                Body::Cmd(Cmd::Fetched | Cmd::Stop) => Ok(Lifecycle::Done),
                other => Err(self.unexpected(format!("{other:?} after the actor finished"))),
            };
        }
        match msg.body {
            Body::Ready { regst, piece, data } => self.on_ready(msg.src, regst, piece, data)?,
            Body::Ack { regst } => self.on_ack(msg.src, regst, env)?,
            Body::Eord { desc } => {
                let position = position_of(&self.inputs, &self.input_lookup, desc, |i| i.desc);
                let input = position.map(|k| &mut self.inputs[k]);
                match input {
                    Some(input) if !input.eord => {
                        input.eord = true;
                        if !input.loop_carried {
                            self.ended_inputs += 1;
                        }
                    }
                    _ => {
                        return Err(
                            self.unexpected(format!("Eord for {desc}, which it does not consume or already ended"))
                        )
                    }
                }
            }
            Body::ActDone => self.complete_oldest(env)?,
            Body::Cmd(Cmd::Start) => {
                if !self.started {
                    self.started = true;
                    self.emit_preloaded(env)?;
                }
            }
            Body::Cmd(Cmd::Stop) => {
                self.stopped = true;
                self.lifecycle = Lifecycle::Done;
                return Ok(Lifecycle::Done);
            }
            Body::Cmd(cmd @ (Cmd::Feed | Cmd::CloseFeed)) => match &mut self.kind {
                KindState::Source { limit: None, available, closed, .. } if !*closed => {
                    if cmd == Cmd::Feed {
                        *available += 1;
                    } else {
                        *closed = true;
                    }
                }
                _ => return Err(self.unexpected(format!("{cmd:?}: not an open fed source"))),
            },
            Body::Cmd(Cmd::Fetched) => match &mut self.kind {
                KindState::Sink { credits: Some(credits) } => *credits += 1,
                _ => return Err(self.unexpected("Fetched: not a sink that delivers to the user".into())),
            },
        }
        self.progress(env)?;
        Ok(self.lifecycle)
    }

    #[cold]
    #[inline(never)]
    fn unexpected(&self, detail: String) -> ActorError {
        ActorError::Unexpected { name: self.name.clone(), id: self.id, detail }
    }

    #[cold]
    #[inline(never)]
    fn env_error(&self, source: EnvError) -> ActorError {
        ActorError::Env { name: self.name.clone(), id: self.id, source }
    }

    #[inline(always)]
    fn send<E: ActorEnv>(&self, env: &mut E, dst: ActorId, body: Body) -> Result<(), ActorError> {
        match env.send(Message { dst, src: self.id, body }) {
            Ok(()) => Ok(()),
            Err(e) => Err(self.env_error(e)),
        }
    }

    #[inline(always)]
    fn on_ready(&mut self, src: ActorId, regst: RegstRef, piece: u64, data: RegstRef) -> Result<(), ActorError> {
        let Some(input) = find_mut(&mut self.inputs, &self.input_lookup, regst.desc, |i| i.desc) else {
            return Err(self.bad_ready(src, regst, piece));
        };
        if input.refuses(src, regst.slot, piece) {
            return Err(self.bad_ready(src, regst, piece));
        }
        input.push_ready(data, &mut self.unready_inputs);
        Ok(())
    }

    /// Why a `Ready` is refused: out of line, so the accepting path stays small.
    #[cold]
    #[inline(never)]
    fn bad_ready(&self, src: ActorId, regst: RegstRef, piece: u64) -> ActorError {
        let Some(input) = self.inputs.iter().find(|i| i.desc == regst.desc) else {
            return self.unexpected(format!("Ready of {} from {src}, which it does not consume", regst.desc));
        };
        if input.producer != src || input.eord {
            let detail =
                format!("Ready of {} from {src} (producer {}, ended: {})", regst.desc, input.producer, input.eord);
            return self.unexpected(detail);
        }
        if piece != input.next_piece {
            let detail = format!("{} delivered piece {piece}, expected piece {}", regst.desc, input.next_piece);
            return ActorError::PieceOrder { name: self.name.clone(), id: self.id, detail };
        }
        if input.ready + input.in_use >= input.register_num {
            let detail = format!("{} delivered more slots than its register_num {}", regst.desc, input.register_num);
            return self.unexpected(detail);
        }
        let detail = format!(
            "{} delivered piece {piece} in slot {}, but piece {piece} of a register of {} slots is in slot {}",
            regst.desc,
            regst.slot,
            input.register_num,
            input.arriving_slot()
        );
        self.unexpected(detail)
    }

    #[inline(always)]
    fn on_ack<E: ActorEnv>(&mut self, src: ActorId, regst: RegstRef, env: &mut E) -> Result<(), ActorError> {
        if self.take_ack(src, regst)? {
            self.on_slot_freed(env)?;
        }
        Ok(())
    }

    /// Records an `Ack`; returns whether the slot became free.
    #[inline(always)]
    fn take_ack(&mut self, src: ActorId, regst: RegstRef) -> Result<bool, ActorError> {
        let Some(output) = find_mut(&mut self.outputs, &self.output_lookup, regst.desc, |o| o.desc) else {
            return Err(self.unexpected(format!("Ack of {} from {src}, which it does not produce", regst.desc)));
        };
        match output.ack(regst.slot, src, &mut self.full_outputs) {
            Ok(freed) => Ok(freed),
            Err(detail) => Err(self.unexpected(detail)),
        }
    }

    /// An output slot came back: only a repeat actor has more to do.
    #[inline(always)]
    fn on_slot_freed<E: ActorEnv>(&mut self, env: &mut E) -> Result<(), ActorError> {
        if matches!(self.kind, KindState::Repeat { .. }) {
            self.repeat_slot_freed(env)?;
        }
        Ok(())
    }

    /// A repeat actor gives its input back once every piece it handed out has come back.
    /// Out of line: the slot handling of every other kind stays small.
    #[inline(never)]
    fn repeat_slot_freed<E: ActorEnv>(&mut self, env: &mut E) -> Result<(), ActorError> {
        if let KindState::Repeat { count, held, handed, outstanding } = &mut self.kind {
            *outstanding -= 1;
            if *handed == *count && *outstanding == 0 {
                if let Some(regst) = held.take() {
                    *handed = 0;
                    let input = &self.inputs[0];
                    let (producer, desc) = (input.producer, input.desc);
                    self.send(env, producer, Body::Ack { regst: RegstRef { desc, slot: regst.slot } })?;
                }
            }
        }
        Ok(())
    }

    /// Whether the actor can fire now: O(1), from the readiness counters.
    #[inline(always)]
    fn can_fire(&self) -> bool {
        debug_assert_eq!(
            self.unready_inputs as usize,
            self.inputs.iter().filter(|i| i.is_empty()).count(),
            "unready input count of {}",
            self.name
        );
        debug_assert_eq!(
            self.full_outputs as usize,
            self.outputs.iter().filter(|o| !o.has_free()).count(),
            "full output count of {}",
            self.name
        );
        let outputs_free = || self.full_outputs == 0;
        let inputs_ready = || self.unready_inputs == 0;
        if self.computes {
            return inputs_ready() && outputs_free();
        }
        match &self.kind {
            KindState::Source { limit, available, produced, .. } => {
                let has_piece = match limit {
                    Some(n) => produced < n,
                    None => *available > 0,
                };
                self.started && has_piece && outputs_free()
            }
            KindState::Compute => inputs_ready() && outputs_free(),
            KindState::Sink { credits } => inputs_ready() && *credits != Some(0),
            KindState::Acc { position, .. } => inputs_ready() && (*position > 0 || outputs_free()),
            KindState::Repeat { count, held, handed, .. } => {
                let has_input = match held {
                    Some(_) => handed < count,
                    None => inputs_ready(),
                };
                has_input && outputs_free()
            }
        }
    }

    #[inline(always)]
    fn progress<E: ActorEnv>(&mut self, env: &mut E) -> Result<(), ActorError> {
        if self.lifecycle == Lifecycle::Running {
            if self.computes {
                // A compute actor's `can_fire` and `fire`, with the kind looked at once
                // per turn instead of twice per firing.
                while self.unready_inputs == 0 && self.full_outputs == 0 {
                    self.fire_compute(env)?;
                }
            } else {
                while self.can_fire() {
                    self.fire(env)?;
                }
            }
            // Checked after every message: an actor none of whose inputs ended yet (the
            // common case), or with a launch in flight, is not drained, without a call.
            if !(self.may_be_drained() && self.pending.is_empty()) {
                return Ok(());
            }
        }
        self.progress_to_end(env)
    }

    /// Whether the actor may be drained as far as its inputs tell: not while none of the
    /// inputs that end it has ended.
    #[inline(always)]
    fn may_be_drained(&self) -> bool {
        !(self.ends_by_inputs && self.ended_inputs == 0)
    }

    /// The rest of [`Actor::progress`]: whether a running actor is drained (then it sends
    /// `Eord` and becomes a zombie), and whether a zombie has every slot back.
    #[inline(never)]
    fn progress_to_end<E: ActorEnv>(&mut self, env: &mut E) -> Result<(), ActorError> {
        if self.lifecycle == Lifecycle::Running && self.drained()? {
            self.flush_partial_group(env)?;
            for o in 0..self.outputs.len() {
                for c in 0..self.outputs[o].consumers.len() {
                    let (dst, desc) = (self.outputs[o].consumers[c].id, self.outputs[o].desc);
                    self.send(env, dst, Body::Eord { desc })?;
                }
            }
            self.lifecycle = Lifecycle::Zombie;
        }
        if self.lifecycle == Lifecycle::Zombie {
            // Loop state still arriving after the loop ended is given straight back.
            self.give_back_loop_pieces(env)?;
            let loops_ended = self.inputs.iter().filter(|i| i.loop_carried).all(InputState::is_finished);
            if loops_ended && self.outputs.iter().all(|o| o.in_flight == 0) {
                self.lifecycle = Lifecycle::Done;
            }
        }
        Ok(())
    }

    /// Acks every ready piece of the loop-carried inputs without firing.
    fn give_back_loop_pieces<E: ActorEnv>(&mut self, env: &mut E) -> Result<(), ActorError> {
        for i in 0..self.inputs.len() {
            if !self.inputs[i].loop_carried {
                continue;
            }
            while let Some(regst) = self.inputs[i].pop_ready(&mut self.unready_inputs) {
                let (producer, desc) = (self.inputs[i].producer, self.inputs[i].desc);
                self.send(env, producer, Body::Ack { regst: RegstRef { desc, slot: regst.slot } })?;
            }
        }
        Ok(())
    }

    /// On start, a register with preloaded slots hands them to its consumers as pieces
    /// `0..preloaded`, holding whatever the runtime put there (a loop's initial value).
    fn emit_preloaded<E: ActorEnv>(&mut self, env: &mut E) -> Result<(), ActorError> {
        for o in 0..self.outputs.len() {
            for _ in 0..self.outputs[o].preloaded {
                let output = &mut self.outputs[o];
                let Some(slot) = output.take(false, &mut self.full_outputs) else {
                    unreachable!("validation keeps preloaded <= register_num")
                };
                output.lend(slot);
                let piece = output.next_piece;
                output.next_piece += 1;
                let regst = RegstRef { desc: output.desc, slot };
                for c in 0..self.outputs[o].consumers.len() {
                    let dst = self.outputs[o].consumers[c].id;
                    self.send(env, dst, Body::Ready { regst, piece, data: regst })?;
                }
            }
        }
        Ok(())
    }

    /// Whether no piece can ever come again. Inputs that end after different numbers of
    /// pieces are a plan error, reported instead of silently dropping pieces.
    fn drained(&self) -> Result<bool, ActorError> {
        match &self.kind {
            KindState::Source { limit: Some(n), produced, .. } => Ok(produced >= n),
            KindState::Source { limit: None, available, closed, .. } => Ok(*closed && *available == 0),
            KindState::Repeat { held, .. } if held.is_some() => Ok(false),
            // Only loop inputs (a repeat handing a variable to micro-batches): it ends when
            // they end.
            _ if self.inputs.iter().all(|i| i.loop_carried) => Ok(self.inputs.iter().all(InputState::is_finished)),
            // Checked after every message: keep the common case to one comparison.
            _ if self.ended_inputs == 0 => Ok(false),
            _ => {
                // Loop-carried inputs do not decide the end: they carry one value more than
                // the loop runs (given back once the actor is drained).
                let ended = self.inputs.iter().find(|i| !i.loop_carried && i.is_finished());
                let waiting = self.inputs.iter().find(|i| !i.loop_carried && !i.is_empty());
                if let (Some(ended), Some(waiting)) = (ended, waiting) {
                    let detail = format!(
                        "input {} ended after {} pieces but input {} still has piece {} ready",
                        ended.desc,
                        ended.next_piece,
                        waiting.desc,
                        waiting.front_piece().unwrap_or(0)
                    );
                    return Err(ActorError::PieceOrder { name: self.name.clone(), id: self.id, detail });
                }
                Ok(self.inputs.iter().filter(|i| !i.loop_carried).all(InputState::is_finished))
            }
        }
    }
}
