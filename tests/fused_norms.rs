//! The global gradient norm fused per device (`graph/src/compile/fuse_norms.rs`): a
//! device's chain of `sum_squares` and scalar adds runs as one `sum_squares_group` actor
//! and trains to the bits of the chain, with clipping and loss scaling, micro-batches, on
//! one device and two (replicated and sharded gradients), on one thread and two; a chain
//! that starts from a total made elsewhere carries it in.

use regflow::graph::plan::Plan;
use regflow::graph::sbp::{Mesh, NdSbp, Sbp};
use regflow::graph::{
    CompileOptions, CompiledGraph, DType, Graph, HostArray, Init, LossScale, Optimizer, ParallelOptions,
};
use regflow::prelude::*;

use crate::common;

use crate::tiny_mlp;

/// Compute actors running `op_type`: (name, carried attribute if any, op inputs).
fn ops(plan: &Plan, op_type: &str) -> Vec<(String, Option<bool>, usize)> {
    common::ops(plan, op_type)
        .into_iter()
        .map(|(name, c)| (name.to_string(), c.attrs["carried"].as_bool(), c.inputs.len()))
        .collect()
}

#[test]
fn one_device_sums_every_gradient_in_one_actor_with_the_bits_of_the_chain() {
    let optimizers = [
        Optimizer::adamw(5e-2, 1e-2).with_clip_norm(0.5),
        Optimizer::sgd(0.1, 0.9, 1e-3).with_clip_norm(0.05),
        Optimizer::adamw(5e-2, 0.0).with_loss_scale(LossScale::fixed(256.0)),
    ];
    for optimizer in optimizers {
        for micro_batches in [1, 3] {
            let g = Graph::new();
            let (step, _) = tiny_mlp::model(&g, &optimizer);
            let compile = |fuse_norms| {
                let accumulate = (micro_batches > 1).then(|| step.accumulate(micro_batches));
                let options = CompileOptions { fuse_norms, accumulate, ..CompileOptions::default() };
                g.compile(&[step.loss], &step.updates, &options).unwrap()
            };
            let (fused, apart) = (compile(true), compile(false));
            let what = format!("{:?}, {micro_batches} micro-batch(es)", optimizer.kind);
            // Three gradients (w0, b0, w1): three sum_squares and two adds become one actor.
            assert_eq!(
                ops(&fused.plan, "sum_squares_group").iter().map(|o| (o.1, o.2)).collect::<Vec<_>>(),
                [(Some(false), 3)],
                "{what}"
            );
            assert_eq!(
                (ops(&fused.plan, "sum_squares").len(), ops(&apart.plan, "sum_squares").len()),
                (0, 3),
                "{what}"
            );
            assert_eq!(fused.plan.actors.len() + 4, apart.plan.actors.len(), "{what}");
            // No register of a fused chain's squares or running totals is left.
            let inner = |plan: &Plan| plan.regst_descs.iter().filter(|d| d.name.starts_with("sum_squares:")).count();
            assert_eq!((inner(&fused.plan), inner(&apart.plan)), (0, 3), "{what}");
            let want = tiny_mlp::train(&apart, apart.plan.clone(), 1, 5, u64::from(micro_batches));
            for threads in [1, 2] {
                let got = tiny_mlp::train(&fused, fused.plan.clone(), threads, 5, u64::from(micro_batches));
                assert_eq!(got, want, "{what}, {threads} threads");
            }
        }
    }
}

/// The MLP on two cpu devices, the batch split; `sharded` also splits every parameter
/// (ZeRO: each device sums the squares of its shards, a partial total boxed after).
fn two_devices(g: &Graph, optimizer: &Optimizer, sharded: bool, fuse_norms: bool) -> CompiledGraph {
    let (step, _) = tiny_mlp::model(g, optimizer);
    let mesh = Mesh::cpu(&[2], &["dp"]).unwrap();
    let parameters: &[&str] = if sharded { &["w0", "b0", "w1"] } else { &[] };
    let split = ["x", "y"].iter().chain(parameters);
    for name in split {
        g.set_layout(g.by_name(name).unwrap(), &mesh, NdSbp(vec![Sbp::Split(0)])).unwrap();
    }
    // Optimizer state replicated unless the parameters are split (left to the compiler, it
    // would be sharded in process: `ParallelOptions::shard_states_in_process`).
    let options =
        ParallelOptions { fuse_norms, shard_states_in_process: false, ..ParallelOptions::new(mesh) }.train(&step);
    g.compile_parallel(&[step.loss], &step.updates, &options).unwrap()
}

#[test]
fn each_device_sums_its_own_gradients_replicated_or_sharded() {
    let optimizer = Optimizer::adamw(5e-2, 1e-2).with_clip_norm(0.5);
    for sharded in [false, true] {
        let (g, h) = (Graph::new(), Graph::new());
        let (fused, apart) = (two_devices(&g, &optimizer, sharded, true), two_devices(&h, &optimizer, sharded, false));
        let groups = ops(&fused.plan, "sum_squares_group");
        assert_eq!(groups.len(), 2, "sharded {sharded}: {groups:?}");
        for (k, (name, carried, inputs)) in groups.iter().enumerate() {
            assert!(name.ends_with(&format!("@{k}")) && *carried == Some(false) && *inputs == 3, "{groups:?}");
        }
        assert_eq!(ops(&fused.plan, "sum_squares").len(), 0);
        let want = tiny_mlp::train(&apart, apart.plan.clone(), 1, 5, 1);
        assert_eq!(tiny_mlp::train(&fused, fused.plan.clone(), 2, 5, 1), want, "sharded {sharded}");
    }
}

/// A chain of squares added to a total made by other ops (here a sum of `w`) carries that
/// total in as its first input, and gives the chain's bits.
#[test]
fn a_chain_after_another_total_carries_it_in() {
    let run = |fuse_norms: bool| {
        let g = Graph::new();
        let w = g.variable("w", [5, 3], DType::F32, Init::Kaiming { seed: 3 }).unwrap();
        let x = g.input("x", [4, 5], DType::F32).unwrap();
        let h = x.matmul(&w).unwrap();
        let mut total = h.sum_to(&regflow::graph::plan::Shape::scalar()).unwrap();
        for t in [x, h, w] {
            total = total.add(&t.sum_squares().unwrap()).unwrap();
        }
        let options = CompileOptions { fuse_norms, ..CompileOptions::default() };
        let compiled = g.compile(&[total], &[], &options).unwrap();
        let groups = ops(&compiled.plan, "sum_squares_group");
        let mut job = Job::builder(compiled.plan.clone()).build().unwrap();
        let mut feeds = job.graph_feeds().unwrap();
        let fetcher = job.graph_fetcher(&compiled.fetches[0]).unwrap();
        let values: Vec<f32> = (0..20).map(|i| (i as f32 - 7.5) / 3.0).collect();
        feeds.push("x", &HostArray::f32([4, 5], values).unwrap()).unwrap();
        feeds.close().unwrap();
        let got = fetcher.recv_scalar().unwrap().unwrap().to_bits();
        drop((feeds, fetcher));
        job.wait().unwrap();
        (groups, got)
    };
    let ((fused_groups, fused), (apart_groups, apart)) = (run(true), run(false));
    assert_eq!(fused_groups.iter().map(|o| (o.1, o.2)).collect::<Vec<_>>(), [(Some(true), 4)]);
    assert!(apart_groups.is_empty());
    assert_eq!(fused, apart);
}
