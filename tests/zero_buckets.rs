//! ZeRO's buckets on a GPT whose weights are split `S(0)` with their AdamW state: its
//! activation gradients are reduce-scattered too, and later ones are made from earlier
//! ones, so buckets must be cut where a part (or a collective issued between two parts)
//! waits for the bucket itself. The plan compiles, makes its buckets, and trains to the same
//! bits as with one collective per tensor.

use crate::gpt;

use gpt::{Gpt, GptConfig};
use regflow::graph::sbp::{Mesh, NdSbp, Sbp};
use regflow::graph::{DType, Graph, HostArray, Optimizer, ParallelOptions, SplitMix64};
use regflow::prelude::*;

const GPT: GptConfig =
    GptConfig { d_model: 16, heads: 2, layers: 2, context: 8, mlp_width: 32, fused_attention: false, apart_qkv: false };
const BATCH: usize = 4;
const VOCAB: usize = 12;

/// Losses over `steps` steps of the GPT with every weight `S(0)` on two cpu devices, and the
/// op names of its bucket collectives, with buckets of `bucket_bytes` (0: none).
fn split_weights(steps: usize, bucket_bytes: u64) -> (Vec<u32>, Vec<&'static str>) {
    let g = Graph::new();
    let model = Gpt::new(&g, GPT, VOCAB).unwrap();
    let mask = g.input("causal_mask", [GPT.context, GPT.context], DType::F32).unwrap();
    let ids = g.input("ids", [BATCH, GPT.context], DType::I64).unwrap();
    let targets = g.input("targets", [BATCH * GPT.context], DType::I64).unwrap();
    let mesh = Mesh::cpu(&[2], &["dp"]).unwrap();
    g.set_layout(mask, &mesh, NdSbp(vec![Sbp::Broadcast])).unwrap();
    for t in [ids, targets].into_iter().chain(g.trainable_variables()) {
        g.set_layout(t, &mesh, NdSbp(vec![Sbp::Split(0)])).unwrap();
    }
    let loss = model.loss(&model.logits(&ids, &mask).unwrap(), &targets).unwrap();
    let train = g.minimize(loss, &Optimizer::adamw(3e-3, 1e-4).with_clip_norm(1.0)).unwrap();
    let options = ParallelOptions { bucket_bytes, ..ParallelOptions::new(mesh).train(&train) };
    let compiled = g.compile_parallel(&[train.loss], &train.updates, &options).unwrap();
    let plan = &compiled.plan;
    let buckets = (0..plan.actors.len())
        .filter_map(|a| plan.collective_conf(a))
        .filter(|c| c.op.is_bucket())
        .map(|c| c.op_name());
    let buckets = buckets.collect();

    let mut job = Job::builder(plan.clone()).build().unwrap();
    let mut feeds = job.graph_feeds().unwrap();
    let fetcher = job.fetcher(&compiled.fetches[0]).unwrap();
    let t = GPT.context;
    let causal: Vec<f32> = (0..t * t).map(|i| if i % t <= i / t { 0.0 } else { -1e9 }).collect();
    let pusher = std::thread::spawn(move || {
        let mut rng = SplitMix64::new(3);
        for _ in 0..steps {
            let tokens: Vec<i64> = (0..BATCH * (t + 1)).map(|_| (rng.next_u64() % VOCAB as u64) as i64).collect();
            let rows = tokens.chunks(t + 1);
            let ids: Vec<i64> = rows.clone().flat_map(|r| r[..t].to_vec()).collect();
            let next: Vec<i64> = rows.flat_map(|r| r[1..].to_vec()).collect();
            feeds.push("causal_mask", &HostArray::f32([t, t], causal.clone()).unwrap()).unwrap();
            feeds.push("ids", &HostArray::i64([BATCH, t], ids).unwrap()).unwrap();
            feeds.push("targets", &HostArray::i64([BATCH * t], next).unwrap()).unwrap();
        }
        feeds.close().unwrap();
    });
    let losses = std::iter::from_fn(|| fetcher.recv())
        .map(|piece| f32::from_le_bytes(piece.bytes().try_into().unwrap()).to_bits())
        .collect();
    pusher.join().unwrap();
    job.wait().unwrap();
    (losses, buckets)
}

#[test]
fn buckets_of_a_gpt_with_split_weights_never_wait_for_themselves() {
    let steps = 6;
    let (bucketed, buckets) = split_weights(steps, 1 << 20);
    let (separate, none) = split_weights(steps, 0);
    assert!(buckets.contains(&"reduce_scatter_bucket") && buckets.contains(&"all_gather_bucket"), "{buckets:?}");
    assert!(none.is_empty(), "{none:?}");
    assert_eq!(bucketed.len(), steps);
    assert_eq!(bucketed, separate, "losses, bit for bit");
}
