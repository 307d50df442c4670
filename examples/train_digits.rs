//! Trains an MLP (64-128-10) on the digits data set with the graph DSL, autodiff and AdamW,
//! and prints the test accuracy on a deterministic 80/20 split.
//!
//! ```text
//! cargo run --release --example train_digits -- [--epochs N] [--save ckpt.safetensors] [--plot loss.png]
//! ```
//!
//! The training step is compiled to a plan of actors and run by the runtime, one piece per
//! step: a dataset source actor serves shuffled batches, the weights are variables carried
//! from step to step in loop-carried registers.
//! The test set goes through a forward-only plan preloaded with the trained weights.

use flate2::read::GzDecoder;
use indicatif::{ProgressBar, ProgressStyle};
use regflow::graph::{
    CompileOptions, DType, DatasetInputs, Graph, GraphError, Init, Optimizer, Schedule, SplitMix64, Tensor,
};
use regflow::prelude::{Job, RuntimeError, SourcePieces};
use regflow::runtime::RecordFile;
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

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn i64_bytes(values: &[i64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Command-line options.
struct Options {
    epochs: usize,
    save: Option<std::path::PathBuf>,
    plot: Option<std::path::PathBuf>,
}

fn options() -> Result<Options, String> {
    let mut o = Options { epochs: 30, save: None, plot: None };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--epochs" => o.epochs = value()?.parse().map_err(|e| format!("--epochs: {e}"))?,
            "--save" => o.save = Some(value()?.into()),
            "--plot" => o.plot = Some(value()?.into()),
            other => return Err(format!("unknown argument '{other}' (expected --epochs N, --save FILE, --plot FILE)")),
        }
    }
    if o.epochs == 0 {
        return Err("--epochs must be at least 1".into());
    }
    Ok(o)
}

/// Draws the loss curve (log scale, one point per step) as a PNG line chart.
fn plot(path: &std::path::Path, losses: &[f32]) -> Result<(), Box<dyn std::error::Error>> {
    let (w, h, margin) = (800usize, 400usize, 20usize);
    let mut pixels = vec![255u8; w * h * 3];
    let mut dot = |x: usize, y: usize, rgb: [u8; 3]| {
        if x < w && y < h {
            pixels[(y * w + x) * 3..(y * w + x) * 3 + 3].copy_from_slice(&rgb);
        }
    };
    for x in margin..w - margin {
        dot(x, h - margin, [0, 0, 0]);
    }
    for y in margin..h - margin {
        dot(margin, y, [0, 0, 0]);
    }
    let logs: Vec<f32> = losses.iter().map(|l| l.max(1e-6).ln()).collect();
    let (lo, hi) = logs.iter().fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    let span = (hi - lo).max(1e-6);
    let (plot_w, plot_h) = ((w - 2 * margin) as f32, (h - 2 * margin) as f32);
    let point = |i: usize| {
        let x = margin as f32 + plot_w * i as f32 / (logs.len().max(2) - 1) as f32;
        let y = margin as f32 + plot_h * (hi - logs[i]) / span;
        (x, y)
    };
    for i in 1..logs.len() {
        let ((x0, y0), (x1, y1)) = (point(i - 1), point(i));
        let steps = ((x1 - x0).abs().max((y1 - y0).abs()).ceil() as usize).max(1);
        for s in 0..=steps {
            let t = s as f32 / steps as f32;
            dot((x0 + t * (x1 - x0)) as usize, (y0 + t * (y1 - y0)) as usize, [30, 90, 200]);
        }
    }
    let mut encoder = png::Encoder::new(std::io::BufWriter::new(std::fs::File::create(path)?), w as u32, h as u32);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    encoder.write_header()?.write_image_data(&pixels)?;
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let options = options()?;
    let epochs = options.epochs;
    let data = Digits::load(concat!(env!("CARGO_MANIFEST_DIR"), "/data/digits.csv.gz"))?;
    let order = shuffled(data.rows(), 0);
    let split = data.rows() * 8 / 10;
    let (train_rows, test_rows) = order.split_at(split);
    let train_rows = train_rows.to_vec();
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

    // Compile the step to a plan of actors and run it: one piece per step. The weights are
    // fetched too (every value they take), so the test plan can start from the last ones.
    let mut fetch = vec![train.loss];
    fetch.extend(params);
    // The training batches come from a dataset source actor: the training rows as records
    // of 64 f32 pixels and an i64 label, reshuffled by seed every epoch.
    let records: Vec<u8> = train_rows
        .iter()
        .flat_map(|&r| {
            let (x, y) = data.batch(&[r]);
            [f32_bytes(&x), i64_bytes(&y)].concat()
        })
        .collect();
    let batches = RecordFile::from_bytes(records, FEATURES * 4 + 8)?.batches(&[FEATURES * 4, 8], BATCH, 1)?;
    let compile_options = CompileOptions {
        dataset: Some(DatasetInputs {
            source: SourcePieces::Custom { count: batches.pieces(epochs as u64), kernel: "digits".into() },
            inputs: vec!["x".into(), "y".into()],
        }),
        ..CompileOptions::default()
    };
    let compiled = g.compile(&fetch, &train.updates, &compile_options)?;
    println!(
        "training plan: {} actors, {} registers, {} bytes",
        compiled.plan.actors.len(),
        compiled.plan.regst_descs.len(),
        compiled.plan.memory()?.report().total_bytes()
    );
    let mut job = Job::builder(compiled.plan.clone()).dataset("digits", batches).build()?;
    let losses = job.fetcher(&compiled.fetches[0])?;
    let weight_watchers: Vec<_> = compiled.fetches[1..]
        .iter()
        .map(|name| {
            let fetcher = job.fetcher(name)?;
            Ok(std::thread::spawn(move || std::iter::from_fn(|| fetcher.recv().map(|p| p.bytes().to_vec())).last()))
        })
        .collect::<Result<_, RuntimeError>>()?;
    let bar = ProgressBar::new(steps as u64);
    bar.set_style(ProgressStyle::with_template("{bar:40} {pos}/{len} steps  loss {msg}")?);
    let mut curve = Vec::with_capacity(steps);
    while let Some(piece) = losses.recv() {
        let loss = f32::from_le_bytes(piece.bytes().try_into()?);
        curve.push(loss);
        bar.inc(1);
        if curve.len() % 10 == 0 {
            bar.set_message(format!("{loss:.4}"));
        }
    }
    bar.finish_and_clear();
    let trained: Vec<Vec<u8>> = weight_watchers
        .into_iter()
        .map(|w| w.join().map_err(|_| "a fetching thread panicked")?.ok_or("no weights were delivered"))
        .collect::<Result<_, &str>>()?;
    let report = job.wait()?;
    let mut reported: Vec<usize> = (4..epochs).step_by(5).collect();
    if reported.last() != Some(&(epochs - 1)) {
        reported.push(epochs - 1);
    }
    for epoch in reported {
        let slice = &curve[epoch * steps_per_epoch..(epoch + 1) * steps_per_epoch];
        println!("epoch {:>3}: mean loss {:.4}", epoch + 1, slice.iter().sum::<f32>() / slice.len() as f32);
    }
    println!("{steps} steps in {:.2?} on the actor runtime", report.elapsed);
    if let Some(path) = &options.plot {
        plot(path, &curve)?;
        println!("loss curve written to {}", path.display());
    }
    if let Some(path) = &options.save {
        let tensors: Vec<(String, regflow::graph::HostArray)> = params
            .iter()
            .zip(&trained)
            .map(|(p, bytes)| {
                let values = bytes.chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
                regflow::graph::HostArray::f32(p.shape(), values).map(|a| (p.name(), a))
            })
            .collect::<Result<_, _>>()?;
        regflow::graph::checkpoint::save(path, &tensors)?;
        println!("weights written to {}", path.display());
    }

    // Test: a forward-only plan, its variables preloaded with the trained weights.
    let x_test = g.input("x_test", [test_rows.len(), FEATURES], DType::F32)?;
    let logits_test = mlp(x_test, &params)?;
    let test_plan = g.compile(&[logits_test], &[], &CompileOptions::default())?;
    let mut builder = Job::builder(test_plan.plan.clone());
    for (variable, bytes) in params.iter().zip(trained) {
        let regst =
            &test_plan.variables.iter().find(|v| v.name == variable.name()).ok_or("variable not compiled")?.regst;
        builder = builder.preload(regst, bytes);
    }
    let mut test_job = builder.build()?;
    let (xs, ys) = data.batch(test_rows);
    let mut feed = test_job.feeder("input:x_test")?;
    let logits_fetcher = test_job.fetcher(&test_plan.fetches[0])?;
    feed.push(&f32_bytes(&xs))?;
    feed.close()?;
    let logits: Vec<f32> = {
        let piece = logits_fetcher.recv().ok_or("no logits were delivered")?;
        piece.bytes().chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    };
    drop(logits_fetcher);
    test_job.wait()?;
    let correct = logits
        .chunks(CLASSES)
        .zip(&ys)
        .filter(|(row, &label)| {
            let best = row.iter().enumerate().fold(0, |best, (i, &v)| if v > row[best] { i } else { best });
            best as i64 == label
        })
        .count();
    println!(
        "test accuracy: {:.2}% ({correct}/{} held-out digits)",
        100.0 * correct as f64 / ys.len() as f64,
        ys.len()
    );
    Ok(())
}
