//! Benchmark: a GPT-2 124M training step (12 layers, d_model 768, 12 heads, context 1024,
//! vocabulary 50257, tied embedding, AdamW) on one device, in tokens per second and
//! model-flops utilisation. `benches/gpu/run.sh` runs it on a GPU beside PyTorch eager and
//! `torch.compile` (`benches/peers/gpt2_torch.py`), in one run.
//!
//! ```text
//! cargo run --release --features cuda --example bench_gpu_gpt2 -- [--device cuda|cpu]
//!     [--size gpt2|tiny] [--precision f32|bf16|f16] [--batch 8] [--steps 20] [--warmup 3]
//!     [--peak-tflops 989] [--trace PATH] [--layers N] [--attention composed|fused]
//!     [--plan-only] [--dry-run] [--lone-casts] [--unfolded-casts] [--unfolded-table-grads]
//!     [--unfolded-norm-grads] [--unfolded-norm-inputs] [--apart-qkv] [--pad-vocab 64]
//! ```
//!
//! `--pad-vocab 64` pads the logits' columns to a multiple of 64 (50257 to 50304, as
//! nanoGPT and llm.c pad GPT-2's vocabulary): the output projection reads the token table
//! with zero rows appended, and the loss is taken over the real 50257 columns
//! (`sparse_cross_entropy_of_first`), so the model and its losses are the unpadded ones
//! while its three largest products run on aligned tensor-core kernels without staging.
//!
//! `--lone-casts` compiles with `fuse_casts` off (each weight and gradient cast its own
//! actor and launch, as before casts were fused), to time the difference in one run.
//! `--unfolded-casts` compiles with `fold_casts` off: the casts of the layer norms'
//! outputs to bf16 (or f16), of their gradients' `dy` back to f32, of the blocks' outputs
//! to f32 for the residual adds and of the residual gradients' sums to bf16 run as lone
//! casts instead of inside those ops. `--unfolded-table-grads` compiles with
//! `fold_table_grads` off: the tied token table's two gradients (the embedding's scatter
//! and the output projection's weight gradient, through the padded vocabulary's slice and
//! mixed precision's cast) are summed by an `add` of their own instead of by the scatter.
//! `--unfolded-norm-grads` compiles with `fold_norm_grads` off: each block's residual
//! gradient (the gradient from above plus its layer norm gradient's `dx`, and the sum's
//! bf16 copy) is summed by an `add` of its own instead of by the layer norm gradient.
//! `--unfolded-norm-inputs` compiles with `fold_norm_inputs` off: each residual add whose
//! sum a layer norm reads runs as an `add` of its own instead of inside the norm.
//!
//! `--attention fused` runs each block's attention as one `attention` op (flash attention
//! on CUDA: tensor cores in bf16 and f16, the `[T, T]` scores never stored) over one packed
//! Q/K/V projection (`attention_packed`: one product, one bias add, one bias gradient, and
//! no sum of three input gradients); `--apart-qkv` keeps three projections and the op over
//! them apart, for timing the packing against it. The default,
//! `composed`, is the two strided products around a masked softmax that PyTorch's eager
//! model in `benches/peers/gpt2_torch.py` also runs (`--attention sdpa` there is
//! `F.scaled_dot_product_attention`, the fused peer).
//!
//! `--dry-run` (no GPU, NVRTC on `LD_LIBRARY_PATH`) builds the job on dry-run `cuda`
//! devices: kernels are compiled and made and every launch is checked, but nothing is
//! computed, so its times are the host's part of a GPU run: the job's build (NVRTC, the
//! initial values, the kernels) and the actors' firings per step. The driver's own launch
//! calls are not issued, so a real step's host side is that plus theirs. Its losses mean
//! nothing and are not printed.
//!
//! `--plan-only` compiles the step and prints its memory per device, its count of actors
//! and casts and every op's count (what a fold or `--apart-qkv` changes), running nothing (no GPU needed: the plan's layout is the memory a GPU
//! run allocates).
//!
//! `--layers N` keeps the size's widths with N layers (to bisect a problem by depth). Each
//! step's loss is reported on stderr as it arrives. `--trace PATH` writes the job's
//! timeline; on `cuda` that runs every kernel alone and times it (a per-op profile, see
//! `runtime/src/device/cuda.rs`), so a traced run's step time is not the benchmark's.
//!
//! `--precision bf16` compiles the graph with `Graph::mixed_precision(Precision::Bf16)`:
//! products in bf16 with f32 accumulation, f32 master weights and optimizer state.
//! `--precision f16` does the same in f16, with dynamic loss scaling (the scaler's
//! scalars run on the device).
//!
//! `--size tiny` (2 layers, d_model 64, context 64) runs the same program on a CPU in
//! seconds, which is how CI keeps it working where no GPU is lent. Model flops per token
//! are 6·N (N parameters) plus 12·L·T·d for attention (the PaLM appendix count); MFU divides
//! the achieved flops by `--peak-tflops` (989: an H100 SXM's dense bf16 peak).

#[path = "common/gpt.rs"]
mod gpt;
#[path = "common/step_timer.rs"]
mod step_timer;

use gpt::{Gpt, GptConfig};
use regflow::graph::{CompileOptions, DType, Graph, Optimizer, Precision};
use regflow::prelude::{DeviceKind, Job};

const GPT2: GptConfig = GptConfig {
    d_model: 768,
    heads: 12,
    layers: 12,
    context: 1024,
    mlp_width: 3072,
    fused_attention: false,
    apart_qkv: false,
};

/// The value after `--name`, parsed, or `default`.
fn arg<T: std::str::FromStr>(name: &str, default: T) -> Result<T, String> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => {
            let value = args.get(i + 1).ok_or_else(|| format!("{name} needs a value"))?;
            value.parse().map_err(|_| format!("{name}: cannot read '{value}'"))
        }
    }
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let dry = std::env::args().any(|a| a == "--dry-run");
    if dry {
        // Where NVRTC is but no GPU: every kernel is compiled and made, every launch
        // checked, nothing computed. What a step then costs is the host's side of it.
        regflow::cuda::enable_dry_run("compute_90")?;
    }
    let device = match arg("--device", "cuda".to_string())?.as_str() {
        "cuda" => DeviceKind::Cuda,
        "cpu" => DeviceKind::Cpu,
        other => return Err(format!("--device {other}: expected cuda or cpu").into()),
    };
    let (mut config, vocab) = match arg("--size", "gpt2".to_string())?.as_str() {
        "gpt2" => (GPT2, 50_257),
        "tiny" => (GptConfig::CHAR, 65),
        other => return Err(format!("--size {other}: expected gpt2 or tiny").into()),
    };
    let precision = match arg("--precision", "f32".to_string())?.as_str() {
        "f32" => None,
        "bf16" => Some(Precision::Bf16),
        "f16" => Some(Precision::F16),
        other => return Err(format!("--precision {other}: expected f32, bf16 or f16").into()),
    };
    config.layers = arg("--layers", config.layers)?;
    config.fused_attention = match arg("--attention", "composed".to_string())?.as_str() {
        "composed" => false,
        "fused" => true,
        other => return Err(format!("--attention {other}: expected composed or fused").into()),
    };
    config.apart_qkv = std::env::args().any(|a| a == "--apart-qkv");
    if config.apart_qkv && !config.fused_attention {
        return Err("--apart-qkv times the fused op over three projections: it needs --attention fused".into());
    }
    let batch: usize = arg("--batch", 8)?;
    let steps: usize = arg("--steps", 20)?;
    let warmup: usize = arg("--warmup", 3)?;
    let trace: String = arg("--trace", String::new())?;
    let peak_tflops: f64 = arg("--peak-tflops", 989.0)?;
    if batch == 0 || steps == 0 || config.layers == 0 || peak_tflops.is_nan() || peak_tflops <= 0.0 {
        return Err("--batch, --steps and --layers must be at least 1 and --peak-tflops positive".into());
    }
    let t = config.context;
    let g = Graph::new();
    if let Some(precision) = precision {
        g.mixed_precision(precision)?;
    }
    let pad_vocab: usize = arg("--pad-vocab", 1)?;
    if pad_vocab == 0 {
        return Err("--pad-vocab must be at least 1 (1: no padding)".into());
    }
    let model = Gpt::new(&g, config, vocab)?.pad_vocab(pad_vocab);
    let mask = g.causal_mask(t, DType::F32)?;
    let ids = g.input("ids", [batch, t], DType::I64)?;
    let targets = g.input("targets", [batch * t], DType::I64)?;
    let loss = model.loss(&model.logits(&ids, &mask)?, &targets)?;
    let train = g.minimize(loss, &Optimizer::adamw(6e-4, 0.1).with_clip_norm(1.0))?;
    let parameters: usize = g.trainable_variables().iter().map(|v| v.shape().numel()).sum();
    let fuse_casts = !std::env::args().any(|a| a == "--lone-casts");
    let fold_casts = !std::env::args().any(|a| a == "--unfolded-casts");
    let fold_table_grads = !std::env::args().any(|a| a == "--unfolded-table-grads");
    let fold_norm_grads = !std::env::args().any(|a| a == "--unfolded-norm-grads");
    let fold_norm_inputs = !std::env::args().any(|a| a == "--unfolded-norm-inputs");
    let options = CompileOptions {
        device,
        fuse_casts,
        fold_casts,
        fold_table_grads,
        fold_norm_grads,
        fold_norm_inputs,
        ..Default::default()
    };
    let compiled = g.compile(&[train.loss], &train.updates, &options)?;
    if std::env::args().any(|a| a == "--plan-only") {
        // What the step needs per device, without a device: the plan's memory layout.
        for device in compiled.plan.memory()?.devices {
            let (total, shared) = (device.total_bytes(), device.shared_bytes);
            let gb = |b: u64| b as f64 / 1e9;
            println!(
                "plan memory {}: {:.2} GB ({:.2} GB shared by registers of disjoint lifetimes, {:.2} GB without sharing)",
                device.label,
                gb(total),
                gb(shared),
                gb(device.unshared_bytes)
            );
        }
        let runs = |op_type: &str| {
            let op = |a: &&regflow::plan::ActorDesc| match &a.kind {
                regflow::plan::ActorKind::Compute { kernel: regflow::plan::KernelConf::Op(conf) } => {
                    conf.op_type == op_type
                }
                _ => false,
            };
            compiled.plan.actors.iter().filter(op).count()
        };
        println!(
            "plan actors: {}, of which {} cast and {} cast_group",
            compiled.plan.actors.len(),
            runs("cast"),
            runs("cast_group")
        );
        // Every op's count, most first: what a fold takes away shows here.
        let mut by_op = std::collections::BTreeMap::<&str, usize>::new();
        for actor in &compiled.plan.actors {
            if let regflow::plan::ActorKind::Compute { kernel: regflow::plan::KernelConf::Op(conf) } = &actor.kind {
                *by_op.entry(conf.op_type.as_str()).or_default() += 1;
            }
        }
        let mut by_op: Vec<_> = by_op.into_iter().collect();
        by_op.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        let listed: Vec<String> = by_op.iter().map(|(op, n)| format!("{op} {n}")).collect();
        println!("plan ops: {}", listed.join(", "));
        if let Ok(p) = std::env::var("TMP_PLAN") {
            std::fs::write(p, compiled.plan.to_json())?;
        }
        return Ok(());
    }
    let mut builder = Job::builder(compiled.plan.clone());
    if !trace.is_empty() {
        builder = builder.trace(&trace);
    }
    let built = std::time::Instant::now();
    let mut job = builder.build()?;
    eprintln!("  job built in {:.1} s", built.elapsed().as_secs_f64());
    for ((device, registers), (_, kernels)) in job.memory_report().devices.iter().zip(&job.kernel_memory().devices) {
        eprintln!(
            "  {device}: {:.2} GB of registers, {:.1} MB of kernel scratch (one per stream)",
            *registers as f64 / 1e9,
            *kernels as f64 / 1e6
        );
    }
    if !job.host_kernels().is_empty() {
        // Ops without a device kernel for their dtype: right, but slow on large tensors.
        eprintln!("  ops run on the host: {}", job.host_kernels().join(", "));
    }
    let (per_step, last) =
        step_timer::time_gpt_steps(&mut job, &compiled.fetches[0], (batch, t, vocab), warmup, steps, true)?;
    job.wait()?;
    if dry {
        // Nothing was computed: neither tokens per second nor MFU mean anything.
        println!("regflow dry run on cuda: the host's side of a step {:.2} ms (kernels made, launches checked but not issued, \
             nothing computed)", per_step * 1e3);
        return Ok(());
    }
    let tokens = (batch * t) as f64 / per_step;
    let flops_per_token = 6.0 * parameters as f64 + 12.0 * (config.layers * t * config.d_model) as f64;
    let mfu = tokens * flops_per_token / (peak_tflops * 1e12);
    println!(
        "regflow {} {}{}{} on {}: {} layers, {parameters} parameters, batch {batch}x{t}, {:.1} ms/step, {tokens:.0} \
         tokens/s, MFU {:.1}% of {peak_tflops} TFLOP/s (last loss {last:.4})",
        if vocab == 50_257 { "gpt2-124M" } else { "tiny gpt" },
        match precision {
            Some(Precision::Bf16) => "bf16",
            Some(Precision::F16) => "f16",
            _ => "f32",
        },
        if config.fused_attention { " fused attention" } else { "" },
        if pad_vocab > 1 { format!(", vocabulary padded to a multiple of {pad_vocab}") } else { String::new() },
        device.name(),
        config.layers,
        per_step * 1e3,
        mfu * 100.0
    );
    Ok(())
}
