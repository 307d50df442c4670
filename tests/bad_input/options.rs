//! Compile options and the fetch and update lists of a step: steps with nothing to pace
//! them, datasets naming what is not an input, register counts of zero.

use crate::{quick, without_gpu, Catalogue};
use regflow::graph::plan::{DatasetConf, DeviceKind, SourcePieces};
use regflow::graph::{CompileOptions, DType, DatasetInputs, Graph, Init};

fn dataset(inputs: &[&str]) -> Option<DatasetInputs> {
    let conf = DatasetConf { path: "records.bin".into(), fields: vec![12, 8], batch: 4, seed: 0, pieces: 1 };
    Some(DatasetInputs { source: SourcePieces::Dataset(conf), inputs: inputs.iter().map(|s| s.to_string()).collect() })
}

#[test]
fn compile_options_and_step_lists() {
    let mut c = Catalogue::new("options");
    let g = Graph::new();
    let x = g.input("x", [4, 3], DType::F32).unwrap();
    let labels = g.input("labels", [4], DType::I64).unwrap();
    let w = g.variable("w", [3, 2], DType::F32, Init::Zeros).unwrap();
    let y = x.matmul(&w).unwrap();
    let loss = y.sparse_cross_entropy(&labels).unwrap();
    let w_only = w.mul_scalar(2.0).unwrap();

    c.case(
        "a step that reads no input",
        || g.compile(&[w_only], &[], &CompileOptions::default()),
        "GraphError::Compile::NoInput",
        &["reads no input", "feed it an input"],
    );
    c.case(
        "a dataset naming a tensor that is not an input",
        || g.compile(&[loss], &[], &CompileOptions { dataset: dataset(&["lables"]), ..Default::default() }),
        "GraphError::Compile::DatasetInput",
        &["'lables'", "did you mean 'labels'"],
    );
    c.case(
        "a dataset naming a variable",
        || g.compile(&[loss], &[], &CompileOptions { dataset: dataset(&["w"]), ..Default::default() }),
        "GraphError::Compile::DatasetInput",
        &["'w'", "not an input"],
    );
    c.case(
        "a dataset producing nothing",
        || g.compile(&[loss], &[], &CompileOptions { dataset: dataset(&[]), ..Default::default() }),
        "GraphError::Compile::EmptyDataset",
        &["no inputs"],
    );
    let compiled = g.compile(&[loss], &[], &CompileOptions { device: DeviceKind::Cuda, ..Default::default() });
    // Refused only where no GPU can run it (CI); a GPU machine runs it.
    if without_gpu() {
        c.case(
            "a one-device plan for cuda, run without a cuda backend",
            || quick(compiled.expect("a cuda plan compiles").plan).build(),
            "RuntimeError::UnsupportedDevice",
            &["node0/cuda:0", "cannot run here", "CUDA"],
        );
    }
    let compiled =
        g.compile(&[loss], &[], &CompileOptions { dataset: dataset(&["x", "labels"]), ..Default::default() });
    c.case(
        "a dataset file that does not exist",
        || quick(compiled.expect("a dataset plan compiles").plan).data_dir("/nonexistent-regflow-dir").build(),
        "RuntimeError::KernelSetup",
        &["actor 'dataset'", "records.bin", "No such file"],
    );
    c.finish();
}

/// Register counts of 0 are raised to 1 without a word (`.max(..)` in
/// graph/src/compile/lower/inputs.rs:35 and graph/src/compile/lower/mod.rs:215).
#[test]
fn register_counts_of_zero_are_refused() {
    let mut c = Catalogue::new("options");
    let g = Graph::new();
    let x = g.input("x", [4, 3], DType::F32).unwrap();
    let labels = g.input("labels", [4], DType::I64).unwrap();
    let w = g.variable("w", [3, 2], DType::F32, Init::Zeros).unwrap();
    let loss = x.matmul(&w).unwrap().sparse_cross_entropy(&labels).unwrap();
    c.case(
        "input registers with 0 slots",
        || g.compile(&[loss], &[], &CompileOptions { input_register_num: 0, ..Default::default() }),
        "GraphError::Compile",
        &["input_register_num", "0"],
    );
    c.case(
        "activation registers with 0 slots",
        || g.compile(&[loss], &[], &CompileOptions { activation_register_num: 0, ..Default::default() }),
        "GraphError::Compile",
        &["activation_register_num", "0"],
    );
    c.finish();
}
