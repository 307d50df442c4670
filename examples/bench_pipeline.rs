//! Benchmark: a 4-stage pipeline on `sim` devices with modeled forward and backward times.
//! Prints, for m micro-batches per step, the step time against the ideal
//! (m + p - 1)(t_f + t_b) of a pipeline with p stages, and the activation memory of stage 0
//! under the 1F1B register counts and under the GPipe option.
//!
//! ```text
//! cargo run --release --example bench_pipeline -- [--trace pipeline.json]
//! ```
//!
//! Each stage is one layer `tanh(x·w + b)` (the last adds the loss): its forward product
//! takes t_f = 1 ms, its two backward products t_b = 2 ms together; every other kernel,
//! and the copies between stages, is modeled as free. `--trace` writes the timeline of the
//! m = 8 run, where the 1F1B pattern shows (stage s runs p - s forwards, then alternates).

use regflow::graph::plan::{ActorKind, DeviceKind};
use regflow::graph::sbp::{Mesh, MeshDevice, NdSbp, Sbp};
use regflow::graph::{DType, Graph, HostArray, Init, Optimizer, ParallelOptions, PipelineSchedule, SplitMix64};
use regflow::prelude::Job;
use std::time::Instant;

const STAGES: usize = 4;
const WIDTH: usize = 64;
const ROWS: usize = 16;
const FORWARD_NS: u64 = 1_000_000;
const BACKWARD_NS: u64 = 2_000_000;

fn stage(s: usize) -> Mesh {
    Mesh::new(vec![MeshDevice { node: 0, kind: DeviceKind::Sim, index: s as u16 }], &[1], &["pp"])
        .unwrap_or_else(|e| unreachable!("{e}"))
}

/// Runs `steps` steps of m micro-batches; returns seconds per step (after one warm-up
/// step), stage 0's activation bytes per the plan, and the most micro-batches stage 0 held.
fn run(
    m: usize,
    schedule: PipelineSchedule,
    steps: usize,
    trace: Option<&str>,
) -> Result<(f64, u64, u32), Box<dyn std::error::Error>> {
    let g = Graph::new();
    let x = g.input("x", [ROWS, WIDTH], DType::F32)?;
    let y = g.input("y", [ROWS], DType::I64)?;
    g.set_layout(x, &stage(0), NdSbp(vec![Sbp::Broadcast]))?;
    g.set_layout(y, &stage(STAGES - 1), NdSbp(vec![Sbp::Broadcast]))?;
    let mut h = x;
    for s in 0..STAGES {
        let w = g.variable(&format!("w{s}"), [WIDTH, WIDTH], DType::F32, Init::Xavier { seed: s as u64 })?;
        let b = g.variable(&format!("b{s}"), [WIDTH], DType::F32, Init::Zeros)?;
        g.set_layout(w, &stage(s), NdSbp(vec![Sbp::Broadcast]))?;
        g.set_layout(b, &stage(s), NdSbp(vec![Sbp::Broadcast]))?;
        if s > 0 {
            h = h.to_placement(&stage(s))?;
        }
        h = h.matmul(&w)?.add(&b)?.tanh()?;
    }
    let loss = h.sparse_cross_entropy(&y)?;
    let train = g.minimize(loss, &Optimizer::sgd(0.01, 0.0, 0.0))?;
    let mut options = ParallelOptions::new(stage(0)).train(&train).micro_batches(&train, m as u32);
    options.schedule = schedule;
    let mut compiled = g.compile_parallel(&[train.loss], &train.updates, &options)?;
    // Forward products: the first STAGES matmul nodes in graph order; the rest are backward.
    let mut names: Vec<(usize, String)> = compiled
        .plan
        .actors
        .iter()
        .enumerate()
        .filter(|(_, a)| a.name.starts_with("matmul:") && matches!(a.kind, ActorKind::Compute { .. }))
        .map(|(i, a)| (i, a.name.clone()))
        .collect();
    names.sort_by_key(|(_, n)| n.trim_start_matches("matmul:").split('@').next().and_then(|k| k.parse::<usize>().ok()));
    for (seen, (i, _)) in names.into_iter().enumerate() {
        let nanos = if seen < STAGES { FORWARD_NS } else { BACKWARD_NS / 2 };
        compiled.plan.actors[i].sim_nanos = Some(nanos);
    }
    let activation_bytes = compiled.plan.memory()?.report().devices.first().map_or(0, |d| d.1);
    let mut builder = Job::builder(compiled.plan.clone());
    if let Some(path) = trace {
        builder = builder.trace(path);
    }
    let mut job = builder.build()?;
    let mut feeds = job.graph_feeds()?;
    let losses = job.fetcher(&compiled.fetches[0])?;
    let mut rng = SplitMix64::new(1);
    let xs = HostArray::f32([ROWS, WIDTH], (0..ROWS * WIDTH).map(|_| rng.next_normal() as f32).collect())?;
    let ys = HostArray::i64([ROWS], (0..ROWS).map(|i| (i % 3) as i64).collect())?;
    let pusher = std::thread::spawn(move || -> Result<(), regflow::prelude::RuntimeError> {
        for _ in 0..(steps + 1) * m {
            feeds.push("x", &xs)?;
            feeds.push("y", &ys)?;
        }
        feeds.close()
    });
    let mut start = Instant::now();
    for piece in 0..(steps + 1) * m {
        if piece == m {
            start = Instant::now();
        }
        losses.recv().ok_or("the job ended early")?;
    }
    let per_step = start.elapsed().as_secs_f64() / steps as f64;
    pusher.join().map_err(|_| "feeder panicked")??;
    drop(losses);
    let report = job.wait()?;
    let live = report
        .actors
        .iter()
        .filter(|a| a.name.starts_with("tanh:") && a.name.ends_with("@0"))
        .flat_map(|a| a.max_in_flight.iter().map(|(n, _)| *n))
        .max()
        .unwrap_or(0);
    Ok((per_step, activation_bytes, live))
}

fn main() -> Result<(), regflow::Report> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let trace = args.iter().position(|a| a == "--trace").and_then(|i| args.get(i + 1)).map(String::as_str);
    let t = (FORWARD_NS + BACKWARD_NS) as f64 * 1e-9;
    println!("p = {STAGES} stages on sim, t_f = 1 ms, t_b = 2 ms per stage and micro-batch");
    println!(
        "{:>4} {:>12} {:>12} {:>8} {:>14} {:>14} {:>10} {:>10}",
        "m", "step ms", "ideal ms", "ratio", "1F1B bytes", "GPipe bytes", "live 1F1B", "live GPipe"
    );
    for m in [4, 8, 16, 32] {
        let steps = if m >= 16 { 3 } else { 5 };
        let (step, bytes_1f1b, live_1f1b) =
            run(m, PipelineSchedule::OneForwardOneBackward, steps, if m == 8 { trace } else { None })?;
        let (_, bytes_gpipe, live_gpipe) = run(m, PipelineSchedule::GPipe, 2, None)?;
        let ideal = (m + STAGES - 1) as f64 * t;
        println!(
            "{m:>4} {:>12.2} {:>12.2} {:>8.3} {bytes_1f1b:>14} {bytes_gpipe:>14} {live_1f1b:>10} {live_gpipe:>10}",
            step * 1e3,
            ideal * 1e3,
            step / ideal
        );
    }
    if let Some(path) = trace {
        println!("timeline of the m = 8 run written to {path}");
    }
    Ok(())
}
