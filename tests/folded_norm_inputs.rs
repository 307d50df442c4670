//! A pre-norm block's residual add done by the layer norm that reads its sum
//! (`graph/src/compile/fold_norm_inputs.rs`): in the tiny GPT every residual add whose sum
//! a layer norm reads (the f32 stream plus, in mixed precision, the block's 16-bit output)
//! folds into that norm, and training gives the bits of the unfolded plan in f32, bf16 and
//! f16, on one thread and two, on one device and with the batch split; plan files keep
//! it, and one that contradicts it is refused.

mod common;
#[allow(dead_code)] // the GPT-2 benchmark's and the pipeline examples' parts go unused here
#[path = "../examples/common/gpt.rs"]
mod gpt;
#[path = "common/tiny_gpt_runs.rs"]
mod tiny_gpt_runs;

use regflow::graph::plan::{ActorKind, KernelConf, Plan};
use regflow::graph::sbp::Mesh;
use regflow::graph::{CompiledGraph, DType, Graph, ParallelOptions, Precision};
use regflow::plan::ops::LayerNorm;
use regflow::prelude::*;
use tiny_gpt_runs::RUNS;

/// The tiny GPT's step in `precision` compiled on `devices` devices of `kind`, its batch
/// split over them, with the residual adds folded into the norms or not.
fn compile(kind: DeviceKind, precision: Option<Precision>, devices: usize, fold: bool) -> CompiledGraph {
    let g = Graph::new();
    let mesh = Mesh::of_kind(kind, &[devices], &["dp"]).unwrap();
    let step = RUNS.step(&g, &mesh, precision, 1);
    let options = ParallelOptions { fold_norm_inputs: fold, ..ParallelOptions::new(mesh) }.train(&step);
    g.compile_parallel(&[step.loss], &step.updates, &options).unwrap()
}

/// The attributes of `plan`'s `layer_norm` ops, with their input and output counts.
fn norms(plan: &Plan) -> Vec<(LayerNorm, usize, usize)> {
    plan.actors
        .iter()
        .filter_map(|actor| match &actor.kind {
            ActorKind::Compute { kernel: KernelConf::Op(conf) } if conf.op_type == "layer_norm" => {
                Some((conf.parse_attrs().unwrap(), conf.inputs.len(), conf.outputs.len()))
            }
            _ => None,
        })
        .collect()
}

#[test]
fn each_residual_add_is_done_by_the_norm_reading_its_sum_with_the_bits_of_the_add() {
    for precision in [None, Some(Precision::Bf16), Some(Precision::F16)] {
        let (folded, apart) =
            (compile(DeviceKind::Cpu, precision, 1, true), compile(DeviceKind::Cpu, precision, 1, false));
        let what = format!("{precision:?}");
        // Two blocks of two norms each and the final one: every norm but the first reads a
        // residual add's sum (the first reads the embeddings' sum, a broadcast add).
        let all = norms(&folded.plan);
        let summing: Vec<_> = all.iter().filter(|(op, ..)| op.residual.is_some()).collect();
        assert_eq!((all.len(), summing.len()), (5, 4), "{what}: {all:?}");
        let summand = match precision {
            Some(Precision::F16) => DType::F16,
            Some(_) => DType::Bf16,
            None => DType::F32,
        };
        for (op, inputs, outputs) in &summing {
            // In mixed precision the block's output is added as the product made it.
            assert_eq!((op.residual, *inputs, *outputs), (Some(summand), 4, 2), "{what}");
        }
        assert!(norms(&apart.plan).iter().all(|(op, ..)| op.residual.is_none()), "{what}");
        assert_eq!(folded.plan.actors.len() + summing.len(), apart.plan.actors.len(), "{what}: one add fewer each");
        assert_eq!(Plan::from_json(&folded.plan.to_json()).unwrap(), folded.plan, "{what}");
        RUNS.assert_same_bits(&folded, &apart, &what);
    }
}

/// The batch split over two devices: each device folds its own adds, and training gives
/// the unfolded bits.
#[test]
fn a_split_batch_trains_to_the_same_bits_folded_or_not() {
    for precision in [None, Some(Precision::Bf16)] {
        let (folded, apart) =
            (compile(DeviceKind::Cpu, precision, 2, true), compile(DeviceKind::Cpu, precision, 2, false));
        assert!(folded.plan.actors.len() < apart.plan.actors.len(), "{precision:?}");
        assert_eq!(RUNS.train(&folded, 1), RUNS.train(&apart, 1), "{precision:?}");
    }
}

/// A plan file whose folded norm has lost its summand, or names another dtype for it, is
/// refused at job build with a sentence naming the op.
#[test]
fn a_plan_file_that_contradicts_its_fold_is_refused() {
    let folded = compile(DeviceKind::Cpu, Some(Precision::Bf16), 1, true);
    for (residual, says) in [(None, "takes 3 inputs"), (Some(DType::F16), "the summand added to the input must be")] {
        let mut plan = folded.plan.clone();
        let conf = plan
            .actors
            .iter_mut()
            .find_map(|actor| match &mut actor.kind {
                ActorKind::Compute { kernel: KernelConf::Op(conf) }
                    if conf.op_type == "layer_norm" && conf.inputs.len() == 4 =>
                {
                    Some(conf)
                }
                _ => None,
            })
            .unwrap();
        let op: LayerNorm = conf.parse_attrs().unwrap();
        conf.attrs = regflow::plan::ops::OpAttrs::attrs(&LayerNorm { residual, ..op });
        let err = Job::builder(plan).build().map(|_| ()).unwrap_err().to_string();
        assert!(err.contains("layer_norm") && err.contains(says), "{says}: {err}");
    }
}

/// A norm whose scale is made from the sum it reads (a graph built by hand) keeps its add:
/// folded, it would wait on itself. Folded or not, the plan runs to the same values.
#[test]
fn a_norm_whose_scale_is_made_from_its_input_keeps_the_add() {
    use regflow::graph::{CompileOptions, HostArray};
    let run = |fold: bool| {
        let g = Graph::new();
        let a = g.input("a", [4, 8], DType::F32).unwrap();
        let b = g.input("b", [4, 8], DType::F32).unwrap();
        let sum = a.add(&b).unwrap();
        let gamma = sum.sum_to(&regflow::graph::Shape::new(vec![8])).unwrap();
        let beta = g.input("beta", [8], DType::F32).unwrap();
        let y = sum.layer_norm(&gamma, &beta, 1e-5).unwrap();
        let options = CompileOptions { fold_norm_inputs: fold, ..Default::default() };
        let compiled = g.compile(&[y], &[], &options).unwrap();
        let summing = norms(&compiled.plan).iter().filter(|(op, ..)| op.residual.is_some()).count();
        let mut job = Job::builder(compiled.plan.clone()).build().unwrap();
        let mut feeds = job.graph_feeds().unwrap();
        let fetched = job.graph_fetcher(&compiled.fetches[0]).unwrap();
        let values = |n: usize, seed: f32| (0..n).map(|i| ((i as f32 + seed) * 0.37).sin()).collect::<Vec<f32>>();
        feeds.push("a", &HostArray::f32([4, 8], values(32, 1.0)).unwrap()).unwrap();
        feeds.push("b", &HostArray::f32([4, 8], values(32, 2.0)).unwrap()).unwrap();
        feeds.push("beta", &HostArray::f32([8], values(8, 3.0)).unwrap()).unwrap();
        let got = fetched.recv().unwrap().unwrap();
        feeds.close().unwrap();
        drop((feeds, fetched));
        job.wait().unwrap();
        (summing, got.to_le_bytes())
    };
    let (folded, apart) = (run(true), run(false));
    assert_eq!(folded.0, 0, "an add folded into the norm whose scale is made from the sum");
    assert_eq!(folded.1, apart.1);
}

/// On a GPU the folded norms give the unfolded plan's bits too. Without a GPU (NVRTC at
/// hand) the folded plan builds its CUDA kernels and runs to its end on dry-run devices;
/// with neither the test skips.
#[test]
fn on_a_gpu_the_folded_norms_train_to_the_unfolded_bits() {
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
