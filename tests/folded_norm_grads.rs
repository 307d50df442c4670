//! A pre-norm block's residual gradient summed by its layer norm's gradient
//! (`graph/src/compile/fold_norm_grads.rs`): in the tiny GPT every block's `add` of the
//! gradient from above and its first layer norm gradient's `dx` (with, in mixed precision,
//! the sum's 16-bit copy) folds into that layer norm gradient, and training gives the bits
//! of the unfolded plan in f32, bf16 and f16, on one thread and two, on one device and
//! with the batch split; plan files keep it, and one that contradicts it is refused.

mod common;
#[allow(dead_code)] // the GPT-2 benchmark's and the pipeline examples' parts go unused here
#[path = "../examples/common/gpt.rs"]
mod gpt;
#[path = "common/tiny_gpt_runs.rs"]
mod tiny_gpt_runs;

use regflow::graph::plan::{ActorKind, KernelConf, OpConf, Plan};
use regflow::graph::sbp::Mesh;
use regflow::graph::{CompiledGraph, DType, Graph, ParallelOptions, Precision};
use regflow::plan::ops::LayerNormGrad;
use regflow::prelude::*;
use tiny_gpt_runs::RUNS;

/// The tiny GPT's step in `precision` compiled on `devices` devices of `kind`, its batch
/// split over them, with the residual gradients' sums folded or not.
fn compile(kind: DeviceKind, precision: Option<Precision>, devices: usize, fold: bool) -> CompiledGraph {
    let g = Graph::new();
    let mesh = Mesh::of_kind(kind, &[devices], &["dp"]).unwrap();
    let step = RUNS.step(&g, &mesh, precision, 1);
    let options = ParallelOptions { fold_norm_grads: fold, ..ParallelOptions::new(mesh) }.train(&step);
    g.compile_parallel(&[step.loss], &step.updates, &options).unwrap()
}

/// The `layer_norm_grad` ops of `plan`, with their attributes.
fn norm_grads(plan: &Plan) -> Vec<(&str, &OpConf, LayerNormGrad)> {
    plan.actors
        .iter()
        .filter_map(|actor| match &actor.kind {
            ActorKind::Compute { kernel: KernelConf::Op(conf) } if conf.op_type == "layer_norm_grad" => {
                Some((actor.name.as_str(), conf, conf.parse_attrs().unwrap()))
            }
            _ => None,
        })
        .collect()
}

#[test]
fn each_blocks_residual_gradient_is_summed_by_its_norm_gradient_with_the_bits_of_the_add() {
    for precision in [None, Some(Precision::Bf16), Some(Precision::F16)] {
        let (folded, apart) =
            (compile(DeviceKind::Cpu, precision, 1, true), compile(DeviceKind::Cpu, precision, 1, false));
        let what = format!("{precision:?}");
        // Two blocks of two layer norms each, and the final one: each block's norms take
        // the residual gradient's sums over (the gradient from above plus their dx), the
        // final norm, where the residual gradient starts, has none to take.
        let grads = norm_grads(&folded.plan);
        let based: Vec<_> = grads.iter().filter(|(_, _, op)| op.base).collect();
        assert_eq!(grads.len(), 5, "{what}: {grads:?}");
        assert_eq!(based.len(), 2 * RUNS.config.layers, "{what}: {grads:?}");
        let narrow = match precision {
            Some(Precision::F16) => Some(DType::F16),
            Some(_) => Some(DType::Bf16),
            None => None,
        };
        for (name, conf, op) in &based {
            // The base is read as the add read it, f32; in mixed precision the sum's 16-bit
            // copy is written too, where the products read one: all but the first block's
            // first norm, whose sum the embeddings' gradients read in f32.
            assert_eq!(conf.inputs.len(), 4, "{what}: {name}");
            assert_eq!(conf.inputs[3], conf.inputs[0], "{what}: {name}");
            assert!(op.dx_narrow.is_none() || op.dx_narrow == narrow, "{what}: {name}");
            assert_eq!(conf.outputs.len(), 3 + usize::from(op.dx_narrow.is_some()), "{what}: {name}");
        }
        let copies = based.iter().filter(|(_, _, op)| op.dx_narrow.is_some()).count();
        assert_eq!(copies, if narrow.is_some() { based.len() - 1 } else { 0 }, "{what}");
        assert!(norm_grads(&apart.plan).iter().all(|(_, conf, op)| !op.base && conf.attrs.get("base").is_none()));
        assert_eq!(folded.plan.actors.len() + based.len(), apart.plan.actors.len(), "{what}: one add fewer each");
        // A plan file like any other.
        assert_eq!(Plan::from_json(&folded.plan.to_json()).unwrap(), folded.plan, "{what}");

        RUNS.assert_same_bits(&folded, &apart, &what);
    }
}

/// The batch split over two devices: each device folds its own blocks' sums, and
/// training gives the unfolded bits.
#[test]
fn a_split_batch_trains_to_the_same_bits_folded_or_not() {
    for precision in [None, Some(Precision::Bf16)] {
        let (folded, apart) =
            (compile(DeviceKind::Cpu, precision, 2, true), compile(DeviceKind::Cpu, precision, 2, false));
        assert!(folded.plan.actors.len() < apart.plan.actors.len(), "{precision:?}");
        assert_eq!(RUNS.train(&folded, 1), RUNS.train(&apart, 1), "{precision:?}");
    }
}

/// A plan file whose folded gradient has lost its base (or whose copy is of the wrong
/// dtype) is refused at job build with a sentence naming the op and what it must be.
#[test]
fn a_plan_file_that_contradicts_its_fold_is_refused() {
    let folded = compile(DeviceKind::Cpu, Some(Precision::Bf16), 1, true);
    for (change, says) in [
        (
            (|op: LayerNormGrad| LayerNormGrad { base: false, ..op }) as fn(LayerNormGrad) -> LayerNormGrad,
            "takes 3 inputs",
        ),
        (|op| LayerNormGrad { dx_narrow: Some(DType::F16), ..op }, "the narrow dx must be"),
        (|op| LayerNormGrad { dx_narrow: None, ..op }, "gives 3 outputs"),
    ] {
        let mut plan = folded.plan.clone();
        let conf = plan
            .actors
            .iter_mut()
            .find_map(|actor| match &mut actor.kind {
                ActorKind::Compute { kernel: KernelConf::Op(conf) }
                    if conf.op_type == "layer_norm_grad" && conf.inputs.len() == 4 =>
                {
                    Some(conf)
                }
                _ => None,
            })
            .unwrap();
        let op: LayerNormGrad = conf.parse_attrs().unwrap();
        conf.attrs = regflow::plan::ops::OpAttrs::attrs(&change(op));
        let err = Job::builder(plan).build().map(|_| ()).unwrap_err().to_string();
        assert!(err.contains("layer_norm_grad") && err.contains(says), "{says}: {err}");
    }
}

/// On a GPU the folded gradient gives the unfolded plan's bits too. Without a GPU (NVRTC
/// at hand) the folded plan builds its CUDA kernels and runs to its end on dry-run
/// devices; with neither the test skips.
#[test]
fn on_a_gpu_the_folded_residual_gradients_train_to_the_unfolded_bits() {
    let Some(on_gpu) = common::gpu_or_dry_run() else { return };
    for precision in [None, Some(Precision::Bf16)] {
        let folded = compile(DeviceKind::Cuda, precision, 1, true);
        let apart = compile(DeviceKind::Cuda, precision, 1, false);
        assert_eq!(folded.plan.actors.len() + 2 * RUNS.config.layers, apart.plan.actors.len(), "{precision:?}");
        if on_gpu {
            assert_eq!(RUNS.train(&folded, 1), RUNS.train(&apart, 1), "{precision:?} on a GPU");
        } else {
            RUNS.run_dry(&folded);
        }
    }
}

/// A sum whose other operand is made from the gradient's own parameter gradients (a graph
/// built by hand: autodiff never makes one) does not fold, since the gradient would then
/// wait on itself; the plan builds and runs, folded or not, to the same values.
#[test]
fn a_sum_made_from_the_gradients_own_outputs_stays_an_add() {
    use regflow::graph::{CompileOptions, HostArray, Shape};
    let run = |fold: bool| {
        let g = Graph::new();
        let x = g.input("x", [4, 8], DType::F32).unwrap();
        let gamma = g.input("gamma", [8], DType::F32).unwrap();
        let dy = g.input("dy", [4, 8], DType::F32).unwrap();
        let grads = g.apply(LayerNormGrad::new(1e-5), &[x, gamma, dy]).unwrap();
        let other = grads[1].broadcast_to(&Shape::new(vec![4, 8])).unwrap();
        let out = grads[0].add(&other).unwrap();
        let options = CompileOptions { fold_norm_grads: fold, ..Default::default() };
        let compiled = g.compile(&[out], &[], &options).unwrap();
        let based = norm_grads(&compiled.plan).iter().filter(|(_, _, op)| op.base).count();
        let mut job = Job::builder(compiled.plan.clone()).build().unwrap();
        let mut feeds = job.graph_feeds().unwrap();
        let fetched = job.graph_fetcher(&compiled.fetches[0]).unwrap();
        let values = |n: usize, seed: f32| (0..n).map(|i| ((i as f32 + seed) * 0.37).sin()).collect::<Vec<f32>>();
        feeds.push("x", &HostArray::f32([4, 8], values(32, 1.0)).unwrap()).unwrap();
        feeds.push("gamma", &HostArray::f32([8], values(8, 2.0)).unwrap()).unwrap();
        feeds.push("dy", &HostArray::f32([4, 8], values(32, 3.0)).unwrap()).unwrap();
        let got = fetched.recv().unwrap().unwrap();
        feeds.close().unwrap();
        drop((feeds, fetched));
        job.wait().unwrap();
        (based, got.to_le_bytes())
    };
    let (folded, apart) = (run(true), run(false));
    assert_eq!(folded.0, 0, "a sum made from dgamma folded into the gradient that makes dgamma");
    assert_eq!(folded.1, apart.1);
}
