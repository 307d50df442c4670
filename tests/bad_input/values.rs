//! Values that mean nothing, refused by name (issue 12): optimizer options, schedules,
//! micro-batch counts, sizes that overflow, meshes past the device index, arrays whose data
//! does not fit their shape, variable values of another shape, slot counts past the limit,
//! non-finite values under `check_finite`, and the waits of a program on its own job.

use crate::feeds::fed_chain;
use crate::{quick, Catalogue};
use regflow::graph::sbp::Mesh;
use regflow::graph::{CompileOptions, DType, Graph, HostArray, Init, Optimizer, ParallelOptions};
use regflow::graph::{LossScale, OptimizerKind, Schedule};
use regflow::prelude::*;
use std::time::Duration;

fn adamw_with(f: impl FnOnce(&mut Optimizer)) -> Optimizer {
    let mut optimizer = Optimizer::adamw(1e-3, 1e-2);
    f(&mut optimizer);
    optimizer
}

fn set_adamw(optimizer: &mut Optimizer, beta1: f64, beta2: f64, eps: f64) {
    if let OptimizerKind::AdamW { beta1: b1, beta2: b2, eps: e, .. } = &mut optimizer.kind {
        (*b1, *b2, *e) = (beta1, beta2, eps);
    }
}

/// `x [4, 3] · w [3, 2]` scored against `labels [4]`: a loss with one variable to train.
fn classifier(g: &Graph) -> regflow::graph::Tensor<'_> {
    let x = g.input("x", [4, 3], DType::F32).unwrap();
    let labels = g.input("labels", [4], DType::I64).unwrap();
    let w = g.variable("w", [3, 2], DType::F32, Init::Zeros).unwrap();
    x.matmul(&w).unwrap().sparse_cross_entropy(&labels).unwrap()
}

#[test]
fn optimizer_options_and_schedules() {
    let mut c = Catalogue::new("values");
    let g = Graph::new();
    let loss = classifier(&g);
    let minimize = |o: Optimizer| g.minimize(loss, &o).map(|_| ());
    let option = "GraphError::OptimizerOption";
    c.case("a NaN learning rate", || minimize(Optimizer::sgd(f64::NAN, 0.0, 0.0)), option, &["'lr'", "NaN"]);
    c.case("an infinite learning rate", || minimize(Optimizer::adamw(f64::INFINITY, 0.0)), option, &["'lr'", "inf"]);
    c.case("a negative learning rate", || minimize(Optimizer::adamw(-1e-3, 0.0)), option, &["'lr'", "-0.001"]);
    c.case("a negative weight decay", || minimize(Optimizer::adamw(1e-3, -0.1)), option, &["weight_decay", "-0.1"]);
    c.case("a NaN weight decay", || minimize(Optimizer::sgd(0.1, 0.0, f64::NAN)), option, &["weight_decay", "NaN"]);
    c.case("a momentum of 1", || minimize(Optimizer::sgd(0.1, 1.0, 0.0)), option, &["momentum", "1"]);
    c.case("a negative momentum", || minimize(Optimizer::sgd(0.1, -0.5, 0.0)), option, &["momentum", "-0.5"]);
    c.case("a beta1 of 1", || minimize(adamw_with(|o| set_adamw(o, 1.0, 0.999, 1e-8))), option, &["beta1", "1"]);
    c.case("a NaN beta2", || minimize(adamw_with(|o| set_adamw(o, 0.9, f64::NAN, 1e-8))), option, &["beta2", "NaN"]);
    c.case("an eps of 0", || minimize(adamw_with(|o| set_adamw(o, 0.9, 0.999, 0.0))), option, &["eps", "0"]);
    c.case(
        "a clip norm of 0",
        || minimize(Optimizer::adamw(1e-3, 0.0).with_clip_norm(0.0)),
        option,
        &["clip_norm", "0"],
    );
    c.case(
        "an infinite clip norm",
        || minimize(Optimizer::adamw(1e-3, 0.0).with_clip_norm(f64::INFINITY)),
        option,
        &["clip_norm", "inf"],
    );
    let cosine = |peak: f64, warmup: u64, total: u64| {
        Optimizer::adamw(1e-3, 0.0).with_schedule(Schedule::WarmupCosine { peak, warmup, total, min: 0.0 })
    };
    c.case(
        "a warm-up longer than the schedule",
        || minimize(cosine(1e-3, 200, 100)),
        option,
        &["warmup", "200", "100"],
    );
    c.case("a schedule of zero steps", || minimize(cosine(1e-3, 0, 0)), option, &["total", "0"]);
    c.case("a NaN schedule peak", || minimize(cosine(f64::NAN, 10, 100)), option, &["peak", "NaN"]);
    let scaled = |loss_scale: LossScale| Optimizer::adamw(1e-3, 0.0).with_loss_scale(loss_scale);
    c.case("a NaN loss scale", || minimize(scaled(LossScale::fixed(f64::NAN))), option, &["loss_scale.init", "NaN"]);
    c.case(
        "a loss scale past f32",
        || minimize(scaled(LossScale::fixed(1e40))),
        option,
        &["loss_scale.init", "kept in f32"],
    );
    c.case(
        "a loss scale that shrinks as it grows",
        || minimize(scaled(LossScale { growth: 0.5, ..LossScale::dynamic() })),
        option,
        &["loss_scale.growth", "0.5", ">= 1"],
    );
    c.case(
        "a loss scale backoff above 1",
        || minimize(scaled(LossScale { backoff: 2.0, ..LossScale::dynamic() })),
        option,
        &["loss_scale.backoff", "2", "(0, 1]"],
    );
    c.case(
        "a loss scale growing after 0 steps",
        || minimize(scaled(LossScale::dynamic().with_interval(0))),
        option,
        &["loss_scale.interval", "0"],
    );
    let untrained = g.input("alone", [2], DType::F32).unwrap().sum_all().unwrap();
    c.case(
        "minimize over a loss no variable reaches",
        || g.minimize(untrained, &Optimizer::adamw(1e-3, 0.0)).map(|_| ()),
        "GraphError::NothingToTrain",
        &["nothing to train"],
    );
    assert!(c.finish() >= 21);
}

#[test]
fn micro_batches_sizes_and_meshes() {
    let mut c = Catalogue::new("values");
    let g = Graph::new();
    let loss = classifier(&g);
    let train = g.minimize(loss, &Optimizer::adamw(1e-3, 0.0)).unwrap();
    c.case(
        "accumulate(0)",
        || {
            let options = CompileOptions { accumulate: Some(train.accumulate(0)), ..CompileOptions::default() };
            g.compile(&[train.loss], &train.updates, &options)
        },
        "GraphError::Compile::BadOption",
        &["micro_batches", "0"],
    );
    c.case(
        "micro_batches(0) on a mesh",
        || {
            let options = ParallelOptions::new(Mesh::cpu(&[2], &["dp"]).unwrap()).micro_batches(&train, 0);
            g.compile_parallel(&[train.loss], &train.updates, &options)
        },
        "GraphError::Compile::BadOption",
        &["micro_batches", "0"],
    );
    let huge = 1usize << 40;
    c.case(
        "an input of 2^80 elements",
        || g.input("big", [huge, huge], DType::F32),
        "GraphError::TooLarge",
        &["'big'"],
    );
    c.case(
        "a variable of 2^80 elements",
        || g.variable("big_w", [huge, huge], DType::F64, Init::Zeros),
        "GraphError::TooLarge",
        &["'big_w'"],
    );
    let tall = g.input("tall", [huge, 2], DType::F32).unwrap();
    let wide = g.input("wide", [2, huge], DType::F32).unwrap();
    c.case("a matmul whose result overflows", || tall.matmul(&wide), "GraphError::TooLarge", &["matmul"]);
    c.case("a mesh of 70,000 devices", || Mesh::cpu(&[70_000], &["dp"]), "String", &["70000", "65536"]);
    c.case("a mesh with an empty axis", || Mesh::cpu(&[2, 0], &["dp", "tp"]), "String", &["'tp'"]);
    c.case(
        "an f32 array with too few values",
        || HostArray::f32([2, 3], vec![0.0; 5]),
        "ArrayError::Length",
        &["[2, 3]", "6", "5"],
    );
    c.case(
        "an i64 array with too many values",
        || HostArray::i64([2], vec![0; 3]),
        "ArrayError::Length",
        &["[2]", "2", "3"],
    );
    c.case("an array whose shape overflows", || HostArray::f64([huge, huge], vec![]), "ArrayError::TooLarge", &[]);
    assert!(c.finish() >= 10);
}

#[test]
fn jobs_refuse_values_and_end_user_side_waits() {
    let mut c = Catalogue::new("values");
    let g = Graph::new();
    let x = g.input("x", [2, 3], DType::F32).unwrap();
    let w = g.variable("w", [3, 2], DType::F32, Init::Zeros).unwrap();
    let y = x.matmul(&w).unwrap();
    let compiled = g.compile(&[y], &[], &CompileOptions::default()).unwrap();
    let plan = || compiled.plan.clone();
    c.case(
        "a transposed variable value",
        || quick(plan()).preload_variable("w", HostArray::f32([2, 3], vec![0.0; 6]).unwrap()).build(),
        "RuntimeError::VariableMismatch",
        &["'w'", "f32[3, 2]", "f32[2, 3]", "transposed"],
    );
    c.case(
        "a variable value of another dtype",
        || quick(plan()).preload_variable("w", HostArray::f64([3, 2], vec![0.0; 6]).unwrap()).build(),
        "RuntimeError::VariableMismatch",
        &["'w'", "f64[3, 2]"],
    );
    c.case(
        "a value for an unknown variable",
        || quick(plan()).preload_variable("v", HostArray::f32([3, 2], vec![0.0; 6]).unwrap()).build(),
        "RuntimeError::UnknownName",
        &["'v'", "did you mean 'w'"],
    );
    c.case(
        "a plan larger than its device's memory",
        || {
            let mut p = plan();
            p.devices[0].memory_capacity = Some(16);
            quick(p).build()
        },
        "RuntimeError::Plan::DoesNotFit",
        &["node0/cpu:0", "256 bytes", "offers 16"],
    );
    c.case(
        "a register of more slots than supported",
        || {
            let mut p = fed_chain();
            p.regst_descs[0].register_num = 1 << 20;
            Plan::from_json(&p.to_json())
        },
        "PlanError::TooManySlots",
        &["1048576", "65536"],
    );
    let checked = {
        let g = Graph::new();
        let x = g.input("x", [2], DType::F32).unwrap();
        let root = x.sqrt().unwrap();
        let options = CompileOptions { check_finite: true, ..CompileOptions::default() };
        g.compile(&[root], &[], &options).unwrap()
    };
    let two_inputs = {
        let g = Graph::new();
        let a = g.input("a", [2], DType::F32).unwrap();
        let b = g.input("b", [2], DType::F32).unwrap();
        let sum = a.add(&b).unwrap();
        g.compile(&[sum], &[], &CompileOptions::default()).unwrap()
    };
    c.case(
        "a NaN under check_finite",
        || {
            let compiled = &checked;
            let mut job = quick(compiled.plan.clone()).build()?;
            let mut feeds = job.graph_feeds()?;
            let fetcher = job.fetcher(&compiled.fetches[0])?;
            feeds.push("x", &HostArray::f32([2], vec![4.0, -1.0]).unwrap())?;
            feeds.close()?;
            while fetcher.recv().is_some() {}
            drop(fetcher);
            job.wait().map(|_| ())
        },
        "RuntimeError::Actor::Env",
        &["check_finite", "sqrt", "NaN at element 1", "step 0", "cpu:0"],
    );
    c.case(
        "pushing past the feed from the thread that should fetch",
        || {
            let mut job = quick(fed_chain()).fetch_depth(1).build()?;
            let mut feeder = job.feeder("src")?;
            let _fetcher = job.fetcher("sink")?;
            for v in 0..64u64 {
                feeder.push(&v.to_le_bytes())?;
            }
            Ok::<(), RuntimeError>(())
        },
        "RuntimeError::FeedStopped",
        &["'src'", "'sink'"],
    );
    c.case(
        "wait() while a fetcher holds unread pieces",
        || {
            let mut job = Job::builder(fed_chain()).watchdog(Duration::from_secs(30)).fetch_depth(1).build()?;
            let mut feeder = job.feeder("src")?;
            let _fetcher = job.fetcher("sink")?;
            for v in 0..2u64 {
                feeder.push(&v.to_le_bytes())?;
            }
            feeder.close()?;
            job.wait().map(|_| ())
        },
        "RuntimeError::UnreadFetcher",
        &["'sink'"],
    );
    c.case(
        "an input never fed",
        || {
            let compiled = &two_inputs;
            let mut job = quick(compiled.plan.clone()).build()?;
            let mut feeds = job.graph_feeds()?;
            let fetcher = job.fetcher(&compiled.fetches[0])?;
            for _ in 0..2 {
                feeds.push("a", &HostArray::f32([2], vec![1.0, 2.0]).unwrap())?;
            }
            // The feeds stay open and `b` gets nothing: the job can only stall.
            let _ = fetcher.recv_timeout(Duration::from_secs(20)).map(|p| p.is_some());
            drop(fetcher);
            let ended = job.wait().map(|_| ());
            drop(feeds);
            ended
        },
        "RuntimeError::Stalled",
        &["input 'b' was never fed", "'a' got 2"],
    );
    assert!(c.finish() >= 9);
}
