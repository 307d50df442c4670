//! Benchmarks of data parallelism.
//!
//! 1. `cpu`: one training step (forward, backward, AdamW) of the MLP 784-1024-1024-10,
//!    batch 256, f32, on one device vs data-parallel over two `cpu` devices (batch `S(0)`
//!    pinned, every other layout the compiler's choice: weights `B`, the AdamW state
//!    sharded in process where its rows split on 64 bytes, `ParallelOptions::
//!    shard_states_in_process`, the gathered weights held once; `dW1` computed by rows from
//!    an all-to-all of the first hidden activation and an all-gather of its output
//!    gradient), then the same with every AdamW state pinned `B` (a copy per device, each
//!    updating all of it) and pinned `S(0)`, one matmul thread per device: ms per step,
//!    samples/s, the cores busy (all threads' core time per step over the step) and the
//!    speed-up over one device. The four jobs are built at once and take turns, a block of
//!    steps each (one untimed, then four timed), in twelve rounds of one block per plan,
//!    in an order that changes from round to round: on a shared host whose speed moves by
//!    a third within seconds, only blocks run close together compare fairly, so each
//!    block's speed-up pairs it with the one-device block of its round, and the figure is
//!    the median of those paired ratios (with their quartiles).
//! 2. `sim`: a 16-layer MLP data-parallel over two `sim` devices with modeled kernel and
//!    link times: the step time against max(compute, comm) (perfect overlap) and against
//!    compute + comm (no overlap), where compute and comm are the modeled busy times of one
//!    device's compute and comm streams per step.
//!
//! ```text
//! cargo run --release --example bench_parallel -- [cpu|sim|all] [--trace dp_step.json]
//! ```
//!
//! `--trace` writes the sim part's timeline. Environment, for looking closer:
//! `REGFLOW_ONE_TRACE=t.json` writes the timeline of the cpu one-device run (all its blocks),
//! `REGFLOW_DP_TRACE=t.json` that of the cpu dp2 run,
//! `REGFLOW_REP_TRACE=t.json` and `REGFLOW_Z1_TRACE=t.json` those of the dp2 runs with the
//! AdamW state pinned `B` and `S(0)`,
//! `REGFLOW_ONLY=one|dp|rep|z1` times only that plan, 200 steps (for a profiler),
//! `REGFLOW_SHOW_COLLECTIVES=1` prints its collectives in issue order,
//! `REGFLOW_NO_REUSE=1` compiles it without memory reuse (to compare),
//! `REGFLOW_CPU_THREADS=n` gives every cpu device's kernels n threads (default 1),
//! `REGFLOW_INLINE_COLLECTIVES=1` runs both dp2 plans' collectives on the compute streams
//! and `=0` on comm streams of their own (`ParallelOptions::collective_streams`; unset: `Auto`,
//! the compute streams on a host of fewer than 4 cores),
//! `REGFLOW_NO_BUCKETS=1` without gradient buckets (one all-reduce per gradient), and
//! `REGFLOW_PLAN_JSON=p.json` writes the sim plan and `REGFLOW_DP_PLAN_JSON=p.json` the cpu
//! dp2 plan, `REGFLOW_REP_PLAN_JSON=p.json` and `REGFLOW_Z1_PLAN_JSON=p.json` those with
//! the AdamW state pinned `B` and `S(0)` (for `regflow plan show|dot`).

#[path = "common/cpu_time.rs"]
mod cpu_time;
use cpu_time::process_cpu_seconds;
use regflow::graph::plan::{ActorKind, KernelConf, StreamKind};
use regflow::graph::sbp::{Mesh, NdSbp, Sbp};
use regflow::graph::{
    CollectiveStreams, CompileOptions, CompiledGraph, DType, Graph, HostArray, Init, Optimizer, ParallelOptions,
    SplitMix64,
};
use regflow::prelude::{Fetcher, Job, RuntimeError};
use std::time::Instant;

/// Per step of a timed run: wall seconds, and CPU seconds of all the process's threads.
#[derive(Clone, Copy)]
struct StepTime {
    wall: f64,
    cpu: f64,
}

/// `REGFLOW_CPU_THREADS`: threads per cpu device's kernels for every plan (default 1).
fn cpu_threads() -> Result<usize, Box<dyn std::error::Error>> {
    match std::env::var("REGFLOW_CPU_THREADS") {
        Ok(text) => Ok(text.parse().map_err(|e| format!("REGFLOW_CPU_THREADS={text:?}: {e}"))?),
        Err(_) => Ok(1),
    }
}

/// A job of one compiled step, fed the same batch every step by a thread of its own and
/// timed a block of steps at a time, so that several jobs can take turns in one process.
/// The feeds are pushed from another thread than the one fetching the losses: a job takes
/// a step's feeds only as its registers free up, which may wait on the fetches.
struct SteppedJob {
    /// Taken only to find why the job ended early ([`SteppedJob::failure`]).
    job: Option<Job>,
    losses: Fetcher,
    /// How many steps' feeds to push next; dropped to close the feeds.
    blocks: Option<std::sync::mpsc::Sender<usize>>,
    /// Taken to join it: at the end, or to find why the job ended early.
    pusher: Option<std::thread::JoinHandle<Result<(), RuntimeError>>>,
}

impl SteppedJob {
    fn start(
        compiled: &CompiledGraph,
        feeds_of: &[(&str, HostArray)],
        trace: Option<&str>,
    ) -> Result<Self, Box<dyn std::error::Error>> {
        let mut builder = Job::builder(compiled.plan.clone()).cpu_threads(cpu_threads()?);
        if let Some(path) = trace {
            builder = builder.trace(path);
        }
        let mut job = builder.build()?;
        let mut feeds = job.graph_feeds()?;
        let losses = job.fetcher(&compiled.fetches[0])?;
        let values: Vec<(String, HostArray)> = feeds_of.iter().map(|(n, v)| (n.to_string(), v.clone())).collect();
        let (blocks, steps_to_push) = std::sync::mpsc::channel::<usize>();
        let pusher = std::thread::spawn(move || -> Result<(), RuntimeError> {
            for steps in steps_to_push {
                for _ in 0..steps {
                    for (name, value) in &values {
                        feeds.push(name, value)?;
                    }
                }
            }
            feeds.close()
        });
        Ok(Self { job: Some(job), losses, blocks: Some(blocks), pusher: Some(pusher) })
    }

    /// Runs `steps` steps; returns the time per step.
    fn run(&mut self, steps: usize) -> Result<StepTime, Box<dyn std::error::Error>> {
        let (start, cpu_start) = (Instant::now(), process_cpu_seconds());
        if self.blocks.as_ref().is_none_or(|blocks| blocks.send(steps).is_err()) {
            return Err(self.failure(0, steps));
        }
        for step in 0..steps {
            if self.losses.recv().is_none() {
                return Err(self.failure(step, steps));
            }
        }
        Ok(StepTime {
            wall: start.elapsed().as_secs_f64() / steps as f64,
            cpu: (process_cpu_seconds() - cpu_start) / steps as f64,
        })
    }

    /// Why the job ended `done` steps into a block of `steps`: the job's own error and the
    /// feeding thread's, whichever there are (a feed refused ends the job too).
    fn failure(&mut self, done: usize, steps: usize) -> Box<dyn std::error::Error> {
        // The feeding thread ends once its feeds close, or at a push the job refused.
        self.blocks = None;
        let job = match self.job.take() {
            Some(job) => job.wait().err().map_or_else(|| "the job ended cleanly".to_string(), |e| e.to_string()),
            None => "the job was already waited for".to_string(),
        };
        let feeder = match self.pusher.take().map(std::thread::JoinHandle::join) {
            Some(Ok(Ok(()))) => "the feeding thread pushed every feed".to_string(),
            Some(Ok(Err(e))) => format!("the feeding thread failed: {e}"),
            Some(Err(_)) => "the feeding thread panicked".to_string(),
            None => "the feeding thread was already joined".to_string(),
        };
        format!("the job ended after {done} of a block's {steps} steps: {job}; {feeder}").into()
    }

    /// Closes the feeds and waits for the job's end.
    fn finish(self) -> Result<(), Box<dyn std::error::Error>> {
        let Self { job, losses, blocks, pusher } = self;
        drop(blocks);
        if let Some(pusher) = pusher {
            pusher.join().map_err(|_| "feeder panicked")??;
        }
        drop(losses);
        if let Some(job) = job {
            job.wait()?;
        }
        Ok(())
    }
}

/// Runs `steps` after `warmup` steps of a compiled step fed with the same batch; returns
/// the time per step.
fn time_steps(
    compiled: &CompiledGraph,
    feeds_of: &[(&str, HostArray)],
    warmup: usize,
    steps: usize,
    trace: Option<&str>,
) -> Result<StepTime, Box<dyn std::error::Error>> {
    let mut job = SteppedJob::start(compiled, feeds_of, trace)?;
    job.run(warmup)?;
    let per_step = job.run(steps)?;
    job.finish()?;
    Ok(per_step)
}

/// The median of `values` and its lower and upper quartiles.
fn quartiles(values: &[f64]) -> (f64, f64, f64) {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.25), at(0.75))
}

/// An MLP with `sizes`; inputs `x`, `y`; returns the graph's step.
fn mlp<'g>(
    g: &'g Graph,
    batch: usize,
    sizes: &[usize],
) -> Result<regflow::graph::TrainStep<'g>, Box<dyn std::error::Error>> {
    let x = g.input("x", [batch, sizes[0]], DType::F32)?;
    let y = g.input("y", [batch], DType::I64)?;
    let mut h = x;
    for layer in 0..sizes.len() - 1 {
        let w = g.variable(
            &format!("w{layer}"),
            [sizes[layer], sizes[layer + 1]],
            DType::F32,
            Init::Kaiming { seed: layer as u64 },
        )?;
        let b = g.variable(&format!("b{layer}"), [sizes[layer + 1]], DType::F32, Init::Zeros)?;
        h = h.matmul(&w)?.add(&b)?;
        if layer + 2 < sizes.len() {
            h = h.relu()?;
        }
    }
    let loss = h.sparse_cross_entropy(&y)?;
    Ok(g.minimize(loss, &Optimizer::adamw(1e-3, 0.0))?)
}

fn batch(batch: usize, features: usize, classes: usize) -> Vec<(&'static str, HostArray)> {
    let mut rng = SplitMix64::new(0);
    let x: Vec<f32> = (0..batch * features).map(|_| rng.next_normal() as f32).collect();
    let y: Vec<i64> = (0..batch).map(|_| (rng.next_u64() % classes as u64) as i64).collect();
    vec![
        ("x", HostArray::f32([batch, features], x).unwrap_or_else(|_| unreachable!())),
        ("y", HostArray::i64([batch], y).unwrap_or_else(|_| unreachable!())),
    ]
}

fn data_parallel(g: &Graph, mesh: &Mesh) -> Result<(), Box<dyn std::error::Error>> {
    for name in ["x", "y"] {
        let t = g.by_name(name).ok_or("input")?;
        g.set_layout(t, mesh, NdSbp(vec![Sbp::Split(0)]))?;
    }
    Ok(())
}

fn cpu() -> Result<(), Box<dyn std::error::Error>> {
    const BATCH: usize = 256;
    const SIZES: [usize; 4] = [784, 1024, 1024, 10];
    // Blocks per plan, and timed steps per block (after one untimed step).
    const BLOCKS: usize = 12;
    const BLOCK_STEPS: usize = 4;
    let warmup = 3;
    let feeds = batch(BATCH, SIZES[0], 10);

    let g = Graph::new();
    let train = mlp(&g, BATCH, &SIZES)?;
    let one = g.compile(&[train.loss], &train.updates, &CompileOptions::default())?;

    let g = Graph::new();
    let train = mlp(&g, BATCH, &SIZES)?;
    let mesh = Mesh::cpu(&[2], &["dp"])?;
    data_parallel(&g, &mesh)?;
    let collective_streams = match std::env::var("REGFLOW_INLINE_COLLECTIVES").as_deref() {
        Ok("0") => CollectiveStreams::CommStreams,
        Ok(_) => CollectiveStreams::ComputeStreams,
        Err(_) => CollectiveStreams::Auto,
    };
    let mut dp_options = ParallelOptions::new(mesh).train(&train);
    dp_options.collective_streams = collective_streams;
    dp_options.reuse_memory = std::env::var_os("REGFLOW_NO_REUSE").is_none();
    if std::env::var_os("REGFLOW_NO_BUCKETS").is_some() {
        dp_options.bucket_bytes = 0;
    }
    let dp = g.compile_parallel(&[train.loss], &train.updates, &dp_options)?;
    if let Some(path) = std::env::var_os("REGFLOW_DP_PLAN_JSON") {
        std::fs::write(path, dp.plan.to_json())?;
    }
    if std::env::var_os("REGFLOW_SHOW_COLLECTIVES").is_some() {
        println!("collectives: {:?}", dp.parallel.as_ref().map(|p| &p.collectives));
    }

    // The same with every AdamW state pinned: `B` (a copy per device, each updating all of
    // it: what the compiler chose before it sharded state in process) and `S(0)` (ZeRO
    // stage 1, all states; the compiler's choice leaves `b2`'s 10 rows replicated).
    let pinned = |layout: Sbp| -> Result<CompiledGraph, Box<dyn std::error::Error>> {
        let g = Graph::new();
        let train = mlp(&g, BATCH, &SIZES)?;
        let mesh = Mesh::cpu(&[2], &["dp"])?;
        data_parallel(&g, &mesh)?;
        for (state, _) in &train.states {
            g.set_layout(*state, &mesh, NdSbp(vec![layout]))?;
        }
        let options = ParallelOptions { collective_streams, ..ParallelOptions::new(mesh) }.train(&train);
        Ok(g.compile_parallel(&[train.loss], &train.updates, &options)?)
    };
    let (replicated, zero1) = (pinned(Sbp::Broadcast)?, pinned(Sbp::Split(0))?);
    if let Some(path) = std::env::var_os("REGFLOW_REP_PLAN_JSON") {
        std::fs::write(path, replicated.plan.to_json())?;
    }
    if let Some(path) = std::env::var_os("REGFLOW_Z1_PLAN_JSON") {
        std::fs::write(path, zero1.plan.to_json())?;
    }

    // One plan alone, for a profiler whose samples should not mix the others.
    if let Ok(which) = std::env::var("REGFLOW_ONLY") {
        let compiled = match which.as_str() {
            "one" => &one,
            "dp" => &dp,
            "rep" => &replicated,
            "z1" => &zero1,
            other => return Err(format!("REGFLOW_ONLY={other:?}: expected one, dp, rep or z1").into()),
        };
        let t = time_steps(compiled, &feeds, warmup, 200, None)?;
        println!("{which}: {:.2} ms/step, {:.2} ms of core time", t.wall * 1e3, t.cpu * 1e3);
        return Ok(());
    }
    let traces: Vec<Option<String>> =
        ["REGFLOW_ONE_TRACE", "REGFLOW_DP_TRACE", "REGFLOW_REP_TRACE", "REGFLOW_Z1_TRACE"]
            .iter()
            .map(|v| std::env::var(v).ok())
            .collect();
    // The plans take turns in one process, a block of steps each: this host's speed moves
    // by a third within seconds (other tenants' load), so a speed-up is only fair between
    // blocks run back to back. Each block's first step is not timed: the plan before it
    // has just taken the caches.
    let plans = [&one, &dp, &replicated, &zero1];
    let mut jobs = Vec::with_capacity(plans.len());
    for (plan, trace) in plans.iter().zip(&traces) {
        let mut job = SteppedJob::start(plan, &feeds, trace.as_deref())?;
        job.run(warmup)?;
        jobs.push(job);
    }
    let mut times: Vec<Vec<StepTime>> = vec![Vec::with_capacity(BLOCKS); plans.len()];
    // The order changes from round to round (rotated by one, and reversed every other
    // round), so that no plan always runs in the same place and after the same plan: in a
    // fixed order (dp2 always right after one device), the compiler's dp2 plan and the one
    // with state pinned `S(0)`, which differ only in `b2`'s 10-float state, measured 5-10 %
    // apart in five invocations of six; in a changing order, 1-5 %.
    let count = jobs.len();
    for round in 0..BLOCKS {
        for k in 0..count {
            let place = if round % 2 == 0 { k } else { count - 1 - k };
            let p = (round + place) % count;
            jobs[p].run(1)?;
            times[p].push(jobs[p].run(BLOCK_STEPS)?);
        }
    }
    for job in jobs {
        job.finish()?;
    }
    println!(
        "cpu MLP 784-1024-1024-10, batch {BATCH}, one cpu thread per device: the four plans take turns, \
         {BLOCKS} blocks of {BLOCK_STEPS} timed steps each"
    );
    let names = ["one device", "dp2", "dp2, AdamW state pinned B", "dp2, AdamW state pinned S(0)"];
    let mut gains = Vec::new();
    for (p, (name, plan_times)) in names.iter().zip(&times).enumerate() {
        let walls: Vec<f64> = plan_times.iter().map(|t| t.wall * 1e3).collect();
        // Core time per step over the step: what two cores must hold for the gain (all
        // threads, the feeder's and the collectives' included).
        let busy: Vec<f64> = plan_times.iter().map(|t| t.cpu / t.wall).collect();
        let (wall, wall_low, wall_high) = quartiles(&walls);
        let mut line = format!(
            "  {name}: {wall:.1} ms/step ({:.0} samples/s; quartiles {wall_low:.1}-{wall_high:.1} ms), {:.2} cores busy",
            BATCH as f64 / wall * 1e3,
            quartiles(&busy).0
        );
        // Each dp2 block against the one-device block of its round.
        if p > 0 {
            let ratios: Vec<f64> = times[0].iter().zip(plan_times).map(|(one, t)| one.wall / t.wall).collect();
            let (gain, low, high) = quartiles(&ratios);
            line += &format!(", {gain:.2}x one device (per-block ratios' median; quartiles {low:.2}-{high:.2})");
            gains.push(gain);
        }
        println!("{line}");
    }
    println!(
        "cpu MLP dp2 speed-up over one device, median of {BLOCKS} paired blocks: {:.2}x (the compiler's layouts); \
         AdamW state pinned B {:.2}x, pinned S(0) {:.2}x",
        gains[0], gains[1], gains[2]
    );
    Ok(())
}

fn sim(trace: Option<&str>) -> Result<(), Box<dyn std::error::Error>> {
    const BATCH: usize = 32;
    const WIDTH: usize = 64;
    const LAYERS: usize = 16;
    // Modeled times: a matmul (forward or either gradient) takes 1 ms, any other kernel
    // 40 µs; a collective takes 100 µs plus 80 ns per byte of its tensor (a 64x64 f32
    // gradient: 1.4 ms, against the 2 ms of the layer's two backward products). Milliseconds keep the host's own costs (thread wake-ups of 10-20 µs,
    // the kernels' real arithmetic) small against the model.
    const MATMUL_NS: u64 = 1_000_000;
    const OTHER_NS: u64 = 40_000;
    const LINK_LATENCY_NS: u64 = 100_000;
    const LINK_NS_PER_BYTE: u64 = 80;
    let mut sizes = vec![WIDTH; LAYERS + 1];
    sizes[LAYERS] = 10;
    let g = Graph::new();
    let train = mlp(&g, BATCH, &sizes)?;
    let mesh = Mesh::of_kind(regflow::graph::plan::DeviceKind::Sim, &[2], &["dp"])?;
    data_parallel(&g, &mesh)?;
    // Per-tensor all-reduces: the sixteen 16 KiB gradients would otherwise be one bucket,
    // issued when the last of them is made; this part measures overlap.
    let options = ParallelOptions { bucket_bytes: 0, ..ParallelOptions::new(mesh) }.train(&train);
    let mut compiled = g.compile_parallel(&[train.loss], &train.updates, &options)?;
    let (mut compute, mut comm) = (0u64, 0u64);
    let plan = &mut compiled.plan;
    for a in 0..plan.actors.len() {
        let stream = plan.streams[plan.actors[a].stream.index()].clone();
        let nanos = match &plan.actors[a].kind {
            ActorKind::Compute { kernel: KernelConf::Collective(c) } => {
                LINK_LATENCY_NS + LINK_NS_PER_BYTE * c.shape.iter().product::<usize>() as u64 * c.dtype.size() as u64
            }
            ActorKind::Compute { .. } if plan.actors[a].name.starts_with("matmul") => MATMUL_NS,
            ActorKind::Compute { .. } => OTHER_NS,
            _ => continue,
        };
        plan.actors[a].sim_nanos = Some(nanos);
        if stream.device.index() == 0 {
            match stream.kind {
                StreamKind::Comm => comm += nanos,
                _ => compute += nanos,
            }
        }
    }
    if let Some(path) = std::env::var_os("REGFLOW_PLAN_JSON") {
        std::fs::write(path, compiled.plan.to_json())?;
    }
    let feeds = batch(BATCH, WIDTH, 10);
    let step = time_steps(&compiled, &feeds, 2, 10, trace)?;
    let (compute_s, comm_s) = (compute as f64 * 1e-9, comm as f64 * 1e-9);
    println!(
        "sim dp2, {LAYERS}-layer MLP: step {:.2} ms; modeled compute {:.2} ms, comm {:.2} ms per device; \
         step / max(compute, comm) = {:.3}; step / (compute + comm) = {:.3}",
        step.wall * 1e3,
        compute_s * 1e3,
        comm_s * 1e3,
        step.wall / compute_s.max(comm_s),
        step.wall / (compute_s + comm_s)
    );
    Ok(())
}

fn main() -> Result<(), regflow::Report> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let which = args.first().map(String::as_str).unwrap_or("all");
    let trace = args.iter().position(|a| a == "--trace").and_then(|i| args.get(i + 1)).map(String::as_str);
    if which == "cpu" || which == "all" {
        cpu()?;
    }
    if which == "sim" || which == "all" || which == "--trace" {
        sim(trace)?;
    }
    Ok(())
}
