//! Compiles a tiny data-parallel MLP onto two `cpu` devices and writes its plan as JSON,
//! the input of the `regflow plan` command-line tool.
//!
//! ```text
//! cargo run --example plan_json -- plan_dp2.json
//! cargo run --bin regflow -- plan show plan_dp2.json
//! cargo run --bin regflow -- plan dot plan_dp2.json -o plan_dp2.dot && dot -Tsvg plan_dp2.dot -o plan_dp2.svg
//! ```
//!
//! The model is the README's "Parallel training from layouts" one: `x: f32[8, 3]` and
//! `y: i64[8]` split along the batch over the mesh axis `dp`, one weight `w: f32[3, 2]`
//! broadcast to both devices, softmax cross-entropy, AdamW. The weight's gradient comes out
//! `Partial` and is all-reduced on each device's comm stream (on its compute stream where
//! this host has fewer than 4 cores: `ParallelOptions::collective_streams`, `Auto`).

use regflow::graph::sbp::{Mesh, NdSbp, Sbp};
use regflow::graph::{DType, Graph, Init, Optimizer, ParallelOptions};

fn main() -> Result<(), regflow::Report> {
    let path = std::env::args().nth(1).ok_or("usage: plan_json <out.json>")?;
    let g = Graph::new();
    let mesh = Mesh::cpu(&[2], &["dp"])?;
    let x = g.input("x", [8, 3], DType::F32)?;
    let y = g.input("y", [8], DType::I64)?;
    g.set_layout(x, &mesh, NdSbp(vec![Sbp::Split(0)]))?;
    g.set_layout(y, &mesh, NdSbp(vec![Sbp::Split(0)]))?;
    let w = g.variable("w", [3, 2], DType::F32, Init::Xavier { seed: 0 })?;
    let loss = x.matmul(&w)?.sparse_cross_entropy(&y)?;
    let step = g.minimize(loss, &Optimizer::adamw(1e-2, 0.0))?;
    let compiled = g.compile_parallel(&[step.loss], &step.updates, &ParallelOptions::new(mesh).train(&step))?;
    std::fs::write(&path, compiled.plan.to_json()).map_err(|e| format!("cannot write {path}: {e}"))?;
    println!("wrote {path}: {} devices, {} actors", compiled.plan.devices.len(), compiled.plan.actors.len());
    Ok(())
}
