//! Mixed precision's casts fused per device (`graph/src/compile/fuse_casts.rs`): a
//! device's weight casts (ready together at a step's start) and gradient casts (read
//! together by its fused update) run as one `cast_group` actor each, and train to the bits
//! of lone casts, in bf16 and f16 (loss scaling), on one device and two, on one thread and
//! two; no all-reduce waits for a group.

use regflow::graph::plan::Plan;
use regflow::graph::{CompileOptions, CompiledGraph, Graph, Optimizer, ParallelOptions, Precision};

use crate::common;

use crate::tiny_mlp;

/// Compute actors running `op_type`: (name, op inputs, (from, to) dtypes of the first).
fn casts(plan: &Plan, op_type: &str) -> Vec<(String, usize, String)> {
    common::ops(plan, op_type)
        .into_iter()
        .map(|(name, c)| (name.to_string(), c.inputs.len(), format!("{}->{}", c.inputs[0].dtype, c.outputs[0].dtype)))
        .collect()
}

fn low_name(precision: Precision) -> &'static str {
    match precision {
        Precision::F16 => "f16",
        _ => "bf16",
    }
}

#[test]
fn one_device_casts_its_weights_and_its_gradients_in_one_actor_each_with_the_bits_of_lone_casts() {
    for precision in [Precision::Bf16, Precision::F16] {
        for optimizer in [Optimizer::adamw(5e-2, 1e-2).with_clip_norm(0.5), Optimizer::sgd(0.1, 0.9, 1e-3)] {
            let g = Graph::new();
            g.mixed_precision(precision).unwrap();
            let (step, _) = tiny_mlp::model(&g, &optimizer);
            let compile = |fuse_casts| {
                let options = CompileOptions { fuse_casts, ..CompileOptions::default() };
                g.compile(&[step.loss], &step.updates, &options).unwrap()
            };
            let (fused, apart) = (compile(true), compile(false));
            let what = format!("{precision:?}, {:?}", optimizer.kind);
            let low = low_name(precision);
            // w0, b0 and w1 to the low dtype at the step's start, their gradients back to f32
            // for the update: two groups of three.
            let mut groups = casts(&fused.plan, "cast_group");
            groups.sort_by(|a, b| a.2.cmp(&b.2));
            let kinds: Vec<(usize, String)> = groups.iter().map(|g| (g.1, g.2.clone())).collect();
            assert_eq!(kinds, [(3, format!("{low}->f32")), (3, format!("f32->{low}"))], "{what}: {groups:?}");
            // The activations' casts (relu's output widened for the loss, its gradient
            // narrowed) each have their own producer and readers: they stay lone casts.
            let lone = (casts(&fused.plan, "cast").len(), casts(&apart.plan, "cast").len());
            assert_eq!(lone.0 + 6, lone.1, "{what}: {lone:?}");
            assert_eq!(fused.plan.actors.len() + 4, apart.plan.actors.len(), "{what}");
            let want = tiny_mlp::train(&apart, apart.plan.clone(), 1, 5, 1);
            for threads in [1, 2] {
                let got = tiny_mlp::train(&fused, fused.plan.clone(), threads, 5, 1);
                assert_eq!(got, want, "{what}, {threads} threads");
            }
        }
    }
}

/// The MLP in bf16 on two cpu devices, the batch split (`bucket_bytes` 0: each gradient
/// its own all-reduce).
fn two_devices(g: &Graph, fuse_casts: bool, bucket_bytes: u64) -> CompiledGraph {
    g.mixed_precision(Precision::Bf16).unwrap();
    let (step, _) = tiny_mlp::model(g, &Optimizer::adamw(5e-2, 1e-2));
    let mesh = tiny_mlp::two_devices(g, &step, false);
    let options = ParallelOptions { fuse_casts, bucket_bytes, ..ParallelOptions::new(mesh) }.train(&step);
    g.compile_parallel(&[step.loss], &step.updates, &options).unwrap()
}

/// Under data parallelism each device groups its own weight casts, and its gradient casts
/// too: the all-reduces read the bf16 gradients (half the bytes) before their casts, each
/// as soon as it is made, and the casts after them feed the update alone. With each
/// gradient its own all-reduce or all in one bucket.
#[test]
fn each_device_groups_its_own_casts_after_the_all_reduces() {
    for bucket_bytes in [0, 1 << 20] {
        let (g, h) = (Graph::new(), Graph::new());
        let (fused, apart) = (two_devices(&g, true, bucket_bytes), two_devices(&h, false, bucket_bytes));
        let groups = casts(&fused.plan, "cast_group");
        let weights: Vec<_> = groups.iter().filter(|c| c.2 == "f32->bf16").collect();
        assert_eq!(weights.len(), 2, "bucket {bucket_bytes}: {groups:?}");
        for (k, (name, inputs, _)) in weights.iter().enumerate() {
            assert!(name.ends_with(&format!("@{k}")) && *inputs == 3, "{groups:?}");
        }
        let gradients = groups.iter().filter(|c| c.2 == "bf16->f32" && c.1 == 3).count();
        assert_eq!(gradients, 2, "bucket {bucket_bytes}: {groups:?}");
        // Every group's inputs are made before it on its device: no all-reduce waits for one.
        for (a, actor) in fused.plan.actors.iter().enumerate() {
            if actor.name.starts_with("box") {
                let reads_a_group = actor.inputs.iter().any(|r| {
                    let producer = &fused.plan.actors[fused.plan.regst_descs[r.index()].producer.index()];
                    producer.name.starts_with("cast:") && producer.name.contains('+')
                });
                assert!(!reads_a_group, "collective {a} '{}' waits for a cast group", actor.name);
            }
        }
        let want = tiny_mlp::train(&apart, apart.plan.clone(), 1, 5, 1);
        assert_eq!(tiny_mlp::train(&fused, fused.plan.clone(), 2, 5, 1), want, "bucket {bucket_bytes}");
    }
}
