//! A training step compiled to a plan and run by the actors gives the same losses, bit for
//! bit, as the host reference session, and the same plan run twice gives the same losses.

use regflow::graph::{CompileOptions, DType, Graph, HostArray, Init, Optimizer, Session, SplitMix64};
use regflow::prelude::*;

/// A two-layer MLP on random data: (graph inputs, batches).
fn batches(steps: usize) -> Vec<(Vec<f32>, Vec<i64>)> {
    let mut rng = SplitMix64::new(5);
    (0..steps)
        .map(|_| {
            let x = (0..8 * 6).map(|_| rng.next_normal() as f32).collect();
            let y = (0..8).map(|_| (rng.next_u64() % 3) as i64).collect();
            (x, y)
        })
        .collect()
}

fn model(g: &Graph) -> regflow::graph::TrainStep<'_> {
    let x = g.input("x", [8, 6], DType::F32).unwrap();
    let y = g.input("y", [8], DType::I64).unwrap();
    let w1 = g.variable("w1", [6, 16], DType::F32, Init::Kaiming { seed: 1 }).unwrap();
    let b1 = g.variable("b1", [16], DType::F32, Init::Zeros).unwrap();
    let w2 = g.variable("w2", [16, 3], DType::F32, Init::Xavier { seed: 2 }).unwrap();
    let h = x.matmul(&w1).unwrap().add(&b1).unwrap().relu().unwrap();
    let loss = h.matmul(&w2).unwrap().sparse_cross_entropy(&y).unwrap();
    g.minimize(loss, &Optimizer::adamw(1e-2, 1e-3).with_clip_norm(1.0)).unwrap()
}

fn session_losses(steps: usize) -> Vec<f64> {
    let g = Graph::new();
    let train = model(&g);
    let (x, y) = (g.by_name("x").unwrap(), g.by_name("y").unwrap());
    let mut s = Session::new(&g);
    batches(steps)
        .into_iter()
        .map(|(xs, ys)| {
            let feeds = [(x, HostArray::f32([8, 6], xs).unwrap()), (y, HostArray::i64([8], ys).unwrap())];
            s.step(&train, &feeds).unwrap()
        })
        .collect()
}

fn actor_losses(steps: usize) -> Vec<f64> {
    let g = Graph::new();
    let train = model(&g);
    let compiled = g.compile(&[train.loss], &train.updates, &CompileOptions::default()).unwrap();
    let mut job = Job::builder(compiled.plan.clone()).compiled(&compiled).build().unwrap();
    let mut fx = job.feeder("input:x").unwrap();
    let mut fy = job.feeder("input:y").unwrap();
    let fetcher = job.fetcher(&compiled.fetches[0]).unwrap();
    let pusher = std::thread::spawn(move || {
        for (xs, ys) in batches(steps) {
            fx.push(&xs.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
            fy.push(&ys.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        }
    });
    let losses: Vec<f64> = std::iter::from_fn(|| fetcher.recv())
        .map(|p| f64::from(f32::from_le_bytes(p.bytes().try_into().unwrap())))
        .collect();
    pusher.join().unwrap();
    job.wait().unwrap();
    losses
}

#[test]
fn compiled_training_matches_the_reference_session_bit_for_bit() {
    let steps = 12;
    let reference = session_losses(steps);
    let actors = actor_losses(steps);
    assert_eq!(actors.len(), steps);
    assert_eq!(actors, reference);
    assert!(actors[steps - 1] < actors[0], "the loss went down: {actors:?}");
    assert_eq!(actor_losses(steps), actors, "same plan, same seed, same losses");
}
