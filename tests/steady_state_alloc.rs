//! Steady state allocates nothing: a counting global allocator shows that running more pieces through a plan costs no more heap allocations.
//!
//! Only allocations on the threads a job uses are counted: its stream threads and the
//! watchdog (recognized by their `regflow-` thread names) and the test thread
//! that builds, feeds, fetches and waits. Libtest's own threads are not counted, and the
//! tests take one lock so that two jobs never overlap. During measured runs every counted
//! allocation is classified by its backtrace, so that crossbeam-channel's lazy, timing-
//! dependent allocations (see `lazy_channel_allocation`) are told apart from the rest.
//! Set `REGFLOW_ALLOC_BACKTRACE=1` to print a backtrace of every other allocation made
//! inside a steady-state window.
//!
//! The watchdog stays on (and one test makes it tick during the window): a tick only reads
//! counters. The Chrome-trace timeline (`JobBuilder::trace`) is left off: its buffer grows
//! with the run by design, and it is opt-in. No `tracing` subscriber is installed, so the
//! per-firing span is disabled.
//!
//! Besides hand-built plans, two compiled training steps run here (the digits MLP and a
//! GPT block, with AdamW), fed and fetched from the test thread: once every kernel has fired
//! a few times, a step allocates nothing, matrix products included (gemm's per-call
//! buffers are reused per thread: `vendor/gemm-common/REGFLOW.md`). Each check prints its
//! steady-state count; `cargo test --test steady_state_alloc -- --nocapture` shows them.

mod common;
#[path = "../examples/common/gpt.rs"]
mod gpt;

use regflow::graph::{CompileOptions, DType, Graph, Optimizer, Schedule as LrSchedule, SplitMix64};
use regflow::prelude::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

// ---------------------------------------------------------------------------------------
// The counting allocator.
// ---------------------------------------------------------------------------------------

/// Who allocated: the kinds of threads that are counted, plus two buckets for
/// crossbeam-channel's lazy allocations, which happen a number of times that depends on
/// timing, not on pieces (see [`lazy_channel_allocation`]).
#[derive(Debug, Clone, Copy)]
enum Counted {
    Stream = 0,
    Watchdog = 1,
    TestThread = 2,
    FirstBlock = 3,
    ListBlock = 4,
}

const CATEGORIES: [&str; 5] = [
    "stream threads",
    "watchdog",
    "test thread",
    "crossbeam first blocking receive",
    "crossbeam unbounded-channel block",
];

static COUNTS: [AtomicU64; 5] = [const { AtomicU64::new(0) }; 5];
/// Set during measured runs: every counted allocation is classified by its backtrace.
static CLASSIFY: AtomicBool = AtomicBool::new(false);
/// Set while a steady-state window is open, to print backtraces when asked.
static WINDOW_OPEN: AtomicBool = AtomicBool::new(false);
static PRINT_BACKTRACES: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// The test thread counts its own allocations once it arms itself.
    static ARMED: Cell<bool> = const { Cell::new(false) };
    /// Set while this thread takes a backtrace, whose own allocations are not counted.
    static IN_HOOK: Cell<bool> = const { Cell::new(false) };
}

/// Which counted kind of thread the caller is, if any. Reads the OS thread name with
/// `pthread_getname_np`, which neither allocates nor touches Rust's thread-locals, so it is
/// safe inside the allocator.
fn category() -> Option<Counted> {
    if ARMED.try_with(Cell::get).unwrap_or(false) {
        return Some(Counted::TestThread);
    }
    let mut name = [0 as libc::c_char; 16];
    // SAFETY: the buffer is 16 bytes, the size Linux thread names are limited to.
    let rc = unsafe { libc::pthread_getname_np(libc::pthread_self(), name.as_mut_ptr(), name.len()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: on success the name is NUL-terminated within the buffer.
    let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }.to_bytes();
    if name.starts_with(b"regflow-watch") {
        Some(Counted::Watchdog)
    } else if name.starts_with(b"regflow-") {
        Some(Counted::Stream)
    } else {
        None
    }
}

/// Whether an allocation is one of crossbeam-channel's lazy ones, and which:
///
/// - `FirstBlock`: a thread's first blocking receive creates its `Context` (a thread-local
///   `Arc`), and a channel's first blocked receiver grows the channel's waker list from
///   empty (to 4 entries, kept for the channel's life; no channel here has more than one
///   blocked receiver). At most once per thread or channel, whenever the scheduler first
///   makes a receive block.
/// - `ListBlock`: an unbounded channel allocates its first block of 31 slots on its first
///   send, and senders that race for that first send each allocate one (the losers' are
///   freed). The runtime's only unbounded channel that sees traffic in these runs is the
///   job's stream-exit channel, sent once by each stream thread as it ends. Inside a
///   steady-state window these count as ordinary allocations: an unbounded channel used
///   per piece would allocate a block every 31 pieces.
///
/// A frame is recognised by its function's path where the backtrace has it, else by its
/// source file: test builds keep line tables only, and there an inlined frame is named
/// by its bare function name (`register`, `new`) next to its file and line.
fn lazy_channel_allocation(backtrace: &str) -> Option<Counted> {
    let in_crossbeam =
        |file: &str| backtrace.lines().any(|line| line.contains("crossbeam-channel-") && line.contains(file));
    // `Context::new`, named in full or as a bare `new` frame whose next line is in
    // crossbeam's context.rs (its `Context::with` frames are not allocations of their own).
    let context_new = || {
        let mut lines = backtrace.lines().map(str::trim);
        while let Some(line) = lines.next() {
            if line.ends_with(": new") || line.ends_with("Context::new") {
                if let Some(at) = lines.next() {
                    if at.contains("crossbeam-channel-") && at.contains("/src/context.rs") {
                        return true;
                    }
                }
            }
        }
        false
    };
    // A blocked receive on an unbounded channel has list.rs frames too: waker and context
    // first.
    if backtrace.contains("crossbeam_channel::context::Context::new")
        || backtrace.contains("crossbeam_channel::waker::Waker::register")
        || in_crossbeam("/src/waker.rs")
        || context_new()
    {
        Some(Counted::FirstBlock)
    } else if backtrace.contains("crossbeam_channel::flavors::list::Block") || in_crossbeam("/src/flavors/list.rs") {
        Some(Counted::ListBlock)
    } else {
        None
    }
}

fn note_allocation() {
    if IN_HOOK.try_with(Cell::get).unwrap_or(true) {
        return;
    }
    let Some(mut category) = category() else { return };
    if CLASSIFY.load(Ordering::Relaxed) {
        let _ = IN_HOOK.try_with(|hook| {
            hook.set(true);
            let backtrace = std::backtrace::Backtrace::force_capture().to_string();
            if let Some(lazy) = lazy_channel_allocation(&backtrace) {
                category = lazy;
            }
            if !matches!(category, Counted::FirstBlock)
                && WINDOW_OPEN.load(Ordering::Relaxed)
                && PRINT_BACKTRACES.load(Ordering::Relaxed)
            {
                eprintln!("steady-state allocation on the {}:\n{backtrace}", CATEGORIES[category as usize]);
            }
            hook.set(false);
        });
    }
    COUNTS[category as usize].fetch_add(1, Ordering::Relaxed);
}

struct CountingAllocator;

// SAFETY: every call is forwarded to `System` unchanged; counting touches only atomics and
// const-initialized thread-locals, and never allocates.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note_allocation();
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note_allocation();
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note_allocation();
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// Allocations so far, per category.
fn counts() -> [u64; 5] {
    std::array::from_fn(|c| COUNTS[c].load(Ordering::Relaxed))
}

fn total(counts: [u64; 5]) -> u64 {
    counts.iter().sum()
}

fn difference(after: [u64; 5], before: [u64; 5]) -> [u64; 5] {
    std::array::from_fn(|c| after[c] - before[c])
}

fn describe(counts: [u64; 5]) -> String {
    let parts: Vec<String> = CATEGORIES.iter().zip(counts).map(|(name, n)| format!("{name}: {n}")).collect();
    parts.join(", ")
}

/// One job at a time in this binary, so counts belong to the test that reads them. Arms
/// the test thread.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    let guard = SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    PRINT_BACKTRACES.store(std::env::var_os("REGFLOW_ALLOC_BACKTRACE").is_some(), Ordering::Relaxed);
    ARMED.with(|armed| armed.set(true));
    guard
}

// ---------------------------------------------------------------------------------------
// Measuring.
// ---------------------------------------------------------------------------------------

/// How many pieces the runs of one check take, and which of them the steady-state window
/// covers: pieces `warm_up..warm_up + window` of the long run.
#[derive(Debug, Clone, Copy)]
struct Schedule {
    /// Pieces of the shorter run.
    short: u64,
    /// Pieces of the longer run: its extra pieces must cost no allocation.
    long: u64,
    /// Pieces run before the steady-state window opens.
    warm_up: u64,
    /// Pieces inside the window (the window fits in the long run).
    window: u64,
}

/// Hand-built plans: cheap pieces, so many of them.
const PIECES: Schedule = Schedule { short: 500, long: 1500, warm_up: 200, window: 1000 };
/// Compiled training steps: every step runs the whole model, so fewer of them; the window
/// still covers many steps after every kernel has fired a few times.
const STEPS: Schedule = Schedule { short: 12, long: 42, warm_up: 6, window: 30 };

/// How long the window waits, before it opens, for every thread of the job to settle.
const SETTLE: Duration = Duration::from_millis(20);

/// The steady-state window of one run: pieces `warm_up..warm_up + window` of its schedule.
///
/// Whoever sees pieces in order calls [`Window::at_piece`]. At `warm_up` it waits until the
/// test thread has finished starting the job (`Job::build` still allocates after the
/// sources start), then pauses a little so that every thread of the job has started and
/// blocked once: a thread's first start-up and first blocking receive allocate, once, at
/// whatever moment the scheduler runs them, and that is not per piece.
#[derive(Debug, Default)]
struct Window {
    /// Only a run long enough to close the window opens it.
    enabled: bool,
    /// First piece of the window.
    opens_at: u64,
    /// First piece after the window.
    closes_at: u64,
    started: AtomicBool,
    opened: Mutex<Option<[u64; 5]>>,
    allocations: Mutex<Option<[u64; 5]>>,
}

impl Window {
    fn new(pieces: u64, schedule: Schedule) -> Arc<Self> {
        let (opens_at, closes_at) = (schedule.warm_up, schedule.warm_up + schedule.window);
        Arc::new(Self { enabled: pieces >= closes_at, opens_at, closes_at, ..Self::default() })
    }

    /// The test thread has finished starting the job.
    fn job_started(&self) {
        self.started.store(true, Ordering::Release);
    }

    /// Called before piece `piece` is handled. Reads atomics, locks uncontended mutexes
    /// and sleeps: no allocation.
    fn at_piece(&self, piece: u64) {
        if !self.enabled {
            return;
        }
        if piece == self.opens_at {
            while !self.started.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(1));
            }
            std::thread::sleep(SETTLE);
            *self.opened.lock().unwrap() = Some(counts());
            WINDOW_OPEN.store(true, Ordering::Relaxed);
        } else if piece == self.closes_at {
            WINDOW_OPEN.store(false, Ordering::Relaxed);
            let now = counts();
            let opened = *self.opened.lock().unwrap();
            *self.allocations.lock().unwrap() = opened.map(|opened| difference(now, opened));
        }
    }

    fn allocations(&self) -> Option<[u64; 5]> {
        *self.allocations.lock().unwrap()
    }
}

/// Most lazy crossbeam-channel allocations one job may make: one `Context` per thread (the
/// stream threads, the watchdog, the test thread), one waker list per
/// channel a receiver or a sender blocks on (the stream inboxes, the
/// watchdog's stop and snapshot channels, the feeders' buffer pools, the fetchers'
/// deliveries, plus every inbox again for a full one a sender waits on), and the
/// stream-exit channel's first block plus one per racing stream thread.
fn lazy_channel_bound(streams: u64, feeders: u64, fetchers: u64) -> u64 {
    let threads = streams + 2;
    let channels = 2 * streams + 2 + feeders + fetchers;
    threads + channels + 1 + streams
}

/// The bound for the hand-built plans of this file: two streams, a feeder and a fetcher at
/// most.
const LAZY_CHANNEL_BOUND: u64 = 4 + 6 + 3;

/// Allocations that are not crossbeam-channel's lazy ones.
fn ordinary(counts: [u64; 5]) -> u64 {
    total(counts) - counts[Counted::FirstBlock as usize] - counts[Counted::ListBlock as usize]
}

/// Runs `run(pieces)` for `schedule.short` and `schedule.long` pieces (after one warm-up run
/// that pays for the process's first-use allocations) and checks that the extra pieces
/// allocate nothing: neither inside the steady-state window of the long run, nor in the
/// whole long run compared to the short one. Crossbeam's lazy allocations are counted apart
/// and only bounded by `lazy_bound`: they happen once per thread or channel, at moments the
/// scheduler picks. In the window only the first-blocking-receive set-up is let through (an
/// unbounded channel's blocks there would be per piece). Prints the window's count.
fn assert_allocates_nothing_per_piece(
    variant: &str,
    schedule: Schedule,
    lazy_bound: u64,
    run: impl Fn(u64, &Arc<Window>),
) {
    let _serial = serial();
    let Schedule { short: n1, long: n2, window: pieces_in_window, .. } = schedule;
    run(n1, &Window::new(n1, schedule));

    let (short_window, window) = (Window::new(n1, schedule), Window::new(n2, schedule));
    CLASSIFY.store(true, Ordering::Relaxed);
    let before = counts();
    run(n1, &short_window);
    let short = difference(counts(), before);

    let before = counts();
    run(n2, &window);
    let long = difference(counts(), before);
    CLASSIFY.store(false, Ordering::Relaxed);

    let in_window = window.allocations().unwrap_or_else(|| panic!("{variant}: the window never closed"));
    let steady = total(in_window) - in_window[Counted::FirstBlock as usize];
    println!(
        "{variant}: {steady} allocations in {pieces_in_window} steady-state pieces ({:.2} per piece; {})",
        steady as f64 / pieces_in_window as f64,
        describe(in_window)
    );
    assert_eq!(
        steady,
        0,
        "{variant}: {pieces_in_window} pieces in steady state allocated ({}); rerun with REGFLOW_ALLOC_BACKTRACE=1 to see where",
        describe(in_window)
    );
    assert_eq!(
        ordinary(long),
        ordinary(short),
        "{variant}: a run of {n2} pieces allocated ({}), one of {n1} pieces ({})",
        describe(long),
        describe(short)
    );
    for (pieces, run) in [(n1, short), (n2, long)] {
        let lazy = total(run) - ordinary(run);
        assert!(lazy <= lazy_bound, "{variant}: a run of {pieces} pieces allocated ({})", describe(run));
    }
}

// ---------------------------------------------------------------------------------------
// Plans.
// ---------------------------------------------------------------------------------------

const BYTES: u64 = 64;

fn tag_of(bytes: &[u8]) -> u64 {
    let mut tag = [0u8; 8];
    tag.copy_from_slice(&bytes[..8]);
    u64::from_le_bytes(tag)
}

/// Adds one to the tag it copies, so the sink can check every stage ran on every piece.
struct Increment;

impl Kernel for Increment {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let input = io.input(0);
        let tag = tag_of(input);
        let out = io.output(0);
        out.copy_from_slice(input);
        out[..8].copy_from_slice(&(tag + 1).to_le_bytes());
        Ok(())
    }
}

/// `src -> copy -> increment -> increment -> sink` on two streams of `kind`, alternating, so
/// every edge but one crosses threads. On sim, every stage takes `sim_nanos`.
fn chain(kind: DeviceKind, source: SourcePieces, sim_nanos: u64) -> Plan {
    let mut b = PlanBuilder::new();
    let device = b.device(0, kind, 0);
    let streams = [b.stream(device, StreamKind::Compute), b.stream(device, StreamKind::Copy)];
    let src = b.actor("src", streams[0], ActorKind::Source { pieces: source });
    let mut prev = b.regst("src.out", src, BYTES, 2);
    let stages = [
        ("copy", KernelConf::Copy),
        ("increment0", KernelConf::Custom { name: "increment".into() }),
        ("increment1", KernelConf::Custom { name: "increment".into() }),
    ];
    for (i, (name, kernel)) in stages.into_iter().enumerate() {
        let actor = b.actor(name, streams[(i + 1) % 2], ActorKind::Compute { kernel });
        b.sim_nanos(actor, sim_nanos);
        b.consume(actor, prev);
        prev = b.regst(&format!("{name}.out"), actor, BYTES, 2);
    }
    let sink = b.actor("sink", streams[0], ActorKind::Sink);
    b.consume(sink, prev);
    b.build().unwrap()
}

/// The watchdog of every job here unless a test says otherwise: long enough that it never
/// ticks during these short runs.
const WATCHDOG: Duration = Duration::from_secs(20);

/// Runs a plan with a counting source and an `on_sink` callback that checks each piece's
/// tag (`piece + increments`) and drives the window.
fn run_with_callback(plan: &Plan, pieces: u64, window: &Arc<Window>, watchdog: Duration, expected_tag: fn(u64) -> u64) {
    let mut plan = plan.clone();
    for actor in &mut plan.actors {
        if let ActorKind::Source { pieces: SourcePieces::Count(n) } = &mut actor.kind {
            *n = pieces;
        }
    }
    let delivered = Arc::new(AtomicU64::new(0));
    let wrong = Arc::new(AtomicU64::new(0));
    let (sink_delivered, sink_wrong) = (delivered.clone(), wrong.clone());
    let sink_window = window.clone();
    let job = Job::builder(plan)
        .watchdog(watchdog)
        .kernel("increment", |_| Ok(Box::new(Increment)))
        .on_sink("sink", move |io| {
            sink_window.at_piece(io.piece());
            if tag_of(io.input(0)) != expected_tag(io.piece()) {
                sink_wrong.fetch_add(1, Ordering::Relaxed);
            }
            sink_delivered.fetch_add(1, Ordering::Relaxed);
        })
        .build()
        .unwrap();
    window.job_started();
    job.wait().unwrap();
    assert_eq!(delivered.load(Ordering::Relaxed), pieces);
    assert_eq!(wrong.load(Ordering::Relaxed), 0, "pieces with a wrong tag");
}

// ---------------------------------------------------------------------------------------
// Tests.
// ---------------------------------------------------------------------------------------

/// A counting source through copy and custom kernels on two cpu streams to an `on_sink`
/// callback: the extra pieces allocate nothing.
#[test]
fn cpu_chain_allocates_nothing_per_piece() {
    let plan = chain(DeviceKind::Cpu, SourcePieces::Count(0), 0);
    assert_allocates_nothing_per_piece("cpu chain", PIECES, LAZY_CHANNEL_BOUND, |pieces, window| {
        run_with_callback(&plan, pieces, window, WATCHDOG, |piece| piece + 2)
    });
}

/// The same chain on a sim device: its stream threads time their kernels' completions.
#[test]
fn sim_chain_allocates_nothing_per_piece() {
    let plan = chain(DeviceKind::Sim, SourcePieces::Count(0), 2_000);
    assert_allocates_nothing_per_piece("sim chain", PIECES, LAZY_CHANNEL_BOUND, |pieces, window| {
        run_with_callback(&plan, pieces, window, WATCHDOG, |piece| piece + 2)
    });
}

/// The sim chain with a watchdog that ticks every 62.5 ms (a 250 ms timeout checks every
/// quarter). One stream runs two 100 us stages per piece, so a run of `PIECES.long` pieces lasts at
/// least 300 ms of modeled time and its window at least 200 ms: the watchdog ticks several
/// times in each, sees progress, and allocates nothing.
#[test]
fn watchdog_ticks_allocate_nothing() {
    let plan = chain(DeviceKind::Sim, SourcePieces::Count(0), 100_000);
    assert_allocates_nothing_per_piece(
        "sim chain with a ticking watchdog",
        PIECES,
        LAZY_CHANNEL_BOUND,
        |pieces, window| run_with_callback(&plan, pieces, window, Duration::from_millis(250), |piece| piece + 2),
    );
}

/// `src` (node 0) -> `copy` -> `increment0` (node 1) -> `increment1` -> `sink` (node 0):
/// every piece crosses the network twice, each way with its `Ack` back.
fn chain_across_nodes() -> Plan {
    let mut b = PlanBuilder::new();
    let d0 = b.device(0, DeviceKind::Cpu, 0);
    let d1 = b.device(1, DeviceKind::Cpu, 0);
    let (s0, s1) = (b.stream(d0, StreamKind::Compute), b.stream(d1, StreamKind::Compute));
    let src = b.actor("src", s0, ActorKind::Source { pieces: SourcePieces::Count(0) });
    let mut prev = b.regst("src.out", src, BYTES, 2);
    let stages = [
        ("copy", s1, KernelConf::Copy),
        ("increment0", s1, KernelConf::Custom { name: "increment".into() }),
        ("increment1", s0, KernelConf::Custom { name: "increment".into() }),
    ];
    for (name, stream, kernel) in stages {
        let actor = b.actor(name, stream, ActorKind::Compute { kernel });
        b.consume(actor, prev);
        prev = b.regst(&format!("{name}.out"), actor, BYTES, 2);
    }
    let sink = b.actor("sink", s0, ActorKind::Sink);
    b.consume(sink, prev);
    b.build().unwrap()
}

/// The chain across two nodes joined over loopback TCP, each node's job on its own thread:
/// the writers, readers and heartbeats of the data plane allocate nothing per piece.
#[test]
fn a_chain_across_nodes_allocates_nothing_per_piece() {
    let plan = chain_across_nodes();
    // Two stream threads and four connection threads (a writer and a reader per node),
    // each with its channel: crossbeam's lazy set-ups, once each.
    let bound = lazy_channel_bound(2, 0, 0) + 8;
    assert_allocates_nothing_per_piece("chain across 2 nodes", PIECES, bound, |pieces, window| {
        let mut plan = plan.clone();
        for actor in &mut plan.actors {
            if let ActorKind::Source { pieces: SourcePieces::Count(n) } = &mut actor.kind {
                *n = pieces;
            }
        }
        let mut clusters = regflow::runtime::Cluster::loopback(2).unwrap().into_iter();
        let (c0, c1) = (clusters.next().unwrap(), clusters.next().unwrap());
        let node1 = {
            let plan = plan.clone();
            std::thread::spawn(move || {
                let job = Job::builder(plan).cluster(c1).kernel("increment", |_| Ok(Box::new(Increment))).build();
                job.unwrap().wait().unwrap();
            })
        };
        let delivered = Arc::new(AtomicU64::new(0));
        let wrong = Arc::new(AtomicU64::new(0));
        let (sink_delivered, sink_wrong, sink_window) = (delivered.clone(), wrong.clone(), window.clone());
        let job = Job::builder(plan)
            .cluster(c0)
            .watchdog(WATCHDOG)
            .kernel("increment", |_| Ok(Box::new(Increment)))
            .on_sink("sink", move |io| {
                sink_window.at_piece(io.piece());
                if tag_of(io.input(0)) != io.piece() + 2 {
                    sink_wrong.fetch_add(1, Ordering::Relaxed);
                }
                sink_delivered.fetch_add(1, Ordering::Relaxed);
            })
            .build()
            .unwrap();
        window.job_started();
        job.wait().unwrap();
        node1.join().unwrap();
        assert_eq!(delivered.load(Ordering::Relaxed), pieces);
        assert_eq!(wrong.load(Ordering::Relaxed), 0, "pieces with a wrong tag");
    });
}

/// `src -> repeat(2) -> acc(2, Copy) -> sink`, on a cpu and a sim stream: the repeat lends
/// its input register, the acc holds its output across a group; neither allocates.
#[test]
fn acc_and_repeat_allocate_nothing_per_piece() {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let sim = b.device(0, DeviceKind::Sim, 0);
    let (s0, s1) = (b.stream(cpu, StreamKind::Compute), b.stream(sim, StreamKind::Compute));
    let src = b.actor("src", s0, ActorKind::Source { pieces: SourcePieces::Count(0) });
    let x = b.regst("x", src, BYTES, 2);
    let repeat = b.actor("repeat", s1, ActorKind::Repeat { count: 2 });
    b.consume(repeat, x);
    let y = b.regst("y", repeat, BYTES, 2);
    let acc = b.actor("acc", s1, ActorKind::Acc { count: 2, kernel: KernelConf::Copy });
    b.sim_nanos(acc, 2_000);
    b.consume(acc, y);
    let z = b.regst("z", acc, BYTES, 2);
    let sink = b.actor("sink", s0, ActorKind::Sink);
    b.consume(sink, z);
    let plan = b.build().unwrap();
    // repeat(2) then acc(2) gives one piece per source piece, holding that source piece.
    assert_allocates_nothing_per_piece("acc and repeat", PIECES, LAZY_CHANNEL_BOUND, |pieces, window| {
        run_with_callback(&plan, pieces, window, WATCHDOG, |piece| piece)
    });
}

/// A fed source and a fetcher driven from the test thread, a few pieces in flight: pushes
/// reuse the feeder's buffers and fetches the sink's, so neither side allocates per piece.
#[test]
fn fed_source_and_fetcher_allocate_nothing_per_piece() {
    /// Pieces pushed ahead of the one fetched; small enough that a push never waits on a
    /// fetch that has not happened (feeder buffers + registers + sink credits hold more).
    const LAG: u64 = 3;
    let plan = chain(DeviceKind::Cpu, SourcePieces::Fed, 0);
    assert_allocates_nothing_per_piece("fed source and fetcher", PIECES, LAZY_CHANNEL_BOUND, |pieces, window| {
        let mut job = Job::builder(plan.clone())
            .watchdog(WATCHDOG)
            .kernel("increment", |_| Ok(Box::new(Increment)))
            .build()
            .unwrap();
        let mut feeder = job.feeder("src").unwrap();
        let fetcher = job.fetcher("sink").unwrap();
        window.job_started();
        let mut piece_bytes = [0u8; BYTES as usize];
        let mut fetched = 0;
        let mut fetch_one = || {
            window.at_piece(fetched);
            let got = fetcher.recv().expect("the sink ended early");
            assert_eq!((got.piece(), tag_of(got.bytes())), (fetched, fetched + 2));
            fetched += 1;
        };
        for piece in 0..pieces {
            piece_bytes[..8].copy_from_slice(&piece.to_le_bytes());
            feeder.push(&piece_bytes).unwrap();
            if piece >= LAG {
                fetch_one();
            }
        }
        feeder.close().unwrap();
        for _ in pieces.saturating_sub(LAG)..pieces {
            fetch_one();
        }
        assert!(fetcher.recv().is_none(), "more pieces than were pushed");
        drop((feeder, fetcher));
        job.wait().unwrap();
    });
}

/// An all-reduce between two cpu devices (counting sources on the compute streams, the
/// collective on each comm stream, sinks back on the compute streams): the rendezvous
/// reuses its tables, so a collective allocates nothing per piece either.
#[test]
fn collectives_allocate_nothing_per_piece() {
    use regflow::graph::plan::{CollectiveConf, CollectiveOp};
    let mut b = PlanBuilder::new();
    for rank in 0..2u32 {
        let device = b.device(0, DeviceKind::Cpu, rank as u16);
        let (compute, comm) = (b.stream(device, StreamKind::Compute), b.stream(device, StreamKind::Comm));
        let src = b.actor(&format!("src{rank}"), compute, ActorKind::Source { pieces: SourcePieces::Count(0) });
        let x = b.regst(&format!("x{rank}"), src, BYTES, 2);
        let conf = CollectiveConf {
            group: "sum".into(),
            rank,
            size: 2,
            op: CollectiveOp::AllReduce,
            dtype: DType::I64,
            shape: vec![BYTES as usize / 8],
        };
        let all_reduce =
            b.actor(&format!("all_reduce{rank}"), comm, ActorKind::Compute { kernel: KernelConf::Collective(conf) });
        b.consume(all_reduce, x);
        let y = b.regst(&format!("y{rank}"), all_reduce, BYTES, 2);
        let sink = b.actor(if rank == 0 { "sink" } else { "sink1" }, compute, ActorKind::Sink);
        b.consume(sink, y);
    }
    let plan = b.build().unwrap();
    assert_allocates_nothing_per_piece("all-reduce", PIECES, LAZY_CHANNEL_BOUND, |pieces, window| {
        let mut plan = plan.clone();
        for actor in &mut plan.actors {
            if let ActorKind::Source { pieces: SourcePieces::Count(n) } = &mut actor.kind {
                *n = pieces;
            }
        }
        let delivered = Arc::new(AtomicU64::new(0));
        let wrong = Arc::new(AtomicU64::new(0));
        let (sink_delivered, sink_wrong, sink_window) = (delivered.clone(), wrong.clone(), window.clone());
        let job = Job::builder(plan)
            .watchdog(WATCHDOG)
            .on_sink("sink", move |io| {
                sink_window.at_piece(io.piece());
                // Both sources tag piece k with k: the sum is 2k.
                if tag_of(io.input(0)) != 2 * io.piece() {
                    sink_wrong.fetch_add(1, Ordering::Relaxed);
                }
                sink_delivered.fetch_add(1, Ordering::Relaxed);
            })
            .on_sink("sink1", |_| {})
            .build()
            .unwrap();
        window.job_started();
        job.wait().unwrap();
        assert_eq!(delivered.load(Ordering::Relaxed), pieces);
        assert_eq!(wrong.load(Ordering::Relaxed), 0, "pieces with a wrong sum");
    });
}

// ---------------------------------------------------------------------------------------
// Compiled graphs.
// ---------------------------------------------------------------------------------------

/// Distinct batches a compiled test feeds in turn.
const BATCHES: usize = 3;

/// A training step compiled for one cpu device, with the bytes of `BATCHES` batches for
/// each of its fed inputs.
struct CompiledStep {
    plan: Plan,
    /// The loss's fetch (the sink the compiler named).
    loss: String,
    /// `(source name, bytes of each batch)` per graph input.
    inputs: Vec<(String, Vec<Vec<u8>>)>,
}

impl CompiledStep {
    fn compile(g: &Graph, train: &regflow::graph::TrainStep<'_>, inputs: Vec<(&str, Vec<Vec<u8>>)>) -> Self {
        let compiled = g.compile(&[train.loss], &train.updates, &CompileOptions::default()).unwrap();
        Self {
            plan: compiled.plan,
            loss: compiled.fetches[0].clone(),
            inputs: inputs.into_iter().map(|(name, batches)| (format!("input:{name}"), batches)).collect(),
        }
    }

    fn lazy_bound(&self) -> u64 {
        lazy_channel_bound(self.plan.streams.len() as u64, self.inputs.len() as u64, 1)
    }

    /// Runs `steps` steps from the test thread: every piece is pushed from bytes made before
    /// the job starts, the loss fetched a few steps behind into a buffer sized up front.
    /// Returns the losses.
    fn run(&self, steps: u64, window: &Window) -> Vec<f32> {
        /// Steps pushed ahead of the loss fetched: fewer than a fed source's buffers
        /// (register count + 1), so a push never waits on a fetch that has not happened.
        const LAG: u64 = 2;
        let mut losses = Vec::with_capacity(steps as usize);
        let mut job = Job::builder(self.plan.clone()).watchdog(WATCHDOG).build().unwrap();
        let mut feeders: Vec<Feeder> = self.inputs.iter().map(|(name, _)| job.feeder(name).unwrap()).collect();
        let fetcher = job.fetcher(&self.loss).unwrap();
        window.job_started();
        let mut fetch_one = || {
            window.at_piece(losses.len() as u64);
            let got = fetcher.recv().expect("the loss sink ended early");
            losses.push(f32::from_le_bytes(got.bytes().try_into().expect("a 4-byte f32 loss")));
        };
        for step in 0..steps {
            for (feeder, (_, batches)) in feeders.iter_mut().zip(&self.inputs) {
                feeder.push(&batches[step as usize % BATCHES]).unwrap();
            }
            if step >= LAG {
                fetch_one();
            }
        }
        for feeder in &mut feeders {
            feeder.close().unwrap();
        }
        for _ in steps.saturating_sub(LAG)..steps {
            fetch_one();
        }
        assert!(fetcher.recv().is_none(), "more losses than steps");
        drop((feeders, fetcher));
        job.wait().unwrap();
        losses
    }

    /// Checks that steady-state steps allocate nothing, and that every run gives the same
    /// losses as the first one for the steps they share (the runtime is deterministic).
    fn assert_allocates_nothing_per_step(&self, variant: &str) {
        let first: Mutex<Vec<f32>> = Mutex::new(Vec::new());
        assert_allocates_nothing_per_piece(variant, STEPS, self.lazy_bound(), |steps, window| {
            let losses = self.run(steps, window);
            assert!(losses.iter().all(|l| l.is_finite()), "{variant}: losses {losses:?}");
            let mut first = first.lock().unwrap();
            if first.is_empty() {
                *first = losses;
            } else {
                let shared = first.len().min(losses.len());
                assert_eq!(losses[..shared], first[..shared], "{variant}: two runs disagree");
            }
        });
    }
}

fn f32_bytes(values: impl IntoIterator<Item = f32>) -> Vec<u8> {
    values.into_iter().flat_map(f32::to_le_bytes).collect()
}

fn i64_bytes(values: impl IntoIterator<Item = i64>) -> Vec<u8> {
    values.into_iter().flat_map(i64::to_le_bytes).collect()
}

/// The digits MLP of `examples/train_digits.rs` (64-128-10, batch 64, f32) with AdamW, a
/// warm-up + cosine schedule and gradient clipping, on one cpu device: a training step
/// allocates nothing once it has run a few times.
#[test]
fn compiled_mlp_training_allocates_nothing_per_step() {
    const BATCH: usize = 64;
    const FEATURES: usize = 64;
    const HIDDEN: usize = 128;
    const CLASSES: usize = 10;
    let g = Graph::new();
    let loss = common::relu_mlp_loss(&g, (BATCH, FEATURES, HIDDEN, CLASSES));
    let optimizer = Optimizer::adamw(1e-2, 1e-4)
        .with_schedule(LrSchedule::WarmupCosine { peak: 1e-2, warmup: 5, total: 100, min: 1e-4 })
        .with_clip_norm(5.0);
    let train = g.minimize(loss, &optimizer).unwrap();
    let mut rng = SplitMix64::new(7);
    let (mut xs, mut ys) = (Vec::new(), Vec::new());
    for _ in 0..BATCHES {
        xs.push(f32_bytes((0..BATCH * FEATURES).map(|_| rng.next_normal() as f32)));
        ys.push(i64_bytes((0..BATCH).map(|_| (rng.next_u64() % CLASSES as u64) as i64)));
    }
    let step = CompiledStep::compile(&g, &train, vec![("x", xs), ("y", ys)]);
    step.assert_allocates_nothing_per_step("compiled digits MLP");
}

/// A GPT block as `examples/common/gpt.rs` builds it (embeddings, layer norms, causal
/// attention with softmax, a GELU MLP, the tied output projection, cross entropy) with AdamW,
/// on one cpu device: a training step allocates nothing once it has run a few times.
#[test]
fn compiled_gpt_block_training_allocates_nothing_per_step() {
    gpt_block_allocates_nothing_per_step(false);
}

/// The same block with its attention as one `attention` op (tiles of scores on the stack).
#[test]
fn compiled_gpt_block_with_fused_attention_allocates_nothing_per_step() {
    gpt_block_allocates_nothing_per_step(true);
}

fn gpt_block_allocates_nothing_per_step(fused_attention: bool) {
    const BATCH: usize = 2;
    const VOCAB: usize = 12;
    let config = gpt::GptConfig {
        d_model: 16,
        heads: 2,
        layers: 1,
        context: 8,
        mlp_width: 64,
        fused_attention,
        apart_qkv: false,
    };
    let time = config.context;
    let g = Graph::new();
    let ids = g.input("ids", [BATCH, time], DType::I64).unwrap();
    let targets = g.input("targets", [BATCH * time], DType::I64).unwrap();
    // The fused op masks by itself: its mask is made on the device and never read.
    let mask = if fused_attention {
        g.causal_mask(time, DType::F32).unwrap()
    } else {
        g.input("mask", [time, time], DType::F32).unwrap()
    };
    let model = gpt::Gpt::new(&g, config, VOCAB).unwrap();
    let loss = model.loss(&model.logits(&ids, &mask).unwrap(), &targets).unwrap();
    let optimizer = Optimizer::adamw(3e-3, 1e-2).with_clip_norm(1.0);
    let train = g.minimize(loss, &optimizer).unwrap();
    let mut rng = SplitMix64::new(11);
    let mut token = || (rng.next_u64() % VOCAB as u64) as i64;
    let (mut id_batches, mut target_batches, mut masks) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..BATCHES {
        id_batches.push(i64_bytes((0..BATCH * time).map(|_| token())));
        target_batches.push(i64_bytes((0..BATCH * time).map(|_| token())));
        // 0 where a position may attend, -1e9 on future positions.
        masks.push(f32_bytes((0..time * time).map(|i| if i % time <= i / time { 0.0 } else { -1e9 })));
    }
    let mut feeds = vec![("ids", id_batches), ("targets", target_batches)];
    if !fused_attention {
        feeds.push(("mask", masks));
    }
    let step = CompiledStep::compile(&g, &train, feeds);
    let what = if fused_attention { "compiled GPT block, fused attention" } else { "compiled GPT block" };
    step.assert_allocates_nothing_per_step(what);
}
