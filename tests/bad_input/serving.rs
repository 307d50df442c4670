//! Serving and training-API input (issue 16): requests whose inputs do not fit the model,
//! models that cannot be served as asked, state dicts that do not fit the plan.

use crate::Catalogue;
use regflow::graph::{CompileOptions, DType, Graph, HostArray, Init};
use regflow::prelude::*;
use regflow_serve::Model;
use std::time::Duration;

fn plan(rows: usize) -> Plan {
    let g = Graph::new();
    let x = g.input("x", [rows, 3], DType::F32).unwrap();
    let w = g.variable("w", [3, 2], DType::F32, Init::Zeros).unwrap();
    let y = x.matmul(&w).unwrap();
    g.compile(&[y], &[], &CompileOptions::default()).unwrap().plan
}

fn rows(n: usize) -> HostArray {
    HostArray::f32([n, 3], vec![0.5; 3 * n]).unwrap()
}

#[test]
fn requests_and_models() {
    let mut c = Catalogue::new("serving");
    let batched = Model::builder(plan(4)).dynamic_batching(Duration::from_micros(100)).build().unwrap();
    let single = Model::builder(plan(4)).build().unwrap();
    c.case(
        "a request for an unknown input",
        || batched.infer([("xx", rows(1))]),
        "ServeError::BadInput",
        &["'xx'", "did you mean 'x'"],
    );
    c.case(
        "a request with more rows than a piece",
        || batched.infer([("x", rows(5))]),
        "ServeError::BadInput",
        &["'x'", "1 <= n <= 4", "f32[5, 3]"],
    );
    c.case(
        "a request of another dtype",
        || batched.infer([("x", HostArray::f64([1, 3], vec![0.0; 3]).unwrap())]),
        "ServeError::BadInput",
        &["'x'", "f64[1, 3]"],
    );
    c.case(
        "a request missing its input",
        || batched.infer(Vec::<(&str, HostArray)>::new()),
        "ServeError::BadInput",
        &["'x'", "missing"],
    );
    c.case(
        "a request giving an input twice",
        || batched.infer([("x", rows(1)), ("x", rows(1))]),
        "ServeError::BadInput",
        &["'x'", "twice"],
    );
    c.case(
        "an unbatched request of another shape",
        || single.infer([("x", rows(2))]),
        "ServeError::BadInput",
        &["'x'", "f32[4, 3]", "f32[2, 3]"],
    );
    c.case(
        "a request with a deadline already past",
        || single.infer_within([("x", rows(4))], Duration::ZERO),
        "ServeError::DeadlineExceeded",
        &["deadline of 0ns"],
    );
    c.case(
        "a queue of no requests",
        || Model::builder(plan(4)).queue_capacity(0).build(),
        "ServeError::Setup",
        &["queue 0"],
    );
    c.case(
        "batching a plan whose output has no batch dimension",
        || {
            let g = Graph::new();
            let x = g.input("x", [4, 3], DType::F32).unwrap();
            let total = x.sum_all().unwrap();
            let plan = g.compile(&[total], &[], &CompileOptions::default()).unwrap().plan;
            Model::builder(plan).dynamic_batching(Duration::from_millis(1)).build()
        },
        "ServeError::Setup",
        &["batch as its first dimension", "'fetch:0' is f32[]"],
    );
    c.case(
        "serving a hand-built plan without a signature",
        || Model::builder(crate::feeds::fed_chain()).build(),
        "ServeError::Setup",
        &["0 input(s)", "compile it from a graph"],
    );
    c.case(
        "a checkpoint that does not exist",
        || Model::builder(plan(4)).checkpoint("/nonexistent/weights.safetensors").build(),
        "ServeError::Setup",
        &["/nonexistent/weights.safetensors"],
    );
    c.case(
        "a checkpoint value of another shape",
        || Model::builder(plan(4)).variable("w", HostArray::f32([2, 3], vec![0.0; 6]).unwrap()).build(),
        "ServeError::Runtime",
        &["'w'", "f32[3, 2]", "f32[2, 3]"],
    );
    batched.shutdown().unwrap();
    c.case("a request after shutdown", || batched.infer([("x", rows(1))]), "ServeError::Stopped", &["shut down"]);
    single.shutdown().unwrap();
    c.case("a second shutdown", || single.shutdown(), "ServeError::Stopped", &["already shut down"]);
    assert!(c.finish() >= 14);
}

#[test]
fn state_dicts() {
    let mut c = Catalogue::new("serving");
    let state = |pairs: Vec<(&str, HostArray)>| {
        StateDict::from(pairs.into_iter().map(|(n, v)| (n.to_string(), v)).collect::<Vec<_>>())
    };
    let w = || HostArray::f32([3, 2], vec![0.0; 6]).unwrap();
    c.case(
        "a strict load missing a variable",
        || Job::builder(plan(4)).load_state_dict(&state(vec![]), true).map(|_| ()),
        "TrainError::MissingVariables",
        &["strict load", "'w'"],
    );
    c.case(
        "a strict load with a stray tensor",
        || Job::builder(plan(4)).load_state_dict(&state(vec![("w", w()), ("ww", w())]), true).map(|_| ()),
        "TrainError::UnexpectedTensors",
        &["strict load", "'ww'", "did you mean 'w'"],
    );
    c.case(
        "a state dict value of another shape",
        || {
            let wrong = HostArray::f32([2, 3], vec![0.0; 6]).unwrap();
            Job::builder(plan(4)).load_state_dict(&state(vec![("w", wrong)]), false).map(|_| ())
        },
        "TrainError::Mismatch",
        &["'w'", "f32[3, 2]", "f32[2, 3]"],
    );
    c.case(
        "a report built without keep_state",
        || {
            let mut job = Job::builder(plan(4)).build()?;
            job.graph_feeds()?.close()?;
            let report = job.wait()?;
            report.state_dict().map(|_| ()).map_err(|e| Box::new(e) as Box<dyn std::error::Error>)
        },
        "Box",
        &["keep_state"],
    );
    assert!(c.finish() >= 4);
}
