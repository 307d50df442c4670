//! Gradient accumulation: k micro-batches per optimizer step, with repeat actors handing the
//! weights to each micro-batch and acc actors averaging the gradients, trains like one
//! batch k times larger.

use regflow::graph::plan::DeviceKind;
use regflow::graph::{CompileOptions, DType, Graph, HostArray, Init, Optimizer, Session, SplitMix64, TrainStep};
use regflow::prelude::*;

fn model(g: &Graph, batch: usize) -> TrainStep<'_> {
    let x = g.input("x", [batch, 5], DType::F64).unwrap();
    let y = g.input("y", [batch], DType::I64).unwrap();
    let w = g.variable("w", [5, 3], DType::F64, Init::Kaiming { seed: 4 }).unwrap();
    let b = g.variable("b", [3], DType::F64, Init::Zeros).unwrap();
    let loss = x.matmul(&w).unwrap().add(&b).unwrap().sparse_cross_entropy(&y).unwrap();
    g.minimize(loss, &Optimizer::adamw(5e-2, 1e-2).with_clip_norm(0.5)).unwrap()
}

/// The same batch every step, so the loss has something to learn.
fn batch(_step: u64) -> (Vec<f64>, Vec<i64>) {
    let mut rng = SplitMix64::new(200);
    ((0..40).map(|_| rng.next_normal()).collect(), (0..8).map(|_| (rng.next_u64() % 3) as i64).collect())
}

#[test]
fn two_micro_batches_of_four_train_like_one_batch_of_eight() {
    let steps = 4u64;
    // Reference: the full batch of 8 in a host session.
    let g = Graph::new();
    let train = model(&g, 8);
    let (x, y) = (g.by_name("x").unwrap(), g.by_name("y").unwrap());
    let mut s = Session::new(&g);
    let full: Vec<f64> = (0..steps)
        .map(|k| {
            let (xs, ys) = batch(k);
            s.step(&train, &[(x, HostArray::f64([8, 5], xs).unwrap()), (y, HostArray::i64([8], ys).unwrap())]).unwrap()
        })
        .collect();

    // Two micro-batches of 4 per step on the actors.
    let g = Graph::new();
    let train = model(&g, 4);
    let options = CompileOptions { accumulate: Some(train.accumulate(2)), ..CompileOptions::default() };
    let compiled = g.compile(&[train.loss], &train.updates, &options).unwrap();
    let kinds = |kind: &str| compiled.plan.actors.iter().filter(|a| a.kind.name() == kind).count();
    assert!(kinds("repeat") >= 2 && kinds("acc") >= 3, "repeat {} acc {}", kinds("repeat"), kinds("acc"));
    let mut job = Job::builder(compiled.plan.clone()).build().unwrap();
    let mut feeds = job.graph_feeds().unwrap();
    let losses = job.fetcher(&compiled.fetches[0]).unwrap();
    for k in 0..steps {
        let (xs, ys) = batch(k);
        for half in 0..2 {
            feeds.push("x", &HostArray::f64([4, 5], xs[half * 20..(half + 1) * 20].to_vec()).unwrap()).unwrap();
            feeds.push("y", &HostArray::i64([4], ys[half * 4..(half + 1) * 4].to_vec()).unwrap()).unwrap();
        }
    }
    feeds.close().unwrap();
    let micro: Vec<f64> =
        std::iter::from_fn(|| losses.recv()).map(|p| f64::from_le_bytes(p.bytes().try_into().unwrap())).collect();
    drop(losses);
    let report = job.wait().unwrap();
    assert_eq!(micro.len(), 2 * steps as usize, "one loss per micro-batch");
    // The loss of a step is the mean of its micro-batch losses (every micro-batch of a step
    // sees the same weights), and the updates match step after step.
    for (k, pair) in micro.chunks(2).enumerate() {
        let mean = (pair[0] + pair[1]) / 2.0;
        assert!((mean - full[k]).abs() <= 1e-12 * full[k].abs(), "step {k}: {mean} vs {}", full[k]);
    }
    assert!(full[steps as usize - 1] < full[0]);
    let updates: Vec<u64> =
        report.actors.iter().filter(|a| a.name.starts_with("adamw_update")).map(|a| a.fires).collect();
    // w's and b's updates are one fused actor (`compile/fuse_updates.rs`): both gradients
    // are made on the device's stream.
    assert_eq!(updates, vec![steps], "one update of w and b per step");
}

/// A layer wide enough for gemm to pack its weight: `[64, 96] · [96, 128]`, ReLU,
/// `· [128, 10]`, three micro-batches per step.
fn wide_model(g: &Graph) -> TrainStep<'_> {
    let x = g.input("x", [64, 96], DType::F32).unwrap();
    let y = g.input("y", [64], DType::I64).unwrap();
    let w0 = g.variable("w0", [96, 128], DType::F32, Init::Kaiming { seed: 1 }).unwrap();
    let w1 = g.variable("w1", [128, 10], DType::F32, Init::Kaiming { seed: 2 }).unwrap();
    let h = x.matmul(&w0).unwrap().relu().unwrap();
    let loss = h.matmul(&w1).unwrap().sparse_cross_entropy(&y).unwrap();
    g.minimize(loss, &Optimizer::adamw(1e-2, 1e-2)).unwrap()
}

/// Each micro-batch reads the step's weights through a repeat, so the plan says each
/// product's weight holds for 3 pieces (`Plan::input_repeats`), and the CPU kernel packs it
/// once per step instead of once per micro-batch (`HeldWeightMatMul`). Training gives the
/// bits of the plain kernel (registered over it with `JobBuilder::op_kernel`), which packs
/// at every piece.
#[test]
fn weights_packed_once_per_step_train_to_the_bits_of_packing_every_micro_batch() {
    use regflow::graph::plan::{ActorIndex, ActorKind, KernelConf};
    use regflow::kernels::{HostOpKernel, KernelError};
    let g = Graph::new();
    let train = wide_model(&g);
    let options = CompileOptions { accumulate: Some(train.accumulate(3)), ..CompileOptions::default() };
    let compiled = g.compile(&[train.loss], &train.updates, &options).unwrap();
    let plan = &compiled.plan;
    // Every product reading a weight: forward `x · w` and backward `dy · wᵀ`.
    let mut held = 0;
    // The products of a held weight, and the bytes of that weight.
    let mut held_products = std::collections::BTreeMap::new();
    for (a, actor) in plan.actors.iter().enumerate() {
        let ActorKind::Compute { kernel: KernelConf::Op(conf) } = &actor.kind else { continue };
        for (k, &input) in conf.input_map.iter().enumerate() {
            let from_repeat = matches!(
                plan.actors[plan.regst_descs[actor.inputs[input].index()].producer.index()].kind,
                ActorKind::Repeat { .. }
            );
            let repeats = plan.input_repeats(ActorIndex(a as u32), input);
            assert_eq!(repeats, if from_repeat { 3 } else { 1 }, "{} input {k}", actor.name);
            if conf.op_type == "matmul" && k == 1 && from_repeat {
                held += 1;
                held_products.insert(actor.name.clone(), plan.regst_descs[actor.inputs[input].index()].bytes);
            }
        }
    }
    assert_eq!(held, 3, "x · w0, h · w1 and dy · w1ᵀ");

    let train_with = |plain: bool| {
        let mut builder = Job::builder(plan.clone()).keep_state();
        if plain {
            builder = builder.op_kernel("matmul", DeviceKind::Cpu, DType::F32, |spec| {
                let conf = spec.op.ok_or_else(|| KernelError("no op".into()))?;
                let op: regflow::graph::plan::ops::MatMul = conf.parse_attrs().map_err(KernelError)?;
                Ok(Box::new(HostOpKernel::new(op, conf)))
            });
        }
        let mut job = builder.build().unwrap();
        let mut feeds = job.graph_feeds().unwrap();
        let losses = job.fetcher(&compiled.fetches[0]).unwrap();
        let mut rng = SplitMix64::new(7);
        for _ in 0..4 * 3 {
            let xs = (0..64 * 96).map(|_| rng.next_normal() as f32).collect();
            let ys = (0..64).map(|_| (rng.next_u64() % 10) as i64).collect();
            feeds.push("x", &HostArray::f32([64, 96], xs).unwrap()).unwrap();
            feeds.push("y", &HostArray::i64([64], ys).unwrap()).unwrap();
        }
        feeds.close().unwrap();
        let bits: Vec<u32> =
            std::iter::from_fn(|| losses.recv()).map(|p| u32::from_le_bytes(p.bytes().try_into().unwrap())).collect();
        drop(losses);
        let report = job.wait().unwrap();
        let held: Vec<(String, u64)> =
            report.actors.iter().filter(|a| a.held_bytes > 0).map(|a| (a.name.clone(), a.held_bytes)).collect();
        assert_eq!(report.held_by_kernels(), held.iter().map(|(_, b)| b).sum::<u64>());
        (bits, report.state.unwrap(), held)
    };
    let (losses, state, held) = train_with(false);
    assert_eq!(losses.len(), 12);
    let (plain_losses, plain_state, plain_held) = train_with(true);
    assert_eq!((losses, state), (plain_losses, plain_state));
    // Only the products of a held weight may keep bytes between firings: their packed
    // panels, at least the weight, where the gemm backend runs them (the backend is chosen
    // by the host's processor; `kernels/tests/matmul_packed.rs` forces it). The plain
    // kernel keeps nothing.
    for (name, bytes) in &held {
        let weight =
            held_products.get(name).unwrap_or_else(|| panic!("{name} keeps {bytes} bytes: not a held product"));
        assert!(bytes >= weight, "{name} keeps {bytes} bytes, less than its weight's {weight}");
    }
    assert!(plain_held.is_empty(), "{plain_held:?}");
}
