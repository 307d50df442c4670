//! The training API: a compiled job's final variables read back (weights and optimizer
//! state, gathered over devices), state dicts saved and loaded strictly or not, resuming
//! bitwise, typed fetches, the Trainer and its loss plots.

use regflow::graph::checkpoint;
use regflow::graph::sbp::{Mesh, NdSbp, Sbp};
use regflow::graph::{
    CompileOptions, CompiledGraph, DType, Graph, HostArray, Init, Optimizer, ParallelOptions, Session, SplitMix64,
    TrainStep,
};
use regflow::prelude::*;
use regflow::train::{save_loss_plot, Skipped, TrainError};
use std::path::PathBuf;

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("regflow-training-api-{}-{name}", std::process::id()))
}

/// An MLP 6-8-3 on a batch of 4 trained by AdamW with clipping and a warm-up schedule
/// (the step counter is a variable too); `layout` pins the weights on a mesh.
fn model<'g>(g: &'g Graph, mesh: Option<&Mesh>, tensor_parallel: bool) -> TrainStep<'g> {
    let x = g.input("x", [4, 6], DType::F32).unwrap();
    let y = g.input("y", [4], DType::I64).unwrap();
    let w1 = g.variable("w1", [6, 8], DType::F32, Init::Kaiming { seed: 1 }).unwrap();
    let b1 = g.variable("b1", [8], DType::F32, Init::Zeros).unwrap();
    let w2 = g.variable("w2", [8, 3], DType::F32, Init::Xavier { seed: 2 }).unwrap();
    if let Some(mesh) = mesh {
        if tensor_parallel {
            // Megatron: w1 split by columns, w2 by rows.
            g.set_layout(w1, mesh, NdSbp(vec![Sbp::Split(1)])).unwrap();
            g.set_layout(b1, mesh, NdSbp(vec![Sbp::Split(0)])).unwrap();
            g.set_layout(w2, mesh, NdSbp(vec![Sbp::Split(0)])).unwrap();
        } else {
            g.set_layout(x, mesh, NdSbp(vec![Sbp::Split(0)])).unwrap();
            g.set_layout(y, mesh, NdSbp(vec![Sbp::Split(0)])).unwrap();
        }
    }
    let loss = x.matmul(&w1).unwrap().add(&b1).unwrap().relu().unwrap().matmul(&w2).unwrap();
    let loss = loss.sparse_cross_entropy(&y).unwrap();
    let optimizer = Optimizer::adamw(2e-2, 1e-2)
        .with_schedule(regflow::graph::Schedule::WarmupCosine { peak: 2e-2, warmup: 3, total: 20, min: 1e-3 })
        .with_clip_norm(0.5);
    g.minimize(loss, &optimizer).unwrap()
}

fn batch(step: u64) -> Vec<(&'static str, HostArray)> {
    let mut rng = SplitMix64::new(1000 + step);
    let x = (0..24).map(|_| rng.next_normal() as f32).collect();
    let y = (0..4).map(|_| (rng.next_u64() % 3) as i64).collect();
    vec![("x", HostArray::f32([4, 6], x).unwrap()), ("y", HostArray::i64([4], y).unwrap())]
}

fn compile(g: &Graph, train: &TrainStep<'_>, options: &CompileOptions) -> CompiledGraph {
    g.compile(&[train.loss], &train.updates, options).unwrap()
}

/// Runs `steps` steps of `compiled` in one job that keeps its state; losses and the report.
fn run_job(compiled: &CompiledGraph, steps: u64) -> (Vec<f64>, JobReport) {
    let mut job = Job::builder(compiled.plan.clone()).keep_state().build().unwrap();
    let mut feeds = job.graph_feeds().unwrap();
    let losses = job.graph_fetcher(&compiled.fetches[0]).unwrap();
    let mut got = Vec::new();
    for step in 0..steps {
        for (name, value) in batch(step) {
            feeds.push(name, &value).unwrap();
        }
        got.push(losses.recv_scalar().unwrap().unwrap());
    }
    feeds.close().unwrap();
    drop((feeds, losses));
    (got, job.wait().unwrap())
}

#[test]
fn a_finished_jobs_state_is_every_variable_as_the_host_session_has_it_for_any_register_count() {
    for register_num in [1, 3] {
        for steps in [0u64, 1, 2, 3, 5] {
            let g = Graph::new();
            let train = model(&g, None, false);
            let options = CompileOptions { activation_register_num: register_num, ..CompileOptions::default() };
            let compiled = compile(&g, &train, &options);
            if register_num == 3 {
                // The loops of directly updated variables take the activation count: the
                // last value is not always in slot 1 of 2.
                assert!(compiled
                    .plan
                    .variables
                    .iter()
                    .any(|v| compiled.plan.regst_descs[v.regst.index()].register_num == 3));
            }
            let (losses, report) = run_job(&compiled, steps);

            let mut session = Session::new(&g);
            let mut want_losses = Vec::new();
            for step in 0..steps {
                let feeds: Vec<_> = batch(step).into_iter().map(|(n, v)| (g.by_name(n).unwrap(), v)).collect();
                want_losses.push(session.step(&train, &feeds).unwrap());
            }
            assert_eq!(losses, want_losses);
            let path = temp(&format!("session-{register_num}-{steps}.safetensors"));
            session.save(&path).unwrap();
            let want = checkpoint::load(&path).unwrap();
            std::fs::remove_file(&path).unwrap();
            let state = report.state_dict().unwrap();
            // Weights, AdamW moments and the step counter.
            assert_eq!(state.len(), want.len(), "{:?}", state.names().collect::<Vec<_>>());
            assert!(state.len() > 6);
            for (name, value) in &want {
                assert_eq!(state.get(name), Some(value), "{name} after {steps} steps with {register_num} slots");
            }
        }
    }
}

#[test]
fn a_report_without_kept_state_says_how_to_ask_for_it() {
    let g = Graph::new();
    let train = model(&g, None, false);
    let compiled = compile(&g, &train, &CompileOptions::default());
    let job = Job::builder(compiled.plan.clone()).build().unwrap();
    let report = job.wait().unwrap();
    assert!(report.state.is_none());
    let err = report.state_dict().unwrap_err();
    assert!(matches!(err, TrainError::NoState));
    assert_eq!(
        err.to_string(),
        "the job report holds no state: build the job with JobBuilder::keep_state() to read its variables back"
    );
}

/// Trains 8 steps unbroken, then 5 + 3 through a saved state dict, then 8 with a checkpoint
/// every 3 steps: the losses are bitwise the same.
fn resumes_bitwise(mesh: Option<Mesh>, tensor_parallel: bool) {
    // The variants run side by side in one process: each writes and removes files of its
    // own (dp2 and tp2 have meshes of one size, and shared a checkpoint folder that the
    // first to finish removed under the other).
    let layout = match (&mesh, tensor_parallel) {
        (None, _) => "one".to_string(),
        (Some(m), false) => format!("dp{}", m.size()),
        (Some(m), true) => format!("tp{}", m.size()),
    };
    let compiled_for = |g: &Graph| {
        let train = model(g, mesh.as_ref(), tensor_parallel);
        match &mesh {
            None => compile(g, &train, &CompileOptions::default()),
            Some(m) => g
                .compile_parallel(&[train.loss], &train.updates, &ParallelOptions::new(m.clone()).train(&train))
                .unwrap(),
        }
    };
    let g = Graph::new();
    let compiled = compiled_for(&g);
    let unbroken = Trainer::new(&compiled).steps(8).progress(false).run(|s| Ok::<_, TrainError>(batch(s))).unwrap();
    assert_eq!(unbroken.losses.len(), 8);
    assert_eq!(unbroken.jobs, 1);

    let first = Trainer::new(&compiled).steps(5).progress(false).run(|s| Ok::<_, TrainError>(batch(s))).unwrap();
    assert_eq!(first.losses, unbroken.losses[..5]);
    let path = temp(&format!("resume-{layout}.safetensors"));
    first.state.save(&path).unwrap();

    // A fresh graph, plan and job from the file.
    let g2 = Graph::new();
    let compiled2 = compiled_for(&g2);
    let state = StateDict::load(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    let resumed =
        Trainer::new(&compiled2).resume(state, 5).steps(3).progress(false).run(|s| Ok::<_, TrainError>(batch(s)));
    let resumed = resumed.unwrap();
    assert_eq!(resumed.first_step, 5);
    assert_eq!(resumed.losses, unbroken.losses[5..]);
    assert_eq!(resumed.state, unbroken.state);

    let dir = temp(&format!("checkpoints-{layout}"));
    let mut seen = Vec::new();
    let stepped = Trainer::new(&compiled)
        .steps(8)
        .progress(false)
        .checkpoint_every(3, &dir)
        .on_eval(4, |e| {
            seen.push((e.step, e.losses.len(), e.state.len()));
            Ok(e.losses.iter().sum::<f64>())
        })
        .run(|s| Ok::<_, TrainError>(batch(s)))
        .unwrap();
    assert_eq!(stepped.losses, unbroken.losses);
    assert_eq!(stepped.state, unbroken.state);
    // Boundaries at 3, 4, 6 and the end.
    assert_eq!(stepped.jobs, 4);
    assert_eq!(seen, [(4, 4, unbroken.state.len()), (8, 8, unbroken.state.len())]);
    assert_eq!(stepped.evals, [(4, unbroken.losses[..4].iter().sum()), (8, unbroken.losses.iter().sum())]);
    let names: Vec<String> =
        stepped.checkpoints.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert_eq!(names, ["step-00000003.safetensors", "step-00000006.safetensors"]);
    let at_six = StateDict::load(&stepped.checkpoints[1]).unwrap();
    let six = Trainer::new(&compiled).steps(6).progress(false).run(|s| Ok::<_, TrainError>(batch(s))).unwrap();
    for (name, value) in six.state.iter() {
        assert_eq!(at_six.get(name), Some(value), "{name}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn resuming_from_a_state_dict_is_bitwise_an_unbroken_run_on_one_device() {
    resumes_bitwise(None, false);
}

#[test]
fn resuming_from_a_state_dict_is_bitwise_an_unbroken_run_data_parallel() {
    resumes_bitwise(Some(Mesh::cpu(&[2], &["dp"]).unwrap()), false);
}

#[test]
fn resuming_from_a_state_dict_is_bitwise_an_unbroken_run_tensor_parallel() {
    resumes_bitwise(Some(Mesh::cpu(&[2], &["tp"]).unwrap()), true);
}

#[test]
fn split_variables_are_gathered_whole_and_match_one_device() {
    let one = {
        let g = Graph::new();
        let train = model(&g, None, false);
        run_job(&compile(&g, &train, &CompileOptions::default()), 4).1.state_dict().unwrap()
    };
    let g = Graph::new();
    let mesh = Mesh::cpu(&[2], &["tp"]).unwrap();
    let train = model(&g, Some(&mesh), true);
    let compiled =
        g.compile_parallel(&[train.loss], &train.updates, &ParallelOptions::new(mesh.clone()).train(&train)).unwrap();
    // w1 really is cut in two parts.
    assert_eq!(compiled.plan.variables.iter().filter(|v| v.name.starts_with("w1@")).count(), 2);
    let tp = run_job(&compiled, 4).1.state_dict().unwrap();
    assert_eq!(tp.names().collect::<Vec<_>>(), one.names().collect::<Vec<_>>());
    for (name, value) in one.iter() {
        let got = tp.get(name).unwrap();
        assert_eq!(got.meta(), value.meta(), "{name}");
        for (a, b) in got.to_f64_vec().iter().zip(value.to_f64_vec()) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{name}: {a} vs {b}");
        }
    }
}

#[test]
fn strict_loads_refuse_missing_and_unexpected_names_and_loose_ones_report_them() {
    let g = Graph::new();
    let train = model(&g, None, false);
    let compiled = compile(&g, &train, &CompileOptions::default());
    let full = run_job(&compiled, 2).1.state_dict().unwrap();

    let mut renamed = full.clone();
    let w1 = renamed.remove("w1").unwrap();
    renamed.insert("w_1", w1);
    let builder = Job::builder(compiled.plan.clone());
    let err = builder.load_state_dict(&renamed, true).unwrap_err();
    assert!(matches!(&err, TrainError::MissingVariables { variables, .. } if variables == &["w1"]), "{err}");
    assert_eq!(
        err.to_string(),
        "strict load: the state dict has no value for 1 variable(s) of the plan: 'w1'; did you mean 'w_1'?"
    );

    let mut extra = full.clone();
    extra.insert("w3", HostArray::f32([1], vec![0.0]).unwrap());
    let err = Job::builder(compiled.plan.clone()).load_state_dict(&extra, true).unwrap_err();
    assert!(matches!(&err, TrainError::UnexpectedTensors { tensors, .. } if tensors == &["w3"]), "{err}");
    assert!(
        err.to_string().starts_with(
            "strict load: the state dict holds 1 tensor(s) that are no variable of the plan: 'w3'; did you mean"
        ),
        "{err}"
    );

    // Non-strict: loads the rest, reports the skipped names, trains from them.
    let (builder, skipped) = Job::builder(compiled.plan.clone()).load_state_dict(&renamed, false).unwrap();
    assert_eq!(skipped, Skipped { missing: vec!["w1".into()], unexpected: vec!["w_1".into()] });
    assert_eq!(skipped.to_string(), "no value for 'w1'; ignored 'w_1'");
    let report = builder.keep_state().build().unwrap().wait().unwrap();
    let state = report.state_dict().unwrap();
    assert_eq!(state.get("w2"), full.get("w2"));
    assert_ne!(state.get("w1"), full.get("w1"), "w1 starts from its initializer");

    let mut transposed = full.clone();
    transposed.insert("w2", HostArray::f32([3, 8], vec![0.0; 24]).unwrap());
    let err = Job::builder(compiled.plan.clone()).load_state_dict(&transposed, false).unwrap_err();
    assert_eq!(err.to_string(), "variable 'w2' is f32[8, 3], the state dict's value is f32[3, 8]");
}

#[test]
fn typed_fetches_return_tensors_and_name_the_nearest_output() {
    let g = Graph::new();
    let train = model(&g, None, false);
    let w2 = g.by_name("w2").unwrap();
    let compiled = g.compile(&[train.loss, w2], &train.updates, &CompileOptions::default()).unwrap();
    let mut job = Job::builder(compiled.plan.clone()).build().unwrap();
    let err = job.graph_fetcher("fetch:7").unwrap_err();
    assert!(err.to_string().starts_with("no output named 'fetch:7'; did you mean"), "{err}");
    let mut feeds = job.graph_feeds().unwrap();
    let fetches = job.graph_fetches().unwrap();
    assert_eq!(
        fetches.outputs().map(|(n, m)| format!("{n} {m}")).collect::<Vec<_>>(),
        ["fetch:0 f32[]", "fetch:1 f32[8, 3]"]
    );
    let err = fetches.get("fetch:1").unwrap().recv_scalar().unwrap_err();
    assert_eq!(err.to_string(), "fetch of output 'fetch:1': it is f32[8, 3], not a scalar; use recv for tensors");
    for (name, value) in batch(0) {
        feeds.push(name, &value).unwrap();
    }
    feeds.close().unwrap();
    let values = fetches.recv_all().unwrap().unwrap();
    assert_eq!(values[0].meta().shape.dims(), [] as [usize; 0]);
    assert_eq!(values[1].meta().to_string(), "f32[8, 3]");
    assert!(values[0].to_f64_vec()[0] > 0.0);
    assert!(fetches.recv_all().unwrap().is_none());
    drop((feeds, fetches));
    job.wait().unwrap();
}

#[test]
fn the_trainer_names_what_is_wrong() {
    let g = Graph::new();
    let train = model(&g, None, false);
    let compiled = compile(&g, &train, &CompileOptions::default());
    let err = Trainer::new(&compiled).progress(false).run(|s| Ok::<_, TrainError>(batch(s))).unwrap_err();
    assert_eq!(err.to_string(), "trainer: steps(0): a run needs at least one step");
    let err = Trainer::new(&compiled)
        .steps(4)
        .progress(false)
        .run(|s| if s == 2 { Err(format!("no data for step {s}")) } else { Ok(batch(s)) })
        .unwrap_err();
    assert_eq!(err.to_string(), "the batch of step 2: no data for step 2");
    let err = Trainer::new(&compiled)
        .steps(1)
        .progress(false)
        .run(|_| Ok::<_, TrainError>(vec![("x_in", HostArray::f32([4, 6], vec![0.0; 24]).unwrap())]))
        .unwrap_err();
    assert_eq!(err.to_string(), "no input named 'x_in' (nearest inputs: 'x', 'y')");
    let err = Trainer::new(&compiled)
        .steps(2)
        .progress(false)
        .on_eval(1, |_| Err("the test set is missing".into()))
        .run(|s| Ok::<_, TrainError>(batch(s)))
        .unwrap_err();
    assert_eq!(err.to_string(), "the evaluation after step 1: the test set is missing");
}

#[test]
fn loss_plots_are_written_as_png_and_svg() {
    let losses: Vec<f64> = (0..50).map(|i| 2.0 * (-(i as f64) / 20.0).exp() + 0.1).collect();
    let png = temp("loss.png");
    save_loss_plot(&png, &losses).unwrap();
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    std::fs::remove_file(&png).unwrap();
    let svg = temp("loss.svg");
    save_loss_plot(&svg, &losses).unwrap();
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.contains("<svg") && text.contains("polyline"), "{}", &text[..text.len().min(300)]);
    std::fs::remove_file(&svg).unwrap();
    let err = save_loss_plot(temp("loss.gif"), &losses).unwrap_err();
    assert!(err.to_string().ends_with(": the file name must end in .png or .svg"), "{err}");
    let err = save_loss_plot(&png, &[f64::NAN]).unwrap_err();
    assert!(err.to_string().ends_with("none of the 1 losses is finite and positive: nothing to draw"), "{err}");
}

#[test]
fn accumulating_micro_batches_resume_bitwise_at_optimizer_steps() {
    let g = Graph::new();
    let train = model(&g, None, false);
    let options = CompileOptions { accumulate: Some(train.accumulate(2)), ..CompileOptions::default() };
    let compiled = compile(&g, &train, &options);
    // A Trainer step is one piece (one micro-batch): 8 pieces are 4 optimizer steps.
    let unbroken = Trainer::new(&compiled).steps(8).progress(false).run(|s| Ok::<_, TrainError>(batch(s))).unwrap();
    let dir = temp("accumulate-checkpoints");
    let stepped = Trainer::new(&compiled)
        .steps(8)
        .progress(false)
        .checkpoint_every(4, &dir)
        .run(|s| Ok::<_, TrainError>(batch(s)))
        .unwrap();
    assert_eq!(stepped.jobs, 2);
    assert_eq!(stepped.losses, unbroken.losses);
    assert_eq!(stepped.state, unbroken.state);
    std::fs::remove_dir_all(&dir).unwrap();
}
