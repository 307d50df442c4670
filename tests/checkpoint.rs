//! Checkpoints round-trip: save mid-training, load into a fresh session or a fresh compiled
//! job, and the next losses are identical to the run that kept going.

use regflow::graph::checkpoint;
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
        builder = builder.preload(&variable.regst, value.to_le_bytes());
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
    let err = Session::new(&g).load(&path).unwrap_err().to_string();
    assert_eq!(err, format!("checkpoint {shown}: variable 'b' is missing"));

    checkpoint::save(&path, &[("w".into(), HostArray::f32([3, 5], vec![0.0; 15]).unwrap())]).unwrap();
    let err = Session::new(&g).load(&path).unwrap_err().to_string();
    assert_eq!(err, format!("checkpoint {shown}: variable 'w' is f32[3, 5] in the checkpoint, f32[5, 3] in the graph"));

    let mut s = Session::new(&g);
    s.save(&path).unwrap();
    let mut extra = checkpoint::load(&path).unwrap();
    extra.push(("stray".into(), HostArray::f64([1], vec![1.0]).unwrap()));
    checkpoint::save(&path, &extra).unwrap();
    let err = Session::new(&g).load(&path).unwrap_err().to_string();
    assert_eq!(err, format!("checkpoint {shown}: tensor 'stray' is not a variable of the graph"));

    std::fs::write(&path, b"not a checkpoint").unwrap();
    let err = checkpoint::load(&path).unwrap_err().to_string();
    assert!(err.starts_with(&format!("checkpoint {shown}: ")), "{err}");
    std::fs::remove_file(&path).unwrap();
    assert!(checkpoint::load(&path).unwrap_err().to_string().contains("No such file"));
}
