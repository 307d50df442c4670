//! Pipeline parallelism from placements and register counts: an MLP whose layers live on
//! 2 or 4 stages (one cpu device each), trained with m micro-batches per step, gives the
//! same losses as one device training on the whole batch; m = 1 does not hang; and the
//! live activations per stage stay within the stage count with 1F1B counts but reach m
//! under the GPipe option.

use regflow::graph::plan::DeviceKind;
use regflow::graph::sbp::{Mesh, MeshDevice, NdSbp, Sbp};
use regflow::graph::{
    DType, Graph, HostArray, Init, Optimizer, ParallelOptions, PipelineSchedule, Session, SplitMix64, TrainStep,
};
use regflow::prelude::*;

const LAYERS: usize = 4;
const WIDTH: usize = 6;
const MICRO: usize = 2;

fn stage_mesh(stage: usize) -> Mesh {
    Mesh::new(vec![MeshDevice { node: 0, kind: DeviceKind::Cpu, index: stage as u16 }], &[1], &["pp"]).unwrap()
}

/// The MLP on `batch` rows; with `stages`, layer l lives on stage l * stages / LAYERS.
fn model(g: &Graph, batch: usize, stages: Option<usize>) -> TrainStep<'_> {
    let x = g.input("x", [batch, WIDTH], DType::F64).unwrap();
    let y = g.input("y", [batch], DType::I64).unwrap();
    let stage_of = |l: usize| stages.map(|p| l * p / LAYERS);
    if let Some(p) = stages {
        g.set_layout(x, &stage_mesh(0), NdSbp(vec![Sbp::Broadcast])).unwrap();
        g.set_layout(y, &stage_mesh(p - 1), NdSbp(vec![Sbp::Broadcast])).unwrap();
    }
    let mut h = x;
    for l in 0..LAYERS {
        let out = if l + 1 == LAYERS { 3 } else { WIDTH };
        let w = g.variable(&format!("w{l}"), [WIDTH, out], DType::F64, Init::Xavier { seed: l as u64 }).unwrap();
        let b = g.variable(&format!("b{l}"), [out], DType::F64, Init::Zeros).unwrap();
        if let Some(s) = stage_of(l) {
            for v in [w, b] {
                g.set_layout(v, &stage_mesh(s), NdSbp(vec![Sbp::Broadcast])).unwrap();
            }
            if l > 0 && stage_of(l - 1) != Some(s) {
                h = h.to_placement(&stage_mesh(s)).unwrap();
            }
        }
        h = h.matmul(&w).unwrap().add(&b).unwrap();
        if l + 1 < LAYERS {
            h = h.tanh().unwrap();
        }
    }
    let loss = h.sparse_cross_entropy(&y).unwrap();
    g.minimize(loss, &Optimizer::adamw(3e-2, 1e-3)).unwrap()
}

/// `steps` times the same batch of `rows` rows (so the loss goes down step by step).
fn data(steps: usize, rows: usize) -> Vec<(Vec<f64>, Vec<i64>)> {
    let mut rng = SplitMix64::new(11);
    let x: Vec<f64> = (0..rows * WIDTH).map(|_| rng.next_normal()).collect();
    let y: Vec<i64> = (0..rows).map(|r| i64::from(x[r * WIDTH] > 0.0) + i64::from(x[r * WIDTH + 1] > 0.5)).collect();
    vec![(x, y); steps]
}

fn reference(steps: usize, m: usize) -> Vec<f64> {
    let g = Graph::new();
    let train = model(&g, m * MICRO, None);
    let (x, y) = (g.by_name("x").unwrap(), g.by_name("y").unwrap());
    let mut s = Session::new(&g);
    data(steps, m * MICRO)
        .into_iter()
        .map(|(xs, ys)| {
            let feeds =
                [(x, HostArray::f64([m * MICRO, WIDTH], xs).unwrap()), (y, HostArray::i64([m * MICRO], ys).unwrap())];
            s.step(&train, &feeds).unwrap()
        })
        .collect()
}

/// Trains on `p` stages with `m` micro-batches per step; returns each step's mean loss and
/// the job's report.
fn pipelined(steps: usize, p: usize, m: usize, schedule: PipelineSchedule) -> (Vec<f64>, regflow::prelude::JobReport) {
    let g = Graph::new();
    let train = model(&g, MICRO, Some(p));
    let mut options = ParallelOptions::new(stage_mesh(0)).train(&train).micro_batches(&train, m as u32);
    options.schedule = schedule;
    let compiled = g.compile_parallel(&[train.loss], &train.updates, &options).unwrap();
    let mut job = Job::builder(compiled.plan.clone())
        .compiled(&compiled)
        .watchdog(std::time::Duration::from_secs(5))
        .build()
        .unwrap();
    let mut feeds = job.graph_feeds(&compiled).unwrap();
    let fetcher = job.fetcher(&compiled.fetches[0]).unwrap();
    let pusher = std::thread::spawn(move || {
        for (xs, ys) in data(steps, m * MICRO) {
            for k in 0..m {
                let x = xs[k * MICRO * WIDTH..(k + 1) * MICRO * WIDTH].to_vec();
                let y = ys[k * MICRO..(k + 1) * MICRO].to_vec();
                feeds.push("x", &HostArray::f64([MICRO, WIDTH], x).unwrap()).unwrap();
                feeds.push("y", &HostArray::i64([MICRO], y).unwrap()).unwrap();
            }
        }
        feeds.close().unwrap();
    });
    let micro_losses: Vec<f64> =
        std::iter::from_fn(|| fetcher.recv()).map(|p| f64::from_le_bytes(p.bytes().try_into().unwrap())).collect();
    drop(fetcher);
    let report = job.wait().unwrap_or_else(|e| panic!("pp{p}, m = {m}: {e}"));
    pusher.join().unwrap();
    assert_eq!(micro_losses.len(), steps * m, "one loss per micro-batch");
    (micro_losses.chunks(m).map(|c| c.iter().sum::<f64>() / m as f64).collect(), report)
}

fn assert_close(name: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len());
    for (step, (a, b)) in got.iter().zip(want).enumerate() {
        assert!((a - b).abs() <= 1e-10 * b.abs(), "{name}: step {step}: {a} vs one device {b}\n{got:?}\n{want:?}");
    }
}

#[test]
fn pipelines_train_like_one_device_for_any_number_of_micro_batches() {
    let steps = 6;
    for p in [2, 4] {
        for m in [1, 2, p, 4 * p] {
            let want = reference(steps, m);
            let (got, _) = pipelined(steps, p, m, PipelineSchedule::OneForwardOneBackward);
            assert_close(&format!("pp{p}, m = {m}"), &got, &want);
            assert!(got[steps - 1] < got[0], "pp{p}, m = {m}: the loss went down: {got:?}");
        }
    }
}

/// Most micro-batches whose first-layer activations stage 0 held at once.
fn live_on_stage_0(report: &regflow::prelude::JobReport) -> u32 {
    // The first layer's tanh output is read by the backward pass of stage 0.
    report
        .actors
        .iter()
        .filter(|a| a.name.starts_with("tanh:") && a.name.ends_with("@0"))
        .flat_map(|a| a.max_in_flight.iter().map(|(n, _)| *n))
        .max()
        .unwrap_or(0)
}

#[test]
fn one_f_one_b_bounds_live_activations_by_the_stages_and_gpipe_does_not() {
    let (p, m) = (4, 8);
    let (_, one_f_one_b) = pipelined(3, p, m, PipelineSchedule::OneForwardOneBackward);
    let (_, gpipe) = pipelined(3, p, m, PipelineSchedule::GPipe);
    let (live_1f1b, live_gpipe) = (live_on_stage_0(&one_f_one_b), live_on_stage_0(&gpipe));
    assert!(live_1f1b >= 2 && live_1f1b <= p as u32, "1F1B: {live_1f1b} micro-batches live on stage 0");
    assert_eq!(live_gpipe, m as u32, "GPipe: every micro-batch of a step is live at once");
}
