//! The small MLP (6 features, a hidden layer, 3 classes) the layout tests train across
//! nodes: its layouts (stage meshes and pinned tensors), its graph and its batches.
#![allow(dead_code)] // each test file uses some of them

use regflow::graph::sbp::{Mesh, NdSbp, Sbp};
use regflow::graph::{DType, Graph, HostArray, Init, Optimizer, SplitMix64, TrainStep};

/// A layout: the stages' meshes (one unless pipelined), the tensors pinned on them, and
/// the micro-batches a step is fed as.
#[derive(Clone)]
pub(crate) struct Layout {
    pub(crate) stages: Vec<Mesh>,
    pub(crate) pins: Vec<(&'static str, Vec<Sbp>)>,
    pub(crate) micro_batches: u32,
}

impl Layout {
    /// One mesh of node-0 cpu devices, one micro-batch per step.
    pub(crate) fn new(shape: &[usize], axes: &[&str], pins: Vec<(&'static str, Vec<Sbp>)>) -> Self {
        Self::on(vec![Mesh::cpu(shape, axes).unwrap()], pins)
    }

    /// These stages, one micro-batch per step.
    pub(crate) fn on(stages: Vec<Mesh>, pins: Vec<(&'static str, Vec<Sbp>)>) -> Self {
        Self { stages, pins, micro_batches: 1 }
    }

    /// The same layout with its devices spread over nodes of `per_node` devices.
    pub(crate) fn on_nodes(&self, per_node: usize) -> Self {
        let stages = self.stages.iter().map(|m| m.place_on_nodes(per_node).unwrap()).collect();
        Self { stages, ..self.clone() }
    }

    /// Nodes its devices sit on.
    pub(crate) fn nodes(&self) -> u16 {
        self.stages.iter().flat_map(|m| m.devices()).map(|d| d.node).max().unwrap_or(0) + 1
    }
}

/// Sharded optimizer state (ZeRO stage 1) on a 1-axis mesh: the inputs split by rows and
/// every AdamW moment `S(0)`, the weights left replicated.
pub(crate) fn sharded_state_pins() -> Vec<(&'static str, Vec<Sbp>)> {
    let moments =
        ["w1.adam_m", "w1.adam_v", "b1.adam_m", "b1.adam_v", "w2.adam_m", "w2.adam_v", "b2.adam_m", "b2.adam_v"];
    let inputs = ["x", "y"];
    inputs.into_iter().chain(moments).map(|name| (name, vec![Sbp::Split(0)])).collect()
}

/// `steps` batches of `batch` rows: normal features, classes 0..3, from `seed`.
pub(crate) fn batches(steps: usize, batch: usize, seed: u64) -> Vec<(HostArray, HostArray)> {
    let mut rng = SplitMix64::new(seed);
    (0..steps)
        .map(|_| {
            let x: Vec<f32> = (0..batch * 6).map(|_| rng.next_normal() as f32).collect();
            let y: Vec<i64> = (0..batch).map(|_| (rng.next_u64() % 3) as i64).collect();
            (HostArray::f32([batch, 6], x).unwrap(), HostArray::i64([batch], y).unwrap())
        })
        .collect()
}

/// The 2-layer MLP on `batch` rows (fed as the layout's micro-batches) with `hidden`
/// units; under a 2-stage layout its second layer runs on the second stage.
pub(crate) fn model<'g>(g: &'g Graph, layout: &Layout, batch: usize, hidden: usize) -> TrainStep<'g> {
    let rows = batch / layout.micro_batches as usize;
    let x = g.input("x", [rows, 6], DType::F32).unwrap();
    let y = g.input("y", [rows], DType::I64).unwrap();
    let w1 = g.variable("w1", [6, hidden], DType::F32, Init::Kaiming { seed: 1 }).unwrap();
    let b1 = g.variable("b1", [hidden], DType::F32, Init::Normal { mean: 0.0, std: 0.1, seed: 3 }).unwrap();
    let w2 = g.variable("w2", [hidden, 3], DType::F32, Init::Xavier { seed: 2 }).unwrap();
    let b2 = g.variable("b2", [3], DType::F32, Init::Normal { mean: 0.0, std: 0.1, seed: 4 }).unwrap();
    let first = &layout.stages[0];
    let last = layout.stages.last().unwrap();
    // The second layer and its labels live on the last stage when there are two.
    let stage_of = |name: &str| if layout.stages.len() > 1 && matches!(name, "w2" | "b2" | "y") { last } else { first };
    for t in [x, y, w1, b1, w2, b2] {
        let name = t.name();
        let mesh = stage_of(&name);
        let sbp = layout.pins.iter().find(|(n, _)| *n == name).map(|(_, s)| s.clone());
        g.set_layout(t, mesh, NdSbp(sbp.unwrap_or_else(|| vec![Sbp::Broadcast; mesh.ndim()]))).unwrap();
    }
    let mut h = x.matmul(&w1).unwrap().add(&b1).unwrap().relu().unwrap();
    if layout.stages.len() > 1 {
        h = h.to_placement(last).unwrap();
    }
    let loss = h.matmul(&w2).unwrap().add(&b2).unwrap().sparse_cross_entropy(&y).unwrap();
    let train = g.minimize(loss, &Optimizer::adamw(1e-2, 1e-3).with_clip_norm(1.0)).unwrap();
    // Optimizer state (`w1.adam_m`, …) exists only now; pinned, it leaves its parameter's
    // layout (sharded optimizer state).
    for (state, param) in &train.states {
        if let Some((_, sbp)) = layout.pins.iter().find(|(n, _)| *n == state.name()) {
            g.set_layout(*state, stage_of(&param.name()), NdSbp(sbp.clone())).unwrap();
        }
    }
    train
}
