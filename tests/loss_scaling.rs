//! Loss scaling on the actor runtime: the skipped steps and scales of the host session
//! (which `graph/tests/loss_scaling.rs` checks against `GradScaler`'s rules), an f16 MLP
//! training like its f32 twin, a power-of-two scale in f32 changing no bit of training
//! (with and without micro-batch accumulation), and data parallelism skipping the same
//! steps as one device, because the overflow check reads the all-reduced norm.

use regflow::graph::{
    CompileOptions, CompiledGraph, DType, Graph, HostArray, Init, LossScale, Optimizer, ParallelOptions, Precision,
    Session, SplitMix64, Tensor, TrainStep,
};
use regflow::prelude::*;

use crate::tiny_mlp;

/// Runs `compiled`, which fetches `fetch`, on `steps` (the feeds of each piece, in order)
/// and returns, per fetch, the first element of every piece as f64 (see [`run_job`]).
fn run(
    compiled: &CompiledGraph,
    fetch: &[Tensor<'_>],
    per_round: &[usize],
    steps: Vec<Vec<(&'static str, HostArray)>>,
) -> Vec<Vec<f64>> {
    compiled.plan.validate().unwrap();
    let job = Job::builder(compiled.plan.clone()).build().unwrap();
    run_job(job, compiled, fetch, per_round, steps)
}

/// [`run`] on a job built already. Fetches are read in turn, `per_round[i]` pieces of
/// fetch `i` at a time (a loss per micro-batch, a scale per step), so no sink runs ahead
/// of the others.
fn run_job(
    mut job: Job,
    compiled: &CompiledGraph,
    fetch: &[Tensor<'_>],
    per_round: &[usize],
    steps: Vec<Vec<(&'static str, HostArray)>>,
) -> Vec<Vec<f64>> {
    let metas: Vec<_> = fetch.iter().map(Tensor::meta).collect();
    let mut feeds = job.graph_feeds().unwrap();
    let fetchers: Vec<_> = compiled.fetches.iter().map(|f| job.fetcher(f).unwrap()).collect();
    let pusher = std::thread::spawn(move || {
        for step in steps {
            for (name, value) in step {
                feeds.push(name, &value).unwrap();
            }
        }
        feeds.close().unwrap();
    });
    let mut out = vec![Vec::new(); fetchers.len()];
    'pieces: loop {
        for (((fetcher, meta), values), &count) in fetchers.iter().zip(&metas).zip(&mut out).zip(per_round) {
            for _ in 0..count {
                let Some(piece) = fetcher.recv() else { break 'pieces };
                values.push(HostArray::from_le_bytes(meta, piece.bytes()).unwrap().to_f64_vec()[0]);
            }
        }
    }
    drop(fetchers);
    pusher.join().unwrap();
    job.wait().unwrap();
    out
}

/// `loss = sum(x · w)` in f16 with `x = 4`: the host session's sequence (three overflows
/// from 65536 down to 8192, then the scale growing back every 2 good steps and
/// overflowing again) on the actors, value for value.
#[test]
fn the_runtime_skips_and_rescales_exactly_as_the_host_session() {
    let g = Graph::new();
    g.mixed_precision(Precision::F16).unwrap();
    let x = g.input("x", [1, 4], DType::F32).unwrap();
    let w = g.variable("w", [4, 1], DType::F32, Init::Zeros).unwrap();
    let loss = x.matmul(&w).unwrap().sum_all().unwrap();
    let optimizer = Optimizer::sgd(0.5, 0.0, 0.0).with_loss_scale(LossScale::dynamic().with_interval(2));
    let train = g.minimize(loss, &optimizer).unwrap();
    let new_w = train.updates.iter().find(|(v, _)| v.id() == w.id()).unwrap().1;
    let new_step = train.updates[0].1;
    let fetch = [train.loss, train.loss_scale.unwrap(), train.grad_factor.unwrap(), new_w, new_step];
    let feed = || HostArray::f32([1, 4], vec![4.0; 4]).unwrap();
    let steps = 9;

    let mut s = Session::new(&g);
    let mut want = vec![Vec::new(); fetch.len()];
    for _ in 0..steps {
        let values = s.run(&[(x, feed())], &fetch).unwrap();
        for (column, value) in want.iter_mut().zip(values) {
            column.push(value.to_f64_vec()[0]);
        }
        s.step(&train, &[(x, feed())]).unwrap();
    }

    let compiled = g.compile(&fetch, &train.updates, &CompileOptions::default()).unwrap();
    let got = run(&compiled, &fetch, &[1; 5], (0..steps).map(|_| vec![("x", feed())]).collect());
    let scales = &got[1];
    assert_eq!(scales, &[65536.0, 32768.0, 16384.0, 8192.0, 8192.0, 16384.0, 8192.0, 8192.0, 16384.0]);
    assert_eq!(got[3], [0.0, 0.0, 0.0, -2.0, -4.0, -4.0, -6.0, -8.0, -8.0], "w after each step");
    assert_eq!(got[4], [0.0, 0.0, 0.0, 1.0, 2.0, 2.0, 3.0, 4.0, 4.0], "the step counter");
    for (name, (g, w)) in ["loss", "scale", "factor", "w", "step"].iter().zip(got.iter().zip(&want)) {
        // NaN factors (skipped steps) compare by their bits' meaning, not by ==.
        let same = g.iter().zip(w).all(|(a, b)| a == b || (a.is_nan() && b.is_nan()));
        assert!(same && g.len() == w.len(), "{name}: runtime {g:?}, session {w:?}");
    }
}

const BATCH: usize = 32;
const FEATURES: usize = 16;
const HIDDEN: usize = 64;
const CLASSES: usize = 4;

/// Batches whose class is a linear function of the features, so the loss can fall.
fn batches(steps: usize, seed: u64) -> Vec<(Vec<f32>, Vec<i64>)> {
    let mut rng = SplitMix64::new(seed);
    let teacher: Vec<f64> = (0..FEATURES * CLASSES).map(|_| rng.next_normal()).collect();
    (0..steps)
        .map(|_| {
            let x: Vec<f32> = (0..BATCH * FEATURES).map(|_| rng.next_normal() as f32).collect();
            let y = (0..BATCH)
                .map(|r| {
                    let score = |c: usize| {
                        (0..FEATURES).map(|f| f64::from(x[r * FEATURES + f]) * teacher[f * CLASSES + c]).sum::<f64>()
                    };
                    (0..CLASSES).max_by(|&a, &b| score(a).total_cmp(&score(b))).unwrap_or(0) as i64
                })
                .collect();
            (x, y)
        })
        .collect()
}

/// `x [rows, FEATURES] -> relu(x·w1 + b1)·w2 + b2 -> cross-entropy`, trained by AdamW with
/// clipping and `optimizer`'s loss scale.
fn mlp<'g>(g: &'g Graph, rows: usize, optimizer: &Optimizer) -> TrainStep<'g> {
    let x = g.input("x", [rows, FEATURES], DType::F32).unwrap();
    let y = g.input("y", [rows], DType::I64).unwrap();
    let w1 = g.variable("w1", [FEATURES, HIDDEN], DType::F32, Init::Kaiming { seed: 1 }).unwrap();
    let b1 = g.variable("b1", [HIDDEN], DType::F32, Init::Zeros).unwrap();
    let w2 = g.variable("w2", [HIDDEN, CLASSES], DType::F32, Init::Xavier { seed: 2 }).unwrap();
    let b2 = g.variable("b2", [CLASSES], DType::F32, Init::Zeros).unwrap();
    let h = x.matmul(&w1).unwrap().add(&b1).unwrap().relu().unwrap();
    let loss = h.matmul(&w2).unwrap().add(&b2).unwrap().sparse_cross_entropy(&y).unwrap();
    g.minimize(loss, optimizer).unwrap()
}

fn adamw() -> Optimizer {
    Optimizer::adamw(1e-2, 1e-4).with_clip_norm(1.0)
}

/// Each step's feeds, cut into `micro` micro-batches.
fn feeds(steps: usize, micro: usize) -> Vec<Vec<(&'static str, HostArray)>> {
    let rows = BATCH / micro;
    batches(steps, 7)
        .into_iter()
        .flat_map(|(x, y)| {
            (0..micro)
                .map(|m| {
                    let x = x[m * rows * FEATURES..(m + 1) * rows * FEATURES].to_vec();
                    let y = y[m * rows..(m + 1) * rows].to_vec();
                    vec![("x", HostArray::f32([rows, FEATURES], x).unwrap()), ("y", HostArray::i64([rows], y).unwrap())]
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Losses (and, with loss scaling, the scale of each step) of the MLP on one cpu device.
fn mlp_run(precision: Precision, optimizer: &Optimizer, micro: usize, steps: usize) -> Vec<Vec<f64>> {
    let g = Graph::new();
    g.mixed_precision(precision).unwrap();
    let train = mlp(&g, BATCH / micro, optimizer);
    let mut fetch: Vec<Tensor<'_>> = vec![train.loss];
    fetch.extend(train.loss_scale);
    let accumulate = (micro > 1).then(|| train.accumulate(micro as u32));
    let options = CompileOptions { accumulate, ..CompileOptions::default() };
    let compiled = g.compile(&fetch, &train.updates, &options).unwrap();
    run(&compiled, &fetch, &[micro, 1], feeds(steps, micro))
}

#[test]
fn an_f16_mlp_trains_like_the_f32_one_with_a_dynamic_loss_scale() {
    let steps = 30;
    let full = mlp_run(Precision::F32, &adamw(), 1, steps);
    let half = mlp_run(Precision::F16, &adamw(), 1, steps);
    let (losses, scales) = (&half[0], &half[1]);
    assert_eq!(scales.len(), steps);
    assert!(scales.iter().all(|&s| s > 0.0 && s <= 65536.0), "{scales:?}");
    for (step, (f, h)) in full[0].iter().zip(losses).enumerate() {
        // Skipped steps would make the curves drift apart: f16's 11 bits keep them within
        // a few per cent whichever steps were skipped.
        assert!((f - h).abs() <= 3e-2 * f.abs(), "step {step}: f32 loss {f}, f16 loss {h} (scales {scales:?})");
    }
    let mean = |l: &[f64]| l.iter().sum::<f64>() / l.len() as f64;
    assert!(mean(&losses[steps - 5..]) < 0.7 * mean(&losses[..5]), "f16 losses did not fall: {losses:?}");
}

/// Scaling by a power of two is exact in f32 (no overflow, no underflow here), and the
/// updates multiply the scale back out exactly: the losses are those of the unscaled run,
/// bit for bit, whole batches or four micro-batches per step.
#[test]
fn a_power_of_two_loss_scale_in_f32_changes_no_bit_of_training() {
    let steps = 12;
    for micro in [1, 4] {
        let plain = mlp_run(Precision::F32, &adamw(), micro, steps);
        let scaled = mlp_run(Precision::F32, &adamw().with_loss_scale(LossScale::fixed(1024.0)), micro, steps);
        assert_eq!(scaled[0], plain[0], "{micro} micro-batch(es) per step");
        assert_eq!(scaled[0].len(), steps * micro);
        assert_eq!(scaled[1], vec![1024.0; steps]);
        assert!(plain[0][plain[0].len() - 1] < plain[0][0]);
    }
}

/// Data parallelism over 2 cpu devices under f16 and a scale that starts far too large:
/// the norm the overflow check reads is all-reduced, so both ranks skip the same steps,
/// and the scales and losses follow one device's (the host session's), with the optimizer
/// state replicated or sharded.
#[test]
fn data_parallel_ranks_skip_the_same_steps_as_one_device() {
    let steps = 16;
    // 2^24: the logits' gradient alone overflows f16 at first; seven halvings later (2^17)
    // it fits, and one more overflow comes at step 11.
    let optimizer = adamw().with_loss_scale(LossScale { init: 16_777_216.0, ..LossScale::dynamic() });
    let g = Graph::new();
    g.mixed_precision(Precision::F16).unwrap();
    let train = mlp(&g, BATCH, &optimizer);
    let scale = train.loss_scale.unwrap();
    let mut s = Session::new(&g);
    let (mut want_losses, mut want_scales) = (Vec::new(), Vec::new());
    for step in feeds(steps, 1) {
        let feed = by_tensor(&g, step);
        want_scales.push(s.run(&feed, &[scale]).unwrap()[0].to_f64_vec()[0]);
        want_losses.push(s.step(&train, &feed).unwrap());
    }
    assert!(want_scales[0] > want_scales[steps - 1], "the scale backed off: {want_scales:?}");

    // Plain data parallelism, and ZeRO-1 (AdamW's moments split by rows: each rank checks
    // its shard of every gradient, and the shards' norms are summed before the check).
    for sharded in [false, true] {
        let g = Graph::new();
        g.mixed_precision(Precision::F16).unwrap();
        let train = mlp(&g, BATCH, &optimizer);
        let mesh = tiny_mlp::two_devices(&g, &train, sharded);
        let options = ParallelOptions::new(mesh).train(&train);
        let fetch = [train.loss, train.loss_scale.unwrap()];
        let compiled = g.compile_parallel(&fetch, &train.updates, &options).unwrap();
        let got = run(&compiled, &fetch, &[1, 1], feeds(steps, 1));
        assert_eq!(got[1], want_scales, "scales of dp2 (sharded state: {sharded}) and of one device");
        for (step, (a, b)) in got[0].iter().zip(&want_losses).enumerate() {
            assert!((a - b).abs() <= 2e-2 * b.abs(), "step {step}: dp2 (sharded {sharded}) loss {a}, one device {b}");
        }
    }
}

/// A step's feeds keyed by the graph's inputs, for a host session.
fn by_tensor<'g>(g: &'g Graph, step: Vec<(&'static str, HostArray)>) -> Vec<(Tensor<'g>, HostArray)> {
    step.into_iter().map(|(name, value)| (g.by_name(name).unwrap(), value)).collect()
}

/// The scaler's state is part of a checkpoint: saved after the scale backed off from a
/// start that overflows, it resumes in a fresh compiled job with the same scales and
/// losses as the session that kept going.
#[test]
fn a_checkpoint_carries_the_loss_scale_and_resumes_exactly() {
    let path = std::env::temp_dir().join(format!("regflow-loss-scale-{}.safetensors", std::process::id()));
    let optimizer = adamw().with_loss_scale(LossScale { init: 16_777_216.0, ..LossScale::dynamic() });
    let g = Graph::new();
    g.mixed_precision(Precision::F16).unwrap();
    let train = mlp(&g, BATCH, &optimizer);
    let mut s = Session::new(&g);
    let mut all = feeds(10, 1).into_iter();
    for step in all.by_ref().take(6) {
        s.step(&train, &by_tensor(&g, step)).unwrap();
    }
    let saved_scale = s.value(train.loss_scale.unwrap()).unwrap().to_f64_vec()[0];
    assert!(saved_scale < 16_777_216.0, "the scale backed off before the checkpoint: {saved_scale}");
    s.save(&path).unwrap();
    let rest: Vec<_> = all.collect();
    let mut want = vec![Vec::new(), Vec::new()];
    for step in rest.clone() {
        let feed = by_tensor(&g, step);
        want[1].push(s.run(&feed, &[train.loss_scale.unwrap()]).unwrap()[0].to_f64_vec()[0]);
        want[0].push(s.step(&train, &feed).unwrap());
    }

    let g = Graph::new();
    g.mixed_precision(Precision::F16).unwrap();
    let train = mlp(&g, BATCH, &optimizer);
    let fetch = [train.loss, train.loss_scale.unwrap()];
    let compiled = g.compile(&fetch, &train.updates, &CompileOptions::default()).unwrap();
    let saved = regflow::graph::checkpoint::load(&path).unwrap();
    let scale = saved.iter().find(|(name, _)| name == "loss_scale.scale").expect("the scale is saved");
    assert_eq!(scale.1.to_f64_vec(), vec![saved_scale]);
    // Preload every variable: the plan's initial values become the checkpoint's.
    let mut builder = Job::builder(compiled.plan.clone());
    for variable in &compiled.variables {
        let (_, value) = saved.iter().find(|(n, _)| n == &variable.name).unwrap();
        builder = builder.preload_variable(&variable.name, value.clone());
    }
    let got = run_job(builder.build().unwrap(), &compiled, &fetch, &[1, 1], rest);
    assert_eq!(got, want, "losses and scales after resuming");
    std::fs::remove_file(&path).unwrap();
}

/// Anomaly checking stops at the first infinity, which the scaler expects and skips: the
/// combination is refused when the step is compiled, with both named.
#[test]
fn check_finite_is_refused_for_a_step_with_loss_scaling() {
    let g = Graph::new();
    g.mixed_precision(Precision::F16).unwrap();
    let train = mlp(&g, BATCH, &adamw());
    let options = CompileOptions { check_finite: true, ..CompileOptions::default() };
    let err = g.compile(&[train.loss], &train.updates, &options).unwrap_err().to_string();
    assert!(
        err.starts_with("check_finite stops the job at the first infinity, but this step scales its loss"),
        "{err}"
    );
    // Without loss scaling (bf16) it compiles.
    let g = Graph::new();
    g.mixed_precision(Precision::Bf16).unwrap();
    let train = mlp(&g, BATCH, &adamw());
    g.compile(&[train.loss], &train.updates, &options).unwrap();
}
