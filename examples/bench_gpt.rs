//! Benchmark: one training step (forward, backward, AdamW update) of the character GPT of
//! `train_char_gpt` (2 pre-LayerNorm blocks, d_model 64, 4 heads, context 64, batch 16,
//! vocabulary 65, tied embedding), compiled to a plan and run by the actor runtime on
//! random token batches. Prints milliseconds per step; `benches/peers/gpt.sh` runs it
//! beside JAX and PyTorch (`benches/peers/gpt_peers.py`).
//!
//! ```text
//! cargo run --release --example bench_gpt -- [steps] [threads] [trace.json] [--fused-attention]
//!     [--unfolded-norm-grads] [--unfolded-norm-inputs] [--apart-qkv]
//! ```
//!
//! A third argument records a Chrome-trace timeline of the run to that file.
//! `--fused-attention` runs each block's attention as one `attention` op (the tiled CPU
//! kernel, `kernels/src/cpu/attention`) instead of the products around a masked softmax,
//! over one packed Q/K/V projection (`attention_packed`), or over three with `--apart-qkv`.
//! `--unfolded-norm-grads` compiles with `fold_norm_grads` off: each block's residual
//! gradients summed by `add`s of their own instead of by the layer norm gradients;
//! `--unfolded-norm-inputs` with `fold_norm_inputs` off (the residual adds before the
//! norms as `add`s of their own).

#[path = "common/gpt.rs"]
mod gpt;
#[path = "common/step_timer.rs"]
mod step_timer;

use gpt::{Gpt, GptConfig};
use regflow::graph::{CompileOptions, DType, Graph, Optimizer};
use regflow::prelude::Job;

const BATCH: usize = 16;
const VOCAB: usize = 65;

fn main() -> Result<(), regflow::Report> {
    let fused = std::env::args().any(|a| a == "--fused-attention");
    let positional: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let steps: usize = positional.first().map(|s| s.parse()).transpose()?.unwrap_or(50);
    let threads: usize = positional.get(1).map(|s| s.parse()).transpose()?.unwrap_or(1);
    let trace = positional.get(2);
    let warmup = 5;
    let apart_qkv = std::env::args().any(|a| a == "--apart-qkv");
    if apart_qkv && !fused {
        return Err("--apart-qkv times the fused op over three projections: it needs --fused-attention".into());
    }
    let config = GptConfig { fused_attention: fused, apart_qkv, ..GptConfig::CHAR };
    let t = config.context;
    let g = Graph::new();
    let model = Gpt::new(&g, config, VOCAB)?;
    let mask = g.causal_mask(t, DType::F32)?;
    let ids = g.input("ids", [BATCH, t], DType::I64)?;
    let targets = g.input("targets", [BATCH * t], DType::I64)?;
    let loss = model.loss(&model.logits(&ids, &mask)?, &targets)?;
    // train_char_gpt's optimizer without its schedule (a schedule costs one scalar op).
    let train = g.minimize(loss, &Optimizer::adamw(6e-3, 0.01).with_clip_norm(1.0))?;
    let fold_norm_grads = !std::env::args().any(|a| a == "--unfolded-norm-grads");
    let fold_norm_inputs = !std::env::args().any(|a| a == "--unfolded-norm-inputs");
    let options = CompileOptions { fold_norm_grads, fold_norm_inputs, ..CompileOptions::default() };
    let compiled = g.compile(&[train.loss], &train.updates, &options)?;
    let mut builder = Job::builder(compiled.plan.clone()).cpu_threads(threads);
    if let Some(path) = &trace {
        builder = builder.trace(path);
    }
    let mut job = builder.build()?;
    let (per_step, last) =
        step_timer::time_gpt_steps(&mut job, &compiled.fetches[0], (BATCH, t, VOCAB), warmup, steps, false)?;
    job.wait()?;
    println!(
        "regflow{}: {steps} steps, {threads} thread(s), {:.2} ms/step ({} actors, last loss {last:.4}, matmul backend {})",
        if fused { " fused attention" } else { "" },
        per_step * 1e3,
        compiled.plan.actors.len(),
        regflow::kernels::cpu::gemm_backend::backend_in_use()?
    );
    Ok(())
}
