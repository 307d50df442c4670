//! The orders the compiler fixes agree with each other: on `cpu` devices, each comm
//! stream's collectives are chained in the order their inputs are made on the compute
//! stream's chain, so a collective whose input is ready never waits behind one whose input
//! comes later (the data-parallel MLP's `dW1` all-reduce once waited about 5 ms behind
//! `dW2`'s all-gather, and the next step's first product for it; BENCHMARKS.md, issue 13,
//! "twelfth"). The rule is the comm streams': with the collectives on the compute streams
//! (`CollectiveStreams::ComputeStreams`, which `Auto` picks on a host of 2 or 3 cores) the
//! compute thread that runs them is the one making their inputs, and their one chain follows
//! the step's estimated schedule instead.

use regflow::graph::plan::Plan;
use regflow::graph::sbp::{Mesh, NdSbp, Sbp};
use regflow::graph::{CollectiveStreams, DType, Graph, Init, Optimizer, ParallelOptions};
use std::collections::HashMap;

/// The benchmark's MLP (784-1024-1024-10, batch 256, AdamW), data parallel over two `cpu`
/// devices; with `sharded`, its AdamW state `S(0)` (ZeRO stage 1).
fn compiled_mlp(sharded: bool) -> Plan {
    let (batch, sizes) = (256usize, [784usize, 1024, 1024, 10]);
    let g = Graph::new();
    let x = g.input("x", [batch, sizes[0]], DType::F32).unwrap();
    let y = g.input("y", [batch], DType::I64).unwrap();
    let mesh = Mesh::cpu(&[2], &["dp"]).unwrap();
    g.set_layout(x, &mesh, NdSbp(vec![Sbp::Split(0)])).unwrap();
    g.set_layout(y, &mesh, NdSbp(vec![Sbp::Split(0)])).unwrap();
    let mut h = x;
    for layer in 0..sizes.len() - 1 {
        let shape = [sizes[layer], sizes[layer + 1]];
        let w = g.variable(&format!("w{layer}"), shape, DType::F32, Init::Kaiming { seed: layer as u64 }).unwrap();
        let b = g.variable(&format!("b{layer}"), [sizes[layer + 1]], DType::F32, Init::Zeros).unwrap();
        h = h.matmul(&w).unwrap().add(&b).unwrap();
        if layer + 2 < sizes.len() {
            h = h.relu().unwrap();
        }
    }
    let loss = h.sparse_cross_entropy(&y).unwrap();
    let train = g.minimize(loss, &Optimizer::adamw(1e-3, 0.0)).unwrap();
    if sharded {
        for (state, _) in &train.states {
            g.set_layout(*state, &mesh, NdSbp(vec![Sbp::Split(0)])).unwrap();
        }
    }
    let options = ParallelOptions { collective_streams: CollectiveStreams::CommStreams, ..ParallelOptions::new(mesh) }
        .train(&train);
    g.compile_parallel(&[train.loss], &train.updates, &options).unwrap().plan
}

/// Actors in the order the zero-byte registers named `prefix…` chain them (each such
/// register from the actor before to the actor after), one list per chain.
fn chains(plan: &Plan, prefix: &str) -> Vec<Vec<usize>> {
    let mut next: HashMap<usize, usize> = HashMap::new();
    for desc in plan.regst_descs.iter().filter(|d| d.name.starts_with(prefix) && d.preloaded == 0) {
        for consumer in &desc.consumers {
            next.insert(desc.producer.index(), consumer.index());
        }
    }
    let followers: std::collections::HashSet<usize> = next.values().copied().collect();
    let mut chains = Vec::new();
    for &first in next.keys().filter(|a| !followers.contains(a)) {
        let mut chain = vec![first];
        while let Some(&after) = next.get(chain.last().unwrap()) {
            chain.push(after);
        }
        chains.push(chain);
    }
    chains
}

fn assert_collectives_follow_their_inputs(plan: &Plan, variant: &str) {
    // Each compute actor's place in its stream's chain.
    let mut position: HashMap<usize, usize> = HashMap::new();
    for chain in chains(plan, "order:") {
        for (p, &a) in chain.iter().enumerate() {
            position.insert(a, p);
        }
    }
    assert!(!position.is_empty(), "{variant}: no compute chain (memory sharing is on by default)");
    let comm = chains(plan, "comm_order@");
    assert!(!comm.is_empty(), "{variant}: no collective chain");
    for chain in comm {
        // Where on its compute chain each collective's input is made: its latest producer.
        let made_at = |c: usize| -> Option<usize> {
            plan.actors[c]
                .inputs
                .iter()
                .map(|r| &plan.regst_descs[r.index()])
                .filter(|d| d.bytes > 0)
                .filter_map(|d| position.get(&d.producer.index()).copied())
                .max()
        };
        let names: Vec<&str> = chain.iter().map(|&c| plan.actors[c].name.as_str()).collect();
        assert!(chain.iter().all(|&c| plan.collective_conf(c).is_some()), "{variant}: {names:?}");
        let made: Vec<Option<usize>> = chain.iter().map(|&c| made_at(c)).collect();
        let known: Vec<usize> = made.iter().flatten().copied().collect();
        assert!(
            known.windows(2).all(|w| w[0] <= w[1]),
            "{variant}: collectives {names:?} are chained in another order than their inputs are made \
             (chain positions of their inputs: {made:?})"
        );
    }
}

#[test]
fn collectives_are_chained_in_the_order_their_inputs_are_made() {
    assert_collectives_follow_their_inputs(&compiled_mlp(false), "data parallel");
    assert_collectives_follow_their_inputs(&compiled_mlp(true), "sharded AdamW state");
}
