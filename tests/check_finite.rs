//! Anomaly checking (`check_finite`): the first op that produces a NaN or an infinity stops
//! the job, named with its step, micro-batch and device; without the option the value flows
//! on (and is fetched as NaN).

use regflow::graph::sbp::{Mesh, NdSbp, Sbp};
use regflow::graph::{CompileOptions, DType, Graph, HostArray, Init, Optimizer, ParallelOptions};
use regflow::prelude::*;
use std::time::Duration;

const WATCHDOG: Duration = Duration::from_secs(10);

/// Runs `plan`, pushing `pieces` of `x` (and of `y` when given); returns the fetched f32
/// values of fetch 0 and how the job ended.
fn run(plan: Plan, fetch: &str, xs: Vec<HostArray>, ys: Option<Vec<HostArray>>) -> (Vec<f32>, Result<(), String>) {
    let mut job = Job::builder(plan).watchdog(WATCHDOG).build().unwrap();
    let mut feeds = job.graph_feeds().unwrap();
    let fetcher = job.fetcher(fetch).unwrap();
    let pusher = std::thread::spawn(move || {
        for (k, x) in xs.iter().enumerate() {
            if feeds.push("x", x).is_err() {
                return;
            }
            if let Some(ys) = &ys {
                if feeds.push("y", &ys[k]).is_err() {
                    return;
                }
            }
        }
        let _ = feeds.close();
    });
    let got: Vec<f32> =
        std::iter::from_fn(|| fetcher.recv()).map(|p| f32::from_le_bytes(p.bytes().try_into().unwrap())).collect();
    drop(fetcher);
    let ended = job.wait().map(|_| ()).map_err(|e| e.to_string());
    pusher.join().unwrap();
    (got, ended)
}

fn x(values: [f32; 4]) -> HostArray {
    HostArray::f32([4, 1], values.to_vec()).unwrap()
}

#[test]
fn the_op_that_makes_a_nan_is_named_with_its_step_and_device() {
    let g = Graph::new();
    let input = g.input("x", [4, 1], DType::F32).unwrap();
    let total = input.log().unwrap().sum_all().unwrap();
    let options = CompileOptions { check_finite: true, ..CompileOptions::default() };
    let compiled = g.compile(&[total], &[], &options).unwrap();
    assert!(compiled.plan.check_finite);
    let pieces = vec![x([1.0; 4]), x([1.0, 2.0, 3.0, -1.0]), x([1.0; 4])];
    let (got, ended) = run(compiled.plan.clone(), &compiled.fetches[0], pieces.clone(), None);
    assert_eq!(got, vec![0.0], "step 0 is delivered, step 1 stops the job");
    let message = ended.unwrap_err();
    assert!(message.contains("check_finite"), "{message}");
    assert!(message.contains("'unary'") || message.contains("log"), "names the op: {message}");
    assert!(message.contains("NaN at element 3"), "names the element: {message}");
    assert!(message.contains("step 1") && message.contains("cpu:0"), "names step and device: {message}");
    assert!(message.contains("its inputs were all finite"), "{message}");
    // Downstream ops are not blamed: the sum never ran on the NaN.
    assert!(!message.contains("sum"), "{message}");

    // Without the option the NaN is computed and fetched.
    let compiled = g.compile(&[total], &[], &CompileOptions::default()).unwrap();
    assert!(!compiled.plan.check_finite);
    let (got, ended) = run(compiled.plan.clone(), &compiled.fetches[0], pieces, None);
    ended.unwrap();
    assert_eq!(got.len(), 3);
    assert!(got[1].is_nan() && got[2] == 0.0, "{got:?}");
}

#[test]
fn on_a_mesh_the_device_that_holds_the_bad_rows_is_named() {
    let g = Graph::new();
    let input = g.input("x", [4, 1], DType::F32).unwrap();
    let mesh = Mesh::cpu(&[2], &["dp"]).unwrap();
    g.set_layout(input, &mesh, NdSbp(vec![Sbp::Split(0)])).unwrap();
    let total = input.sqrt().unwrap().sum_all().unwrap();
    let mut options = ParallelOptions::new(mesh);
    options.check_finite = true;
    let compiled = g.compile_parallel(&[total], &[], &options).unwrap();
    // Rows 2..4 live on device 1.
    let (_, ended) = run(compiled.plan.clone(), &compiled.fetches[0], vec![x([1.0, 4.0, 9.0, -1.0])], None);
    let message = ended.unwrap_err();
    assert!(message.contains("cpu:1") && message.contains("NaN at element 1"), "{message}");
    assert!(!message.contains("cpu:0"), "{message}");
}

#[test]
fn under_accumulation_the_micro_batch_is_named() {
    let g = Graph::new();
    let input = g.input("x", [4, 1], DType::F32).unwrap();
    let labels = g.input("y", [4], DType::I64).unwrap();
    let w = g.variable("w", [1, 3], DType::F32, Init::Xavier { seed: 1 }).unwrap();
    let loss = input.log().unwrap().matmul(&w).unwrap().sparse_cross_entropy(&labels).unwrap();
    let train = g.minimize(loss, &Optimizer::sgd(0.1, 0.0, 0.0)).unwrap();
    let options =
        CompileOptions { check_finite: true, accumulate: Some(train.accumulate(2)), ..CompileOptions::default() };
    let compiled = g.compile(&[train.loss], &train.updates, &options).unwrap();
    let xs = vec![x([1.0; 4]), x([1.0; 4]), x([1.0; 4]), x([2.0, 0.0, 1.0, 1.0])];
    let ys = vec![HostArray::i64([4], vec![0, 1, 2, 0]).unwrap(); 4];
    let (got, ended) = run(compiled.plan.clone(), &compiled.fetches[0], xs, Some(ys));
    assert_eq!(got.len(), 3, "the losses before the bad micro-batch: {got:?}");
    let message = ended.unwrap_err();
    assert!(message.contains("-inf at element 1"), "log(0) is -inf: {message}");
    assert!(message.contains("step 1, micro-batch 1 of 2 (piece 3)"), "{message}");
}
