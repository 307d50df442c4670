//! A variable nobody updates is a constant register: every slot holds its value from the
//! job's start, a no-op hands it out each step, and no step copies it; preloading a value,
//! reading state back and memory sharing all respect it.

use regflow::graph::plan::{ActorKind, KernelConf};
use regflow::graph::{CompileOptions, DType, Graph, HostArray, Init};
use regflow::prelude::*;

fn forward() -> regflow::graph::CompiledGraph {
    let g = Graph::new();
    let x = g.input("x", [2, 3], DType::F32).unwrap();
    let w = g.variable("w", [3, 2], DType::F32, Init::Constant(1.0)).unwrap();
    let y = x.matmul(&w).unwrap().relu().unwrap();
    g.compile(&[y], &[], &CompileOptions::default()).unwrap()
}

#[test]
fn a_forward_plan_hands_its_weights_out_without_a_copy() {
    let compiled = forward();
    let plan = &compiled.plan;
    assert_eq!(plan.variables.len(), 1);
    let variable = &plan.variables[0];
    assert!(variable.constant, "{variable:?}");
    let desc = &plan.regst_descs[variable.regst.index()];
    assert_eq!((desc.name.as_str(), desc.preloaded, desc.shared_offset), ("w", 0, None));
    let producer = &plan.actors[desc.producer.index()];
    assert!(matches!(producer.kind, ActorKind::Compute { kernel: KernelConf::Noop }), "{:?}", producer.kind);
    assert!(
        !plan.actors.iter().any(|a| matches!(a.kind, ActorKind::Compute { kernel: KernelConf::Copy })),
        "no actor copies a weight"
    );
    // The plan file round-trips the flag.
    let reread = Plan::from_json(&plan.to_json()).unwrap();
    assert!(reread.variables[0].constant);
}

fn run(plan: Plan, value: Option<HostArray>, steps: usize) -> (Vec<Vec<f32>>, Vec<(String, HostArray)>) {
    let mut builder = Job::builder(plan).keep_state();
    if let Some(value) = value {
        builder = builder.preload_variable("w", value);
    }
    let mut job = builder.build().unwrap();
    let mut feeds = job.graph_feeds().unwrap();
    let out = job.graph_fetcher("fetch:0").unwrap();
    let mut got = Vec::new();
    for k in 0..steps {
        let x = HostArray::f32([2, 3], vec![1.0, 2.0, 3.0, -1.0, 0.5, k as f32]).unwrap();
        feeds.push("x", &x).unwrap();
        got.push(out.recv().unwrap().unwrap().to_f64_vec().iter().map(|&v| v as f32).collect());
    }
    feeds.close().unwrap();
    drop(out);
    let report = job.wait().unwrap();
    (got, report.state.unwrap())
}

#[test]
fn every_step_reads_the_initial_or_preloaded_value_and_state_reads_it_back() {
    let compiled = forward();
    let (got, state) = run(compiled.plan.clone(), None, 4);
    for (k, row) in got.iter().enumerate() {
        // relu(x · 1): each output is the row sum of x.
        assert_eq!(row, &vec![6.0, 6.0, (-0.5 + k as f32).max(0.0), (-0.5 + k as f32).max(0.0)], "step {k}");
    }
    assert_eq!(state, vec![("w".to_string(), HostArray::f32([3, 2], vec![1.0; 6]).unwrap())]);

    let value = HostArray::f32([3, 2], vec![1.0, 0.0, 0.0, 1.0, 0.0, 0.0]).unwrap();
    let (got, state) = run(compiled.plan.clone(), Some(value.clone()), 3);
    for row in &got {
        assert_eq!(&row[..2], &[1.0, 2.0], "x · w picks the first two columns");
    }
    assert_eq!(state, vec![("w".to_string(), value)]);
}
