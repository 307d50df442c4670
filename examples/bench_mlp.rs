//! Benchmark: one training step (forward, backward, AdamW update) of an MLP
//! 784-1024-1024-10, batch 256, f32, compiled to a plan and run by the actor runtime.
//! Prints samples per second; `benches/peers/run.sh` runs it beside JAX and PyTorch.
//!
//! ```text
//! cargo run --release --example bench_mlp -- [steps] [threads] [trace.json]
//! REGFLOW_MICRO_BATCHES=4 cargo run --release --example bench_mlp   # 4 micro-batches of 64
//! ```
//!
//! A third argument records a Chrome-trace timeline of the run to that file.
//! `REGFLOW_MICRO_BATCHES=m` (a divisor of 256) feeds each step as `m` micro-batches of
//! `256 / m` rows and accumulates their gradients (`TrainStep::accumulate`): the same
//! samples per step, in smaller products, each weight handed to every micro-batch by a
//! repeat (and packed once per step by the CPU kernel).

#[path = "common/step_timer.rs"]
mod step_timer;

use regflow::graph::{CompileOptions, DType, Graph, Init, Optimizer, SplitMix64};
use regflow::prelude::{Job, RuntimeError};

const BATCH: usize = 256;
const SIZES: [usize; 4] = [784, 1024, 1024, 10];

fn main() -> Result<(), regflow::Report> {
    let steps: usize = std::env::args().nth(1).map(|s| s.parse()).transpose()?.unwrap_or(30);
    let threads: usize = std::env::args().nth(2).map(|s| s.parse()).transpose()?.unwrap_or(1);
    let micro: usize = match std::env::var("REGFLOW_MICRO_BATCHES") {
        Ok(m) => m.parse().map_err(|e| format!("REGFLOW_MICRO_BATCHES={m:?}: {e}"))?,
        Err(_) => 1,
    };
    if micro == 0 || !BATCH.is_multiple_of(micro) {
        return Err(format!("REGFLOW_MICRO_BATCHES={micro}: must divide the batch of {BATCH}").into());
    }
    let rows = BATCH / micro;
    let warmup = 3;
    let g = Graph::new();
    let x = g.input("x", [rows, SIZES[0]], DType::F32)?;
    let y = g.input("y", [rows], DType::I64)?;
    let mut h = x;
    for layer in 0..3 {
        let w = g.variable(
            &format!("w{layer}"),
            [SIZES[layer], SIZES[layer + 1]],
            DType::F32,
            Init::Kaiming { seed: layer as u64 },
        )?;
        let b = g.variable(&format!("b{layer}"), [SIZES[layer + 1]], DType::F32, Init::Zeros)?;
        h = h.matmul(&w)?.add(&b)?;
        if layer < 2 {
            h = h.relu()?;
        }
    }
    let loss = h.sparse_cross_entropy(&y)?;
    let train = g.minimize(loss, &Optimizer::adamw(1e-3, 0.0))?;
    let options =
        CompileOptions { accumulate: (micro > 1).then(|| train.accumulate(micro as u32)), ..Default::default() };
    let compiled = g.compile(&[train.loss], &train.updates, &options)?;
    // The plan's bytes, and what they would be with two buffers per variable and moment
    // (updates not in place), for BENCHMARKS.md.
    let bytes = compiled.plan.memory()?.report().total_bytes();
    let mut two_buffers = compiled.plan.clone();
    two_buffers.regst_descs.iter_mut().for_each(|d| d.aliased_slots = false);
    let two_buffer_bytes = two_buffers.memory()?.report().total_bytes();
    let mut builder = Job::builder(compiled.plan.clone()).cpu_threads(threads);
    if let Some(path) = std::env::args().nth(3) {
        builder = builder.trace(path);
    }
    let mut job = builder.build()?;
    let (mut fx, mut fy) = (job.feeder("input:x")?, job.feeder("input:y")?);
    let losses = job.fetcher(&compiled.fetches[0])?;

    let mut rng = SplitMix64::new(0);
    let xs: Vec<u8> = (0..rows * SIZES[0]).flat_map(|_| (rng.next_normal() as f32).to_le_bytes()).collect();
    let ys: Vec<u8> = (0..rows).flat_map(|_| ((rng.next_u64() % 10) as i64).to_le_bytes()).collect();
    let pusher = std::thread::spawn(move || -> Result<(), RuntimeError> {
        for _ in 0..(warmup + steps) * micro {
            fx.push(&xs)?;
            fy.push(&ys)?;
        }
        Ok(())
    });
    // One loss per micro-batch: time pieces, then scale to steps.
    let (per_piece, last) = step_timer::seconds_per_step(&losses, warmup * micro, steps * micro, false)?;
    let per_step = per_piece * micro as f64;
    pusher.join().map_err(|_| "feeder panicked")??;
    drop(losses);
    let held = job.wait()?.held_by_kernels();
    println!(
        "regflow: {steps} steps of {micro} micro-batch(es) of {rows}, {threads} thread(s), {:.2} ms/step, {:.0} samples/s (last loss {last:.4}, matmul backend {}, plan {:.1} MB; {:.1} MB without in-place updates; kernels kept {:.1} MB more)",
        per_step * 1e3,
        BATCH as f64 / per_step,
        regflow::kernels::cpu::gemm_backend::backend_in_use()?,
        bytes as f64 / 1e6,
        two_buffer_bytes as f64 / 1e6,
        held as f64 / 1e6
    );
    Ok(())
}
