//! Benchmarks of data parallelism.
//!
//! 1. `cpu`: one training step (forward, backward, AdamW) of the MLP 784-1024-1024-10,
//!    batch 256, f32, on one device vs data-parallel over two `cpu` devices (batch `S(0)`
//!    pinned, every other layout the compiler's choice: weights `B`, the AdamW state
//!    sharded in process where its rows split on 64 bytes, `ParallelOptions::
//!    shard_states_in_process`, the gathered weights held once; `dW1` computed by rows from
//!    an all-to-all of the first hidden activation and an all-gather of its output
//!    gradient), then the same with every AdamW state pinned `B` (a copy per device, each
//!    updating all of it) and pinned `S(0)`, one matmul thread per device: samples/s, the
//!    core time per step (all threads) and ratio, in three rounds that each time all four
//!    plans once, and the median per-round ratios.
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
//! `REGFLOW_ONE_TRACE=t.json` writes the timeline of the cpu one-device run (first round),
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
use regflow::prelude::{Job, RuntimeError};
use std::time::Instant;

/// Per step of a timed run: wall seconds, and CPU seconds of all the process's threads.
#[derive(Clone, Copy)]
struct StepTime {
    wall: f64,
    cpu: f64,
}

/// Runs `steps` after `warmup` steps of a compiled step fed with the same batch; returns
/// the time per step.
/// `REGFLOW_CPU_THREADS`: threads per cpu device's kernels for every plan (default 1).
fn cpu_threads() -> Result<usize, Box<dyn std::error::Error>> {
    match std::env::var("REGFLOW_CPU_THREADS") {
        Ok(text) => Ok(text.parse().map_err(|e| format!("REGFLOW_CPU_THREADS={text:?}: {e}"))?),
        Err(_) => Ok(1),
    }
}

fn time_steps(
    compiled: &CompiledGraph,
    feeds_of: &[(&str, HostArray)],
    warmup: usize,
    steps: usize,
    trace: Option<&str>,
) -> Result<StepTime, Box<dyn std::error::Error>> {
    let mut builder = Job::builder(compiled.plan.clone()).cpu_threads(cpu_threads()?);
    if let Some(path) = trace {
        builder = builder.trace(path);
    }
    let mut job = builder.build()?;
    let mut feeds = job.graph_feeds()?;
    let losses = job.fetcher(&compiled.fetches[0])?;
    let values: Vec<(String, HostArray)> = feeds_of.iter().map(|(n, v)| (n.to_string(), v.clone())).collect();
    let pusher = std::thread::spawn(move || -> Result<(), RuntimeError> {
        for _ in 0..warmup + steps {
            for (name, value) in &values {
                feeds.push(name, value)?;
            }
        }
        feeds.close()
    });
    let (mut start, mut cpu_start) = (Instant::now(), process_cpu_seconds());
    for step in 0..warmup + steps {
        if step == warmup {
            (start, cpu_start) = (Instant::now(), process_cpu_seconds());
        }
        losses.recv().ok_or("the job ended early")?;
    }
    let per_step = StepTime {
        wall: start.elapsed().as_secs_f64() / steps as f64,
        cpu: (process_cpu_seconds() - cpu_start) / steps as f64,
    };
    pusher.join().map_err(|_| "feeder panicked")??;
    drop(losses);
    job.wait()?;
    Ok(per_step)
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
    // Rounds, each timing the three plans once: this host's clock drifts between minutes,
    // so a speed-up is only fair between runs of the same round.
    const ROUNDS: usize = 3;
    let (warmup, steps) = (3, 20);
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
    let plans = [&one, &dp, &replicated, &zero1];
    let mut gains = vec![Vec::new(); 3];
    for round in 0..ROUNDS {
        let mut times = Vec::new();
        for (plan, trace) in plans.iter().zip(&traces) {
            let trace = if round == 0 { trace.as_deref() } else { None };
            times.push(time_steps(plan, &feeds, warmup, steps, trace)?);
        }
        for (gain, t) in gains.iter_mut().zip(&times[1..]) {
            gain.push(times[0].wall / t.wall);
        }
        // Core time per step: what two cores must hold for the gain (all threads, the
        // feeder's and the collectives' included).
        let describe = |t: StepTime| {
            format!(
                "{:.1} ms/step ({:.0} samples/s; {:.1} ms of core time, {:.2} cores busy), {:.2}x",
                t.wall * 1e3,
                BATCH as f64 / t.wall,
                t.cpu * 1e3,
                t.cpu / t.wall,
                times[0].wall / t.wall
            )
        };
        println!(
            "round {}: cpu MLP 784-1024-1024-10, batch {BATCH}: one device {}; dp2 {}; \
             dp2, AdamW state pinned B {}; pinned S(0) {}",
            round + 1,
            describe(times[0]),
            describe(times[1]),
            describe(times[2]),
            describe(times[3]),
        );
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "cpu MLP dp2 speed-up over one device, median of {ROUNDS} rounds: {:.2}x (the compiler's layouts); \
         AdamW state pinned B {:.2}x, pinned S(0) {:.2}x",
        median(gains[0].clone()),
        median(gains[1].clone()),
        median(gains[2].clone())
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
