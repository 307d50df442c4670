//! Lifetime-based memory reuse in compiled plans: a 16-layer MLP forward pass needs a
//! fraction of the activation memory, computes the same bits, and the job allocates exactly
//! what the plan predicted before running.

use regflow::graph::{CompileOptions, DType, Graph, Init, SplitMix64};
use regflow::prelude::*;

const BATCH: usize = 32;
const WIDTH: usize = 256;
const LAYERS: usize = 16;

fn forward_plan(reuse_memory: bool) -> (regflow::graph::CompiledGraph, u64) {
    let g = Graph::new();
    let x = g.input("x", [BATCH, WIDTH], DType::F32).unwrap();
    let mut h = x;
    for layer in 0..LAYERS {
        let w =
            g.variable(&format!("w{layer}"), [WIDTH, WIDTH], DType::F32, Init::Kaiming { seed: layer as u64 }).unwrap();
        let b = g.variable(&format!("b{layer}"), [WIDTH], DType::F32, Init::Zeros).unwrap();
        h = h.matmul(&w).unwrap().add(&b).unwrap().relu().unwrap();
    }
    let options = CompileOptions { reuse_memory, ..CompileOptions::default() };
    let compiled = g.compile(&[h], &[], &options).unwrap();
    let bytes = compiled.plan.memory().unwrap().report().total_bytes();
    (compiled, bytes)
}

fn run(compiled: &regflow::graph::CompiledGraph, steps: usize) -> (Vec<Vec<u8>>, u64) {
    let mut job = Job::builder(compiled.plan.clone()).build().unwrap();
    let allocated = job.memory_report().total_bytes();
    let mut feeds = job.graph_feeds().unwrap();
    let out = job.fetcher(&compiled.fetches[0]).unwrap();
    let mut rng = SplitMix64::new(3);
    let mut results = Vec::new();
    for _ in 0..steps {
        let x: Vec<f32> = (0..BATCH * WIDTH).map(|_| rng.next_normal() as f32).collect();
        feeds.push("x", &regflow::graph::HostArray::f32([BATCH, WIDTH], x).unwrap()).unwrap();
        results.push(out.recv().unwrap().bytes().to_vec());
    }
    feeds.close().unwrap();
    drop(out);
    job.wait().unwrap();
    (results, allocated)
}

#[test]
fn lifetime_reuse_cuts_the_activation_peak_and_changes_no_bit() {
    let (shared, shared_bytes) = forward_plan(true);
    let (separate, separate_bytes) = forward_plan(false);
    let activation = (BATCH * WIDTH * 4) as u64;
    // Shared: each layer's three activations (matmul, add, relu; the last relu is fetched, so
    // it keeps its own bytes). The weights and biases are constant registers, written once
    // and never shared or copied. At any moment a layer's input and output are live.
    let memory = shared.plan.memory().unwrap();
    let region: u64 = memory.devices.iter().map(|d| d.shared_bytes).sum();
    let unshared: u64 = memory.devices.iter().map(|d| d.unshared_bytes).sum();
    assert_eq!(unshared, (3 * LAYERS as u64 - 1) * activation, "what is shared");
    assert_eq!(region, 2 * activation, "shared region: the peak of live bytes");
    assert_eq!(separate_bytes - shared_bytes, unshared - region);

    let (a, allocated_shared) = run(&shared, 3);
    let (b, allocated_separate) = run(&separate, 3);
    assert_eq!(a, b, "same outputs, bit for bit");
    assert_eq!((allocated_shared, allocated_separate), (shared_bytes, separate_bytes), "arenas are what the plan said");
}
