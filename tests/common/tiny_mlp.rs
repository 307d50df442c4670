//! A 12-16-5 MLP the optimizer-update tests train (`in_place_updates.rs`,
//! `fused_updates.rs`, `collectives_on_compute.rs`, ...): its graph, its layout on two
//! data-parallel devices, its batches, and a job that trains it and returns the losses'
//! bits and every variable's final value, for comparisons bit for bit.
#![allow(dead_code)] // each test file uses some of it

use regflow::graph::plan::Plan;
use regflow::graph::sbp::{Mesh, NdSbp, Sbp};
use regflow::graph::{CompiledGraph, DType, Graph, HostArray, Init, Optimizer, SplitMix64, Tensor, TrainStep};
use regflow::prelude::*;

/// Rows per batch.
pub(crate) const BATCH: usize = 8;

/// The MLP with a loss, trained by `optimizer` (three parameters: `w0`, `b0`, `w1`), and
/// its first weight.
pub(crate) fn model<'g>(g: &'g Graph, optimizer: &Optimizer) -> (TrainStep<'g>, Tensor<'g>) {
    let x = g.input("x", [BATCH, 12], DType::F32).unwrap();
    let y = g.input("y", [BATCH], DType::I64).unwrap();
    let w0 = g.variable("w0", [12, 16], DType::F32, Init::Kaiming { seed: 1 }).unwrap();
    let b0 = g.variable("b0", [16], DType::F32, Init::Zeros).unwrap();
    let w1 = g.variable("w1", [16, 5], DType::F32, Init::Kaiming { seed: 2 }).unwrap();
    let h = x.matmul(&w0).unwrap().add(&b0).unwrap().relu().unwrap();
    let loss = h.matmul(&w1).unwrap().sparse_cross_entropy(&y).unwrap();
    (g.minimize(loss, optimizer).unwrap(), w0)
}

/// Two data-parallel cpu devices for the MLP in `g`: its inputs split `S(0)` over `dp`,
/// and every optimizer state of `step` split too where `sharded_state` (ZeRO stage 1), else
/// pinned `Broadcast` (left to the compiler, states of one process's cpu devices are
/// sharded where their rows allow: `ParallelOptions::shard_states_in_process`).
pub(crate) fn two_devices(g: &Graph, step: &TrainStep<'_>, sharded_state: bool) -> Mesh {
    let mesh = Mesh::cpu(&[2], &["dp"]).unwrap();
    for name in ["x", "y"] {
        g.set_layout(g.by_name(name).unwrap(), &mesh, NdSbp(vec![Sbp::Split(0)])).unwrap();
    }
    let layout = if sharded_state { Sbp::Split(0) } else { Sbp::Broadcast };
    for (state, _) in &step.states {
        g.set_layout(*state, &mesh, NdSbp(vec![layout])).unwrap();
    }
    mesh
}

/// Batch `k` (the same for every run).
pub(crate) fn batch(k: u64) -> [(&'static str, HostArray); 2] {
    let mut rng = SplitMix64::new(50 + k);
    let x = (0..BATCH * 12).map(|_| rng.next_normal() as f32).collect();
    let y = (0..BATCH).map(|_| (rng.next_u64() % 5) as i64).collect();
    [("x", HostArray::f32([BATCH, 12], x).unwrap()), ("y", HostArray::i64([BATCH], y).unwrap())]
}

/// Losses (as bits) and final state of `steps` steps of `plan` (compiled as `compiled`) on
/// `threads` threads per device, `pieces` fed pieces per step (micro-batches), fed on
/// every device.
pub(crate) fn train(
    compiled: &CompiledGraph,
    plan: Plan,
    threads: usize,
    steps: u64,
    pieces: u64,
) -> (Vec<u64>, Vec<(String, HostArray)>) {
    let mut job = Job::builder(plan).cpu_threads(threads).keep_state().build().unwrap();
    let mut feeds = job.graph_feeds().unwrap();
    let losses = job.graph_fetcher(&compiled.fetches[0]).unwrap();
    let mut got = Vec::new();
    for k in 0..steps * pieces {
        for (name, value) in batch(k) {
            feeds.push(name, &value).unwrap();
        }
        got.push(losses.recv_scalar().unwrap().unwrap().to_bits());
    }
    feeds.close().unwrap();
    drop((feeds, losses));
    let report = job.wait().unwrap();
    assert_eq!(report.lane_waits, 0, "a message between stream threads found its lane full");
    (got, report.state.unwrap())
}
