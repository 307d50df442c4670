//! Actor-runtime benchmarks B1–B4: regflow chains, sim pipelines and copies against hand-written floors.
//!
//! Run with `cargo run --release --example bench_actors`; name benchmarks to run only those
//! (`-- b1 b3`; the others are `b2`, `b4` and `primitives`). Every figure is the best and
//! the median of [`REPS`] runs, because the machine these numbers come from is a shared VM.
//! B1 and B2 run regflow and their floors in rounds (each once per round) and report the
//! median over rounds of the per-round ratio, so a drift of the host's clock between runs
//! does not pass for a difference. `REGFLOW_BENCH_PIECES=n` shortens the chains, e.g. to
//! count instructions per firing under `valgrind --tool=callgrind`, and
//! `REGFLOW_BENCH_REGISTERS=n` runs B1 and B2 with `n` registers per edge only.
//! Results and their analysis: `BENCHMARKS.md`.
//!
//! - **B1** one cpu stream, source → 64 no-op stages → sink: ns per firing, beside two
//!   single-thread floors that move the same pieces through the same 65 bounded edges
//!   (plain `VecDeque`s, and crossbeam bounded channels).
//! - **B2** the same chain with actor *i* on stream *i* % 2: ns per hop, beside the same
//!   chain of crossbeam bounded channels alternating between two threads.
//! - **B2 jobs** (`b2jobs`) two B2 chains with 2 registers (or `REGFLOW_BENCH_JOBS` of
//!   them) as jobs of one process at once: ns per hop of all together, beside one chain
//!   alone. Their stream threads outnumber two cores, so this is where the lanes' barrier
//!   mode could matter (`runtime/src/lane.rs`).
//! - **B3** four `sim` stages of 1 ms each: wall time against the ideal (m + p − 1)·t,
//!   with 1, 2 and 3 registers per stage edge.
//! - **B4** source → copy → sink with 1 MiB registers: pieces/s and GB/s copied.

use regflow::prelude::*;
use std::collections::VecDeque;
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Runs per measurement; the tables show the best and the median.
const REPS: usize = 5;
/// No-op stages in the B1 and B2 chains.
const STAGES: usize = 64;
/// Pieces through the B1 chain.
const B1_PIECES: u64 = 100_000;
/// Pieces through the B2 chain.
const B2_PIECES: u64 = 20_000;
/// Stages of the B3 pipeline (p) and the modeled duration of each (t).
const B3_STAGES: usize = 4;
const B3_STAGE_NANOS: u64 = 1_000_000;
/// Register size and pieces of B4.
const B4_BYTES: usize = 1 << 20;
const B4_PIECES: u64 = 1_000;

/// Best and median of a set of timings.
#[derive(Debug, Clone, Copy)]
struct Stats {
    best: Duration,
    median: Duration,
}

impl Stats {
    fn of(mut runs: Vec<Duration>) -> Self {
        runs.sort();
        Self { best: runs[0], median: runs[runs.len() / 2] }
    }

    /// Best and median in nanoseconds per unit of work.
    fn per(&self, units: u64) -> (f64, f64) {
        (self.best.as_nanos() as f64 / units as f64, self.median.as_nanos() as f64 / units as f64)
    }
}

fn repeat(mut run: impl FnMut() -> Duration) -> Stats {
    Stats::of((0..REPS).map(|_| run()).collect())
}

/// Runs every contender once per round, [`REPS`] rounds, so that a drift of the host's
/// clock between rounds (this VM's moves by 2×) hits them all alike. Returns each
/// contender's timings, round by round.
fn interleaved(contenders: &mut [&mut dyn FnMut() -> Duration]) -> Vec<Vec<Duration>> {
    let mut runs: Vec<Vec<Duration>> = vec![Vec::new(); contenders.len()];
    for _ in 0..REPS {
        for (run, times) in contenders.iter_mut().zip(&mut runs) {
            times.push(run());
        }
    }
    runs
}

/// The median over rounds of `a`'s time over `b`'s in the same round.
fn median_ratio(a: &[Duration], b: &[Duration]) -> f64 {
    let mut r: Vec<f64> = a.iter().zip(b).map(|(a, b)| a.as_secs_f64() / b.as_secs_f64()).collect();
    r.sort_by(f64::total_cmp);
    r[r.len() / 2]
}

/// Pieces of a chain benchmark: `default`, or `REGFLOW_BENCH_PIECES` (to count
/// instructions under callgrind on a short run).
fn pieces_or(default: u64) -> u64 {
    std::env::var("REGFLOW_BENCH_PIECES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Register counts a chain benchmark runs with: 1 and 2, or only `REGFLOW_BENCH_REGISTERS`
/// (to count one configuration's instructions).
fn chain_registers() -> Vec<u32> {
    let Ok(value) = std::env::var("REGFLOW_BENCH_REGISTERS") else { return vec![1, 2] };
    match value.parse::<u32>() {
        Ok(n) if n > 0 => vec![n],
        _ => panic!("REGFLOW_BENCH_REGISTERS is {value:?}; it must be a positive whole number of registers"),
    }
}

// ---------------------------------------------------------------------------------------
// Chains (B1, B2)
// ---------------------------------------------------------------------------------------

/// Source → `STAGES` no-op actors → sink. Stage `i` runs on stream `i % streams`; the
/// source sits on the stream "before" stage 0 and the sink on the one "after" the last
/// stage, so with two streams every one of the 65 edges crosses threads.
fn chain_plan(register_num: u32, pieces: u64, streams: usize) -> Plan {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let ss: Vec<_> = (0..streams).map(|_| b.stream(cpu, StreamKind::Compute)).collect();
    let stream_of = |position: isize| ss[position.rem_euclid(streams as isize) as usize];
    let src = b.actor("src", stream_of(-1), ActorKind::Source { pieces: SourcePieces::Count(pieces) });
    let mut prev = b.regst("src.out", src, 8, register_num);
    for i in 0..STAGES {
        let a = b.actor(&format!("stage{i}"), stream_of(i as isize), ActorKind::Compute { kernel: KernelConf::Noop });
        b.consume(a, prev);
        prev = b.regst(&format!("stage{i}.out"), a, 8, register_num);
    }
    let sink = b.actor("sink", stream_of(STAGES as isize), ActorKind::Sink);
    b.consume(sink, prev);
    b.build().expect("the chain plan is valid")
}

/// Runs a plan whose sink is named `sink`, counting pieces in an `on_sink` callback;
/// returns the wall time from `Job::build` to the end of `Job::wait`.
fn run_counting(plan: &Plan, pieces: u64) -> Duration {
    let seen = Arc::new(AtomicU64::new(0));
    let counter = seen.clone();
    let mut count = 0u64;
    let plan = plan.clone();
    let start = Instant::now();
    let job = Job::builder(plan)
        .on_sink("sink", move |_io| {
            count += 1;
            counter.store(count, Ordering::Relaxed);
        })
        .build()
        .expect("job starts");
    job.wait().expect("job ends cleanly");
    let elapsed = start.elapsed();
    assert_eq!(seen.load(Ordering::Relaxed), pieces, "the sink saw every piece");
    elapsed
}

/// Floor for B1: the same chain (source, `STAGES` stages, sink; 65 edges of `capacity`
/// slots) as plain `VecDeque`s on one thread. A sweep from the sink back to the source
/// moves every item that has room downstream, which is exactly the register protocol's
/// backpressure without any messages: what one thread cannot do faster.
fn queue_floor(capacity: usize, pieces: u64) -> Duration {
    let mut edges: Vec<VecDeque<u64>> = (0..=STAGES).map(|_| VecDeque::with_capacity(capacity)).collect();
    let (mut produced, mut consumed) = (0u64, 0u64);
    let start = Instant::now();
    while consumed < pieces {
        while let Some(piece) = edges[STAGES].pop_front() {
            black_box(piece);
            consumed += 1;
        }
        for stage in (0..STAGES).rev() {
            let (upstream, downstream) = edges.split_at_mut(stage + 1);
            let (input, output) = (&mut upstream[stage], &mut downstream[0]);
            while output.len() < capacity {
                match input.pop_front() {
                    Some(piece) => output.push_back(black_box(piece)),
                    None => break,
                }
            }
        }
        while produced < pieces && edges[0].len() < capacity {
            edges[0].push_back(black_box(produced));
            produced += 1;
        }
    }
    black_box(&edges);
    start.elapsed()
}

/// Second floor for B1: the same sweep over crossbeam bounded channels of `capacity`, on
/// one thread. It pays what a thread-safe queue costs (atomics, no contention), which is
/// the price regflow's inboxes pay for cross-thread messages.
fn crossbeam_floor(capacity: usize, pieces: u64) -> Duration {
    let edges: Vec<_> = (0..=STAGES).map(|_| crossbeam_channel::bounded::<u64>(capacity)).collect();
    let (mut produced, mut consumed) = (0u64, 0u64);
    let start = Instant::now();
    while consumed < pieces {
        while let Ok(piece) = edges[STAGES].1.try_recv() {
            black_box(piece);
            consumed += 1;
        }
        for stage in (0..STAGES).rev() {
            let (input, output) = (&edges[stage].1, &edges[stage + 1].0);
            while !output.is_full() {
                match input.try_recv() {
                    Ok(piece) => output.try_send(black_box(piece)).expect("room was checked"),
                    Err(_) => break,
                }
            }
        }
        while produced < pieces && !edges[0].0.is_full() {
            edges[0].0.try_send(black_box(produced)).expect("room was checked");
            produced += 1;
        }
    }
    start.elapsed()
}

/// Comparison for B2: the 66 positions (source, `STAGES` stages, sink) alternate between
/// two threads exactly as the actors alternate between the two streams, and every one of
/// the 65 edges is a crossbeam bounded channel of `capacity`. Each thread sweeps its own
/// positions (downstream first) without blocking, and yields when a sweep moved nothing.
/// This is the cheapest correct way to run the same cross-thread chain with the same
/// backpressure: one channel send and one receive per hop, where regflow also sends an
/// `Ack` back.
fn crossbeam_two_threads(capacity: usize, pieces: u64) -> Duration {
    let positions = STAGES + 2;
    let edges: Vec<_> = (0..positions - 1).map(|_| crossbeam_channel::bounded::<u64>(capacity)).collect();
    // Position p is stage p - 1; the source (p = 0) lands on thread 1, the sink on thread 0.
    let thread_of = |p: usize| (p as isize - 1).rem_euclid(2) as usize;
    let start = Instant::now();
    std::thread::scope(|scope| {
        for thread in 0..2 {
            let edges = &edges;
            scope.spawn(move || {
                let mine: Vec<usize> = (0..positions).rev().filter(|&p| thread_of(p) == thread).collect();
                let mut moved = vec![0u64; positions];
                let mut idle_sweeps = 0u32;
                while mine.iter().any(|&p| moved[p] < pieces) {
                    let mut progress = false;
                    for &p in &mine {
                        if p == 0 {
                            while moved[0] < pieces && edges[0].0.try_send(black_box(moved[0])).is_ok() {
                                moved[0] += 1;
                                progress = true;
                            }
                        } else if p == positions - 1 {
                            while let Ok(piece) = edges[p - 1].1.try_recv() {
                                black_box(piece);
                                moved[p] += 1;
                                progress = true;
                            }
                        } else {
                            let (input, output) = (&edges[p - 1].1, &edges[p].0);
                            while !output.is_full() {
                                match input.try_recv() {
                                    Ok(piece) => {
                                        output.try_send(black_box(piece)).expect("only this thread sends here");
                                        moved[p] += 1;
                                        progress = true;
                                    }
                                    Err(_) => break,
                                }
                            }
                        }
                    }
                    if progress {
                        idle_sweeps = 0;
                    } else {
                        idle_sweeps += 1;
                        if idle_sweeps > 16 {
                            std::thread::yield_now();
                        } else {
                            std::hint::spin_loop();
                        }
                    }
                }
            });
        }
    });
    start.elapsed()
}

fn b1() {
    let pieces = pieces_or(B1_PIECES);
    println!("\n## B1: {STAGES} no-op actors on one cpu stream, {pieces} pieces");
    // Firings per piece: the source, every stage, the sink. The floors make as many moves.
    let firings = pieces * (STAGES as u64 + 2);
    println!(
        "{:>5} | {:>22} | {:>22} | {:>22} | {:>12} | {:>12}",
        "regs", "regflow ns/firing", "VecDeque ns/move", "crossbeam ns/move", "vs VecDeque", "vs crossbeam"
    );
    println!(
        "{:>5} | {:>22} | {:>22} | {:>22} | {:>12} | {:>12}",
        "", "best / median", "best / median", "best / median", "median/round", "median/round"
    );
    for register_num in chain_registers() {
        let plan = chain_plan(register_num, pieces, 1);
        let runs = interleaved(&mut [
            &mut || run_counting(&plan, pieces),
            &mut || queue_floor(register_num as usize, pieces),
            &mut || crossbeam_floor(register_num as usize, pieces),
        ]);
        let per = |i: usize| Stats::of(runs[i].clone()).per(firings);
        let (regflow, queues, channels) = (per(0), per(1), per(2));
        println!(
            "{:>5} | {:>10.1} / {:>9.1} | {:>10.2} / {:>9.2} | {:>10.2} / {:>9.2} | {:>11.1}x | {:>11.1}x",
            register_num,
            regflow.0,
            regflow.1,
            queues.0,
            queues.1,
            channels.0,
            channels.1,
            median_ratio(&runs[0], &runs[1]),
            median_ratio(&runs[0], &runs[2]),
        );
    }
    println!("target: regflow <= 3x the crossbeam floor (ratios: median over rounds that run each once)");
}

fn b2() {
    let pieces = pieces_or(B2_PIECES);
    println!("\n## B2: {STAGES} no-op actors alternating over 2 cpu streams, {pieces} pieces");
    // Every edge (source → stage 0 → … → stage 63 → sink) crosses threads.
    let hops = pieces * (STAGES as u64 + 1);
    println!("{:>5} | {:>22} | {:>22} | {:>12}", "regs", "regflow ns/hop", "crossbeam ns/hop", "ratio");
    println!("{:>5} | {:>22} | {:>22} | {:>12}", "", "best / median", "best / median", "median/round");
    for register_num in chain_registers() {
        let plan = chain_plan(register_num, pieces, 2);
        let runs = interleaved(&mut [&mut || run_counting(&plan, pieces), &mut || {
            crossbeam_two_threads(register_num as usize, pieces)
        }]);
        let per = |i: usize| Stats::of(runs[i].clone()).per(hops);
        let (regflow, channels) = (per(0), per(1));
        println!(
            "{:>5} | {:>10.1} / {:>9.1} | {:>10.1} / {:>9.1} | {:>11.2}x",
            register_num,
            regflow.0,
            regflow.1,
            channels.0,
            channels.1,
            median_ratio(&runs[0], &runs[1]),
        );
    }
    println!("target: regflow <= 2x the crossbeam chain (ratio: median over rounds that run each once)");
}

/// B2 chains run as jobs of one process at the same time: two, or `REGFLOW_BENCH_JOBS`.
fn b2_jobs() {
    let pieces = pieces_or(B2_PIECES);
    let jobs = std::env::var("REGFLOW_BENCH_JOBS").ok().and_then(|n| n.parse::<u64>().ok()).unwrap_or(2).max(1);
    println!(
        "\n## B2 jobs: {jobs} chains of {STAGES} no-op actors over 2 cpu streams each, at once, {pieces} pieces each"
    );
    let hops = pieces * (STAGES as u64 + 1);
    let plan = chain_plan(2, pieces, 2);
    let mut all = || {
        let start = Instant::now();
        std::thread::scope(|scope| {
            let others: Vec<_> = (1..jobs).map(|_| scope.spawn(|| run_counting(&plan, pieces))).collect();
            run_counting(&plan, pieces);
            for other in others {
                other.join().expect("a job's thread does not panic");
            }
        });
        start.elapsed()
    };
    let runs = interleaved(&mut [&mut || run_counting(&plan, pieces), &mut all]);
    let (alone, together) = (Stats::of(runs[0].clone()).per(hops), Stats::of(runs[1].clone()).per(jobs * hops));
    println!("{:>14} | {:>22}", "", "ns/hop best / median");
    println!("{:>14} | {:>10.1} / {:>9.1}", "one job", alone.0, alone.1);
    println!("{:>14} | {:>10.1} / {:>9.1}", format!("{jobs} jobs"), together.0, together.1);
}

// ---------------------------------------------------------------------------------------
// Sim pipeline (B3)
// ---------------------------------------------------------------------------------------

/// A copy kernel that notes when it first runs (on `sim` a kernel runs at launch, so this
/// is when the pipeline's first stage starts its first piece).
struct FirstRun {
    epoch: Instant,
    first: Arc<AtomicU64>,
}

impl Kernel for FirstRun {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        if io.piece() == 0 {
            self.first.store(self.epoch.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
        let n = io.input(0).len().min(io.output(0).len());
        let input = io.input(0);
        io.output(0)[..n].copy_from_slice(&input[..n]);
        Ok(())
    }
}

/// Count source and callback sink on a cpu stream; `B3_STAGES` stages on a sim device,
/// one stream each, `B3_STAGE_NANOS` each. Stage outputs have `register_num` slots; the
/// source gets 2 so it is never what the stages wait on.
fn pipeline_plan(pieces: u64, register_num: u32) -> Plan {
    let mut b = PlanBuilder::new();
    let host = b.device(0, DeviceKind::Cpu, 0);
    let io = b.stream(host, StreamKind::Compute);
    let sim = b.device(0, DeviceKind::Sim, 0);
    let src = b.actor("src", io, ActorKind::Source { pieces: SourcePieces::Count(pieces) });
    let mut prev = b.regst("src.out", src, 8, 2);
    for i in 0..B3_STAGES {
        let stream = b.stream(sim, StreamKind::Compute);
        let kernel = if i == 0 { KernelConf::Custom { name: "first_run".into() } } else { KernelConf::Copy };
        let a = b.actor(&format!("stage{i}"), stream, ActorKind::Compute { kernel });
        b.sim_nanos(a, B3_STAGE_NANOS);
        b.consume(a, prev);
        prev = b.regst(&format!("stage{i}.out"), a, 8, register_num);
    }
    let sink = b.actor("sink", io, ActorKind::Sink);
    b.consume(sink, prev);
    b.build().expect("the pipeline plan is valid")
}

/// Returns (first stage start → last piece at the sink, `Job::build` → end of `Job::wait`).
fn run_pipeline(plan: &Plan, pieces: u64) -> (Duration, Duration) {
    let epoch = Instant::now();
    let first = Arc::new(AtomicU64::new(0));
    let last = Arc::new(AtomicU64::new(0));
    let (first_for_kernel, last_for_sink) = (first.clone(), last.clone());
    let job = Job::builder(plan.clone())
        .kernel("first_run", move |_| Ok(Box::new(FirstRun { epoch, first: first_for_kernel.clone() })))
        .on_sink("sink", move |io| {
            if io.piece() + 1 == pieces {
                last_for_sink.store(epoch.elapsed().as_nanos() as u64, Ordering::Relaxed);
            }
        })
        .build()
        .expect("job starts");
    job.wait().expect("job ends cleanly");
    let total = epoch.elapsed();
    let pipeline = Duration::from_nanos(last.load(Ordering::Relaxed) - first.load(Ordering::Relaxed));
    (pipeline, total)
}

fn b3() {
    let t = Duration::from_nanos(B3_STAGE_NANOS);
    let p = B3_STAGES as u32;
    println!("\n## B3: {p}-stage pipeline on sim, t = {t:?} per stage");
    println!(
        "{:>4} | {:>4} | {:>7} | {:>17} | {:>15} | {:>7} | {:>15} | {:>11} | {:>17}",
        "m", "regs", "ideal", "measured (ms)", "vs ideal", "model", "vs model", "extra/piece", "job total (ms)"
    );
    println!(
        "{:>4} | {:>4} | {:>7} | {:>17} | {:>15} | {:>7} | {:>15} | {:>11} | {:>17}",
        "", "", "(ms)", "best / median", "best / median", "(ms)", "best / median", "(us, best)", "best / median"
    );
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    for register_num in [1u32, 2, 3] {
        for m in [4u32, 8, 32] {
            let plan = pipeline_plan(u64::from(m), register_num);
            let runs: Vec<(Duration, Duration)> = (0..REPS).map(|_| run_pipeline(&plan, u64::from(m))).collect();
            let pipeline = Stats::of(runs.iter().map(|r| r.0).collect());
            let total = Stats::of(runs.iter().map(|r| r.1).collect());
            let ideal = t * (m + p - 1);
            // With one register a stage frees its slot only when the next stage finishes,
            // so each stage alternates one t of compute and one t of waiting:
            // stage i starts piece k at (i + 2k)·t and the last piece ends at (2m + p − 2)·t.
            let model = if register_num == 1 { t * (2 * m + p - 2) } else { ideal };
            let extra_per_piece = (pipeline.best.as_secs_f64() - model.as_secs_f64()) / f64::from(m) * 1e6;
            println!(
                "{:>4} | {:>4} | {:>7.2} | {:>7.3} / {:>7.3} | {:>6.3}x / {:>5.3}x | {:>7.2} | {:>6.3}x / {:>5.3}x | {:>11.1} | {:>7.3} / {:>7.3}",
                m,
                register_num,
                ms(ideal),
                ms(pipeline.best),
                ms(pipeline.median),
                pipeline.best.as_secs_f64() / ideal.as_secs_f64(),
                pipeline.median.as_secs_f64() / ideal.as_secs_f64(),
                ms(model),
                pipeline.best.as_secs_f64() / model.as_secs_f64(),
                pipeline.median.as_secs_f64() / model.as_secs_f64(),
                extra_per_piece,
                ms(total.best),
                ms(total.median),
            );
        }
    }
    println!("measured: first stage's first kernel start -> last piece at the sink; ideal = (m + p - 1)·t");
    println!("model: (2m + p - 2)·t for 1 register, the ideal otherwise; extra/piece = (best - model) / m");
    println!("job total: Job::build -> end of Job::wait (adds thread start-up and shutdown)");
    println!("target: <= 1.02x ideal with 2 registers");
}

// ---------------------------------------------------------------------------------------
// Copies (B4)
// ---------------------------------------------------------------------------------------

/// Source → copy → sink with `B4_BYTES` registers of `register_num` slots; `layout` gives
/// the stream of (source, copy, sink).
fn copy_plan(register_num: u32, streams: usize, layout: [usize; 3]) -> Plan {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let ss: Vec<_> = (0..streams).map(|_| b.stream(cpu, StreamKind::Compute)).collect();
    let src = b.actor("src", ss[layout[0]], ActorKind::Source { pieces: SourcePieces::Count(B4_PIECES) });
    let x = b.regst("src.out", src, B4_BYTES as u64, register_num);
    let copy = b.actor("copy", ss[layout[1]], ActorKind::Compute { kernel: KernelConf::Copy });
    b.consume(copy, x);
    let y = b.regst("copy.out", copy, B4_BYTES as u64, register_num);
    let sink = b.actor("sink", ss[layout[2]], ActorKind::Sink);
    b.consume(sink, y);
    b.build().expect("the copy plan is valid")
}

/// Floor for B4: the same number of 1 MiB `copy_from_slice` calls on one thread, between
/// buffers that rotate like `register_num` slots: the memory bandwidth one core reaches.
fn memcpy_floor(register_num: usize) -> Duration {
    // Non-zero fills: `vec![0; n]` maps lazily zeroed pages, which would put page faults
    // (outputs) or the shared zero page (inputs) into the timed loop.
    let inputs: Vec<Vec<u8>> = (0..register_num).map(|i| vec![1 + i as u8; B4_BYTES]).collect();
    let mut outputs: Vec<Vec<u8>> = (0..register_num).map(|_| vec![0xff; B4_BYTES]).collect();
    let start = Instant::now();
    for piece in 0..B4_PIECES as usize {
        let slot = piece % register_num;
        outputs[slot].copy_from_slice(black_box(&inputs[slot]));
        black_box(&mut outputs[slot]);
    }
    start.elapsed()
}

fn b4() {
    println!("\n## B4: source -> copy -> sink on cpu, {} MiB registers, {B4_PIECES} pieces", B4_BYTES >> 20);
    println!(
        "{:>5} | {:<28} | {:>21} | {:>17} | {:>10}",
        "regs", "streams (src, copy, sink)", "pieces/s", "GB/s copied", "vs memcpy"
    );
    println!("{:>5} | {:<28} | {:>21} | {:>17} | {:>10}", "", "", "best / median", "best / median", "best");
    let gb = |d: Duration| (B4_PIECES as f64 * B4_BYTES as f64) / d.as_secs_f64() / 1e9;
    let rate = |d: Duration| B4_PIECES as f64 / d.as_secs_f64();
    let layouts: [(&str, usize, [usize; 3]); 3] = [
        ("1 stream (0, 0, 0)", 1, [0, 0, 0]),
        ("2 streams (0, 1, 0)", 2, [0, 1, 0]),
        ("3 streams (0, 1, 2)", 3, [0, 1, 2]),
    ];
    for register_num in [2u32, 1] {
        let floor = repeat(|| memcpy_floor(register_num as usize));
        for (label, streams, layout) in layouts {
            let plan = copy_plan(register_num, streams, layout);
            let stats = repeat(|| run_counting(&plan, B4_PIECES));
            println!(
                "{:>5} | {:<28} | {:>9.0} / {:>9.0} | {:>7.2} / {:>7.2} | {:>9.2}x",
                register_num,
                label,
                rate(stats.best),
                rate(stats.median),
                gb(stats.best),
                gb(stats.median),
                gb(stats.best) / gb(floor.best),
            );
        }
        println!(
            "{:>5} | {:<28} | {:>9.0} / {:>9.0} | {:>7.2} / {:>7.2} |",
            register_num,
            "memcpy floor (1 thread)",
            rate(floor.best),
            rate(floor.median),
            gb(floor.best),
            gb(floor.median),
        );
    }
}

// ---------------------------------------------------------------------------------------
// Costs that explain the figures
// ---------------------------------------------------------------------------------------

/// What a few primitives cost here, to read the per-firing figures against.
fn primitives() {
    const N: u32 = 1_000_000;
    let start = Instant::now();
    for _ in 0..N {
        black_box(Instant::now());
    }
    let now = start.elapsed().as_nanos() as f64 / f64::from(N);
    let counter = AtomicU64::new(0);
    let start = Instant::now();
    for _ in 0..N {
        black_box(&counter).fetch_add(1, Ordering::Relaxed);
    }
    let fetch_add = start.elapsed().as_nanos() as f64 / f64::from(N);
    let (tx, rx) = crossbeam_channel::bounded::<u64>(1024);
    let start = Instant::now();
    for i in 0..u64::from(N) {
        tx.try_send(black_box(i)).expect("drained every time");
        black_box(rx.try_recv().expect("just sent"));
    }
    let channel = start.elapsed().as_nanos() as f64 / f64::from(N);
    // Round trip between two threads that block in `recv`, as a stream thread waits on its
    // inbox: what a `Ready` → `Ack` exchange across threads costs when the other side sleeps.
    const ROUND_TRIPS: u32 = 20_000;
    let (ping_tx, ping_rx) = crossbeam_channel::bounded::<u64>(1);
    let (pong_tx, pong_rx) = crossbeam_channel::bounded::<u64>(1);
    let echo = std::thread::spawn(move || {
        while let Ok(v) = ping_rx.recv() {
            if pong_tx.send(v).is_err() {
                break;
            }
        }
    });
    let start = Instant::now();
    for i in 0..u64::from(ROUND_TRIPS) {
        ping_tx.send(i).expect("echo thread alive");
        black_box(pong_rx.recv().expect("echo thread alive"));
    }
    let round_trip = start.elapsed().as_nanos() as f64 / f64::from(ROUND_TRIPS);
    drop(ping_tx);
    echo.join().expect("echo thread ends");
    println!("\n## Primitive costs on this machine (ns)");
    println!(
        "one thread: Instant::now {now:.1} | AtomicU64::fetch_add {fetch_add:.1} | crossbeam try_send + try_recv {channel:.1}"
    );
    println!("two threads: crossbeam ping-pong round trip, blocking recv: {round_trip:.0}");

    // Latency from a send to the return of `recv` in a thread that had time to park, as a
    // stream thread parks between the 1 ms kernels of B3: what each message on a
    // pipeline's critical path costs there.
    const WAKES: usize = 300;
    let (wake_tx, wake_rx) = crossbeam_channel::bounded::<Instant>(1);
    let sleeper = std::thread::spawn(move || {
        let mut latencies = Vec::with_capacity(WAKES);
        while let Ok(sent) = wake_rx.recv() {
            latencies.push(sent.elapsed());
        }
        latencies
    });
    for _ in 0..WAKES {
        std::thread::sleep(Duration::from_micros(300));
        wake_tx.send(Instant::now()).expect("sleeper alive");
    }
    drop(wake_tx);
    let mut latencies = sleeper.join().expect("sleeper ends");
    latencies.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "two threads: wake-up of a parked receiver, send -> recv returns (us): median {:.1} | p90 {:.1}",
        us(latencies[WAKES / 2]),
        us(latencies[WAKES * 9 / 10]),
    );
}

fn main() {
    // `bench_actors b1 b3` runs only those; no argument runs everything.
    let only: Vec<String> = std::env::args().skip(1).map(|a| a.to_lowercase()).collect();
    let wanted = |name: &str| only.is_empty() || only.iter().any(|a| a == name);
    let start = Instant::now();
    println!("# regflow actor benchmarks: best / median of {REPS} runs");
    let benchmarks: [(&str, fn()); 6] =
        [("primitives", primitives), ("b1", b1), ("b2", b2), ("b2jobs", b2_jobs), ("b3", b3), ("b4", b4)];
    for (name, run) in benchmarks {
        if wanted(name) {
            run();
        }
    }
    println!("\ntotal run time: {:.1} s", start.elapsed().as_secs_f64());
}
