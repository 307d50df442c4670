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
    let mut job = Job::builder(compiled.plan.clone()).build().unwrap();
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

/// One pre-LayerNorm causal attention block with an MLP, on token ids: exercises batched
/// and shared matmuls, 4-D permutes, a broadcast mask, softmax, layer norm (three-output
/// gradient), embeddings, gelu and cross-entropy through the compiler.
fn attention_step<'g>(g: &'g Graph) -> regflow::graph::TrainStep<'g> {
    let (batch, time, vocab, d, heads) = (2usize, 4usize, 7usize, 8usize, 2usize);
    let hd = d / heads;
    let ids = g.input("ids", [batch, time], DType::I64).unwrap();
    let targets = g.input("targets", [batch * time], DType::I64).unwrap();
    let mask = g.input("mask", [time, time], DType::F32).unwrap();
    let normal = |seed| Init::Normal { mean: 0.0, std: 0.3, seed };
    let emb = g.variable("emb", [vocab, d], DType::F32, normal(1)).unwrap();
    let pos = g.variable("pos", [time, d], DType::F32, normal(2)).unwrap();
    let gamma = g.variable("gamma", [d], DType::F32, Init::Ones).unwrap();
    let beta = g.variable("beta", [d], DType::F32, Init::Zeros).unwrap();
    let wq = g.variable("wq", [d, d], DType::F32, normal(3)).unwrap();
    let wk = g.variable("wk", [d, d], DType::F32, normal(4)).unwrap();
    let wv = g.variable("wv", [d, d], DType::F32, normal(5)).unwrap();
    let w1 = g.variable("w1", [d, 2 * d], DType::F32, normal(6)).unwrap();
    let w2 = g.variable("w2", [2 * d, vocab], DType::F32, normal(7)).unwrap();
    let x = emb.embedding(&ids).unwrap().add(&pos).unwrap(); // [B, T, D]
    let h = x.layer_norm(&gamma, &beta, 1e-5).unwrap();
    let shape = [batch as isize, time as isize, heads as isize, hd as isize];
    let split = |t: regflow::graph::Tensor<'g>| -> regflow::graph::Tensor<'g> {
        t.reshape(&shape).unwrap().permute(&[0, 2, 1, 3]).unwrap()
    };
    let (q, k, v) = (split(h.matmul(&wq).unwrap()), split(h.matmul(&wk).unwrap()), split(h.matmul(&wv).unwrap()));
    let scores = q.matmul(&k.transpose(-1, -2).unwrap()).unwrap().mul_scalar(1.0 / (hd as f64).sqrt()).unwrap();
    let attn = scores.add(&mask).unwrap().softmax(-1).unwrap().matmul(&v).unwrap(); // [B, H, T, hd]
    let merged = attn.permute(&[0, 2, 1, 3]).unwrap().reshape(&[batch as isize, time as isize, d as isize]).unwrap();
    let y = x.add(&merged).unwrap();
    let logits = y.matmul(&w1).unwrap().gelu().unwrap().matmul(&w2).unwrap(); // [B, T, V]
    let loss =
        logits.reshape(&[(batch * time) as isize, vocab as isize]).unwrap().sparse_cross_entropy(&targets).unwrap();
    g.minimize(loss, &Optimizer::adamw(1e-2, 0.0)).unwrap()
}

fn attention_batches(steps: usize) -> Vec<(Vec<i64>, Vec<i64>, Vec<f32>)> {
    let mut rng = SplitMix64::new(9);
    let mask: Vec<f32> = (0..16).map(|i| if i % 4 <= i / 4 { 0.0 } else { -1e9 }).collect();
    // One fixed batch, so the loss has something to learn.
    let ids: Vec<i64> = (0..8).map(|_| (rng.next_u64() % 7) as i64).collect();
    let targets: Vec<i64> = (0..8).map(|_| (rng.next_u64() % 7) as i64).collect();
    (0..steps).map(|_| (ids.clone(), targets.clone(), mask.clone())).collect()
}

#[test]
fn a_compiled_attention_block_trains_like_the_reference_session() {
    let steps = 6;
    let reference: Vec<f64> = {
        let g = Graph::new();
        let train = attention_step(&g);
        let (ids, targets, mask) =
            (g.by_name("ids").unwrap(), g.by_name("targets").unwrap(), g.by_name("mask").unwrap());
        let mut s = Session::new(&g);
        attention_batches(steps)
            .into_iter()
            .map(|(i, t, m)| {
                let feeds = [
                    (ids, HostArray::i64([2, 4], i).unwrap()),
                    (targets, HostArray::i64([8], t).unwrap()),
                    (mask, HostArray::f32([4, 4], m).unwrap()),
                ];
                s.step(&train, &feeds).unwrap()
            })
            .collect()
    };
    let g = Graph::new();
    let train = attention_step(&g);
    let compiled = g.compile(&[train.loss], &train.updates, &CompileOptions::default()).unwrap();
    let mut job = Job::builder(compiled.plan.clone()).build().unwrap();
    let (mut fi, mut ft, mut fm) =
        (job.feeder("input:ids").unwrap(), job.feeder("input:targets").unwrap(), job.feeder("input:mask").unwrap());
    let fetcher = job.fetcher(&compiled.fetches[0]).unwrap();
    let pusher = std::thread::spawn(move || {
        for (i, t, m) in attention_batches(steps) {
            fi.push(&i.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
            ft.push(&t.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
            fm.push(&m.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        }
    });
    let losses: Vec<f64> = std::iter::from_fn(|| fetcher.recv())
        .map(|p| f64::from(f32::from_le_bytes(p.bytes().try_into().unwrap())))
        .collect();
    pusher.join().unwrap();
    job.wait().unwrap();
    assert_eq!(losses, reference);
    assert!(losses[steps - 1] < losses[0], "{losses:?}");
}

#[test]
fn typed_feeds_name_the_input_and_the_values_that_do_not_fit() {
    let g = Graph::new();
    let train = model(&g);
    let compiled = g.compile(&[train.loss], &train.updates, &CompileOptions::default()).unwrap();
    let mut job = Job::builder(compiled.plan.clone()).build().unwrap();
    let mut feeds = job.graph_feeds().unwrap();
    let losses = job.fetcher(&compiled.fetches[0]).unwrap();
    let (xs, ys) = batches(1).remove(0);
    let x = HostArray::f32([8, 6], xs).unwrap();
    let y = HostArray::i64([8], ys).unwrap();
    let err = |r: Result<(), RuntimeError>| r.unwrap_err().to_string();
    assert_eq!(err(feeds.push("z", &x)), "no input named 'z'; did you mean 'x'? (nearest inputs: 'x', 'y')");
    assert_eq!(
        err(feeds.push("x", &HostArray::f32([6, 8], vec![0.0; 48]).unwrap())),
        "feed for input 'x': got f32[6, 8], expected f32[8, 6]"
    );
    assert_eq!(
        err(feeds.push("y", &HostArray::f64([8], vec![0.0; 8]).unwrap())),
        "feed for input 'y': got f64[8], expected i64[8]"
    );
    // Nothing was lost: a correct step goes through and gives the reference loss.
    feeds.push("x", &x).unwrap();
    feeds.push("y", &y).unwrap();
    feeds.close().unwrap();
    let loss = f64::from(f32::from_le_bytes(losses.recv().unwrap().bytes().try_into().unwrap()));
    assert_eq!(loss, session_losses(1)[0]);
    assert!(losses.recv().is_none());
    drop(losses);
    job.wait().unwrap();
}
