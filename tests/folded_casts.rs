//! Mixed precision's casts folded into the ops beside them (`graph/src/compile/fold_casts.rs`):
//! in the tiny GPT's bf16 and f16 steps each layer norm writes the 16-bit tensor its
//! block's products read, each layer-norm gradient reads the products' 16-bit input
//! gradient as its `dy`, each residual add reads its block's 16-bit output as it is, and
//! each sum of residual gradients writes its 16-bit copy itself, so all but one lone cast
//! go; training gives the bits of the unfolded plan, on one thread and two, on one device
//! and with the batch split over two.

use crate::common;
use crate::tiny_gpt_runs;

use regflow::graph::plan::{ActorKind, KernelConf, Plan};
use regflow::graph::sbp::Mesh;
use regflow::graph::{CompiledGraph, DType, Graph, ParallelOptions, Precision};
use regflow::plan::ops::{LayerNorm, LayerNormGrad};
use regflow::prelude::*;
use tiny_gpt_runs::RUNS;

/// Two per block and the final one.
const LAYER_NORMS: usize = 2 * RUNS.config.layers + 1;
/// Adds that read a block's (or the logits' product's) 16-bit result through a cast: two
/// residual adds per block (after attention and after the MLP), and the tied token
/// table's gradient, the sum of the logits product's bf16 weight gradient and the
/// embedding's f32 one.
const WIDENING_ADDS: usize = 2 * RUNS.config.layers + 1;
/// The backward pass's sums of residual gradients, each read in f32 by the next and in
/// the low dtype by a block's products: they write that copy as a second output.
const GRADIENT_SUMS: usize = 2 * RUNS.config.layers - 1;
/// Every cast folded: two per layer norm, one per such add and one per such sum.
const FOLDED: usize = 2 * LAYER_NORMS + WIDENING_ADDS + GRADIENT_SUMS;

/// The step compiled on `devices` cpu devices, with the casts folded or not.
fn compile(precision: Precision, devices: usize, fold_casts: bool) -> CompiledGraph {
    compile_on(DeviceKind::Cpu, precision, devices, fold_casts)
}

/// [`compile`] on devices of `kind`.
fn compile_on(kind: DeviceKind, precision: Precision, devices: usize, fold_casts: bool) -> CompiledGraph {
    let g = Graph::new();
    let mesh = Mesh::of_kind(kind, &[devices], &["dp"]).unwrap();
    let step = RUNS.step(&g, &mesh, Some(precision), 1);
    // The tied table's gradient sum stays an add (`tests/folded_table_grads.rs` folds it):
    // one of the adds counted here, whose 16-bit operand's cast folds into it. So do the
    // residual gradients' sums (`tests/folded_norms.rs` folds them with their copies)
    // and the residual adds (the same tests fold them into the norms).
    let options = ParallelOptions {
        fold_casts,
        fold_table_grads: false,
        fold_norm_grads: false,
        fold_norm_inputs: false,
        ..ParallelOptions::new(mesh)
    }
    .train(&step);
    g.compile_parallel(&[step.loss], &step.updates, &options).unwrap()
}

/// The ops of `plan`'s compute actors running `op_type`, with the actor's index.
fn ops<'p>(plan: &'p Plan, op_type: &str) -> Vec<(usize, &'p regflow::graph::plan::OpConf)> {
    plan.actors
        .iter()
        .enumerate()
        .filter_map(|(a, actor)| match &actor.kind {
            ActorKind::Compute { kernel: KernelConf::Op(conf) } if conf.op_type == op_type => Some((a, conf)),
            _ => None,
        })
        .collect()
}

/// Which casts remain: every lone cast between f32 and the low dtype, as `from->to`.
fn casts(plan: &Plan) -> Vec<String> {
    let mut casts: Vec<String> =
        ops(plan, "cast").into_iter().map(|(_, c)| format!("{}->{}", c.inputs[0].dtype, c.outputs[0].dtype)).collect();
    casts.sort();
    casts
}

#[test]
fn layer_norms_and_residual_adds_read_and_write_the_low_dtype_with_the_bits_of_the_casts() {
    for precision in [Precision::Bf16, Precision::F16] {
        let low = if precision == Precision::F16 { DType::F16 } else { DType::Bf16 };
        let (folded, apart) = (compile(precision, 1, true), compile(precision, 1, false));
        let what = format!("{precision:?}");
        // Every layer norm and every gradient of one, folded with its cast.
        let norms = ops(&folded.plan, "layer_norm");
        assert_eq!(norms.len(), LAYER_NORMS, "{what}");
        for (a, conf) in &norms {
            let op: LayerNorm = conf.parse_attrs().unwrap();
            assert_eq!(op.out, Some(low), "{what}: {}", folded.plan.actors[*a].name);
            assert_eq!(conf.outputs[0].dtype, low, "{what}");
        }
        let grads = ops(&folded.plan, "layer_norm_grad");
        assert_eq!(grads.len(), LAYER_NORMS, "{what}");
        for (a, conf) in &grads {
            let op: LayerNormGrad = conf.parse_attrs().unwrap();
            assert_eq!(op.dy, Some(low), "{what}: {}", folded.plan.actors[*a].name);
            assert_eq!(conf.inputs[2].dtype, low, "{what}");
        }
        // Unfolded, none is, and none writes the attributes into the plan (plan files
        // from before keep their bytes).
        for (_, conf) in ops(&apart.plan, "layer_norm").into_iter().chain(ops(&apart.plan, "layer_norm_grad")) {
            assert!(conf.attrs.get("out").is_none() && conf.attrs.get("dy").is_none(), "{what}: {}", conf.attrs);
        }
        // Every residual add reads one 16-bit operand (the block's output) beside the f32
        // stream, and the table's gradient sum its bf16 part; no other binary op mixes dtypes.
        let mixed = |plan: &Plan| {
            ops(plan, "binary")
                .into_iter()
                .filter(|(_, c)| c.inputs.iter().any(|m| m.dtype != c.outputs[0].dtype))
                .count()
        };
        assert_eq!(mixed(&folded.plan), WIDENING_ADDS, "{what}");
        assert_eq!(mixed(&apart.plan), 0, "{what}");
        for (_, conf) in ops(&folded.plan, "binary").into_iter().filter(|(_, c)| c.inputs[0].dtype != c.inputs[1].dtype)
        {
            assert_eq!(conf.outputs[0].dtype, DType::F32, "{what}");
            assert_eq!(conf.attrs, serde_json::json!("Add"), "{what}");
        }
        // Each sum of residual gradients writes its low-dtype copy itself.
        let narrowing_sums: Vec<_> =
            ops(&folded.plan, "binary").into_iter().filter(|(_, c)| c.outputs.len() == 2).collect();
        assert_eq!(narrowing_sums.len(), GRADIENT_SUMS, "{what}");
        for (_, conf) in &narrowing_sums {
            let dtypes: Vec<DType> = conf.outputs.iter().map(|m| m.dtype).collect();
            assert_eq!(dtypes, [DType::F32, low], "{what}");
            assert!(conf.inputs.iter().all(|m| m.dtype == DType::F32), "{what}");
        }
        // One cast to the low dtype per layer norm and per such sum, and one back per layer
        // norm and per such add went, no other cast.
        let (kept, before) = (casts(&folded.plan), casts(&apart.plan));
        let narrowing = |casts: &[String]| casts.iter().filter(|c| c.as_str() == format!("f32->{low}")).count();
        let widening = |casts: &[String]| casts.iter().filter(|c| c.as_str() == format!("{low}->f32")).count();
        assert_eq!(
            narrowing(&kept) + LAYER_NORMS + GRADIENT_SUMS,
            narrowing(&before),
            "{what}: {kept:?} from {before:?}"
        );
        assert_eq!(
            widening(&kept) + LAYER_NORMS + WIDENING_ADDS,
            widening(&before),
            "{what}: {kept:?} from {before:?}"
        );
        assert_eq!(kept.len() + FOLDED, before.len(), "{what}: {kept:?} from {before:?}");
        assert_eq!(folded.plan.actors.len() + FOLDED, apart.plan.actors.len(), "{what}");
        // No cast reads what a layer norm wrote, nor writes what a gradient of one reads.
        let plan = &folded.plan;
        let op_type = |a: usize| match &plan.actors[a].kind {
            ActorKind::Compute { kernel: KernelConf::Op(conf) } => conf.op_type.as_str(),
            _ => "",
        };
        for (c, _) in ops(plan, "cast") {
            let producer = plan.regst_descs[plan.actors[c].inputs[0].index()].producer.index();
            assert_ne!(op_type(producer), "layer_norm", "{what}: {} after a norm", plan.actors[c].name);
        }
        for (g, conf) in &grads {
            let dy = plan.actors[*g].inputs[conf.input_map[2]];
            let producer = plan.regst_descs[dy.index()].producer.index();
            assert_ne!(op_type(producer), "cast", "{what}: dy of {} from a cast", plan.actors[*g].name);
        }
        // No widening cast is read by a binary op alone.
        for (c, conf) in ops(plan, "cast").into_iter().filter(|(_, c)| c.outputs[0].dtype == DType::F32) {
            let readers: Vec<usize> = plan
                .regst_descs
                .iter()
                .filter(|d| d.producer.index() == c && !d.name.starts_with("order:"))
                .flat_map(|d| d.consumers.iter().map(|r| r.index()))
                .collect();
            let alone_by_binary = readers.len() == 1 && op_type(readers[0]) == "binary";
            assert!(!alone_by_binary, "{what}: {} ({:?}) still feeds a binary op", plan.actors[c].name, conf.inputs);
        }
        // The folded plan is plan data like any other: it round-trips through JSON.
        let reloaded = Plan::from_json(&folded.plan.to_json()).unwrap();
        assert_eq!(reloaded, folded.plan, "{what}");

        RUNS.assert_same_bits(&folded, &apart, &what);
    }
}

/// Data parallelism: each device folds its own casts, and the two devices train to the
/// bits of the unfolded plan.
#[test]
fn each_device_of_a_split_batch_folds_its_own_casts_with_the_same_bits() {
    for precision in [Precision::Bf16, Precision::F16] {
        let (folded, apart) = (compile(precision, 2, true), compile(precision, 2, false));
        let what = format!("{precision:?} on two devices");
        for device in 0..2 {
            let on_device = |plan: &Plan, op_type: &str| {
                let suffix = format!("@{device}");
                ops(plan, op_type).iter().filter(|(a, _)| plan.actors[*a].name.ends_with(&suffix)).count()
            };
            let norms = ops(&folded.plan, "layer_norm");
            let folded_norms = norms
                .iter()
                .filter(|(a, c)| {
                    folded.plan.actors[*a].name.ends_with(&format!("@{device}"))
                        && c.parse_attrs::<LayerNorm>().unwrap().out.is_some()
                })
                .count();
            assert_eq!(folded_norms, LAYER_NORMS, "{what}, device {device}");
            let lone = (on_device(&folded.plan, "cast"), on_device(&apart.plan, "cast"));
            assert_eq!(lone.0 + FOLDED, lone.1, "{what}, device {device}: {lone:?}");
        }
        assert_eq!(RUNS.train(&folded, 1), RUNS.train(&apart, 1), "{what}");
    }
}

/// On a GPU the folded kernels give the unfolded plan's bits too: the layer norms' 16-bit
/// outputs and `dy`s and the adds' 16-bit operands go through the cast kernels' own
/// conversions. Without a GPU (NVRTC at hand) the folded plan builds its CUDA kernels and
/// runs to its end on dry-run devices; with neither the test skips.
#[test]
fn on_a_gpu_the_folded_plan_trains_to_the_bits_of_the_unfolded_one() {
    let Some(on_gpu) = common::gpu_or_dry_run() else { return };
    for precision in [Precision::Bf16, Precision::F16] {
        let folded = compile_on(DeviceKind::Cuda, precision, 1, true);
        let apart = compile_on(DeviceKind::Cuda, precision, 1, false);
        assert_eq!(folded.plan.actors.len() + FOLDED, apart.plan.actors.len(), "{precision:?}");
        if on_gpu {
            assert_eq!(RUNS.train(&folded, 1), RUNS.train(&apart, 1), "{precision:?} on a GPU");
        } else {
            RUNS.run_dry(&folded);
        }
    }
}
