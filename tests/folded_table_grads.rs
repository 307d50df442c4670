//! A tied table's two gradients summed by the embedding gradient itself
//! (`graph/src/compile/fold_table_grads.rs`): in the tiny GPT, whose output projection reads
//! the token table, the `add` of the `embedding_grad` scatter and the projection's weight
//! gradient folds into the scatter (through the padded vocabulary's slice and mixed
//! precision's cast), and training gives the bits of the unfolded plan in f32, bf16 and
//! f16, padded or not, on one thread and two, on one device and with the batch split.

use crate::common;
use crate::tiny_gpt_runs;

use common::ops;
use regflow::graph::plan::{ActorKind, KernelConf, Plan};
use regflow::graph::sbp::Mesh;
use regflow::graph::{CompiledGraph, DType, Graph, ParallelOptions, Precision};
use regflow::plan::ops::EmbeddingGrad;
use regflow::prelude::*;
use tiny_gpt_runs::{low, RUNS};

/// How a step is compiled: its precision, the vocabulary's padding multiple (1: none), its
/// devices, and whether the table's gradients fold.
#[derive(Debug, Clone, Copy)]
struct Setup {
    precision: Option<Precision>,
    pad: usize,
    devices: usize,
    fold: bool,
}

/// The tiny GPT's step compiled on `devices` devices of `kind`, its batch split over them.
fn compile(kind: DeviceKind, setup: Setup) -> CompiledGraph {
    let g = Graph::new();
    let mesh = Mesh::of_kind(kind, &[setup.devices], &["dp"]).unwrap();
    let step = RUNS.step(&g, &mesh, setup.precision, setup.pad);
    let options = ParallelOptions { fold_table_grads: setup.fold, ..ParallelOptions::new(mesh) }.train(&step);
    g.compile_parallel(&[step.loss], &step.updates, &options).unwrap()
}

#[test]
fn the_tied_tables_gradient_is_summed_by_its_scatter_with_the_bits_of_the_add() {
    for precision in [None, Some(Precision::Bf16), Some(Precision::F16)] {
        for pad in [1, 8] {
            let setup = Setup { precision, pad, devices: 1, fold: true };
            let (folded, apart) =
                (compile(DeviceKind::Cpu, setup), compile(DeviceKind::Cpu, Setup { fold: false, ..setup }));
            let what = format!("{precision:?}, vocabulary padded to a multiple of {pad}");
            // The one scatter reads the projection's gradient as its base: through the
            // padded vocabulary's slice (16 rows for a table of 13) and, in mixed
            // precision, as the product made it, 16-bit.
            let folded_scatters = ops(&folded.plan, "embedding_grad");
            let [(name, conf)] = folded_scatters.as_slice() else { panic!("{what}: {folded_scatters:?}") };
            let op: EmbeddingGrad = conf.parse_attrs().unwrap();
            assert_eq!(op.base, Some(low(precision)), "{what}: {name}");
            let rows = if pad == 1 { RUNS.vocab } else { 16 };
            assert_eq!(conf.inputs[2].shape.dims(), [rows, RUNS.config.d_model], "{what}: {name}");
            assert_eq!(conf.inputs[2].dtype, low(precision), "{what}");
            let unfolded_scatters = ops(&apart.plan, "embedding_grad");
            let [(_, plain)] = unfolded_scatters.as_slice() else { panic!("{what}: {unfolded_scatters:?}") };
            assert!(plain.attrs.get("base").is_none(), "{what}: {}", plain.attrs);
            // The add goes, and with padding the slice, and in mixed precision the cast
            // (unpadded, fold_casts already made the add read the 16-bit gradient).
            let gone = 1 + usize::from(pad > 1) + usize::from(pad > 1 && precision.is_some());
            assert_eq!(folded.plan.actors.len() + gone, apart.plan.actors.len(), "{what}");
            // A plan file like any other.
            assert_eq!(Plan::from_json(&folded.plan.to_json()).unwrap(), folded.plan, "{what}");

            RUNS.assert_same_bits(&folded, &apart, &what);
        }
    }
}

/// The batch split over two devices: each device's scatter makes a partial gradient;
/// whatever the compiler folds there, training gives the unfolded bits.
#[test]
fn a_split_batch_trains_to_the_same_bits_folded_or_not() {
    for precision in [None, Some(Precision::Bf16)] {
        let setup = Setup { precision, pad: 8, devices: 2, fold: true };
        let (folded, apart) =
            (compile(DeviceKind::Cpu, setup), compile(DeviceKind::Cpu, Setup { fold: false, ..setup }));
        assert_eq!(RUNS.train(&folded, 1), RUNS.train(&apart, 1), "{precision:?}");
    }
}

/// A plan file whose folded scatter contradicts its base is refused at job build with a
/// sentence naming the actor, the base and what it must be.
#[test]
fn a_plan_file_with_a_wrong_base_is_refused() {
    let folded = compile(DeviceKind::Cpu, Setup { precision: Some(Precision::Bf16), pad: 8, devices: 1, fold: true });
    let mut plan = folded.plan.clone();
    let scatter = plan
        .actors
        .iter_mut()
        .find_map(|actor| match &mut actor.kind {
            ActorKind::Compute { kernel: KernelConf::Op(conf) } if conf.op_type == "embedding_grad" => Some(conf),
            _ => None,
        })
        .unwrap();
    let op: EmbeddingGrad = scatter.parse_attrs().unwrap();
    scatter.attrs = regflow::plan::ops::OpAttrs::attrs(&EmbeddingGrad { base: Some(DType::F16), ..op });
    let err = Job::builder(plan).build().map(|_| ()).unwrap_err().to_string();
    assert!(err.contains("embedding_grad") && err.contains("base of f16") && err.contains("bf16"), "{err}");
}

/// On a GPU the folded kernel gives the unfolded plan's bits too (the scatter sums each
/// row in id order, then adds the base as the add did). Without a GPU (NVRTC at hand) the
/// folded plan builds its CUDA kernels and runs to its end on dry-run devices; with
/// neither the test skips.
#[test]
fn on_a_gpu_the_folded_table_gradient_trains_to_the_unfolded_bits() {
    let Some(on_gpu) = common::gpu_or_dry_run() else { return };
    for precision in [None, Some(Precision::Bf16)] {
        let setup = Setup { precision, pad: 8, devices: 1, fold: true };
        let folded = compile(DeviceKind::Cuda, setup);
        let apart = compile(DeviceKind::Cuda, Setup { fold: false, ..setup });
        let gone = 2 + usize::from(precision.is_some());
        assert_eq!(folded.plan.actors.len() + gone, apart.plan.actors.len(), "{precision:?}");
        if on_gpu {
            assert_eq!(RUNS.train(&folded, 1), RUNS.train(&apart, 1), "{precision:?} on a GPU");
        } else {
            RUNS.run_dry(&folded);
        }
    }
}
