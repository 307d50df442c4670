//! Trains an MLP (64-128-10) on the digits data set with the graph DSL, autodiff and AdamW,
//! and prints the test accuracy on a deterministic 80/20 split.
//!
//! ```text
//! cargo run --release --example train_digits -- [--epochs N] [--save ckpt.safetensors] [--plot loss.png|loss.svg]
//!     [--eval-every EPOCHS]
//! ```
//!
//! The training step is compiled to a plan of actors and run by a [`Trainer`], one piece
//! per step, with a progress bar: each epoch's batches are the training rows in a seeded
//! order, the weights and optimizer state are variables carried from step to step in
//! loop-carried registers. The test set goes through a forward-only plan preloaded with
//! the trained weights (`--eval-every` does that during training too).

use flate2::read::GzDecoder;
use regflow::graph::{
    CompileOptions, CompiledGraph, DType, Graph, GraphError, HostArray, Init, Optimizer, Schedule, SplitMix64, Tensor,
};
use regflow::prelude::{Job, LoadStateDict, StateDict, Trainer};
use regflow::train::BoxError;
use std::io::Read;

const FEATURES: usize = 64;
const CLASSES: usize = 10;
const HIDDEN: usize = 128;
const BATCH: usize = 64;

struct Digits {
    pixels: Vec<f32>,
    labels: Vec<i64>,
}

impl Digits {
    fn rows(&self) -> usize {
        self.labels.len()
    }

    /// Parses `digits.csv.gz`: 64 pixels (0–16) and a label per line.
    fn load(path: &str) -> Result<Self, Box<dyn std::error::Error>> {
        let mut text = String::new();
        GzDecoder::new(std::fs::File::open(path)?).read_to_string(&mut text)?;
        let (mut pixels, mut labels) = (Vec::new(), Vec::new());
        for (line_no, line) in text.lines().enumerate() {
            let values: Vec<&str> = line.split(',').collect();
            if values.len() != FEATURES + 1 {
                return Err(
                    format!("{path}:{}: {} fields, expected {}", line_no + 1, values.len(), FEATURES + 1).into()
                );
            }
            for v in &values[..FEATURES] {
                pixels.push(v.trim().parse::<f32>()? / 16.0);
            }
            let label: i64 = values[FEATURES].trim().parse()?;
            if !(0..CLASSES as i64).contains(&label) {
                return Err(format!("{path}:{}: label {label} is not a digit", line_no + 1).into());
            }
            labels.push(label);
        }
        Ok(Self { pixels, labels })
    }

    /// Rows `order[range]` as a batch.
    fn batch(&self, order: &[usize]) -> (Vec<f32>, Vec<i64>) {
        let mut x = Vec::with_capacity(order.len() * FEATURES);
        let mut y = Vec::with_capacity(order.len());
        for &r in order {
            x.extend_from_slice(&self.pixels[r * FEATURES..(r + 1) * FEATURES]);
            y.push(self.labels[r]);
        }
        (x, y)
    }
}

/// Fisher–Yates with a seeded generator: the same seed, the same order.
fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut rng = SplitMix64::new(seed);
    for i in (1..n).rev() {
        order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    order
}

/// The model: relu(x·w1 + b1)·w2 + b2.
fn mlp<'g>(x: Tensor<'g>, [w1, b1, w2, b2]: &[Tensor<'g>; 4]) -> Result<Tensor<'g>, GraphError> {
    x.matmul(w1)?.add(b1)?.relu()?.matmul(w2)?.add(b2)
}

/// Command-line options.
struct Options {
    epochs: usize,
    save: Option<std::path::PathBuf>,
    plot: Option<std::path::PathBuf>,
    eval_every: Option<usize>,
}

fn options() -> Result<Options, String> {
    let mut o = Options { epochs: 30, save: None, plot: None, eval_every: None };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--epochs" => o.epochs = value()?.parse().map_err(|e| format!("--epochs: {e}"))?,
            "--save" => o.save = Some(value()?.into()),
            "--plot" => o.plot = Some(value()?.into()),
            "--eval-every" => o.eval_every = Some(value()?.parse().map_err(|e| format!("--eval-every: {e}"))?),
            other => {
                return Err(format!(
                    "unknown argument '{other}' (expected --epochs N, --save FILE, --plot FILE.png|FILE.svg, \
                     --eval-every EPOCHS)"
                ))
            }
        }
    }
    if o.epochs == 0 {
        return Err("--epochs must be at least 1".into());
    }
    if o.eval_every == Some(0) {
        return Err("--eval-every must be at least 1".into());
    }
    Ok(o)
}

/// Accuracy of the model with weights `state` on `rows`: a forward-only plan (compiled
/// once by the caller) preloaded with the trained weights (the optimizer state in `state`
/// is no variable of it: a non-strict load skips it).
fn accuracy(test_plan: &CompiledGraph, state: &StateDict, data: &Digits, rows: &[usize]) -> Result<f64, BoxError> {
    let (builder, skipped) = Job::builder(test_plan.plan.clone()).load_state_dict(state, false)?;
    if !skipped.missing.is_empty() {
        return Err(format!("the trained state lacks weights: {skipped}").into());
    }
    let mut job = builder.build()?;
    let (xs, ys) = data.batch(rows);
    let mut feeds = job.graph_feeds()?;
    let logits = job.graph_fetcher(&test_plan.fetches[0])?;
    feeds.push("x_test", &HostArray::f32([rows.len(), FEATURES], xs)?)?;
    feeds.close()?;
    let values = logits.recv()?.ok_or("no logits were delivered")?.to_f64_vec();
    drop((feeds, logits));
    job.wait()?;
    let correct = values
        .chunks(CLASSES)
        .zip(&ys)
        .filter(|(row, &label)| {
            let best = row.iter().enumerate().fold(0, |best, (i, &v)| if v > row[best] { i } else { best });
            best as i64 == label
        })
        .count();
    Ok(correct as f64 / ys.len() as f64)
}

fn main() -> Result<(), regflow::Report> {
    let options = options()?;
    let epochs = options.epochs;
    let data = Digits::load(concat!(env!("CARGO_MANIFEST_DIR"), "/data/digits.csv.gz"))?;
    let order = shuffled(data.rows(), 0);
    let split = data.rows() * 8 / 10;
    let (train_rows, test_rows) = order.split_at(split);
    let steps_per_epoch = train_rows.len() / BATCH;
    let steps = epochs * steps_per_epoch;

    // The model and one training step, as a logical graph.
    let g = Graph::new();
    let w1 = g.variable("w1", [FEATURES, HIDDEN], DType::F32, Init::Kaiming { seed: 1 })?;
    let b1 = g.variable("b1", [HIDDEN], DType::F32, Init::Zeros)?;
    let w2 = g.variable("w2", [HIDDEN, CLASSES], DType::F32, Init::Xavier { seed: 2 })?;
    let b2 = g.variable("b2", [CLASSES], DType::F32, Init::Zeros)?;
    let params = [w1, b1, w2, b2];
    let x = g.input("x", [BATCH, FEATURES], DType::F32)?;
    let y = g.input("y", [BATCH], DType::I64)?;
    let loss = mlp(x, &params)?.sparse_cross_entropy(&y)?;
    let optimizer = Optimizer::adamw(1e-2, 1e-4)
        .with_schedule(Schedule::WarmupCosine { peak: 1e-2, warmup: 20, total: (steps as u64).max(20), min: 1e-4 })
        .with_clip_norm(5.0);
    let train = g.minimize(loss, &optimizer)?;
    // The test set goes through a forward-only plan of the same weights.
    let x_test = g.input("x_test", [test_rows.len(), FEATURES], DType::F32)?;
    let test_plan = g.compile(&[mlp(x_test, &params)?], &[], &CompileOptions::default())?;

    // Compile the step to a plan of actors; the Trainer runs it one piece per step, the
    // weights and optimizer state carried from step to step in loop-carried registers.
    let compiled = g.compile(&[train.loss], &train.updates, &CompileOptions::default())?;
    println!(
        "training plan: {} actors, {} registers, {} bytes",
        compiled.plan.actors.len(),
        compiled.plan.regst_descs.len(),
        compiled.plan.memory()?.report().total_bytes()
    );
    // Each epoch visits the training rows in its own seeded order.
    let batches = |step: u64| -> Result<_, BoxError> {
        let (epoch, k) = (step as usize / steps_per_epoch, step as usize % steps_per_epoch);
        let epoch_order = shuffled(train_rows.len(), 1 + epoch as u64);
        let rows: Vec<usize> = epoch_order[k * BATCH..(k + 1) * BATCH].iter().map(|&i| train_rows[i]).collect();
        let (xs, ys) = data.batch(&rows);
        Ok(vec![("x", HostArray::f32([BATCH, FEATURES], xs)?), ("y", HostArray::i64([BATCH], ys)?)])
    };
    let mut trainer = Trainer::new(&compiled).steps(steps as u64);
    if let Some(every) = options.eval_every {
        trainer = trainer.on_eval((every * steps_per_epoch) as u64, |e| {
            let correct = accuracy(&test_plan, e.state, &data, test_rows)?;
            println!("epoch {:>3}: test accuracy {:.2}%", e.step as usize / steps_per_epoch, 100.0 * correct);
            Ok(correct)
        });
    }
    let started = std::time::Instant::now();
    let history = trainer.run(batches)?;
    let curve = &history.losses;
    let mut reported: Vec<usize> = (4..epochs).step_by(5).collect();
    if reported.last() != Some(&(epochs - 1)) {
        reported.push(epochs - 1);
    }
    for epoch in reported {
        let slice = &curve[epoch * steps_per_epoch..(epoch + 1) * steps_per_epoch];
        println!("epoch {:>3}: mean loss {:.4}", epoch + 1, slice.iter().sum::<f64>() / slice.len() as f64);
    }
    println!("{steps} steps in {:.2?} on the actor runtime ({} job(s))", started.elapsed(), history.jobs);
    if let Some(path) = &options.plot {
        history.save_loss_plot(path)?;
        println!("loss curve written to {}", path.display());
    }
    if let Some(path) = &options.save {
        history.state.save(path)?;
        println!("weights and optimizer state written to {}", path.display());
    }
    let correct = accuracy(&test_plan, &history.state, &data, test_rows).map_err(|e| e.to_string())?;
    println!(
        "test accuracy: {:.2}% ({}/{} held-out digits)",
        100.0 * correct,
        (correct * test_rows.len() as f64).round(),
        test_rows.len()
    );
    Ok(())
}
