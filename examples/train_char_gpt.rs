//! Trains a tiny character-level GPT (2 pre-LayerNorm blocks, d_model 64, 4 heads, causal
//! self-attention, context 64, batch 16) on `data/tiny_text.txt` with the graph DSL,
//! autodiff and AdamW (warm-up + cosine), prints the training loss curve, the held-out loss
//! and a seeded sample continuing a prompt.
//!
//! ```text
//! cargo run --release --example train_char_gpt -- [steps] [--precision f32|bf16|f16] [--loss-scale S]
//! ```
//!
//! `steps` defaults to 400. `--precision bf16` or `f16` trains in mixed precision
//! (products and activations in the 16-bit type, master weights and AdamW's state in f32);
//! under f16 the loss is scaled dynamically, and the run ends by printing the final scale
//! and how many steps the scaler skipped. `--loss-scale S` fixes the scale at `S` instead
//! (`--loss-scale 1`: none, to see what f16 loses without it). Training is compiled to a plan and run by the actor runtime;
//! the trained weights are then loaded into the host reference [`Session`] for the
//! held-out loss and for sampling (one forward pass per generated character).
//!
//! The model: learned token and position embeddings; per block `x + attn(ln1(x))` then
//! `x + mlp(ln2(x))`, where attention has separate Q/K/V projections, scaled dot-product
//! scores plus a causal mask (`Graph::causal_mask`: `[T, T]` of 0 / -1e9, made on the
//! device each step, broadcast over batch and heads), a softmax and an output projection, and the MLP is
//! `gelu(x·w1 + b1)·w2 + b2` with a 4× hidden width; a final LayerNorm, then logits from
//! the *tied* token embedding (`h · wteᵀ`); the loss is the mean cross-entropy of the next
//! character at every position.

#[path = "common/gpt.rs"]
mod gpt;

use gpt::{Gpt, GptConfig};
use regflow::graph::{
    CompileOptions, DType, Graph, HostArray, LossScale, Optimizer, Precision, Schedule, Session, SplitMix64,
};
use regflow::prelude::Trainer;
use regflow::train::BoxError;
use std::time::Instant;

const D_MODEL: usize = 64;
const HEADS: usize = 4;
const LAYERS: usize = 2;
const CONTEXT: usize = 64;
const BATCH: usize = 16;
const MLP_WIDTH: usize = 4 * D_MODEL;
const PEAK_LR: f64 = 6e-3;
const DEFAULT_STEPS: usize = 400;
const LOG_EVERY: usize = 25;
const PROMPT: &str = "MARCIUS:\n";
const SAMPLE_CHARS: usize = 200;
const TEMPERATURE: f64 = 0.8;

/// The text as character ids over a vocabulary of its distinct characters.
struct Corpus {
    vocab: Vec<char>,
    ids: Vec<i64>,
}

impl Corpus {
    fn new(text: &str) -> Self {
        let mut vocab: Vec<char> = text.chars().collect();
        vocab.sort_unstable();
        vocab.dedup();
        // Every character is in the vocabulary built from the same text.
        let ids = text.chars().map(|c| vocab.binary_search(&c).map_or(0, |i| i as i64)).collect();
        Self { vocab, ids }
    }

    /// Ids of `text`, or the first character the vocabulary lacks.
    fn encode(&self, text: &str) -> Result<Vec<i64>, char> {
        text.chars().map(|c| self.vocab.binary_search(&c).map(|i| i as i64).map_err(|_| c)).collect()
    }

    fn decode(&self, id: i64) -> char {
        usize::try_from(id).ok().and_then(|i| self.vocab.get(i)).copied().unwrap_or('?')
    }
}

/// `BATCH` windows of `CONTEXT` ids starting in `starts`, with the windows shifted by one
/// as targets: `(inputs [B, T], targets [B·T])`.
fn windows(ids: &[i64], starts: &[usize]) -> (Vec<i64>, Vec<i64>) {
    let mut inputs = Vec::with_capacity(starts.len() * CONTEXT);
    let mut targets = Vec::with_capacity(starts.len() * CONTEXT);
    for &s in starts {
        inputs.extend_from_slice(&ids[s..s + CONTEXT]);
        targets.extend_from_slice(&ids[s + 1..s + CONTEXT + 1]);
    }
    (inputs, targets)
}

/// `count` window starts drawn uniformly from `range` (each window needs `CONTEXT + 1` ids).
fn random_starts(rng: &mut SplitMix64, range: std::ops::Range<usize>, count: usize) -> Vec<usize> {
    let span = (range.end - range.start - CONTEXT) as u64;
    (0..count).map(|_| range.start + (rng.next_u64() % span) as usize).collect()
}

/// Creates the variables with distinct seeds and readable names.
/// Draws from `softmax(logits / temperature)`.
fn sample(logits: &[f64], temperature: f64, rng: &mut SplitMix64) -> usize {
    let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let weights: Vec<f64> = logits.iter().map(|&l| ((l - max) / temperature).exp()).collect();
    let mut u = rng.next_f64() * weights.iter().sum::<f64>();
    for (i, w) in weights.iter().enumerate() {
        if u < *w {
            return i;
        }
        u -= w;
    }
    weights.len() - 1
}

/// `[steps] [--precision f32|bf16|f16] [--loss-scale S]`, in any order.
fn parse_args() -> Result<(usize, Precision, Option<LossScale>), String> {
    let (mut steps, mut precision, mut loss_scale) = (DEFAULT_STEPS, Precision::F32, None);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if arg == "--loss-scale" {
            let value = args.next().unwrap_or_default();
            let scale: f64 = value.parse().map_err(|_| format!("--loss-scale '{value}': expected a number"))?;
            loss_scale = Some(LossScale::fixed(scale));
        } else if arg == "--precision" {
            precision = match args.next().as_deref() {
                Some("f32") => Precision::F32,
                Some("bf16") => Precision::Bf16,
                Some("f16") => Precision::F16,
                other => return Err(format!("--precision {}: expected f32, bf16 or f16", other.unwrap_or("(none)"))),
            };
        } else {
            steps = arg.parse().map_err(|_| format!("'{arg}': expected a number of steps or --precision"))?;
        }
    }
    if steps == 0 {
        return Err("steps must be at least 1".into());
    }
    Ok((steps, precision, loss_scale))
}

fn main() -> Result<(), regflow::Report> {
    let (steps, precision, loss_scale) = parse_args()?;
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/data/tiny_text.txt");
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    let corpus = Corpus::new(&text);
    // The last tenth is held out: its loss says whether the model learned the language or
    // only the training windows.
    let split = corpus.ids.len() * 9 / 10;
    if split <= CONTEXT + 1 || corpus.ids.len() - split <= CONTEXT + 1 {
        return Err(format!("{path}: {} characters are too few for windows of {CONTEXT}", corpus.ids.len()).into());
    }
    let vocab_size = corpus.vocab.len();

    let g = Graph::new();
    g.mixed_precision(precision)?;
    let config = GptConfig {
        d_model: D_MODEL,
        heads: HEADS,
        layers: LAYERS,
        context: CONTEXT,
        mlp_width: MLP_WIDTH,
        fused_attention: false,
        apart_qkv: false,
    };
    let model = Gpt::new(&g, config, vocab_size)?;
    // 0 where query `i` may attend key `j <= i`, -1e9 after it: made by the step itself.
    let mask = g.causal_mask(CONTEXT, DType::F32)?;
    let ids = g.input("ids", [BATCH, CONTEXT], DType::I64)?;
    let targets = g.input("targets", [BATCH * CONTEXT], DType::I64)?;
    let loss = model.loss(&model.logits(&ids, &mask)?, &targets)?;
    // One parameter group: the (small) decoupled weight decay also reaches the gains,
    // biases and embeddings, which GPT-2 exempts; over a few hundred steps it hardly shows.
    let optimizer = Optimizer::adamw(PEAK_LR, 0.01)
        .with_schedule(Schedule::WarmupCosine {
            peak: PEAK_LR,
            warmup: 30,
            total: (steps as u64).max(30),
            min: PEAK_LR / 10.0,
        })
        .with_clip_norm(1.0);
    let optimizer = match loss_scale {
        Some(scale) => optimizer.with_loss_scale(scale),
        None => optimizer,
    };
    let train = g.minimize(loss, &optimizer)?;
    // Generation reuses the weights on one sequence.
    let sample_ids = g.input("sample_ids", [1, CONTEXT], DType::I64)?;
    let sample_logits = model.logits(&sample_ids, &mask)?;

    let parameters: usize = g.trainable_variables().iter().map(|v| v.shape().numel()).sum();
    println!(
        "char GPT: {LAYERS} blocks, d_model {D_MODEL}, {HEADS} heads, context {CONTEXT}, vocab {vocab_size}, \
         {parameters} parameters; {} training / {} held-out characters",
        split,
        corpus.ids.len() - split
    );

    let mut rng = SplitMix64::new(42);
    let (val_inputs, val_targets) = windows(&corpus.ids, &random_starts(&mut rng, split..corpus.ids.len(), BATCH));
    let val_feeds = [
        (ids, HostArray::i64([BATCH, CONTEXT], val_inputs)?),
        (targets, HostArray::i64([BATCH * CONTEXT], val_targets)?),
    ];

    // Training runs on the actor runtime: the step is compiled to a plan and run by a
    // Trainer, which feeds each step's batch and hands back the losses and the final state
    // (weights and optimizer state), loaded into the host session for evaluation and
    // sampling afterwards.
    let compiled = g.compile(&[train.loss], &train.updates, &CompileOptions::default())?;
    let started = Instant::now();
    let history = Trainer::new(&compiled).steps(steps as u64).run(|_| -> Result<_, BoxError> {
        let (inputs, step_targets) = windows(&corpus.ids, &random_starts(&mut rng, 0..split, BATCH));
        Ok(vec![
            ("ids", HostArray::i64([BATCH, CONTEXT], inputs)?),
            ("targets", HostArray::i64([BATCH * CONTEXT], step_targets)?),
        ])
    })?;
    let elapsed = started.elapsed().as_secs_f64();
    let mut last_logged = 0;
    for step in 1..=steps {
        if step == 1 || step % LOG_EVERY == 0 || step == steps {
            let window = &history.losses[last_logged..step];
            if let Some(bad) = window.iter().find(|l| !l.is_finite()) {
                return Err(format!("a loss before step {step} is {bad}").into());
            }
            println!(
                "step {step:>4}: train loss {:.4} (mean of last {:>2})",
                window.iter().sum::<f64>() / window.len() as f64,
                window.len()
            );
            last_logged = step;
        }
    }
    let mut session = Session::new(&g);
    for param in g.trainable_variables() {
        let value =
            history.state.get(&param.name()).ok_or_else(|| format!("no trained value of '{}'", param.name()))?;
        session.set(param, value.clone())?;
    }
    println!(
        "{steps} steps in {elapsed:.1}s ({:.1} ms/step) on the actor runtime ({} actors)",
        1e3 * elapsed / steps as f64,
        compiled.plan.actors.len()
    );
    let val_loss = session.run(&val_feeds, &[loss])?[0].to_f64_vec()[0];
    println!("held-out loss after training: {val_loss:.4}");
    if let (Some(scale), Some(applied)) = (history.state.get("loss_scale.scale"), history.state.get("optimizer.step")) {
        let applied = applied.to_f64_vec()[0] as usize;
        println!(
            "loss scale at the end: {}; {} of {steps} steps skipped for gradients that overflowed",
            scale.to_f64_vec()[0],
            steps.saturating_sub(applied)
        );
    }

    // Sampling: the context is the last `CONTEXT` characters, padded on the right with id 0
    // (the causal mask keeps the padding from affecting the position that is read).
    let mut text_ids = corpus.encode(PROMPT).map_err(|c| format!("prompt character {c:?} is not in the text"))?;
    let mut sample_rng = SplitMix64::new(7);
    for _ in 0..SAMPLE_CHARS {
        let context = &text_ids[text_ids.len().saturating_sub(CONTEXT)..];
        let mut window = context.to_vec();
        window.resize(CONTEXT, 0);
        let feeds = [(sample_ids, HostArray::i64([1, CONTEXT], window)?)];
        let logits = session.run(&feeds, &[sample_logits])?[0].to_f64_vec();
        let row = &logits[(context.len() - 1) * vocab_size..context.len() * vocab_size];
        text_ids.push(sample(row, TEMPERATURE, &mut sample_rng) as i64);
    }
    let continuation: String = text_ids.iter().map(|&id| corpus.decode(id)).collect();
    println!("--- sample (temperature {TEMPERATURE}, seed 7) ---\n{continuation}");
    Ok(())
}
