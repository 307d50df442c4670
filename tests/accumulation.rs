//! Gradient accumulation: k micro-batches per optimizer step, with repeat actors handing the
//! weights to each micro-batch and acc actors averaging the gradients, trains like one
//! batch k times larger.

use regflow::graph::{CompileOptions, DType, Graph, HostArray, Init, Optimizer, Session, SplitMix64, TrainStep};
use regflow::prelude::*;

fn model(g: &Graph, batch: usize) -> TrainStep<'_> {
    let x = g.input("x", [batch, 5], DType::F64).unwrap();
    let y = g.input("y", [batch], DType::I64).unwrap();
    let w = g.variable("w", [5, 3], DType::F64, Init::Kaiming { seed: 4 }).unwrap();
    let b = g.variable("b", [3], DType::F64, Init::Zeros).unwrap();
    let loss = x.matmul(&w).unwrap().add(&b).unwrap().sparse_cross_entropy(&y).unwrap();
    g.minimize(loss, &Optimizer::adamw(5e-2, 1e-2).with_clip_norm(0.5)).unwrap()
}

/// The same batch every step, so the loss has something to learn.
fn batch(_step: u64) -> (Vec<f64>, Vec<i64>) {
    let mut rng = SplitMix64::new(200);
    ((0..40).map(|_| rng.next_normal()).collect(), (0..8).map(|_| (rng.next_u64() % 3) as i64).collect())
}

#[test]
fn two_micro_batches_of_four_train_like_one_batch_of_eight() {
    let steps = 4u64;
    // Reference: the full batch of 8 in a host session.
    let g = Graph::new();
    let train = model(&g, 8);
    let (x, y) = (g.by_name("x").unwrap(), g.by_name("y").unwrap());
    let mut s = Session::new(&g);
    let full: Vec<f64> = (0..steps)
        .map(|k| {
            let (xs, ys) = batch(k);
            s.step(&train, &[(x, HostArray::f64([8, 5], xs).unwrap()), (y, HostArray::i64([8], ys).unwrap())]).unwrap()
        })
        .collect();

    // Two micro-batches of 4 per step on the actors.
    let g = Graph::new();
    let train = model(&g, 4);
    let options = CompileOptions { accumulate: Some(train.accumulate(2)), ..CompileOptions::default() };
    let compiled = g.compile(&[train.loss], &train.updates, &options).unwrap();
    let kinds = |kind: &str| compiled.plan.actors.iter().filter(|a| a.kind.name() == kind).count();
    assert!(kinds("repeat") >= 2 && kinds("acc") >= 3, "repeat {} acc {}", kinds("repeat"), kinds("acc"));
    let mut job = Job::builder(compiled.plan.clone()).build().unwrap();
    let mut feeds = job.graph_feeds().unwrap();
    let losses = job.fetcher(&compiled.fetches[0]).unwrap();
    for k in 0..steps {
        let (xs, ys) = batch(k);
        for half in 0..2 {
            feeds.push("x", &HostArray::f64([4, 5], xs[half * 20..(half + 1) * 20].to_vec()).unwrap()).unwrap();
            feeds.push("y", &HostArray::i64([4], ys[half * 4..(half + 1) * 4].to_vec()).unwrap()).unwrap();
        }
    }
    feeds.close().unwrap();
    let micro: Vec<f64> =
        std::iter::from_fn(|| losses.recv()).map(|p| f64::from_le_bytes(p.bytes().try_into().unwrap())).collect();
    drop(losses);
    let report = job.wait().unwrap();
    assert_eq!(micro.len(), 2 * steps as usize, "one loss per micro-batch");
    // The loss of a step is the mean of its micro-batch losses (every micro-batch of a step
    // sees the same weights), and the updates match step after step.
    for (k, pair) in micro.chunks(2).enumerate() {
        let mean = (pair[0] + pair[1]) / 2.0;
        assert!((mean - full[k]).abs() <= 1e-12 * full[k].abs(), "step {k}: {mean} vs {}", full[k]);
    }
    assert!(full[steps as usize - 1] < full[0]);
    let updates: Vec<u64> =
        report.actors.iter().filter(|a| a.name.starts_with("adamw_update")).map(|a| a.fires).collect();
    // w's and b's updates are one fused actor (`compile/fuse_updates.rs`): both gradients
    // are made on the device's stream.
    assert_eq!(updates, vec![steps], "one update of w and b per step");
}
