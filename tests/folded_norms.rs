//! The residual stream's adds folded into the layer norms beside them: each block's
//! residual gradient summed by its norm's gradient (`graph/src/compile/fold_norm_grads.rs`,
//! `LayerNormGrad::base` and `dx_narrow`), and each residual add done by the norm that
//! reads its sum (`graph/src/compile/fold_norm_inputs.rs`, `LayerNorm::residual`). In the
//! tiny GPT training gives the bits of the unfolded plan in f32, bf16 and f16, on one
//! thread and two, on one device and with the batch split, and on a GPU; plan files keep
//! the folds, and ones that contradict them are refused; a hand-built graph in which a
//! fold would make an op wait on itself keeps its add.

use crate::common;
use crate::tiny_gpt_runs;

use common::ops;
use regflow::graph::plan::{ActorKind, KernelConf, OpConf, Plan};
use regflow::graph::sbp::Mesh;
use regflow::graph::{CompileOptions, CompiledGraph, DType, Graph, HostArray, ParallelOptions, Precision, Tensor};
use regflow::plan::ops::{LayerNorm, LayerNormGrad, OpAttrs};
use regflow::prelude::*;
use tiny_gpt_runs::{low, RUNS};

/// Which of the two folds a plan is compiled with or without.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fold {
    /// `fold_norm_grads`.
    Grads,
    /// `fold_norm_inputs`.
    Inputs,
    /// Both, as the compiler's defaults have them.
    Both,
}

const FOLDS: [Fold; 3] = [Fold::Grads, Fold::Inputs, Fold::Both];

impl Fold {
    /// `options` with this fold on (`folded`) and every other norm fold off.
    fn options(self, folded: bool, options: ParallelOptions) -> ParallelOptions {
        ParallelOptions {
            fold_norm_grads: folded && self != Fold::Inputs,
            fold_norm_inputs: folded && self != Fold::Grads,
            ..options
        }
    }
}

/// The tiny GPT's step in `precision` compiled on `devices` devices of `kind`, its batch
/// split over them, with `fold` on (`folded`) or off; any other norm fold is off.
fn compile(kind: DeviceKind, precision: Option<Precision>, devices: usize, fold: Fold, folded: bool) -> CompiledGraph {
    let g = Graph::new();
    let mesh = Mesh::of_kind(kind, &[devices], &["dp"]).unwrap();
    let step = RUNS.step(&g, &mesh, precision, 1);
    let options = fold.options(folded, ParallelOptions::new(mesh)).train(&step);
    g.compile_parallel(&[step.loss], &step.updates, &options).unwrap()
}

#[test]
fn each_blocks_residual_gradient_is_summed_by_its_norm_gradient_with_the_bits_of_the_add() {
    for precision in [None, Some(Precision::Bf16), Some(Precision::F16)] {
        let folded = compile(DeviceKind::Cpu, precision, 1, Fold::Grads, true);
        let apart = compile(DeviceKind::Cpu, precision, 1, Fold::Grads, false);
        let what = format!("{precision:?}");
        // Two blocks of two layer norms each, and the final one: each block's norms take
        // the residual gradient's sums over (the gradient from above plus their dx), the
        // final norm, where the residual gradient starts, has none to take.
        let grads = ops(&folded.plan, "layer_norm_grad");
        let based: Vec<_> = grads
            .iter()
            .map(|(name, conf)| (name, conf, conf.parse_attrs::<LayerNormGrad>().unwrap()))
            .filter(|(.., op)| op.base)
            .collect();
        assert_eq!((grads.len(), based.len()), (5, 2 * RUNS.config.layers), "{what}: {grads:?}");
        for (name, conf, op) in &based {
            // The base is read as the add read it, f32; in mixed precision the sum's 16-bit
            // copy is written too, where the products read one: all but the first block's
            // first norm, whose sum the embeddings' gradients read in f32.
            assert_eq!(conf.inputs.len(), 4, "{what}: {name}");
            assert_eq!(conf.inputs[3], conf.inputs[0], "{what}: {name}");
            assert!(op.dx_narrow.is_none() || op.dx_narrow == Some(low(precision)), "{what}: {name}");
            assert_eq!(conf.outputs.len(), 3 + usize::from(op.dx_narrow.is_some()), "{what}: {name}");
        }
        let copies = based.iter().filter(|(.., op)| op.dx_narrow.is_some()).count();
        assert_eq!(copies, if precision.is_some() { based.len() - 1 } else { 0 }, "{what}");
        let unfolded = ops(&apart.plan, "layer_norm_grad");
        assert!(unfolded.iter().all(|(_, conf)| conf.attrs.get("base").is_none()), "{what}: {unfolded:?}");
        assert_eq!(folded.plan.actors.len() + based.len(), apart.plan.actors.len(), "{what}: one add fewer each");
        assert_eq!(Plan::from_json(&folded.plan.to_json()).unwrap(), folded.plan, "{what}");
        RUNS.assert_same_bits(&folded, &apart, &what);
    }
}

#[test]
fn each_residual_add_is_done_by_the_norm_reading_its_sum_with_the_bits_of_the_add() {
    for precision in [None, Some(Precision::Bf16), Some(Precision::F16)] {
        let folded = compile(DeviceKind::Cpu, precision, 1, Fold::Inputs, true);
        let apart = compile(DeviceKind::Cpu, precision, 1, Fold::Inputs, false);
        let what = format!("{precision:?}");
        // Every norm but the first reads a residual add's sum (the first reads the
        // embeddings' sum, a broadcast add), whose block output is a product plus its bias:
        // the norm adds the bias too, and in mixed precision reads the product as it was
        // made, 16-bit.
        let norms = ops(&folded.plan, "layer_norm");
        let summing: Vec<_> = norms.iter().filter(|(_, conf)| conf.inputs.len() > 3).collect();
        assert_eq!((norms.len(), summing.len()), (5, 4), "{what}: {norms:?}");
        for (name, conf) in &summing {
            let op: LayerNorm = conf.parse_attrs().unwrap();
            let found = (op.residual, op.summand_bias, conf.inputs.len(), conf.outputs.len());
            assert_eq!(found, (Some(low(precision)), true, 5, 2), "{what}: {name}");
        }
        let unfolded = ops(&apart.plan, "layer_norm");
        assert!(unfolded.iter().all(|(_, conf)| conf.attrs.get("residual").is_none()), "{what}: {unfolded:?}");
        let gone = 2 * summing.len();
        assert_eq!(folded.plan.actors.len() + gone, apart.plan.actors.len(), "{what}: two adds fewer each");
        assert_eq!(Plan::from_json(&folded.plan.to_json()).unwrap(), folded.plan, "{what}");
        RUNS.assert_same_bits(&folded, &apart, &what);
    }
}

/// Both folds together, as the compiler's defaults have them: every residual add and every
/// residual gradient's sum goes, and training gives the bits of neither.
#[test]
fn both_folds_together_train_to_the_bits_of_neither() {
    for precision in [None, Some(Precision::Bf16), Some(Precision::F16)] {
        let folded = compile(DeviceKind::Cpu, precision, 1, Fold::Both, true);
        let apart = compile(DeviceKind::Cpu, precision, 1, Fold::Both, false);
        let what = format!("{precision:?}");
        assert_eq!(folded.plan.actors.len() + 6 * RUNS.config.layers, apart.plan.actors.len(), "{what}");
        RUNS.assert_same_bits(&folded, &apart, &what);
    }
}

/// The batch split over two devices: each device folds its own adds, and training gives
/// the unfolded bits.
#[test]
fn a_split_batch_trains_to_the_same_bits_folded_or_not() {
    for fold in FOLDS {
        for precision in [None, Some(Precision::Bf16)] {
            let folded = compile(DeviceKind::Cpu, precision, 2, fold, true);
            let apart = compile(DeviceKind::Cpu, precision, 2, fold, false);
            assert!(folded.plan.actors.len() < apart.plan.actors.len(), "{fold:?}, {precision:?}");
            assert_eq!(RUNS.train(&folded, 1), RUNS.train(&apart, 1), "{fold:?}, {precision:?}");
        }
    }
}

/// The error a job build gives for the folded bf16 plan of `fold` after `change` rewrote
/// the attributes of its first folded `op_type` op (one with more than 3 inputs).
fn refusal_after(fold: Fold, op_type: &str, change: impl Fn(&mut OpConf)) -> String {
    let folded = compile(DeviceKind::Cpu, Some(Precision::Bf16), 1, fold, true);
    let mut plan = folded.plan.clone();
    let conf = plan
        .actors
        .iter_mut()
        .find_map(|actor| match &mut actor.kind {
            ActorKind::Compute { kernel: KernelConf::Op(conf) } if conf.op_type == op_type && conf.inputs.len() > 3 => {
                Some(conf)
            }
            _ => None,
        })
        .unwrap();
    change(conf);
    Job::builder(plan).build().map(|_| ()).unwrap_err().to_string()
}

/// Plan files whose folded ops contradict their folds (a gradient that lost its base or
/// has a copy of another dtype, a norm that lost its summand or names another dtype for
/// it) are refused at job build with a sentence naming the op and what it must be.
#[test]
fn a_plan_file_that_contradicts_a_fold_is_refused() {
    type Change = fn(LayerNormGrad) -> LayerNormGrad;
    let grad_changes: [(Change, &str); 3] = [
        (|op| LayerNormGrad { base: false, ..op }, "takes 3 inputs"),
        (|op| LayerNormGrad { dx_narrow: Some(DType::F16), ..op }, "the narrow dx must be"),
        (|op| LayerNormGrad { dx_narrow: None, ..op }, "gives 3 outputs"),
    ];
    for (change, says) in grad_changes {
        let err = refusal_after(Fold::Grads, "layer_norm_grad", |conf| {
            conf.attrs = change(conf.parse_attrs().unwrap()).attrs();
        });
        assert!(err.contains("layer_norm_grad") && err.contains(says), "{says}: {err}");
    }
    type NormChange = fn(LayerNorm) -> LayerNorm;
    let norm_changes: [(NormChange, &str); 3] = [
        (|op| LayerNorm { residual: None, summand_bias: false, ..op }, "takes 3 inputs"),
        (|op| LayerNorm { residual: Some(DType::F16), ..op }, "the summand added to the input must be"),
        (|op| LayerNorm { summand_bias: false, ..op }, "takes 4 inputs"),
    ];
    for (change, says) in norm_changes {
        let err = refusal_after(Fold::Inputs, "layer_norm", |conf| {
            conf.attrs = change(conf.parse_attrs().unwrap()).attrs();
        });
        assert!(err.contains("layer_norm") && err.contains(says), "{says}: {err}");
    }
}

/// A graph built by hand from `[4, 8]` f32 inputs `a` and `b` and an `[8]` one `c`.
type Build = for<'g> fn(&'g Graph, [Tensor<'g>; 3]) -> Tensor<'g>;

/// `build`'s graph compiled with `fold` on or off and run once: how many ops the fold made
/// (`op_type` ops of more than 3 inputs) and the output's bytes.
fn run_hand_built(fold: Fold, folded: bool, op_type: &str, build: Build) -> (usize, Vec<u8>) {
    let g = Graph::new();
    let (a, b) = (g.input("a", [4, 8], DType::F32).unwrap(), g.input("b", [4, 8], DType::F32).unwrap());
    let c = g.input("c", [8], DType::F32).unwrap();
    let out = build(&g, [a, b, c]);
    let options = CompileOptions {
        fold_norm_grads: folded && fold != Fold::Inputs,
        fold_norm_inputs: folded && fold != Fold::Grads,
        ..Default::default()
    };
    let compiled = g.compile(&[out], &[], &options).unwrap();
    let made = ops(&compiled.plan, op_type).iter().filter(|(_, conf)| conf.inputs.len() > 3).count();
    let mut job = Job::builder(compiled.plan.clone()).build().unwrap();
    let mut feeds = job.graph_feeds().unwrap();
    let fetched = job.graph_fetcher(&compiled.fetches[0]).unwrap();
    let values = |n: usize, seed: f32| (0..n).map(|i| ((i as f32 + seed) * 0.37).sin()).collect::<Vec<f32>>();
    feeds.push("a", &HostArray::f32([4, 8], values(32, 1.0)).unwrap()).unwrap();
    feeds.push("b", &HostArray::f32([4, 8], values(32, 2.0)).unwrap()).unwrap();
    feeds.push("c", &HostArray::f32([8], values(8, 3.0)).unwrap()).unwrap();
    let got = fetched.recv().unwrap().unwrap();
    feeds.close().unwrap();
    drop((feeds, fetched));
    job.wait().unwrap();
    (made, got.to_le_bytes())
}

/// A layer norm gradient (x `a`, gamma `c`, dy `b`) whose `dx` is summed with its own
/// `dgamma`, broadcast.
fn sum_of_own_gradient<'g>(g: &'g Graph, [a, b, c]: [Tensor<'g>; 3]) -> Tensor<'g> {
    let grads = g.apply(LayerNormGrad::new(1e-5), &[a, c, b]).unwrap();
    let other = grads[1].broadcast_to(&regflow::graph::Shape::new(vec![4, 8])).unwrap();
    grads[0].add(&other).unwrap()
}

/// A layer norm of `a + b` whose scale is that sum's column sums (shift `c`).
fn scale_of_its_sum<'g>(_: &'g Graph, [a, b, c]: [Tensor<'g>; 3]) -> Tensor<'g> {
    let sum = a.add(&b).unwrap();
    let gamma = sum.sum_to(&regflow::graph::Shape::new(vec![8])).unwrap();
    sum.layer_norm(&gamma, &c, 1e-5).unwrap()
}

/// A sum whose other operand is made from the gradient's own parameter gradients, and a
/// norm whose scale is made from the sum it reads (graphs built by hand: autodiff makes
/// neither) keep their adds, since the folded op would wait on itself. Folded or not,
/// each plan runs to the same values.
#[test]
fn a_fold_that_would_make_an_op_wait_on_itself_is_not_made() {
    let cases: [(Fold, &str, Build); 2] =
        [(Fold::Grads, "layer_norm_grad", sum_of_own_gradient), (Fold::Inputs, "layer_norm", scale_of_its_sum)];
    for (fold, op_type, build) in cases {
        let (folded, apart) = (run_hand_built(fold, true, op_type, build), run_hand_built(fold, false, op_type, build));
        assert_eq!(folded.0, 0, "{fold:?}: an add folded into an op it depends on");
        assert_eq!(folded.1, apart.1, "{fold:?}");
    }
}

/// On a GPU both folds give the unfolded plans' bits too. Without a GPU (NVRTC at hand)
/// the folded plans build their CUDA kernels and run to their end on dry-run devices;
/// with neither the test skips.
#[test]
fn on_a_gpu_the_folded_norms_train_to_the_unfolded_bits() {
    let Some(on_gpu) = common::gpu_or_dry_run() else { return };
    for fold in FOLDS {
        for precision in [None, Some(Precision::Bf16)] {
            let folded = compile(DeviceKind::Cuda, precision, 1, fold, true);
            let apart = compile(DeviceKind::Cuda, precision, 1, fold, false);
            let what = format!("{fold:?}, {precision:?}");
            // Per block: 2 gradient sums; 2 residual adds and their 2 bias adds.
            let gone = match fold {
                Fold::Grads => 2,
                Fold::Inputs => 4,
                Fold::Both => 6,
            } * RUNS.config.layers;
            assert_eq!(folded.plan.actors.len() + gone, apart.plan.actors.len(), "{what}");
            if on_gpu {
                assert_eq!(RUNS.train(&folded, 1), RUNS.train(&apart, 1), "{what} on a GPU");
            } else {
                RUNS.run_dry(&folded);
            }
        }
    }
}
