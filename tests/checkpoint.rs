//! Checkpoints round-trip: save mid-training, load into a fresh session or a fresh compiled
//! job, and the next losses are identical to the run that kept going.

use regflow::graph::checkpoint::{self, CheckpointError};
use regflow::graph::{CompileOptions, DType, Graph, HostArray, Init, Optimizer, Session, SplitMix64, TrainStep};
use regflow::prelude::*;
use std::path::PathBuf;

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("regflow-{name}-{}.safetensors", std::process::id()))
}

fn model(g: &Graph) -> TrainStep<'_> {
    let x = g.input("x", [4, 5], DType::F32).unwrap();
    let y = g.input("y", [4], DType::I64).unwrap();
    let w = g.variable("w", [5, 3], DType::F32, Init::Kaiming { seed: 4 }).unwrap();
    let b = g.variable("b", [3], DType::F32, Init::Zeros).unwrap();
    let loss = x.matmul(&w).unwrap().add(&b).unwrap().sparse_cross_entropy(&y).unwrap();
    g.minimize(loss, &Optimizer::adamw(5e-2, 1e-2)).unwrap()
}

fn batch(step: u64) -> (Vec<f32>, Vec<i64>) {
    let mut rng = SplitMix64::new(100 + step);
    ((0..20).map(|_| rng.next_normal() as f32).collect(), (0..4).map(|_| (rng.next_u64() % 3) as i64).collect())
}

fn session_steps<'g>(
    g: &'g Graph,
    train: &TrainStep<'g>,
    s: &mut Session<'g>,
    steps: std::ops::Range<u64>,
) -> Vec<f64> {
    let (x, y) = (g.by_name("x").unwrap(), g.by_name("y").unwrap());
    steps
        .map(|k| {
            let (xs, ys) = batch(k);
            s.step(train, &[(x, HostArray::f32([4, 5], xs).unwrap()), (y, HostArray::i64([4], ys).unwrap())]).unwrap()
        })
        .collect()
}

#[test]
fn a_checkpoint_resumes_training_exactly_in_a_session_and_in_a_compiled_job() {
    let path = temp("resume");
    let g = Graph::new();
    let train = model(&g);
    let mut s = Session::new(&g);
    session_steps(&g, &train, &mut s, 0..5);
    s.save(&path).unwrap();
    let continued = session_steps(&g, &train, &mut s, 5..8);

    // A fresh session.
    let g2 = Graph::new();
    let train2 = model(&g2);
    let mut s2 = Session::new(&g2);
    s2.load(&path).unwrap();
    assert_eq!(session_steps(&g2, &train2, &mut s2, 5..8), continued);

    // A fresh compiled job: every variable (weights, AdamW moments, step) preloaded.
    let g3 = Graph::new();
    let train3 = model(&g3);
    let compiled = g3.compile(&[train3.loss], &train3.updates, &CompileOptions::default()).unwrap();
    let saved = checkpoint::load(&path).unwrap();
    let mut builder = Job::builder(compiled.plan.clone());
    for variable in &compiled.variables {
        let (_, value) = saved.iter().find(|(n, _)| n == &variable.name).unwrap();
        builder = builder.preload_variable(&variable.name, value.clone());
    }
    let mut job = builder.build().unwrap();
    let (mut fx, mut fy, losses) =
        (job.feeder("input:x").unwrap(), job.feeder("input:y").unwrap(), job.fetcher(&compiled.fetches[0]).unwrap());
    for k in 5..8 {
        let (xs, ys) = batch(k);
        fx.push(&xs.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        fy.push(&ys.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    }
    drop((fx, fy));
    let resumed: Vec<f64> = std::iter::from_fn(|| losses.recv())
        .map(|p| f64::from(f32::from_le_bytes(p.bytes().try_into().unwrap())))
        .collect();
    drop(losses);
    job.wait().unwrap();
    assert_eq!(resumed, continued);
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn checkpoints_that_do_not_fit_are_refused_with_the_tensor_named() {
    let path = temp("mismatch");
    let shown = path.display().to_string();
    checkpoint::save(&path, &[("w".into(), HostArray::f32([5, 3], vec![0.0; 15]).unwrap())]).unwrap();
    let g = Graph::new();
    model(&g);
    let err = Session::new(&g).load(&path).unwrap_err();
    assert!(matches!(&err, CheckpointError::MissingVariable { variable, .. } if variable == "b"), "{err}");
    assert_eq!(err.to_string(), format!("checkpoint '{shown}' has no tensor for variable 'b'; it holds 1 tensor: 'w'"));

    let mut s = Session::new(&g);
    s.save(&path).unwrap();
    let mut extra = checkpoint::load(&path).unwrap();
    extra.push(("stray".into(), HostArray::f64([1], vec![1.0]).unwrap()));
    checkpoint::save(&path, &extra).unwrap();
    let err = Session::new(&g).load(&path).unwrap_err();
    assert!(matches!(&err, CheckpointError::UnknownTensor { tensor, .. } if tensor == "stray"), "{err}");
    assert!(
        err.to_string().starts_with(&format!(
            "checkpoint '{shown}': tensor 'stray' is not a variable of the graph; the nearest of its"
        )),
        "{err}"
    );
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn a_renamed_variable_is_refused_with_the_nearest_name() {
    let path = temp("renamed");
    let shown = path.display().to_string();
    let g = Graph::new();
    model(&g);
    let mut s = Session::new(&g);
    s.save(&path).unwrap();
    let renamed: Vec<(String, HostArray)> = checkpoint::load(&path)
        .unwrap()
        .into_iter()
        .map(|(name, value)| (if name == "w.adam_m" { "w.adam_mm".into() } else { name }, value))
        .collect();
    checkpoint::save(&path, &renamed).unwrap();
    let err = Session::new(&g).load(&path).unwrap_err().to_string();
    assert_eq!(
        err,
        format!("checkpoint '{shown}': tensor 'w.adam_mm' is not a variable of the graph; did you mean 'w.adam_m'?")
    );
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn a_transposed_weight_with_the_right_element_count_is_refused_with_both_shapes() {
    let path = temp("transposed");
    let shown = path.display().to_string();
    let g = Graph::new();
    model(&g);
    let mut s = Session::new(&g);
    s.save(&path).unwrap();
    let transposed: Vec<(String, HostArray)> = checkpoint::load(&path)
        .unwrap()
        .into_iter()
        .map(|(name, value)| {
            let value = if name == "w" { HostArray::f32([3, 5], vec![0.5; 15]).unwrap() } else { value };
            (name, value)
        })
        .collect();
    checkpoint::save(&path, &transposed).unwrap();
    let err = Session::new(&g).load(&path).unwrap_err();
    let CheckpointError::ShapeMismatch { tensor, checkpoint, variable, .. } = &err else { panic!("{err}") };
    assert_eq!((tensor.as_str(), checkpoint.dims(), variable.dims()), ("w", &[3, 5][..], &[5, 3][..]));
    assert_eq!(
        err.to_string(),
        format!("checkpoint '{shown}': tensor 'w' has shape [3, 5], but variable 'w' has shape [5, 3]")
    );

    // The same check serves a compiled job's preload, which only sees bytes.
    let value = HostArray::f32([3, 5], vec![0.5; 15]).unwrap();
    let meta = g.by_name("w").unwrap().meta();
    assert!(matches!(checkpoint::check_fits(&path, "w", &value, &meta), Err(CheckpointError::ShapeMismatch { .. })));
    let wrong_dtype = HostArray::f64([5, 3], vec![0.5; 15]).unwrap();
    let err = checkpoint::check_fits(&path, "w", &wrong_dtype, &meta).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("checkpoint '{shown}': tensor 'w' holds f64 values, but variable 'w' is f32[5, 3]")
    );
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn files_that_are_not_checkpoints_are_refused_in_terms_of_the_file() {
    let path = temp("garbage");
    let shown = path.display().to_string();
    let refused = |bytes: &[u8]| {
        std::fs::write(&path, bytes).unwrap();
        let err = checkpoint::load(&path).unwrap_err();
        assert!(matches!(err, CheckpointError::NotSafetensors { .. }), "{err}");
        err.to_string()
    };
    assert_eq!(
        refused(b"short"),
        format!("checkpoint '{shown}' is not a safetensors file: it is shorter than the 8 bytes that give its header's length")
    );
    assert_eq!(
        refused(b"not a checkpoint"),
        format!("checkpoint '{shown}' is not a safetensors file: it declares a header larger than safetensors allows (100 MB)")
    );
    let mut cut = 64u64.to_le_bytes().to_vec();
    cut.extend_from_slice(b"{\"w\":");
    assert_eq!(
        refused(&cut),
        format!(
            "checkpoint '{shown}' is not a safetensors file: its header is cut short: the file ends before the header \
             length it declares"
        )
    );
    let mut not_json = 4u64.to_le_bytes().to_vec();
    not_json.extend_from_slice(b"{{{{");
    assert!(refused(&not_json).ends_with("its header is not the JSON table of tensors a safetensors file starts with"));

    // A dtype regflow does not hold.
    let header = br#"{"h":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}}"#;
    let mut int32 = (header.len() as u64).to_le_bytes().to_vec();
    int32.extend_from_slice(header);
    int32.extend_from_slice(&[0; 8]);
    std::fs::write(&path, &int32).unwrap();
    let err = checkpoint::load(&path).unwrap_err().to_string();
    assert_eq!(
        err,
        format!(
            "checkpoint '{shown}': tensor 'h' holds i32 values, which regflow does not support \
             (f32, f64, i64, bf16 and f16 it does)"
        )
    );

    std::fs::remove_file(&path).unwrap();
    let err = checkpoint::load(&path).unwrap_err();
    assert!(matches!(err, CheckpointError::Io { action: "read", .. }), "{err}");
    assert!(err.to_string().starts_with(&format!("checkpoint '{shown}' cannot be read: ")), "{err}");
}

/// Runs `steps` of the model compiled with `options` on `mesh`, every variable preloaded
/// from `saved` by its logical name; returns the losses.
fn job_losses(
    saved: &[(String, HostArray)],
    mesh: Option<regflow::graph::sbp::Mesh>,
    steps: std::ops::Range<u64>,
) -> Vec<f64> {
    use regflow::graph::sbp::{NdSbp, Sbp};
    let g = Graph::new();
    let train = model(&g);
    let compiled = match mesh {
        None => g.compile(&[train.loss], &train.updates, &CompileOptions::default()).unwrap(),
        Some(mesh) => {
            g.set_layout(g.by_name("w").unwrap(), &mesh, NdSbp(vec![Sbp::Split(1)])).unwrap();
            g.set_layout(g.by_name("b").unwrap(), &mesh, NdSbp(vec![Sbp::Split(0)])).unwrap();
            let options = regflow::graph::ParallelOptions::new(mesh).train(&train);
            g.compile_parallel(&[train.loss], &train.updates, &options).unwrap()
        }
    };
    let mut builder = Job::builder(compiled.plan.clone());
    for (name, value) in saved {
        builder = builder.preload_variable(name, value.clone());
    }
    let mut job = builder.build().unwrap();
    let mut feeds = job.graph_feeds().unwrap();
    let losses = job.fetcher(&compiled.fetches[0]).unwrap();
    for k in steps {
        let (xs, ys) = batch(k);
        feeds.push("x", &HostArray::f32([4, 5], xs).unwrap()).unwrap();
        feeds.push("y", &HostArray::i64([4], ys).unwrap()).unwrap();
    }
    feeds.close().unwrap();
    let got: Vec<f64> = std::iter::from_fn(|| losses.recv())
        .map(|p| f64::from(f32::from_le_bytes(p.bytes().try_into().unwrap())))
        .collect();
    drop(losses);
    job.wait().unwrap();
    got
}

#[test]
fn a_checkpoint_preloads_a_tensor_parallel_job_by_logical_name() {
    let path = temp("tensor-parallel");
    let g = Graph::new();
    let train = model(&g);
    let mut s = Session::new(&g);
    session_steps(&g, &train, &mut s, 0..3);
    s.save(&path).unwrap();
    let saved = checkpoint::load(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let one = job_losses(&saved, None, 3..6);
    // w is split by columns and b by rows over two devices: each gets its part of the value.
    let two = job_losses(&saved, Some(regflow::graph::sbp::Mesh::cpu(&[2], &["tp"]).unwrap()), 3..6);
    assert_eq!(one.len(), 3);
    for (a, b) in one.iter().zip(&two) {
        assert!((a - b).abs() <= 1e-5 * a.abs(), "{one:?} vs {two:?}");
    }
}

#[test]
fn a_job_refuses_a_transposed_or_unknown_variable_value() {
    let g = Graph::new();
    let train = model(&g);
    let compiled = g.compile(&[train.loss], &train.updates, &CompileOptions::default()).unwrap();
    let build = |name: &str, value: HostArray| {
        Job::builder(compiled.plan.clone()).preload_variable(name, value).build().map(|_| ()).unwrap_err().to_string()
    };
    let transposed = HostArray::f32([3, 5], vec![0.5; 15]).unwrap();
    assert_eq!(
        build("w", transposed),
        "preload of variable 'w': the variable is f32[5, 3], the value given is f32[3, 5] \
         (the same number of elements in another shape: transposed?)"
    );
    let wrong_dtype = HostArray::f64([5, 3], vec![0.5; 15]).unwrap();
    assert_eq!(
        build("w", wrong_dtype),
        "preload of variable 'w': the variable is f32[5, 3], the value given is f64[5, 3]"
    );
    let message = build("ww", HostArray::f32([5, 3], vec![0.5; 15]).unwrap());
    assert!(message.starts_with("no variable named 'ww'; did you mean 'w'?"), "{message}");
}
