//! Every valid graph runs: random small models × layouts (one device, data, tensor, ZeRO,
//! pipeline, 2-D and pipelined data parallel) × micro-batches per step k ∈ 1..=8 × register
//! counts × schedules compile (the compiler's progress check passes) and run to the end
//! with one loss per micro-batch; the one-op graph runs; settings that cannot be honoured
//! are refused at compile time naming the option.

use proptest::prelude::*;
use regflow::graph::plan::DeviceKind;
use regflow::graph::sbp::{Mesh, MeshDevice, NdSbp, Sbp};
use regflow::graph::{
    CompileError, CompileOptions, DType, Graph, GraphError, HostArray, Init, Optimizer, ParallelOptions,
    PipelineSchedule, SplitMix64, TrainStep,
};
use regflow::prelude::*;
use std::time::Duration;

/// A hang becomes a `Stalled` error naming who waits on whom, not a stuck test.
const WATCHDOG: Duration = Duration::from_secs(10);

/// Rows of one micro-batch (divisible by every data-parallel degree below).
const ROWS: usize = 4;

/// Classes of the labels.
const CLASSES: usize = 3;

fn proptest_config() -> ProptestConfig {
    let cases = std::env::var("REGFLOW_PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(48);
    ProptestConfig { max_shrink_time: 60_000, ..ProptestConfig::with_cases(cases) }
}

/// How the model is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// `Graph::compile` on one device.
    OneDevice,
    /// Inputs split over 2 devices.
    Data,
    /// First weight column-split, second row-split over 2 devices.
    Tensor,
    /// Inputs, weights and optimizer state split over 2 devices.
    Zero,
    /// The layers over 2 stages of one device each.
    Pipeline,
    /// 2 × 2 devices: data over the first axis, tensor over the second.
    DataTensor,
    /// 2 stages of 2 data-parallel devices.
    PipelinedData,
}

const LAYOUTS: [Layout; 7] = [
    Layout::OneDevice,
    Layout::Data,
    Layout::Tensor,
    Layout::Zero,
    Layout::Pipeline,
    Layout::DataTensor,
    Layout::PipelinedData,
];

/// A random small model and how it runs.
#[derive(Debug, Clone)]
struct Case {
    /// Hidden widths (even, so tensor splits divide them); the last layer maps to the classes.
    widths: Vec<usize>,
    /// Per layer: add a bias.
    bias: Vec<bool>,
    /// Per layer: 0 none, 1 relu, 2 tanh, 3 gelu.
    activation: Vec<u8>,
    /// Per hidden layer: add its input back when the shapes agree.
    residual: Vec<bool>,
    /// Freeze the first layer's weight (a constant register) when another layer trains.
    frozen_first: bool,
    layout: Layout,
    micro_batches: u32,
    steps: usize,
    input_register_num: u32,
    activation_register_num: u32,
    reuse_memory: bool,
    gpipe: bool,
}

fn case() -> impl Strategy<Value = Case> {
    (
        (1usize..=3, 0usize..LAYOUTS.len(), 1u32..=8, 1usize..=3),
        (1u32..=3, 1u32..=2, any::<bool>(), any::<bool>(), any::<bool>()),
    )
        .prop_flat_map(|((layers, layout, k, steps), (inputs, activations, reuse, gpipe, frozen_first))| {
            (
                prop::collection::vec(prop::sample::select(vec![4usize, 6]), layers + 1),
                prop::collection::vec(any::<bool>(), layers),
                prop::collection::vec(0u8..4, layers),
                prop::collection::vec(any::<bool>(), layers),
            )
                .prop_map(move |(widths, bias, activation, residual)| Case {
                    widths,
                    bias,
                    activation,
                    residual,
                    frozen_first,
                    layout: LAYOUTS[layout],
                    micro_batches: k,
                    steps,
                    input_register_num: inputs,
                    activation_register_num: activations,
                    reuse_memory: reuse,
                    gpipe,
                })
        })
}

fn devices(from: u16, n: u16) -> Vec<MeshDevice> {
    (from..from + n).map(|i| MeshDevice { node: 0, kind: DeviceKind::Cpu, index: i }).collect()
}

/// The stage meshes of a layout (one entry unless it is pipelined).
fn meshes(layout: Layout) -> Vec<Mesh> {
    let mesh = |from, shape: &[usize], axes: &[&str]| {
        let n = shape.iter().product::<usize>() as u16;
        Mesh::new(devices(from, n), shape, axes).unwrap()
    };
    match layout {
        Layout::OneDevice => vec![mesh(0, &[1], &["d"])],
        Layout::Data | Layout::Zero => vec![mesh(0, &[2], &["dp"])],
        Layout::Tensor => vec![mesh(0, &[2], &["tp"])],
        Layout::DataTensor => vec![mesh(0, &[2, 2], &["dp", "tp"])],
        Layout::Pipeline => vec![mesh(0, &[1], &["pp"]), mesh(1, &[1], &["pp"])],
        Layout::PipelinedData => vec![mesh(0, &[2], &["dp"]), mesh(2, &[2], &["dp"])],
    }
}

/// Builds the model; returns its training step.
fn model<'g>(g: &'g Graph, case: &Case) -> TrainStep<'g> {
    use Sbp::{Broadcast as B, Split as S};
    let layers = case.widths.len() - 1;
    let meshes = meshes(case.layout);
    let x = g.input("x", [ROWS, case.widths[0]], DType::F64).unwrap();
    let y = g.input("y", [ROWS], DType::I64).unwrap();
    let data = |m: &Mesh| match case.layout {
        Layout::DataTensor => NdSbp(vec![S(0), B]),
        Layout::Data | Layout::Zero | Layout::PipelinedData => NdSbp(vec![S(0)]),
        _ => NdSbp(vec![B; m.axes().len()]),
    };
    if case.layout != Layout::OneDevice {
        g.set_layout(x, &meshes[0], data(&meshes[0])).unwrap();
        let last = &meshes[meshes.len() - 1];
        g.set_layout(y, last, data(last)).unwrap();
    }
    let mut h = x;
    for l in 0..layers {
        let out = if l + 1 == layers { CLASSES } else { case.widths[l + 1] };
        let w =
            g.variable(&format!("w{l}"), [case.widths[l], out], DType::F64, Init::Xavier { seed: l as u64 }).unwrap();
        let stage = l * meshes.len() / layers;
        let mesh = &meshes[stage];
        if l > 0 && stage != (l - 1) * meshes.len() / layers {
            h = h.to_placement(mesh).unwrap();
        }
        // Megatron pairs: even layers column-split (when the width divides), odd row-split.
        let tensor_split = || {
            if l % 2 == 0 && out % 2 == 0 {
                Some(S(1))
            } else if l % 2 == 1 {
                Some(S(0))
            } else {
                None
            }
        };
        match case.layout {
            Layout::Tensor => {
                if let Some(s) = tensor_split() {
                    g.set_layout(w, mesh, NdSbp(vec![s])).unwrap();
                }
            }
            Layout::DataTensor => {
                if let Some(s) = tensor_split() {
                    g.set_layout(w, mesh, NdSbp(vec![B, s])).unwrap();
                }
            }
            Layout::Zero => g.set_layout(w, mesh, NdSbp(vec![S(0)])).unwrap(),
            Layout::OneDevice => {}
            _ => g.set_layout(w, mesh, NdSbp(vec![B; mesh.axes().len()])).unwrap(),
        }
        if l == 0 && case.frozen_first && layers > 1 {
            g.set_trainable(w, false);
        }
        let input = h;
        h = h.matmul(&w).unwrap();
        if case.bias[l] {
            let b = g.variable(&format!("b{l}"), [out], DType::F64, Init::Zeros).unwrap();
            if case.layout != Layout::OneDevice && case.layout != Layout::Tensor && case.layout != Layout::DataTensor {
                g.set_layout(b, mesh, NdSbp(vec![B; mesh.axes().len()])).unwrap();
            }
            h = h.add(&b).unwrap();
        }
        h = match case.activation[l] {
            1 => h.relu().unwrap(),
            2 => h.tanh().unwrap(),
            3 => h.gelu().unwrap(),
            _ => h,
        };
        if case.residual[l] && input.shape() == h.shape() {
            h = h.add(&input).unwrap();
        }
    }
    if (layers - 1) * meshes.len() / layers + 1 < meshes.len() {
        // One layer on the first stage: the labels live on the last.
        h = h.to_placement(&meshes[meshes.len() - 1]).unwrap();
    }
    let loss = h.sparse_cross_entropy(&y).unwrap();
    g.minimize(loss, &Optimizer::adamw(1e-2, 1e-3).with_clip_norm(1.0)).unwrap()
}

fn batches(case: &Case) -> Vec<(HostArray, HostArray)> {
    let mut rng = SplitMix64::new(case.widths.len() as u64);
    let pieces = case.steps * case.micro_batches as usize;
    (0..pieces)
        .map(|_| {
            let x: Vec<f64> = (0..ROWS * case.widths[0]).map(|_| rng.next_normal()).collect();
            let y: Vec<i64> = (0..ROWS).map(|_| (rng.next_u64() % CLASSES as u64) as i64).collect();
            (HostArray::f64([ROWS, case.widths[0]], x).unwrap(), HostArray::i64([ROWS], y).unwrap())
        })
        .collect()
}

/// Compiles and runs the case; returns the losses fetched or the error that stopped it.
fn run(case: &Case) -> Result<Vec<f64>, String> {
    let g = Graph::new();
    let train = model(&g, case);
    let compiled = if case.layout == Layout::OneDevice {
        let options = CompileOptions {
            accumulate: Some(train.accumulate(case.micro_batches)),
            input_register_num: case.input_register_num,
            activation_register_num: case.activation_register_num,
            reuse_memory: case.reuse_memory,
            ..CompileOptions::default()
        };
        g.compile(&[train.loss], &train.updates, &options)
    } else {
        let mut options = ParallelOptions::new(meshes(case.layout)[0].clone())
            .train(&train)
            .micro_batches(&train, case.micro_batches);
        options.input_register_num = case.input_register_num;
        options.activation_register_num = case.activation_register_num;
        options.reuse_memory = case.reuse_memory;
        if case.gpipe {
            options.schedule = PipelineSchedule::GPipe;
        }
        g.compile_parallel(&[train.loss], &train.updates, &options)
    }
    .map_err(|e| format!("compile: {e}"))?;
    let mut job = Job::builder(compiled.plan.clone()).watchdog(WATCHDOG).build().map_err(|e| format!("build: {e}"))?;
    let mut feeds = job.graph_feeds().map_err(|e| format!("feeds: {e}"))?;
    let fetcher = job.fetcher(&compiled.fetches[0]).map_err(|e| format!("fetcher: {e}"))?;
    let data = batches(case);
    let pusher = std::thread::spawn(move || -> Result<(), String> {
        for (x, y) in &data {
            feeds.push("x", x).map_err(|e| format!("push x: {e}"))?;
            feeds.push("y", y).map_err(|e| format!("push y: {e}"))?;
        }
        feeds.close().map_err(|e| format!("close: {e}"))
    });
    let losses: Vec<f64> =
        std::iter::from_fn(|| fetcher.recv()).map(|p| f64::from_le_bytes(p.bytes().try_into().unwrap())).collect();
    drop(fetcher);
    let waited = job.wait().map(|_| ()).map_err(|e| format!("job: {e}"));
    let pushed = pusher.join().map_err(|_| "the pushing thread panicked".to_string())?;
    waited?;
    pushed?;
    Ok(losses)
}

proptest! {
    #![proptest_config(proptest_config())]

    #[test]
    fn every_valid_model_runs_with_one_loss_per_micro_batch(case in case()) {
        let losses = run(&case).map_err(|e| TestCaseError::fail(format!("{case:?}: {e}")))?;
        prop_assert_eq!(losses.len(), case.steps * case.micro_batches as usize, "{:?}", case);
        prop_assert!(losses.iter().all(|l| l.is_finite()), "{:?}: {:?}", case, losses);
    }
}

/// Every micro-batch count with every layout at least once, whatever proptest draws.
#[test]
fn every_layout_runs_every_micro_batch_count_from_1_to_8() {
    for layout in LAYOUTS {
        for k in 1..=8 {
            let case = Case {
                widths: vec![4, 4, 4],
                bias: vec![true, true],
                activation: vec![1, 0],
                residual: vec![false, false],
                frozen_first: k % 3 == 0,
                layout,
                micro_batches: k,
                steps: 2,
                input_register_num: 1,
                activation_register_num: 1,
                reuse_memory: true,
                gpipe: k % 2 == 0,
            };
            let losses = run(&case).unwrap_or_else(|e| panic!("{layout:?}, k = {k}: {e}"));
            assert_eq!(losses.len(), 2 * k as usize, "{layout:?}, k = {k}");
        }
    }
}

/// An input followed by one op, compiled alone: a plan whose only compute actor is that op.
#[test]
fn a_one_op_graph_runs() {
    let g = Graph::new();
    let x = g.input("x", [3], DType::F32).unwrap();
    let total = x.sum_all().unwrap();
    for reuse_memory in [true, false] {
        let options = CompileOptions { reuse_memory, ..CompileOptions::default() };
        let compiled = g.compile(&[total], &[], &options).unwrap();
        let mut job = Job::builder(compiled.plan.clone()).watchdog(WATCHDOG).build().unwrap();
        let mut feeds = job.graph_feeds().unwrap();
        let fetcher = job.fetcher(&compiled.fetches[0]).unwrap();
        let pusher = std::thread::spawn(move || {
            for k in 0..5 {
                feeds.push("x", &HostArray::f32([3], vec![k as f32, 1.0, 2.0]).unwrap()).unwrap();
            }
            feeds.close().unwrap();
        });
        let sums: Vec<f32> =
            std::iter::from_fn(|| fetcher.recv()).map(|p| f32::from_le_bytes(p.bytes().try_into().unwrap())).collect();
        drop(fetcher);
        pusher.join().unwrap();
        job.wait().unwrap();
        assert_eq!(sums, vec![3.0, 4.0, 5.0, 6.0, 7.0]);
    }
}

fn option_error(result: Result<regflow::graph::CompiledGraph, GraphError>) -> (&'static str, String, String) {
    match result {
        Err(GraphError::Compile(e)) => match *e {
            CompileError::BadOption { option, ref value, .. } => (option, value.clone(), e.to_string()),
            other => panic!("expected a BadOption error, got: {other}"),
        },
        Err(other) => panic!("expected a compile error, got: {other}"),
        Ok(_) => panic!("expected an error, the compile succeeded"),
    }
}

#[test]
fn zero_micro_batches_or_zero_slots_are_refused_naming_the_option() {
    let g = Graph::new();
    let case = Case {
        widths: vec![4, 4],
        bias: vec![false],
        activation: vec![0],
        residual: vec![false],
        frozen_first: false,
        layout: Layout::OneDevice,
        micro_batches: 1,
        steps: 1,
        input_register_num: 1,
        activation_register_num: 1,
        reuse_memory: true,
        gpipe: false,
    };
    let train = model(&g, &case);
    let compile = |options: CompileOptions| g.compile(&[train.loss], &train.updates, &options);
    let (option, value, message) =
        option_error(compile(CompileOptions { accumulate: Some(train.accumulate(0)), ..CompileOptions::default() }));
    assert_eq!((option, value.as_str()), ("micro_batches", "0"));
    assert!(message.contains("micro_batches") && message.contains('0'), "{message}");
    let (option, _, message) =
        option_error(compile(CompileOptions { input_register_num: 0, ..CompileOptions::default() }));
    assert_eq!(option, "input_register_num", "{message}");
    let (option, _, _) =
        option_error(compile(CompileOptions { activation_register_num: 0, ..CompileOptions::default() }));
    assert_eq!(option, "activation_register_num");
    let mesh = Mesh::new(devices(0, 2), &[2], &["dp"]).unwrap();
    let options = ParallelOptions::new(mesh).train(&train).micro_batches(&train, 0);
    let (option, _, _) = option_error(g.compile_parallel(&[train.loss], &train.updates, &options));
    assert_eq!(option, "micro_batches");
}

/// A program may push every micro-batch of one input of a step before the next input: the
/// feed holds a step of pieces (its register count plus the source's firings per step).
#[test]
fn a_whole_step_of_one_input_may_be_pushed_before_the_next() {
    for k in [1u32, 3, 8] {
        let g = Graph::new();
        let case = Case {
            widths: vec![4, 4],
            bias: vec![true],
            activation: vec![0],
            residual: vec![false],
            frozen_first: false,
            layout: Layout::OneDevice,
            micro_batches: k,
            steps: 2,
            input_register_num: 1,
            activation_register_num: 1,
            reuse_memory: true,
            gpipe: false,
        };
        let train = model(&g, &case);
        let options = CompileOptions { accumulate: Some(train.accumulate(k)), ..CompileOptions::default() };
        let compiled = g.compile(&[train.loss], &train.updates, &options).unwrap();
        let mut job = Job::builder(compiled.plan.clone()).watchdog(WATCHDOG).build().unwrap();
        let mut feeds = job.graph_feeds().unwrap();
        let fetcher = job.fetcher(&compiled.fetches[0]).unwrap();
        let data = batches(&case);
        let pusher = std::thread::spawn(move || {
            for step in data.chunks(k as usize) {
                for (x, _) in step {
                    feeds.push("x", x).unwrap();
                }
                for (_, y) in step {
                    feeds.push("y", y).unwrap();
                }
            }
            feeds.close().unwrap();
        });
        let losses = std::iter::from_fn(|| fetcher.recv()).count();
        drop(fetcher);
        job.wait().unwrap_or_else(|e| panic!("k = {k}: {e}"));
        pusher.join().unwrap();
        assert_eq!(losses, 2 * k as usize);
    }
}
