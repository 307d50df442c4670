//! The rendezvous of an in-process collective group: the barriers of a round and the table
//! of where each member's input (and, for two-step all-reduces, output) lies meanwhile.

use crate::kernel::KernelError;
use crate::sync::{lock, AtomicU64, Condvar, Mutex, MutexGuard, Ordering};

/// Longest a member spins on the phase before it sleeps, while the process's stream
/// threads all fit on its cores: pauses only, checking the clock every
/// [`ROUNDS_PER_CLOCK`] rounds (a pause takes 24 ns on the 2-vCPU benchmark VM and about
/// as long on recent Intel cores, but a few on older ones, so a count of rounds is no
/// duration). A peer that is about to arrive is caught without a futex sleep and wake
/// (30–45 µs per small all-reduce before, under 2 µs now; `bench_collectives`); a peer
/// that is far behind costs this little. Yielding in the spin, as the inbox does, was
/// tried: on two cores shared with the compute threads it spent their time while members
/// waited for peers a kernel away (dp2 1.23–1.35× against 1.33–1.41×). About 3 µs caught
/// too few arrivals (medians 10–28 µs at 1 KiB); 12 µs (512 rounds, until the
/// twenty-fifth session) left the tiny GPT's tp2 step with about 10 sleeps at barriers
/// (`perf stat -e syscalls:sys_enter_futex`), half as many at 100 µs, and its tp2, dp2
/// and zero1 steps 3–5 % longer (BENCHMARKS.md, issue 13; the MLP's dp2, with few and
/// large collectives, did not change beyond its noise).
#[cfg(not(loom))]
const SPIN_TIME: std::time::Duration = std::time::Duration::from_micros(100);

/// Longest a member spins where the process has more stream threads than cores (and the
/// awake ones fit, `crate::activity::may_spin`). A spin that only pauses keeps its core
/// from a thread woken to run, which counts itself awake only once it runs: with 100 µs
/// here, the tiny GPT on 8 devices over 2 cores (`train_parallel --layout dp2xtp2xpp2`)
/// ran 3× slower than with 12 µs.
#[cfg(not(loom))]
const CROWDED_SPIN_TIME: std::time::Duration = std::time::Duration::from_micros(12);

/// Spin rounds between two reads of the clock (a read costs about one round).
#[cfg(not(loom))]
const ROUNDS_PER_CLOCK: u32 = 64;

/// Rounds a member spins under loom: the peer arriving during the spin, or after it.
#[cfg(loom)]
const LOOM_SPIN_ROUNDS: u32 = 2;

use crate::sync::spin_loop;
use std::fmt;

/// Where one member's input lies during a round: an address, readable by peers only
/// between the two barriers of that round (see [`Peers`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct PeerInput {
    ptr: *const u8,
    len: usize,
}

// SAFETY: a `PeerInput` is an address. It is dereferenced only through `Peers`, which exists
// only between the barriers of a round, while the owner of the bytes is blocked inside
// `Rendezvous::round` holding a shared borrow of them (nobody writes them meanwhile).
unsafe impl Send for PeerInput {}
// SAFETY: as above.
unsafe impl Sync for PeerInput {}

impl PeerInput {
    /// Where one member's `output` lies, for peers to read parts of it in a two-step
    /// all-reduce; the member writes it only through [`PeerInput::output_ptr`] meanwhile.
    pub(crate) fn of_output(output: &mut [u8]) -> Self {
        Self { ptr: output.as_mut_ptr(), len: output.len() }
    }

    /// The address of an output published with [`PeerInput::of_output`].
    pub(crate) fn output_ptr(&self) -> *mut u8 {
        self.ptr as *mut u8
    }

    /// The input `bytes` of one member for one round.
    pub(crate) fn new(bytes: &[u8]) -> Self {
        Self { ptr: bytes.as_ptr(), len: bytes.len() }
    }

    /// No bytes (a member that publishes no output).
    pub(crate) fn empty() -> Self {
        Self { ptr: std::ptr::NonNull::<u8>::dangling().as_ptr(), len: 0 }
    }
}

/// Every member's input during one round, readable until the round's barrier 2, and
/// every member's output for rounds that publish one.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Peers<'r> {
    inputs: &'r [PeerInput],
    outputs: &'r [PeerInput],
    /// The round's rendezvous and this member's rank, for middle barriers; `None` for
    /// inputs gathered otherwise (over the network), where no op needs one.
    rendezvous: Option<(&'r Rendezvous, usize)>,
}

impl<'r> Peers<'r> {
    /// Inputs gathered without a rendezvous (no outputs, no middle barriers).
    pub(crate) fn of_inputs(inputs: &'r [PeerInput]) -> Self {
        Self { inputs, outputs: &[], rendezvous: None }
    }

    /// Input of rank `r`. Panics if `r` is out of range (a kernel bug).
    pub(crate) fn input(&self, r: usize) -> &'r [u8] {
        let input = self.inputs[r];
        // SAFETY: `Peers` is only handed to the compute step of `Rendezvous::round`, after
        // barrier 1 (every member has published an input borrowed for the whole round) and
        // before this member arrives at barrier 2. The owners do not return from `round`,
        // and so do not release their inputs, before barrier 2 completes, which needs this
        // member; `Peers` cannot outlive the compute step (its lifetime is the step's).
        unsafe { std::slice::from_raw_parts(input.ptr, input.len) }
    }

    /// Bytes `range` of rank `r`'s output, for a round that published outputs. Only
    /// between a [`Peers::barrier`] after which `r` no longer writes `range` and barrier 2,
    /// and only where this member's own writes are elsewhere (each member writes its own
    /// output; the ranges a peer reads there are ones its owner has finished).
    pub(crate) fn output(&self, r: usize, range: std::ops::Range<usize>) -> &'r [u8] {
        let output = self.outputs[r];
        assert!(range.end <= output.len, "output range {range:?} of rank {r} is past its {} bytes", output.len);
        // SAFETY: the owner published this address for the whole round and does not return
        // (so does not release its output) before barrier 2; the caller's barrier orders the
        // owner's writes of `range` before this read and the owner writes no byte of
        // `range` again in this round (two-step all-reduce: it writes only its own part
        // before the middle barrier and only other parts after it).
        unsafe { std::slice::from_raw_parts(output.ptr.add(range.start), range.len()) }
    }

    /// A barrier inside the round: returns once every member has called it. Every member
    /// must call it the same number of times in a round (they compute the same op).
    pub(crate) fn barrier(&self) {
        let Some((rendezvous, rank)) = self.rendezvous else {
            panic!("a middle barrier was asked of inputs gathered without a rendezvous (a collective kernel bug)");
        };
        rendezvous.barrier(rank);
    }

    /// Address of rank `r`'s input (the loom model stores a cell there).
    #[cfg(all(test, loom))]
    pub(crate) fn addr(&self, r: usize) -> *const u8 {
        self.inputs[r].ptr
    }
}

/// What the rendezvous lock guards.
#[derive(Debug)]
struct RoundState {
    /// Which ranks have arrived at the barrier now filling.
    arrived: Vec<bool>,
    /// How many.
    count: usize,
    /// Each member's input of the current round.
    inputs: Vec<PeerInput>,
    /// Each member's output of the current round (empty for rounds that publish none).
    outputs: Vec<PeerInput>,
    /// Set by an abort, for ever: no barrier 1 completes after it.
    aborted: bool,
    /// Members asleep on `changed` (counted under the lock before they wait): the last
    /// arrival wakes them only if there are any, since a condition variable's notify is a
    /// system call even when nobody waits.
    sleeping: usize,
}

/// The meeting point of one group's members; every table is allocated once, at creation.
pub(crate) struct Rendezvous {
    pub(super) group: String,
    size: usize,
    state: Mutex<RoundState>,
    changed: Condvar,
    /// Barriers completed so far (barrier 1, any middle ones, barrier 2 of every round).
    /// Advanced only under `state`'s lock, by the last arrival; read without it by a
    /// member that spins before it sleeps on `changed`.
    phase: AtomicU64,
}

impl fmt::Debug for Rendezvous {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rendezvous").field("group", &self.group).field("size", &self.size).finish_non_exhaustive()
    }
}

impl Rendezvous {
    /// A rendezvous for `size` members of `group`.
    pub(crate) fn new(group: &str, size: usize) -> Self {
        Self {
            group: group.to_string(),
            size,
            state: Mutex::new(RoundState {
                arrived: vec![false; size],
                count: 0,
                inputs: vec![PeerInput::empty(); size],
                outputs: vec![PeerInput::empty(); size],
                aborted: false,
                sleeping: 0,
            }),
            changed: Condvar::new(),
            phase: AtomicU64::new(0),
        }
    }

    /// Wakes every member waiting at barrier 1; they, and every later arrival, fail.
    pub(crate) fn abort(&self) {
        lock(&self.state).aborted = true;
        self.changed.notify_all();
    }

    /// One round for `rank`: publishes `input`, waits for every member, runs `compute` on
    /// all inputs (`peers` is this member's copy of the table, `size` long), waits until
    /// every member has computed, and returns what `compute` returned. Fails, without
    /// running `compute`, if the rendezvous is or gets aborted before all have arrived.
    pub(crate) fn round<R>(
        &self,
        rank: usize,
        input: PeerInput,
        peers: &mut [PeerInput],
        compute: impl FnOnce(Peers<'_>) -> R,
    ) -> Result<R, KernelError> {
        self.round_with_outputs(rank, input, PeerInput::empty(), peers, &mut [], compute)
    }

    /// [`Rendezvous::round`] that also publishes where this member's output lies, so peers
    /// can read parts of it ([`Peers::output`]) after a [`Peers::barrier`]. `peer_outputs`
    /// is this member's copy of the output table (`size` long, or empty when unused).
    pub(crate) fn round_with_outputs<R>(
        &self,
        rank: usize,
        input: PeerInput,
        output: PeerInput,
        peers: &mut [PeerInput],
        peer_outputs: &mut [PeerInput],
        compute: impl FnOnce(Peers<'_>) -> R,
    ) -> Result<R, KernelError> {
        {
            let mut state = lock(&self.state);
            if state.aborted {
                return Err(KernelError(format!("collective '{}': aborted before rank {rank} arrived", self.group)));
            }
            state.inputs[rank] = input;
            state.outputs[rank] = output;
            let phase = self.phase();
            if !self.arrive(&mut state, rank) {
                drop(state);
                self.spin_past(phase);
                state = lock(&self.state);
                loop {
                    // A completed barrier wins over an abort: peers are reading our input.
                    if self.phase() != phase {
                        break;
                    }
                    if state.aborted {
                        let missing: Vec<usize> = (0..self.size).filter(|&r| !state.arrived[r]).collect();
                        return Err(KernelError(format!(
                            "collective '{}': aborted while waiting for ranks {missing:?}",
                            self.group
                        )));
                    }
                    state = self.wait(state);
                }
            }
            // Nobody publishes the next round before this member passes barrier 2.
            peers.copy_from_slice(&state.inputs);
            if !peer_outputs.is_empty() {
                peer_outputs.copy_from_slice(&state.outputs);
            }
        }
        // Arrives at barrier 2 when dropped, even if `compute` unwinds.
        let departure = Departure { rendezvous: self, rank };
        let result = compute(Peers { inputs: peers, outputs: peer_outputs, rendezvous: Some((self, rank)) });
        drop(departure);
        Ok(result)
    }

    /// Counts `rank` in at the barrier now filling; the last arrival completes it, wakes
    /// the others and returns true.
    fn arrive(&self, state: &mut RoundState, rank: usize) -> bool {
        state.arrived[rank] = true;
        state.count += 1;
        if state.count < self.size {
            return false;
        }
        state.count = 0;
        state.arrived.fill(false);
        self.phase.fetch_add(1, Ordering::Release);
        if state.sleeping > 0 {
            self.changed.notify_all();
        }
        true
    }

    /// Barriers completed so far; what the last arrival wrote before it advanced them is
    /// visible after this load.
    fn phase(&self) -> u64 {
        self.phase.load(Ordering::Acquire)
    }

    /// Spins a little while the barrier of `phase` fills ([`SPIN_TIME`], or
    /// [`CROWDED_SPIN_TIME`] where the process has more stream threads than cores), unless
    /// the stream threads that are awake outnumber the cores (then the peer waited for may
    /// need this very core, `crate::activity`); returns whether it completed.
    fn spin_past(&self, phase: u64) -> bool {
        if !crate::activity::may_spin() {
            return false;
        }
        #[cfg(loom)]
        for _ in 0..LOOM_SPIN_ROUNDS {
            if self.phase() != phase {
                return true;
            }
            spin_loop();
        }
        #[cfg(not(loom))]
        {
            let limit = if crate::activity::all_stream_threads_fit() { SPIN_TIME } else { CROWDED_SPIN_TIME };
            let start = std::time::Instant::now();
            while start.elapsed() < limit {
                for _ in 0..ROUNDS_PER_CLOCK {
                    if self.phase() != phase {
                        return true;
                    }
                    spin_loop();
                }
            }
        }
        false
    }

    /// Sleeps until the last arrival of a barrier (or an abort) wakes it, counted in
    /// `sleeping` meanwhile: both under the lock the waker holds, so no wake-up is lost.
    fn wait<'g>(&self, mut state: MutexGuard<'g, RoundState>) -> MutexGuard<'g, RoundState> {
        state.sleeping += 1;
        // Poison only says another member panicked; the state is whole (see `sync::lock`).
        let mut state =
            crate::activity::asleep(|| self.changed.wait(state).unwrap_or_else(std::sync::PoisonError::into_inner));
        state.sleeping -= 1;
        state
    }
}

/// Barrier 2 of one member's round.
struct Departure<'a> {
    rendezvous: &'a Rendezvous,
    rank: usize,
}

impl Drop for Departure<'_> {
    fn drop(&mut self) {
        self.rendezvous.barrier(self.rank);
    }
}

impl Rendezvous {
    /// A barrier after barrier 1 of a round (barrier 2, or a middle one): returns once every
    /// member has arrived. Not abortable: every member passed barrier 1 and is computing
    /// (module docs), so every member arrives.
    fn barrier(&self, rank: usize) {
        let mut state = lock(&self.state);
        let phase = self.phase();
        if self.arrive(&mut state, rank) {
            return;
        }
        drop(state);
        if self.spin_past(phase) {
            return;
        }
        let mut state = lock(&self.state);
        while self.phase() == phase {
            state = self.wait(state);
        }
    }
}
