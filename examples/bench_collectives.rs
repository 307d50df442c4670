//! In-process all-reduce bandwidth: 2 members on 2 threads against one-thread memcpy.
//!
//! Run with `cargo run --release --example bench_collectives` (`-- direct` or `-- plan` for
//! one part). Results and their analysis: `BENCHMARKS.md`, section "Collectives".
//!
//! - **direct**: the real rendezvous through [`CollectiveMember`] (what a collective actor's
//!   kernel runs), f32 all-reduce of 1 KiB … 64 MiB (powers of 4), 2 members on 2 threads.
//!   Algorithm bandwidth = bytes of the tensor / time per all-reduce. Beside it, on one
//!   thread and the same size: `memcpy` (`copy_from_slice`) and `out = a + b`, which is the
//!   work each member does (it reads both inputs and writes its own output).
//! - **plan**: the same all-reduce as actors: per device a counting source (compute stream)
//!   → the collective (comm stream) → a sink callback, 2 cpu devices, 1 MiB and 64 MiB,
//!   timed from `build` to the end of `wait`, so it includes the actor protocol per piece
//!   and, amortized over the pieces, the job's start and first touch of its registers.
//!
//! Every figure is the best and the median of [`REPS`] (plan: [`PLAN_REPS`]) runs.

use regflow::graph::plan::{CollectiveConf, CollectiveOp};
use regflow::graph::DType;
use regflow::prelude::*;
use regflow::runtime::CollectiveMember;
use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// Runs per measurement; the tables show the best and the median.
const REPS: usize = 5;
/// Runs per plan measurement (each allocates and first-touches the registers).
const PLAN_REPS: usize = 3;
/// Members of the group.
const MEMBERS: usize = 2;
/// Bytes moved per size so that each run takes long enough to time (at most).
const BYTES_PER_RUN: usize = 512 << 20;

/// Best and median of a set of timings (per operation).
#[derive(Debug, Clone, Copy)]
struct Stats {
    best: Duration,
    median: Duration,
}

fn stats(mut runs: Vec<Duration>) -> Stats {
    runs.sort();
    Stats { best: runs[0], median: runs[runs.len() / 2] }
}

/// GB/s (10^9 bytes per second) of `bytes` moved in `time`.
fn gbps(bytes: usize, time: Duration) -> f64 {
    bytes as f64 / time.as_secs_f64() / 1e9
}

fn iterations(bytes: usize) -> usize {
    (BYTES_PER_RUN / bytes).clamp(8, 5_000)
}

fn all_reduce_conf(bytes: usize) -> CollectiveConf {
    CollectiveConf {
        group: "bench".into(),
        rank: 0,
        size: MEMBERS as u32,
        op: CollectiveOp::AllReduce,
        dtype: DType::F32,
        shape: vec![bytes / 4],
    }
}

/// Time per all-reduce through the rendezvous, `iters` in a row, for each of [`REPS`] runs.
fn direct_all_reduce(bytes: usize, iters: usize) -> Stats {
    let mut runs = Vec::with_capacity(REPS);
    for _ in 0..REPS {
        let members = CollectiveMember::group(&all_reduce_conf(bytes)).expect("a valid group");
        let start = Arc::new(Barrier::new(MEMBERS));
        let threads: Vec<_> = members
            .into_iter()
            .map(|mut member| {
                let start = start.clone();
                std::thread::spawn(move || {
                    let input: Vec<u8> = (0..bytes / 4).flat_map(|i| (i as f32).to_le_bytes()).collect();
                    let mut output = vec![0u8; bytes];
                    // One warm-up round (first touch of the output pages).
                    member.run(&input, &mut output).expect("all-reduce");
                    start.wait();
                    let began = Instant::now();
                    for _ in 0..iters {
                        member.run(black_box(&input), black_box(&mut output)).expect("all-reduce");
                    }
                    began.elapsed()
                })
            })
            .collect();
        let slowest = threads.into_iter().map(|t| t.join().expect("member thread")).max().unwrap_or_default();
        runs.push(slowest / iters as u32);
    }
    stats(runs)
}

/// Time per `op` on one thread, `iters` in a row, for each of [`REPS`] runs.
fn single_thread(iters: usize, mut op: impl FnMut()) -> Stats {
    op();
    let runs = (0..REPS)
        .map(|_| {
            let began = Instant::now();
            for _ in 0..iters {
                op();
            }
            began.elapsed() / iters as u32
        })
        .collect();
    stats(runs)
}

fn direct() {
    println!("## direct: f32 all-reduce through the rendezvous, {MEMBERS} members on {MEMBERS} threads");
    println!("GB/s = tensor bytes / time per operation; best / median of {REPS} runs\n");
    println!(
        "| size | iters | all-reduce µs | all-reduce GB/s | memcpy GB/s (1 thread) | a+b GB/s (1 thread) | all-reduce / memcpy |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    let mut bytes = 1 << 10;
    while bytes <= 64 << 20 {
        let iters = iterations(bytes);
        let reduce = direct_all_reduce(bytes, iters);
        let src = vec![1u8; bytes];
        let mut dst = vec![0u8; bytes];
        let copy = single_thread(iters, || {
            dst.copy_from_slice(black_box(&src));
            black_box(&mut dst);
        });
        let (a, b) = (vec![1.0f32; bytes / 4], vec![2.0f32; bytes / 4]);
        let mut out = vec![0.0f32; bytes / 4];
        let add = single_thread(iters, || {
            for ((o, x), y) in out.iter_mut().zip(black_box(&a)).zip(black_box(&b)) {
                *o = x + y;
            }
            black_box(&mut out);
        });
        println!(
            "| {} | {iters} | {:.1} / {:.1} | {:.2} / {:.2} | {:.2} / {:.2} | {:.2} / {:.2} | {:.2} |",
            human(bytes),
            reduce.best.as_secs_f64() * 1e6,
            reduce.median.as_secs_f64() * 1e6,
            gbps(bytes, reduce.best),
            gbps(bytes, reduce.median),
            gbps(bytes, copy.best),
            gbps(bytes, copy.median),
            gbps(bytes, add.best),
            gbps(bytes, add.median),
            gbps(bytes, reduce.best) / gbps(bytes, copy.best),
        );
        bytes *= 4;
    }
}

/// Per device: counting source → all-reduce (comm stream) → sink callback.
fn all_reduce_plan(bytes: usize, pieces: u64) -> Plan {
    let mut b = PlanBuilder::new();
    for r in 0..MEMBERS {
        let device = b.device(0, DeviceKind::Cpu, r as u16);
        let compute = b.stream(device, StreamKind::Compute);
        let comm = b.stream(device, StreamKind::Comm);
        let src = b.actor(&format!("src{r}"), compute, ActorKind::Source { pieces: SourcePieces::Count(pieces) });
        let x = b.regst(&format!("x{r}"), src, bytes as u64, 2);
        let conf = CollectiveConf { rank: r as u32, ..all_reduce_conf(bytes) };
        let reduce = b.actor(&format!("ar{r}"), comm, ActorKind::Compute { kernel: KernelConf::Collective(conf) });
        b.consume(reduce, x);
        let y = b.regst(&format!("y{r}"), reduce, bytes as u64, 2);
        let sink = b.actor(&format!("sink{r}"), compute, ActorKind::Sink);
        b.consume(sink, y);
    }
    b.build().expect("a valid plan")
}

fn plan() {
    println!("\n## plan: the same all-reduce as actors on comm streams, {MEMBERS} cpu devices");
    println!("time from build to the end of wait, per piece; best / median of {PLAN_REPS} runs\n");
    println!("| size | pieces | µs per piece | GB/s |");
    println!("|---:|---:|---:|---:|");
    for (bytes, pieces) in [(1usize << 20, 2_000u64), (64 << 20, 100)] {
        let runs = (0..PLAN_REPS)
            .map(|_| {
                let mut builder = Job::builder(all_reduce_plan(bytes, pieces));
                for r in 0..MEMBERS {
                    builder = builder.on_sink(&format!("sink{r}"), |io| {
                        black_box(io.input(0));
                    });
                }
                let began = Instant::now();
                let job = builder.build().expect("job");
                job.wait().expect("job ran");
                began.elapsed() / pieces as u32
            })
            .collect();
        let s = stats(runs);
        println!(
            "| {} | {pieces} | {:.1} / {:.1} | {:.2} / {:.2} |",
            human(bytes),
            s.best.as_secs_f64() * 1e6,
            s.median.as_secs_f64() * 1e6,
            gbps(bytes, s.best),
            gbps(bytes, s.median)
        );
    }
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 20 => format!("{} MiB", b >> 20),
        b => format!("{} KiB", b >> 10),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let wants = |name: &str| args.is_empty() || args.iter().any(|a| a == name);
    if wants("direct") {
        direct();
    }
    if wants("plan") {
        plan();
    }
}
