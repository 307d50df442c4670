//! Mixed precision on the actor runtime: an MLP and causal attention built under
//! `Precision::Bf16` train like their f32 twins (losses within 2% per step; the MLP's
//! going down), the MLP plan's per-step registers take fewer bytes (bf16 and f16), plans
//! with bf16 or f16 tensors survive JSON (the f16 one, with its loss scaler, trains the
//! same from the file), and a bf16 input refuses f32 values by name.

use regflow::graph::{CompileOptions, CompiledGraph, DType, Graph, HostArray, Init, Optimizer, Precision, SplitMix64};
use regflow::plan::Plan;

use crate::common;
use regflow::prelude::*;

const BATCH: usize = 64;
const FEATURES: usize = 32;
const HIDDEN: usize = 128;
const CLASSES: usize = 10;

/// Batches whose class is a linear function of the features, so the loss can fall.
fn batches(steps: usize) -> Vec<(HostArray, HostArray)> {
    let mut rng = SplitMix64::new(11);
    let teacher: Vec<f64> = (0..FEATURES * CLASSES).map(|_| rng.next_normal()).collect();
    (0..steps)
        .map(|_| {
            let x: Vec<f32> = (0..BATCH * FEATURES).map(|_| rng.next_normal() as f32).collect();
            let y: Vec<i64> = (0..BATCH)
                .map(|r| {
                    let score = |c: usize| {
                        (0..FEATURES).map(|f| f64::from(x[r * FEATURES + f]) * teacher[f * CLASSES + c]).sum::<f64>()
                    };
                    (0..CLASSES).max_by(|&a, &b| score(a).total_cmp(&score(b))).unwrap_or(0) as i64
                })
                .collect();
            (HostArray::f32([BATCH, FEATURES], x).unwrap(), HostArray::i64([BATCH], y).unwrap())
        })
        .collect()
}

fn compiled(precision: Precision) -> CompiledGraph {
    let g = Graph::new();
    g.mixed_precision(precision).unwrap();
    let loss = common::relu_mlp_loss(&g, (BATCH, FEATURES, HIDDEN, CLASSES));
    let train = g.minimize(loss, &Optimizer::adamw(1e-2, 1e-4)).unwrap();
    g.compile(&[train.loss], &train.updates, &CompileOptions::default()).unwrap()
}

fn losses(precision: Precision, steps: usize) -> Vec<f64> {
    let compiled = compiled(precision);
    let job = Job::builder(compiled.plan.clone()).build().unwrap();
    let feeds = batches(steps).into_iter().map(|(x, y)| vec![("x", x), ("y", y)]).collect();
    common::fed_losses(job, &compiled.fetches[0], feeds, DType::F32)
}

#[test]
fn a_bf16_mlp_trains_like_the_f32_one_on_the_actor_runtime() {
    let steps = 30;
    let (full, mixed) = (losses(Precision::F32, steps), losses(Precision::Bf16, steps));
    assert_eq!(mixed.len(), steps);
    for (step, (f, m)) in full.iter().zip(&mixed).enumerate() {
        assert!((f - m).abs() <= 2e-2 * f.abs(), "step {step}: f32 loss {f}, bf16 loss {m}");
    }
    let mean = |l: &[f64]| l.iter().sum::<f64>() / l.len() as f64;
    assert!(mean(&mixed[steps - 5..]) < 0.7 * mean(&mixed[..5]), "bf16 losses did not fall: {mixed:?}");
}

#[test]
fn the_mixed_precision_plan_holds_smaller_activations() {
    let full = compiled(Precision::F32);
    let bytes = |c: &CompiledGraph| {
        let memory = c.plan.memory().unwrap();
        let device = &memory.devices[0];
        (device.unshared_bytes, device.total_bytes())
    };
    let (full_activations, full_total) = bytes(&full);
    // f16 as bf16: two bytes an element; its loss scaler adds three scalars.
    for precision in [Precision::Bf16, Precision::F16] {
        let mixed = compiled(precision);
        let (mixed_activations, mixed_total) = bytes(&mixed);
        // Activations and their gradients, [64, 128] and [64, 10], are half as wide; the
        // 16-bit copies of the weights ([32, 128], [128, 10]) cost less than that saves.
        assert!(
            mixed_activations * 10 < full_activations * 9,
            "per-step registers: {precision:?} {mixed_activations} bytes, f32 {full_activations} bytes"
        );
        assert!(mixed_total < full_total, "arena: {precision:?} {mixed_total} bytes, f32 {full_total} bytes");
        assert!(mixed.plan.regst_descs.iter().any(|r| r.bytes == (BATCH * HIDDEN * 2) as u64));
    }
}

#[test]
fn a_plan_with_bf16_tensors_round_trips_through_json() {
    let plan = compiled(Precision::Bf16).plan;
    let json = plan.to_json();
    assert!(json.contains("\"bf16\""));
    let back = Plan::from_json(&json).unwrap();
    assert_eq!(back.to_json(), json);
}

/// An f16 plan (f16 tensors, the loss scaler's ops and state) is data like any other: read
/// back from its JSON it trains exactly as the plan it was written from.
#[test]
fn an_f16_plan_with_loss_scaling_runs_the_same_from_its_json() {
    let compiled = compiled(Precision::F16);
    let json = compiled.plan.to_json();
    for needed in ["\"f16\"", "unscale_factor", "loss_scale_update", "loss_scale.scale"] {
        assert!(json.contains(needed), "the plan file names {needed}");
    }
    let back = Plan::from_json(&json).unwrap();
    assert_eq!(back.to_json(), json);
    let run = |plan: Plan| {
        let job = Job::builder(plan).build().unwrap();
        let feeds = batches(8).into_iter().map(|(x, y)| vec![("x", x), ("y", y)]).collect();
        common::fed_losses(job, &compiled.fetches[0], feeds, DType::F32)
    };
    let (direct, from_json) = (run(compiled.plan.clone()), run(back));
    assert_eq!(direct.len(), 8);
    assert_eq!(from_json, direct);
}

#[test]
fn a_bf16_input_refuses_f32_values_by_name() {
    let g = Graph::new();
    g.mixed_precision(Precision::Bf16).unwrap();
    let x = g.input("x", [2, 3], DType::Bf16).unwrap();
    let w = g.variable("w", [3, 2], DType::F32, Init::Ones).unwrap();
    let out = x.matmul(&w).unwrap().cast(DType::F32).unwrap();
    let compiled = g.compile(&[out], &[], &CompileOptions::default()).unwrap();
    let mut job = Job::builder(compiled.plan.clone()).build().unwrap();
    let mut feeds = job.graph_feeds().unwrap();
    let fetcher = job.fetcher(&compiled.fetches[0]).unwrap();
    let err = feeds.push("x", &HostArray::f32([2, 3], vec![1.0; 6]).unwrap()).unwrap_err().to_string();
    assert_eq!(err, "feed for input 'x': got f32[2, 3], expected bf16[2, 3]");
    // The right dtype goes through: ones times ones, three terms.
    feeds.push("x", &HostArray::bf16_from_f32([2, 3], &[1.0; 6]).unwrap()).unwrap();
    feeds.close().unwrap();
    let result: Vec<f32> =
        fetcher.recv().unwrap().bytes().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(result, vec![3.0; 4]);
    drop(fetcher);
    job.wait().unwrap();
}

/// Causal attention over bf16 scores: under `Precision::Bf16` the masked softmax reads the
/// product's bf16 scores as they are and gives their gradient in bf16 (CPU kernels keyed
/// bf16). It builds, runs on the actor runtime, and trains like its f32 twin.
#[test]
fn bf16_attention_trains_like_the_f32_one_on_the_actor_runtime() {
    let (heads, t, d, out) = (4usize, 8usize, 16usize, 5usize);
    let compiled = |precision: Precision| {
        let g = Graph::new();
        g.mixed_precision(precision).unwrap();
        let x = g.input("x", [heads, t, d], DType::F32).unwrap();
        let mask = g.input("mask", [t, t], DType::F32).unwrap();
        let y = g.input("y", [heads * t], DType::I64).unwrap();
        let wq = g.variable("wq", [d, t], DType::F32, Init::Xavier { seed: 1 }).unwrap();
        let wv = g.variable("wv", [t, out], DType::F32, Init::Xavier { seed: 2 }).unwrap();
        let scores = x.matmul(&wq).unwrap();
        let probs = scores.masked_softmax(&mask, 0.5).unwrap();
        let logits = probs.matmul(&wv).unwrap().reshape(&[(heads * t) as isize, out as isize]).unwrap();
        let loss = logits.sparse_cross_entropy(&y).unwrap();
        let train = g.minimize(loss, &Optimizer::adamw(1e-2, 0.0)).unwrap();
        g.compile(&[train.loss], &train.updates, &CompileOptions::default()).unwrap()
    };
    let mut rng = SplitMix64::new(21);
    let causal: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { -1e9 } else { 0.0 }).collect();
    let steps: Vec<_> = (0..12)
        .map(|_| {
            let x: Vec<f32> = (0..heads * t * d).map(|_| rng.next_normal() as f32).collect();
            let y: Vec<i64> = (0..heads * t).map(|i| (i % out) as i64).collect();
            vec![
                ("x", HostArray::f32([heads, t, d], x).unwrap()),
                ("mask", HostArray::f32([t, t], causal.clone()).unwrap()),
                ("y", HostArray::i64([heads * t], y).unwrap()),
            ]
        })
        .collect();
    let run = |precision: Precision| {
        let compiled = compiled(precision);
        let job = Job::builder(compiled.plan.clone()).build().unwrap();
        common::fed_losses(job, &compiled.fetches[0], steps.clone(), DType::F32)
    };
    let (full, mixed) = (run(Precision::F32), run(Precision::Bf16));
    assert_eq!(mixed.len(), full.len());
    for (step, (f, m)) in full.iter().zip(&mixed).enumerate() {
        assert!((f - m).abs() <= 2e-2 * f.abs(), "step {step}: f32 loss {f}, bf16 loss {m}");
    }
}
