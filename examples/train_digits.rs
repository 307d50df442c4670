//! Trains an MLP (64-128-10) on the digits data set with the graph DSL, autodiff and AdamW,
//! and prints the test accuracy on a deterministic 80/20 split.
//!
//! ```text
//! cargo run --release --example train_digits -- [epochs]
//! ```
//!
//! This runs the graph with the host reference [`Session`]; lowering the same graph to a
//! plan of actors is the compiler's job (issue 4, in progress).

use flate2::read::GzDecoder;
use regflow::graph::{DType, Graph, GraphError, HostArray, Init, Optimizer, Schedule, Session, SplitMix64, Tensor};
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

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let epochs: usize = std::env::args().nth(1).map(|s| s.parse()).transpose()?.unwrap_or(30);
    let data = Digits::load(concat!(env!("CARGO_MANIFEST_DIR"), "/data/digits.csv.gz"))?;
    let order = shuffled(data.rows(), 0);
    let split = data.rows() * 8 / 10;
    let (train_rows, test_rows) = order.split_at(split);

    let g = Graph::new();
    let w1 = g.variable("w1", [FEATURES, HIDDEN], DType::F32, Init::Kaiming { seed: 1 })?;
    let b1 = g.variable("b1", [HIDDEN], DType::F32, Init::Zeros)?;
    let w2 = g.variable("w2", [HIDDEN, CLASSES], DType::F32, Init::Xavier { seed: 2 })?;
    let b2 = g.variable("b2", [CLASSES], DType::F32, Init::Zeros)?;
    let params = [w1, b1, w2, b2];
    let x = g.input("x", [BATCH, FEATURES], DType::F32)?;
    let y = g.input("y", [BATCH], DType::I64)?;
    let loss = mlp(x, &params)?.sparse_cross_entropy(&y)?;
    let steps = (epochs * (train_rows.len() / BATCH)) as u64;
    let optimizer = Optimizer::adamw(1e-2, 1e-4)
        .with_schedule(Schedule::WarmupCosine { peak: 1e-2, warmup: 20, total: steps, min: 1e-4 })
        .with_clip_norm(5.0);
    let train = g.minimize(loss, &optimizer)?;
    let x_test = g.input("x_test", [test_rows.len(), FEATURES], DType::F32)?;
    let logits_test = mlp(x_test, &params)?;

    let mut session = Session::new(&g);
    for epoch in 0..epochs {
        let epoch_order: Vec<usize> =
            shuffled(train_rows.len(), 1 + epoch as u64).iter().map(|&i| train_rows[i]).collect();
        let mut total = 0.0;
        let batches = epoch_order.len() / BATCH;
        for b in 0..batches {
            let (xs, ys) = data.batch(&epoch_order[b * BATCH..(b + 1) * BATCH]);
            let feeds = [
                (x, HostArray::f32([BATCH, FEATURES], xs).ok_or("batch shape")?),
                (y, HostArray::i64([BATCH], ys).ok_or("label shape")?),
            ];
            total += session.step(&train, &feeds)?;
        }
        if epoch % 5 == 4 || epoch + 1 == epochs {
            println!("epoch {:>3}: mean loss {:.4}", epoch + 1, total / batches as f64);
        }
    }

    let (xs, ys) = data.batch(test_rows);
    let logits = session
        .run(&[(x_test, HostArray::f32([test_rows.len(), FEATURES], xs).ok_or("test shape")?)], &[logits_test])?;
    let logits = logits[0].to_f64_vec();
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
