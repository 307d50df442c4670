//! Nodes over TCP against raw TCP on the same machine, in one run: every figure is a ratio
//! to sockets driven by hand with the same bytes, so it says what the data plane costs.
//!
//! Run with `cargo run --release --example bench_nodes` (`-- transfer`, `hop`, `allreduce`
//! or `train` for one part). Results and their analysis: `BENCHMARKS.md`, section
//! "Issue 15: nodes over TCP". Every node is a thread of this process, joined to the
//! others by [`Cluster::loopback`]; every timing is the best and the median of [`REPS`] runs.
//!
//! - **transfer**: one register crossing two nodes. A counting source on node 0 → a
//!   register of `S` bytes with 2 (and 4) slots → a sink on node 1 whose callback reads the
//!   piece in place (no fetch copy). GB/s = `S` × pieces / time from starting both jobs to
//!   the end of both waits (so job start and the registers' first touch are in it,
//!   amortized over ≥ 256 MiB); *steady* is the rate between the first and the last piece
//!   at the sink. Raw: one thread `write_all`s the same bytes in chunks of `S` to a
//!   `TcpStream`, another `read_exact`s them into one buffer of `S`. A second table runs
//!   4 KiB pieces with 1 … 32 slots: small pieces are bound by slots per round trip.
//! - **hop**: latency of one 8-byte piece crossing nodes. Source (node 0) → copy (node 1)
//!   → sink (node 0), every register with 1 slot: a piece needs the previous one's `Ack`
//!   to come back over the network, so each piece costs one round trip (a `Ready` one way,
//!   its `Ack` back) and one hop is half the time per piece. Raw: an 8-byte ping-pong
//!   between two threads (`TCP_NODELAY`), half the time per round trip.
//! - **allreduce**: f32 all-reduce over 2 and 4 nodes, one cpu device each (counting source
//!   → the collective on a comm stream → sink callback). Bus bandwidth = 2(n−1)/n × bytes
//!   / time per all-reduce. Raw: the direct exchange (the collective's pattern on 2 nodes;
//!   on 4 nodes from 256 KiB it goes around a ring instead, which moves less), by hand: on
//!   each connection, in each direction, one thread writes `S` bytes per round and one
//!   reads them (no reduction).
//! - **train**: the digits-size MLP of `train_parallel` (64-128-10, batch 64, AdamW;
//!   synthetic inputs), data parallel over 2 devices: time per step with the devices on 2
//!   nodes (`Mesh::place_on_nodes`) against the same layout in one process.

use regflow::graph::plan::{CollectiveConf, CollectiveOp};
use regflow::graph::sbp::{Mesh, NdSbp, Sbp};
use regflow::graph::{DType, Graph, HostArray, Init, Optimizer, ParallelOptions, SplitMix64};
use regflow::prelude::*;
use regflow::runtime::Cluster;
use std::hint::black_box;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

/// Runs per measurement; the tables show the best and the median.
const REPS: usize = 3;
/// Bytes a transfer moves per size (at least [`MIN_PIECES`] pieces).
const TRANSFER_BYTES: usize = 256 << 20;
const MIN_PIECES: usize = 64;
/// Pieces (and raw round trips) of the hop latency.
const HOPS: u64 = 20_000;
/// Training steps per run.
const STEPS: usize = 200;
const MLP_BATCH: usize = 64;

/// Best and median of a set of timings.
#[derive(Debug, Clone, Copy)]
struct Stats {
    best: Duration,
    median: Duration,
}

fn stats(mut runs: Vec<Duration>) -> Stats {
    runs.sort();
    Stats { best: runs[0], median: runs[runs.len() / 2] }
}

fn repeat(mut run: impl FnMut() -> Duration) -> Stats {
    stats((0..REPS).map(|_| run()).collect())
}

/// GB/s (10^9 bytes per second) of `bytes` moved in `time`.
fn gbps(bytes: f64, time: Duration) -> f64 {
    bytes / time.as_secs_f64() / 1e9
}

fn micros(time: Duration) -> f64 {
    time.as_secs_f64() * 1e6
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 20 => format!("{} MiB", b >> 20),
        b => format!("{} KiB", b >> 10),
    }
}

/// When a sink saw its first and its last piece: the steady rate leaves job start out.
#[derive(Debug, Default)]
struct SinkClock {
    first: Option<Instant>,
    last: Option<Instant>,
    pieces: u64,
}

type Clock = Arc<Mutex<SinkClock>>;

/// A sink callback that reads nothing (the piece is in place) and only stamps the clock.
fn stamp(clock: Clock) -> impl FnMut(&KernelIo<'_>) + Send + 'static {
    move |io| {
        black_box(io.input(0));
        let now = Instant::now();
        let mut c = clock.lock().expect("the clock is never poisoned");
        c.first.get_or_insert(now);
        c.last = Some(now);
        c.pieces += 1;
    }
}

/// Time per piece between the first and the last piece at the sink.
fn steady(clock: &Clock) -> Duration {
    let c = clock.lock().expect("the clock is never poisoned");
    match (c.first, c.last) {
        (Some(first), Some(last)) if c.pieces > 1 => (last - first) / (c.pieces - 1) as u32,
        _ => Duration::ZERO,
    }
}

/// Runs `node(cluster)` for every node of a loopback cluster of `world`, each on its own
/// thread; returns the time from starting the first to the end of the last.
fn on_nodes(world: u16, node: impl Fn(Cluster) + Send + Sync + 'static) -> Duration {
    let clusters = Cluster::loopback(world).expect("loopback connections");
    let node = Arc::new(node);
    let began = Instant::now();
    let threads: Vec<_> = clusters
        .into_iter()
        .map(|cluster| {
            let node = node.clone();
            std::thread::spawn(move || node(cluster))
        })
        .collect();
    for t in threads {
        t.join().expect("a node's thread panicked");
    }
    began.elapsed()
}

/// Builds and runs this node's part of `plan`, with `clocks` on the named sinks it hosts.
fn run_node(plan: &Plan, cluster: Cluster, clocks: &[(String, Clock)]) {
    let rank = cluster.rank();
    let mut builder = Job::builder(plan.clone()).cluster(cluster).watchdog(Duration::from_secs(60));
    for (sink, clock) in clocks {
        let actor = plan.actor_by_name(sink).expect("the sink is in the plan");
        if plan.devices[plan.device_of(actor).index()].node == rank {
            builder = builder.on_sink(sink, stamp(clock.clone()));
        }
    }
    builder.build().expect("the job starts").wait().expect("the job runs");
}

/// A connected loopback pair with `TCP_NODELAY`, like [`Cluster::loopback`]'s.
fn tcp_pair() -> (TcpStream, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    let a = TcpStream::connect(listener.local_addr().expect("an address")).expect("connect");
    let (b, _) = listener.accept().expect("accept");
    for s in [&a, &b] {
        s.set_nodelay(true).expect("nodelay");
    }
    (a, b)
}

/// Raw TCP moving `rounds` chunks of `bytes` over each given direction of each connection,
/// one writer and one reader thread per direction; time from all threads ready to done.
fn raw_streams(directions: Vec<(TcpStream, TcpStream)>, bytes: usize, rounds: usize) -> Duration {
    let start = Arc::new(Barrier::new(2 * directions.len() + 1));
    let mut threads = Vec::new();
    for (mut from, mut to) in directions {
        let s = start.clone();
        threads.push(std::thread::spawn(move || {
            let chunk = vec![1u8; bytes];
            s.wait();
            for _ in 0..rounds {
                from.write_all(&chunk).expect("raw write");
            }
        }));
        let s = start.clone();
        threads.push(std::thread::spawn(move || {
            let mut buffer = vec![0u8; bytes];
            s.wait();
            for _ in 0..rounds {
                to.read_exact(&mut buffer).expect("raw read");
                black_box(&mut buffer);
            }
        }));
    }
    start.wait();
    let began = Instant::now();
    for t in threads {
        t.join().expect("a raw TCP thread panicked");
    }
    began.elapsed()
}

/// Both directions of one connection per two of `world` endpoints.
fn all_pairs(world: usize) -> Vec<(TcpStream, TcpStream)> {
    let mut directions = Vec::new();
    for _ in 0..world * (world - 1) / 2 {
        let (x, y) = tcp_pair();
        let (x2, y2) = (x.try_clone().expect("clone"), y.try_clone().expect("clone"));
        directions.push((x, y));
        directions.push((y2, x2));
    }
    directions
}

/// Counting source (node 0) → register of `bytes` with `slots` → sink (node 1).
fn transfer_plan(bytes: usize, slots: u32, pieces: u64) -> Plan {
    let mut b = PlanBuilder::new();
    let d0 = b.device(0, DeviceKind::Cpu, 0);
    let d1 = b.device(1, DeviceKind::Cpu, 0);
    let s0 = b.stream(d0, StreamKind::Compute);
    let s1 = b.stream(d1, StreamKind::Compute);
    let src = b.actor("src", s0, ActorKind::Source { pieces: SourcePieces::Count(pieces) });
    let x = b.regst("x", src, bytes as u64, slots);
    let sink = b.actor("sink", s1, ActorKind::Sink);
    b.consume(sink, x);
    b.build().expect("a valid plan")
}

/// Time per piece of `plan` on `world` nodes, whole run and steady (at sink `sink`).
fn time_plan(plan: &Plan, world: u16, sink: &str, pieces: u64) -> (Stats, Stats) {
    let (mut whole, mut steady_runs) = (Vec::new(), Vec::new());
    for _ in 0..REPS {
        let clock = Clock::default();
        let (p, clocks) = (plan.clone(), vec![(sink.to_string(), clock.clone())]);
        let time = on_nodes(world, move |cluster| run_node(&p, cluster, &clocks));
        whole.push(time / pieces as u32);
        steady_runs.push(steady(&clock));
    }
    (stats(whole), stats(steady_runs))
}

fn transfer() {
    println!("## transfer: one register from node 0 to node 1 over loopback TCP");
    println!("GB/s = bytes × pieces / time (whole: job start to end of wait; steady: first to last piece at the sink)");
    println!("best / median of {REPS} runs; ratio = regflow whole best / raw best\n");
    println!("| size | pieces | raw TCP GB/s | 2 slots GB/s | 2 slots steady | ratio 2 slots | 4 slots GB/s | 4 slots steady | ratio 4 slots |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for bytes in [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20] {
        let pieces = (TRANSFER_BYTES / bytes).max(MIN_PIECES);
        let raw = repeat(|| {
            let (a, b) = tcp_pair();
            raw_streams(vec![(a, b)], bytes, pieces) / pieces as u32
        });
        let rate = |t: Duration| gbps(bytes as f64, t);
        let mut row = format!("| {} | {pieces} | {:.2} / {:.2} ", human(bytes), rate(raw.best), rate(raw.median));
        for slots in [2, 4] {
            let plan = transfer_plan(bytes, slots, pieces as u64);
            let (whole, steady) = time_plan(&plan, 2, "sink", pieces as u64);
            row += &format!(
                "| {:.2} / {:.2} | {:.2} | {:.0} % ",
                rate(whole.best),
                rate(whole.median),
                rate(steady.best),
                100.0 * rate(whole.best) / rate(raw.best)
            );
        }
        println!("{row}|");
    }
    window();
}

/// Small pieces are bound by `register_num` / round trip, not by bandwidth: the same
/// 4 KiB transfer with more slots.
fn window() {
    let (bytes, pieces) = (4usize << 10, 16_384usize);
    println!(
        "\n4 KiB pieces ({pieces}) by slots: at most register_num pieces per round trip (steady GB/s, best / median)\n"
    );
    println!("| slots | GB/s | µs per piece |");
    println!("|---:|---:|---:|");
    for slots in [1, 2, 4, 8, 16, 32] {
        let (_, steady) = time_plan(&transfer_plan(bytes, slots, pieces as u64), 2, "sink", pieces as u64);
        let rate = |t: Duration| gbps(bytes as f64, t);
        println!("| {slots} | {:.2} / {:.2} | {:.1} |", rate(steady.best), rate(steady.median), micros(steady.best));
    }
}

/// Source (node 0) → copy (node 1) → sink (node 0), 8-byte registers of 1 slot.
fn hop_plan(pieces: u64) -> Plan {
    let mut b = PlanBuilder::new();
    let d0 = b.device(0, DeviceKind::Cpu, 0);
    let d1 = b.device(1, DeviceKind::Cpu, 0);
    let s0 = b.stream(d0, StreamKind::Compute);
    let s1 = b.stream(d1, StreamKind::Compute);
    let src = b.actor("src", s0, ActorKind::Source { pieces: SourcePieces::Count(pieces) });
    let x = b.regst("x", src, 8, 1);
    let copy = b.actor("copy", s1, ActorKind::Compute { kernel: KernelConf::Copy });
    b.consume(copy, x);
    let y = b.regst("y", copy, 8, 1);
    let sink = b.actor("sink", s0, ActorKind::Sink);
    b.consume(sink, y);
    b.build().expect("a valid plan")
}

/// Time per round trip of an 8-byte ping-pong between two threads.
fn raw_ping_pong(rounds: u64) -> Duration {
    let (mut a, mut b) = tcp_pair();
    let echo = std::thread::spawn(move || {
        let mut word = [0u8; 8];
        for _ in 0..rounds {
            b.read_exact(&mut word).expect("raw read");
            b.write_all(&word).expect("raw write");
        }
    });
    let mut word = [7u8; 8];
    let began = Instant::now();
    for _ in 0..rounds {
        a.write_all(&word).expect("raw write");
        a.read_exact(&mut word).expect("raw read");
    }
    let time = began.elapsed();
    echo.join().expect("the echo thread panicked");
    time / rounds as u32
}

fn hop() {
    println!("\n## hop: one 8-byte piece across nodes, registers of 1 slot");
    println!("a piece waits for the previous one's Ack: one round trip per piece, a hop is half of it");
    println!("best / median of {REPS} runs of {HOPS} pieces (raw: round trips)\n");
    println!("| | per round trip µs | hop µs | hop / raw hop |");
    println!("|---|---:|---:|---:|");
    let raw = repeat(|| raw_ping_pong(HOPS));
    let (whole, steady) = time_plan(&hop_plan(HOPS), 2, "sink", HOPS);
    let line = |name: &str, s: Stats| {
        println!(
            "| {name} | {:.1} / {:.1} | {:.1} / {:.1} | {:.2} |",
            micros(s.best),
            micros(s.median),
            micros(s.best) / 2.0,
            micros(s.median) / 2.0,
            micros(s.best) / micros(raw.best)
        );
    };
    line("raw TCP ping-pong", raw);
    line("regflow (whole run)", whole);
    line("regflow (steady)", steady);
}

/// Rank `r` on the cpu device of node `r`: counting source → all-reduce → sink.
fn all_reduce_plan(world: usize, bytes: usize, pieces: u64) -> Plan {
    let mut b = PlanBuilder::new();
    for r in 0..world {
        let conf = CollectiveConf {
            group: "g".into(),
            rank: r as u32,
            size: world as u32,
            op: CollectiveOp::AllReduce,
            dtype: DType::F32,
            shape: vec![bytes / 4],
        };
        let device = b.device(r as u16, DeviceKind::Cpu, 0);
        let compute = b.stream(device, StreamKind::Compute);
        let comm = b.stream(device, StreamKind::Comm);
        let src = b.actor(&format!("in{r}"), compute, ActorKind::Source { pieces: SourcePieces::Count(pieces) });
        let x = b.regst(&format!("x{r}"), src, bytes as u64, 2);
        let member = b.actor(&format!("c{r}"), comm, ActorKind::Compute { kernel: KernelConf::Collective(conf) });
        b.consume(member, x);
        let y = b.regst(&format!("y{r}"), member, bytes as u64, 2);
        let sink = b.actor(&format!("out{r}"), compute, ActorKind::Sink);
        b.consume(sink, y);
    }
    b.build().expect("a valid plan")
}

fn allreduce() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("\n## allreduce: f32 all-reduce across loopback nodes, one cpu device each (direct exchange; a ring on 3+ nodes from 256 KiB)");
    println!("bus GB/s = 2(n-1)/n × bytes / time per all-reduce; raw: the same exchange by hand, no reduction");
    println!(
        "whole: job start to end of wait; steady: first to last piece at node 0's sink; best / median of {REPS} runs"
    );
    println!("this machine has {cores} cores: 4 nodes (each a writer and a reader thread per peer, and its streams) oversubscribe it\n");
    println!("| nodes | size | pieces | raw bus GB/s | regflow bus GB/s | steady | ratio |");
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    for world in [2usize, 4] {
        for bytes in [1 << 20, 16 << 20, 64 << 20] {
            // Each piece moves (n-1) × bytes into every node.
            let pieces = ((2usize << 30) / (bytes * (world - 1) * world)).clamp(8, 256);
            let bus = |t: Duration| gbps(2.0 * (world - 1) as f64 / world as f64 * bytes as f64, t);
            let raw = repeat(|| raw_streams(all_pairs(world), bytes, pieces) / pieces as u32);
            let plan = all_reduce_plan(world, bytes, pieces as u64);
            let (whole, steady) = time_plan(&plan, world as u16, "out0", pieces as u64);
            println!(
                "| {world} | {} | {pieces} | {:.2} / {:.2} | {:.2} / {:.2} | {:.2} | {:.0} % |",
                human(bytes),
                bus(raw.best),
                bus(raw.median),
                bus(whole.best),
                bus(whole.median),
                bus(steady.best),
                100.0 * bus(whole.best) / bus(raw.best)
            );
        }
    }
}

/// The digits MLP of `train_parallel`, data parallel over `mesh`; returns the plan and the
/// loss's output name.
fn mlp_plan(mesh: &Mesh) -> (Plan, String) {
    use Sbp::{Broadcast as B, Split as S};
    let g = Graph::new();
    let x = g.input("x", [MLP_BATCH, 64], DType::F32).expect("x");
    let y = g.input("y", [MLP_BATCH], DType::I64).expect("y");
    let w1 = g.variable("w1", [64, 128], DType::F32, Init::Kaiming { seed: 1 }).expect("w1");
    let b1 = g.variable("b1", [128], DType::F32, Init::Zeros).expect("b1");
    let w2 = g.variable("w2", [128, 10], DType::F32, Init::Xavier { seed: 2 }).expect("w2");
    let b2 = g.variable("b2", [10], DType::F32, Init::Zeros).expect("b2");
    for t in [x, y] {
        g.set_layout(t, mesh, NdSbp(vec![S(0)])).expect("inputs split over dp");
    }
    for t in [w1, b1, w2, b2] {
        g.set_layout(t, mesh, NdSbp(vec![B])).expect("weights whole on each device");
    }
    let hidden = x.matmul(&w1).and_then(|h| h.add(&b1)).and_then(|h| h.relu()).expect("hidden layer");
    let loss = hidden.matmul(&w2).and_then(|l| l.add(&b2)).and_then(|l| l.sparse_cross_entropy(&y)).expect("the loss");
    let step = g.minimize(loss, &Optimizer::adamw(3e-3, 1e-4).with_clip_norm(1.0)).expect("the training step");
    let options = ParallelOptions::new(mesh.clone()).train(&step);
    let compiled = g.compile_parallel(&[step.loss], &step.updates, &options).expect("the plan compiles");
    (compiled.plan, compiled.fetches[0].clone())
}

fn batches() -> Arc<Vec<(HostArray, HostArray)>> {
    let mut rng = SplitMix64::new(5);
    let batches = (0..STEPS)
        .map(|_| {
            let x: Vec<f32> = (0..MLP_BATCH * 64).map(|_| rng.next_normal() as f32).collect();
            let y: Vec<i64> = (0..MLP_BATCH).map(|_| (rng.next_u64() % 10) as i64).collect();
            (HostArray::f32([MLP_BATCH, 64], x).expect("x"), HostArray::i64([MLP_BATCH], y).expect("y"))
        })
        .collect();
    Arc::new(batches)
}

/// Feeds every step (only this node's parts go anywhere); where the loss is delivered,
/// stamps `clock` at each step's loss.
fn train_node(mut job: Job, loss: &str, data: Arc<Vec<(HostArray, HostArray)>>, clock: &Clock) {
    let mut feeds = job.graph_feeds().expect("graph feeds");
    let fetcher = job.has_output(loss).then(|| job.fetcher(loss).expect("the loss"));
    let pusher = std::thread::spawn(move || {
        for (x, y) in data.iter() {
            feeds.push("x", x).expect("push x");
            feeds.push("y", y).expect("push y");
        }
        feeds.close().expect("close the feeds");
    });
    if let Some(fetcher) = fetcher {
        while let Some(piece) = fetcher.recv() {
            black_box(piece.bytes());
            let now = Instant::now();
            let mut c = clock.lock().expect("the clock is never poisoned");
            c.first.get_or_insert(now);
            c.last = Some(now);
            c.pieces += 1;
        }
    }
    pusher.join().expect("the feeding thread panicked");
    job.wait().expect("the job runs");
}

fn train() {
    println!("\n## train: digits-size MLP 64-128-10, batch {MLP_BATCH}, dp2, {STEPS} steps (synthetic inputs)");
    println!(
        "ms per step (whole: job start to end of wait; steady: first to last loss); best / median of {REPS} runs\n"
    );
    println!("| where | ms / step | steady ms / step | / one process |");
    println!("|---|---:|---:|---:|");
    let mesh = Mesh::cpu(&[2], &["dp"]).expect("a mesh");
    let data = batches();
    let (plan, loss) = mlp_plan(&mesh);
    let (mut whole, mut steady_runs) = (Vec::new(), Vec::new());
    for _ in 0..REPS {
        let clock = Clock::default();
        let began = Instant::now();
        let job = Job::builder(plan.clone()).build().expect("the job starts");
        train_node(job, &loss, data.clone(), &clock);
        whole.push(began.elapsed() / STEPS as u32);
        steady_runs.push(steady(&clock));
    }
    let one = (stats(whole), stats(steady_runs));
    let (plan, loss) = mlp_plan(&mesh.place_on_nodes(1).expect("one device per node"));
    let (mut whole, mut steady_runs) = (Vec::new(), Vec::new());
    for _ in 0..REPS {
        let clock = Clock::default();
        let (p, l, d, c) = (plan.clone(), loss.clone(), data.clone(), clock.clone());
        let time = on_nodes(2, move |cluster| {
            let job = Job::builder(p.clone()).cluster(cluster).watchdog(Duration::from_secs(60));
            train_node(job.build().expect("the job starts"), &l, d.clone(), &c);
        });
        whole.push(time / STEPS as u32);
        steady_runs.push(steady(&clock));
    }
    let nodes = (stats(whole), stats(steady_runs));
    let ms = |t: Duration| t.as_secs_f64() * 1e3;
    for (name, (w, s)) in [("one process, 2 devices", one), ("2 nodes over loopback TCP", nodes)] {
        println!(
            "| {name} | {:.3} / {:.3} | {:.3} / {:.3} | {:.2} |",
            ms(w.best),
            ms(w.median),
            ms(s.best),
            ms(s.median),
            ms(w.best) / ms(one.0.best)
        );
    }
}

fn processor() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = info.lines().find_map(|l| l.strip_prefix("model name")?.split_once(':').map(|(_, m)| m.trim()));
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!("{} ({cores} cores)", model.unwrap_or("unknown processor"))
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let wants = |name: &str| args.is_empty() || args.iter().any(|a| a == name);
    println!("# bench_nodes on {}", processor());
    let tail = if args.is_empty() { String::new() } else { format!(" -- {}", args.join(" ")) };
    println!("command: cargo run --release --example bench_nodes{tail}\n");
    let began = Instant::now();
    if wants("transfer") {
        transfer();
    }
    if wants("hop") {
        hop();
    }
    if wants("allreduce") {
        allreduce();
    }
    if wants("train") {
        train();
    }
    println!("\nwhole benchmark: {:.0} s", began.elapsed().as_secs_f64());
}
