//! One compiler: `Graph::compile` is `Graph::compile_parallel` on a mesh of one device, so
//! both give the same plan and the same losses; one-device plans keep the names programs
//! use (`input:<name>`, `fetch:<k>`, variables by their graph names); what cannot be
//! compiled is refused with a typed error that names it.

use regflow::graph::plan::{ActorKind, SourcePieces};
use regflow::graph::sbp::{Mesh, MeshDevice, NdSbp, Sbp};
use regflow::graph::{
    CompileError, CompileOptions, CompiledGraph, DType, DatasetInputs, Graph, GraphError, HostArray, Init, Optimizer,
    ParallelOptions, Schedule, SplitMix64, TrainStep,
};
use regflow::prelude::*;
use regflow::runtime::RecordFile;

const BATCH: usize = 8;

fn model(g: &Graph) -> TrainStep<'_> {
    let x = g.input("x", [BATCH, 6], DType::F32).unwrap();
    let y = g.input("y", [BATCH], DType::I64).unwrap();
    let w1 = g.variable("w1", [6, 16], DType::F32, Init::Kaiming { seed: 1 }).unwrap();
    let b1 = g.variable("b1", [16], DType::F32, Init::Zeros).unwrap();
    let w2 = g.variable("w2", [16, 3], DType::F32, Init::Xavier { seed: 2 }).unwrap();
    let h = x.matmul(&w1).unwrap().add(&b1).unwrap().relu().unwrap();
    let loss = h.matmul(&w2).unwrap().sparse_cross_entropy(&y).unwrap();
    // The schedule reads the step counter, whose update this step also reads: an `assign`.
    let optimizer = Optimizer::adamw(1e-2, 1e-3)
        .with_schedule(Schedule::WarmupCosine { peak: 1e-2, warmup: 2, total: 12, min: 1e-4 })
        .with_clip_norm(1.0);
    g.minimize(loss, &optimizer).unwrap()
}

/// The same batch every piece, so the loss has something to learn.
fn batches(pieces: usize, rows: usize) -> Vec<(HostArray, HostArray)> {
    (0..pieces)
        .map(|_| {
            let mut rng = SplitMix64::new(9);
            let x = (0..rows * 6).map(|_| rng.next_normal() as f32).collect();
            let y = (0..rows).map(|_| (rng.next_u64() % 3) as i64).collect();
            (HostArray::f32([rows, 6], x).unwrap(), HostArray::i64([rows], y).unwrap())
        })
        .collect()
}

fn losses(compiled: &CompiledGraph, pieces: usize, rows: usize) -> Vec<f32> {
    let mut job = Job::builder(compiled.plan.clone()).build().unwrap();
    let mut feeds = job.graph_feeds().unwrap();
    let fetcher = job.fetcher(&compiled.fetches[0]).unwrap();
    let data = batches(pieces, rows);
    let pusher = std::thread::spawn(move || {
        for (x, y) in &data {
            feeds.push("x", x).unwrap();
            feeds.push("y", y).unwrap();
        }
        feeds.close().unwrap();
    });
    let out =
        std::iter::from_fn(|| fetcher.recv()).map(|p| f32::from_le_bytes(p.bytes().try_into().unwrap())).collect();
    pusher.join().unwrap();
    drop(fetcher);
    job.wait().unwrap();
    out
}

fn one_device_mesh() -> Mesh {
    Mesh::cpu(&[1], &["one"]).unwrap()
}

#[test]
fn compile_is_compile_parallel_on_a_one_device_mesh_and_trains_to_the_same_bits() {
    let g = Graph::new();
    let train = model(&g);
    let one = g.compile(&[train.loss], &train.updates, &CompileOptions::default()).unwrap();
    let options = ParallelOptions::new(one_device_mesh()).train(&train);
    let parallel = g.compile_parallel(&[train.loss], &train.updates, &options).unwrap();
    assert_eq!(one.plan, parallel.plan, "one pipeline, one plan");
    assert!(one.parallel.is_none() && parallel.parallel.is_some());
    let steps = 12;
    let (a, b) = (losses(&one, steps, BATCH), losses(&parallel, steps, BATCH));
    assert_eq!(a.len(), steps);
    assert_eq!(a.iter().map(|l| l.to_bits()).collect::<Vec<_>>(), b.iter().map(|l| l.to_bits()).collect::<Vec<_>>());
    assert!(a[steps - 1] < a[0], "the loss went down: {a:?}");

    // Gradient accumulation: the same again, two micro-batches per step.
    let g = Graph::new();
    let train = model(&g);
    let accumulate = CompileOptions { accumulate: Some(train.accumulate(2)), ..CompileOptions::default() };
    let one = g.compile(&[train.loss], &train.updates, &accumulate).unwrap();
    let options = ParallelOptions::new(one_device_mesh()).train(&train).micro_batches(&train, 2);
    let parallel = g.compile_parallel(&[train.loss], &train.updates, &options).unwrap();
    assert_eq!(one.plan, parallel.plan);
    let (a, b) = (losses(&one, 2 * steps, BATCH), losses(&parallel, 2 * steps, BATCH));
    assert_eq!(a.len(), 2 * steps, "one loss per micro-batch");
    assert_eq!(a, b);
}

#[test]
fn one_device_plans_keep_the_names_programs_use() {
    let g = Graph::new();
    let train = model(&g);
    let compiled = g.compile(&[train.loss], &train.updates, &CompileOptions::default()).unwrap();
    let plan = &compiled.plan;
    let inputs: Vec<(&str, &str)> = compiled.inputs.iter().map(|i| (i.name.as_str(), i.actor.as_str())).collect();
    assert_eq!(inputs, [("x", "input:x"), ("y", "input:y")]);
    assert_eq!(compiled.fetches, ["fetch:0"]);
    assert!(plan.actors.iter().all(|a| !a.name.contains('@')), "no device suffix on one device");
    // Variables by their graph names, each held by a register no other register is named
    // like, so a program preloads it by that name.
    let mut names: Vec<String> = compiled.variables.iter().map(|v| v.name.clone()).collect();
    names.sort_unstable();
    let params = ["w1", "b1", "w2"];
    let mut expected: Vec<String> = params.iter().map(|p| p.to_string()).collect();
    expected.push("optimizer.step".into());
    expected.extend(params.iter().flat_map(|p| [format!("{p}.adam_m"), format!("{p}.adam_v")]));
    expected.sort_unstable();
    assert_eq!(names, expected);
    let mut builder = Job::builder(plan.clone());
    for v in &compiled.variables {
        assert_eq!(plan.regst_descs.iter().filter(|d| d.name == v.regst).count(), 1, "{}", v.regst);
        let desc = &plan.variables.iter().find(|d| d.name == v.name).unwrap();
        builder = builder.preload(&v.regst, desc.init.value(&desc.meta).to_le_bytes());
    }
    let mut job = builder.build().unwrap();
    job.graph_feeds().unwrap().close().unwrap();
    job.wait().unwrap();
    // The step counter's update is read by this step (the schedule), so an `assign` copy
    // feeds its loop; the weights' updates write their loops directly.
    let named = |name: &str| plan.actor_by_name(name).is_some();
    assert!(named("assign:optimizer.step") && !named("assign:w1"));
    // One tick paces the actors that read nothing fed.
    assert_eq!(plan.actors.iter().filter(|a| a.name == "tick").count(), 1);
}

#[test]
fn compile_puts_a_placed_graph_on_one_device() {
    let g = Graph::new();
    let train = model(&g);
    let mesh = Mesh::cpu(&[2], &["dp"]).unwrap();
    for name in ["x", "y"] {
        g.set_layout(g.by_name(name).unwrap(), &mesh, NdSbp(vec![Sbp::Split(0)])).unwrap();
    }
    let one = g.compile(&[train.loss], &train.updates, &CompileOptions::default()).unwrap();
    assert_eq!(one.plan.devices.len(), 1);
    assert!(one
        .plan
        .actors
        .iter()
        .all(|a| !matches!(a.kind, ActorKind::Compute { kernel: KernelConf::Collective(_) })));
    let dp = g.compile_parallel(&[train.loss], &train.updates, &ParallelOptions::new(mesh).train(&train)).unwrap();
    assert_eq!(dp.plan.devices.len(), 2);
    assert_eq!(losses(&one, 3, BATCH).len(), 3);
}

fn compile_error(result: Result<CompiledGraph, GraphError>) -> CompileError {
    match result {
        Err(GraphError::Compile(e)) => *e,
        other => panic!("expected a compile error, got {other:?}"),
    }
}

#[test]
fn a_step_that_reads_no_input_is_refused_because_nothing_paces_it() {
    let g = Graph::new();
    let w = g.variable("w", [2], DType::F32, Init::Ones).unwrap();
    let doubled = w.mul_scalar(2.0).unwrap();
    let err = compile_error(g.compile(&[doubled], &[], &CompileOptions::default()));
    assert_eq!(err, CompileError::NoInput);
    assert!(err.to_string().starts_with("the step reads no input, so nothing paces it"), "{err}");
    let err = compile_error(g.compile_parallel(&[doubled], &[], &ParallelOptions::new(one_device_mesh())));
    assert_eq!(err, CompileError::NoInput);
}

fn dataset(inputs: &[&str]) -> Option<DatasetInputs> {
    Some(DatasetInputs {
        source: SourcePieces::Custom { count: 3, kernel: "records".into() },
        inputs: inputs.iter().map(|s| s.to_string()).collect(),
    })
}

#[test]
fn dataset_mistakes_name_the_input_and_suggest_the_nearest() {
    let g = Graph::new();
    let x = g.input("x", [4, 3], DType::F32).unwrap();
    let _labels = g.input("labels", [4], DType::I64).unwrap();
    let y = x.mul_scalar(2.0).unwrap();
    let options = CompileOptions { dataset: dataset(&["x", "lables"]), ..CompileOptions::default() };
    let err = compile_error(g.compile(&[y], &[], &options));
    assert_eq!(err, CompileError::DatasetInput { name: "lables".into(), nearest: Some("labels".into()) });
    assert_eq!(
        err.to_string(),
        "the dataset produces 'lables', which is not an input of the graph (did you mean 'labels'?)"
    );
    let options = CompileOptions { dataset: dataset(&[]), ..CompileOptions::default() };
    assert_eq!(compile_error(g.compile(&[y], &[], &options)), CompileError::EmptyDataset);
}

#[test]
fn dataset_inputs_on_two_placements_are_refused_with_both_meshes_named() {
    let g = Graph::new();
    let x = g.input("x", [4, 3], DType::F32).unwrap();
    let z = g.input("z", [4, 3], DType::F32).unwrap();
    let first = Mesh::cpu(&[2], &["dp"]).unwrap();
    let devices = (2..4).map(|index| MeshDevice { node: 0, kind: DeviceKind::Cpu, index }).collect();
    let second = Mesh::new(devices, &[2], &["dp"]).unwrap();
    g.set_layout(x, &first, NdSbp(vec![Sbp::Split(0)])).unwrap();
    g.set_layout(z, &second, NdSbp(vec![Sbp::Split(0)])).unwrap();
    let y = x.add(&z.to_placement(&first).unwrap()).unwrap();
    let options = ParallelOptions { dataset: dataset(&["x", "z"]), ..ParallelOptions::new(first) };
    let err = compile_error(g.compile_parallel(&[y], &[], &options));
    assert!(matches!(err, CompileError::DatasetPlacements { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        "the dataset's inputs must share one placement: 'x' is on cpu:0..2 [dp=2], 'z' on cpu:2..4 [dp=2]"
    );
}

/// Records of 4 f32 features and one i64 the step ignores.
fn records(n: usize) -> RecordFile {
    let bytes: Vec<u8> = (0..n)
        .flat_map(|i| {
            let features: Vec<u8> = (0..4).flat_map(|k| ((i * 4 + k) as f32).to_le_bytes()).collect();
            [features, (i as i64).to_le_bytes().to_vec()].concat()
        })
        .collect();
    RecordFile::from_bytes(bytes, 4 * 4 + 8).unwrap()
}

#[test]
fn a_dataset_input_the_step_does_not_read_is_discarded_on_one_device_and_on_a_mesh() {
    let g = Graph::new();
    let x = g.input("x", [2, 4], DType::F32).unwrap();
    let _ids = g.input("ids", [2], DType::I64).unwrap();
    let total = x.sum_all().unwrap();
    let batches = records(6).batches(&[16, 8], 2, 0).unwrap();
    let source = SourcePieces::Custom { count: batches.pieces(1), kernel: "records".into() };
    let inputs = vec!["x".to_string(), "ids".to_string()];
    let dataset = Some(DatasetInputs { source, inputs });
    let options = CompileOptions { dataset: dataset.clone(), ..CompileOptions::default() };
    let compiled = g.compile(&[total], &[], &options).unwrap();
    assert!(compiled.inputs.is_empty(), "nothing is fed");
    assert_eq!(compiled.plan.actors.iter().filter(|a| matches!(a.kind, ActorKind::Discard)).count(), 1);
    let mut job = Job::builder(compiled.plan.clone()).dataset("records", batches).build().unwrap();
    let fetcher = job.fetcher(&compiled.fetches[0]).unwrap();
    let sums: Vec<f32> =
        std::iter::from_fn(|| fetcher.recv()).map(|p| f32::from_le_bytes(p.bytes().try_into().unwrap())).collect();
    drop(fetcher);
    job.wait().unwrap();
    // Three batches of two records cover the 24 features 0..24 once.
    assert_eq!(sums.len(), 3);
    assert_eq!(sums.iter().sum::<f32>(), (0..24).sum::<i32>() as f32);

    let mesh = Mesh::cpu(&[2], &["dp"]).unwrap();
    let options = ParallelOptions { dataset, ..ParallelOptions::new(mesh) };
    let parallel = g.compile_parallel(&[total], &[], &options).unwrap();
    let plan = &parallel.plan;
    let ids: Vec<_> = plan.regst_descs.iter().filter(|d| d.name.starts_with("ids@")).collect();
    assert_eq!(ids.len(), 2, "one per device");
    for desc in ids {
        assert!(desc.consumers.iter().all(|c| matches!(plan.actors[c.index()].kind, ActorKind::Discard)));
    }
}

#[test]
fn variables_may_take_each_others_values() {
    // a <- b and b <- a: each step swaps them, through `assign` copies wired after every
    // loop register exists.
    let g = Graph::new();
    let x = g.input("x", [1], DType::F32).unwrap();
    let a = g.variable("a", [1], DType::F32, Init::Constant(1.0)).unwrap();
    let b = g.variable("b", [1], DType::F32, Init::Constant(2.0)).unwrap();
    let fetch = [a.add(&x).unwrap(), b.add(&x).unwrap()];
    let compiled = g.compile(&fetch, &[(a, b), (b, a)], &CompileOptions::default()).unwrap();
    let mut job = Job::builder(compiled.plan.clone()).build().unwrap();
    let mut feeds = job.graph_feeds().unwrap();
    let fetchers: Vec<_> = compiled.fetches.iter().map(|f| job.fetcher(f).unwrap()).collect();
    for _ in 0..4 {
        feeds.push("x", &HostArray::f32([1], vec![0.0]).unwrap()).unwrap();
    }
    feeds.close().unwrap();
    let values: Vec<Vec<f32>> = fetchers
        .into_iter()
        .map(|f| std::iter::from_fn(|| f.recv()).map(|p| f32::from_le_bytes(p.bytes().try_into().unwrap())).collect())
        .collect();
    job.wait().unwrap();
    assert_eq!(values, [vec![1.0, 2.0, 1.0, 2.0], vec![2.0, 1.0, 2.0, 1.0]]);
}
