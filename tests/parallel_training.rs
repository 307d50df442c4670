//! Data, tensor, ZeRO and 2-D parallel training from layouts: the same graph compiled onto
//! a mesh of cpu devices trains like one device (the host reference session), step by step.

use regflow::graph::plan::CollectiveOp;
use regflow::graph::sbp::{Mesh, NdSbp, Sbp};
use regflow::graph::{
    CollectiveStreams, DType, Graph, HostArray, Init, Optimizer, ParallelOptions, Session, SplitMix64, TrainStep,
};
use regflow::prelude::*;

use Sbp::{Broadcast as B, Split as S};

const BATCH: usize = 8;

/// Layouts of one model: `(tensor name, layout)` plus the mesh.
struct Layout {
    mesh: Mesh,
    pins: Vec<(&'static str, Vec<Sbp>)>,
}

fn batches(steps: usize, dtype: DType) -> Vec<(HostArray, HostArray)> {
    let mut rng = SplitMix64::new(5);
    (0..steps)
        .map(|_| {
            let x: Vec<f64> = (0..BATCH * 6).map(|_| rng.next_normal()).collect();
            let y: Vec<i64> = (0..BATCH).map(|_| (rng.next_u64() % 3) as i64).collect();
            let x = match dtype {
                DType::F32 => HostArray::f32([BATCH, 6], x.iter().map(|&v| v as f32).collect()),
                _ => HostArray::f64([BATCH, 6], x),
            };
            (x.unwrap(), HostArray::i64([BATCH], y).unwrap())
        })
        .collect()
}

fn model<'g>(g: &'g Graph, dtype: DType, layout: Option<&Layout>) -> TrainStep<'g> {
    model_clipped(g, dtype, layout, true)
}

/// [`model`], its gradients clipped by their global norm or not.
fn model_clipped<'g>(g: &'g Graph, dtype: DType, layout: Option<&Layout>, clip: bool) -> TrainStep<'g> {
    let x = g.input("x", [BATCH, 6], dtype).unwrap();
    let y = g.input("y", [BATCH], DType::I64).unwrap();
    let w1 = g.variable("w1", [6, 16], dtype, Init::Kaiming { seed: 1 }).unwrap();
    let b1 = g.variable("b1", [16], dtype, Init::Normal { mean: 0.0, std: 0.1, seed: 3 }).unwrap();
    let w2 = g.variable("w2", [16, 3], dtype, Init::Xavier { seed: 2 }).unwrap();
    // Added to a row-split product (Partial under tensor parallelism): boxed B -> P.
    let b2 = g.variable("b2", [3], dtype, Init::Normal { mean: 0.0, std: 0.1, seed: 4 }).unwrap();
    if let Some(layout) = layout {
        for (name, sbp) in &layout.pins {
            let t = g.by_name(name).unwrap();
            g.set_layout(t, &layout.mesh, NdSbp(sbp.clone())).unwrap();
        }
    }
    let h = x.matmul(&w1).unwrap().add(&b1).unwrap().relu().unwrap();
    let loss = h.matmul(&w2).unwrap().add(&b2).unwrap().sparse_cross_entropy(&y).unwrap();
    let optimizer = Optimizer::adamw(1e-2, 1e-3);
    g.minimize(loss, &if clip { optimizer.with_clip_norm(1.0) } else { optimizer }).unwrap()
}

fn as_f64(bytes: &[u8], dtype: DType) -> f64 {
    match dtype {
        DType::F32 => f64::from(f32::from_le_bytes(bytes.try_into().unwrap())),
        _ => f64::from_le_bytes(bytes.try_into().unwrap()),
    }
}

fn reference_losses(steps: usize, dtype: DType) -> Vec<f64> {
    let g = Graph::new();
    let train = model(&g, dtype, None);
    let (x, y) = (g.by_name("x").unwrap(), g.by_name("y").unwrap());
    let mut s = Session::new(&g);
    batches(steps, dtype).into_iter().map(|(xs, ys)| s.step(&train, &[(x, xs), (y, ys)]).unwrap()).collect()
}

fn parallel_losses(steps: usize, dtype: DType, layout: &Layout) -> Vec<f64> {
    losses_with(steps, dtype, layout, ParallelOptions::new(layout.mesh.clone()))
}

fn losses_with(steps: usize, dtype: DType, layout: &Layout, options: ParallelOptions) -> Vec<f64> {
    let g = Graph::new();
    let train = model(&g, dtype, Some(layout));
    let options = options.train(&train);
    let compiled = g.compile_parallel(&[train.loss], &train.updates, &options).unwrap();
    run_losses(&compiled, steps, dtype)
}

/// Runs `steps` steps of a compiled `model` and returns the fetched losses.
fn run_losses(compiled: &regflow::graph::CompiledGraph, steps: usize, dtype: DType) -> Vec<f64> {
    compiled.plan.validate().unwrap();
    let mut job = Job::builder(compiled.plan.clone()).build().unwrap();
    let mut feeds = job.graph_feeds().unwrap();
    let fetcher = job.fetcher(&compiled.fetches[0]).unwrap();
    let pusher = std::thread::spawn(move || {
        for (xs, ys) in batches(steps, dtype) {
            feeds.push("x", &xs).unwrap();
            feeds.push("y", &ys).unwrap();
        }
        feeds.close().unwrap();
    });
    let losses: Vec<f64> = std::iter::from_fn(|| fetcher.recv()).map(|p| as_f64(p.bytes(), dtype)).collect();
    pusher.join().unwrap();
    job.wait().unwrap();
    losses
}

fn assert_close(name: &str, got: &[f64], want: &[f64], tolerance: f64) {
    assert_eq!(got.len(), want.len(), "{name}: {got:?} vs {want:?}");
    for (step, (a, b)) in got.iter().zip(want).enumerate() {
        let rel = (a - b).abs() / b.abs().max(1e-12);
        assert!(rel <= tolerance, "{name}: step {step}: {a} vs one device {b} (relative {rel:e})\n{got:?}\n{want:?}");
    }
    assert!(got[got.len() - 1] < got[0], "{name}: the loss went down: {got:?}");
}

fn layout(shape: &[usize], axes: &[&str], pins: Vec<(&'static str, Vec<Sbp>)>) -> Layout {
    Layout { mesh: Mesh::cpu(shape, axes).unwrap(), pins }
}

fn data_parallel(p: usize) -> Layout {
    layout(&[p], &["dp"], vec![("x", vec![S(0)]), ("y", vec![S(0)])])
}

fn tensor_parallel() -> Layout {
    layout(&[2], &["tp"], vec![("w1", vec![S(1)]), ("b1", vec![S(0)]), ("w2", vec![S(0)])])
}

fn zero() -> Layout {
    layout(
        &[2],
        &["dp"],
        vec![("x", vec![S(0)]), ("y", vec![S(0)]), ("w1", vec![S(0)]), ("b1", vec![S(0)]), ("w2", vec![S(0)])],
    )
}

fn dp_tp() -> Layout {
    layout(
        &[2, 2],
        &["dp", "tp"],
        vec![
            ("x", vec![S(0), B]),
            ("y", vec![S(0), B]),
            ("w1", vec![B, S(1)]),
            ("b1", vec![B, S(0)]),
            ("w2", vec![B, S(0)]),
        ],
    )
}

fn check(name: &str, layout: Layout) {
    let steps = 20;
    let want = reference_losses(steps, DType::F64);
    assert_close(name, &parallel_losses(steps, DType::F64, &layout), &want, 1e-10);
    let want = reference_losses(steps, DType::F32);
    assert_close(name, &parallel_losses(steps, DType::F32, &layout), &want, 1e-5);
}

#[test]
fn data_parallel_2_trains_like_one_device() {
    check("dp2", data_parallel(2));
}

#[test]
fn data_parallel_4_trains_like_one_device() {
    check("dp4", data_parallel(4));
}

#[test]
fn uneven_data_parallel_3_trains_like_one_device() {
    check("dp3 (batch 8 over 3)", data_parallel(3));
}

#[test]
fn tensor_parallel_2_trains_like_one_device() {
    check("tp2", tensor_parallel());
}

#[test]
fn zero_2_trains_like_one_device() {
    check("zero2", zero());
}

/// ZeRO stage 1: data parallel with every AdamW moment split `S(0)` and the weights
/// replicated. Each gradient is reduce-scattered to the rows its device updates, the
/// all-gather of the new rows writes the variable's loop register itself (no `assign` copy
/// of the gathered weight), and it trains like one device.
#[test]
fn sharded_optimizer_state_trains_like_one_device_without_weight_copies() {
    let steps = 20;
    for (dtype, tolerance) in [(DType::F64, 1e-10), (DType::F32, 1e-5)] {
        let layout = data_parallel(2);
        let g = Graph::new();
        let train = model(&g, dtype, Some(&layout));
        for (state, _) in &train.states {
            g.set_layout(*state, &layout.mesh, NdSbp(vec![S(0)])).unwrap();
        }
        let options = ParallelOptions::new(layout.mesh.clone()).train(&train);
        let compiled = g.compile_parallel(&[train.loss], &train.updates, &options).unwrap();
        let plan = &compiled.plan;
        for weight in ["w1", "b1", "w2", "b2"] {
            let copies: Vec<&str> = plan
                .actors
                .iter()
                .map(|a| a.name.as_str())
                .filter(|n| n.starts_with(&format!("assign:{weight}@")))
                .collect();
            assert!(copies.is_empty(), "{weight} is copied after its all-gather by {copies:?}");
        }
        // The rows a device updates are read in place from the replicated weight (a window
        // of its register), not cut out by a copy, where they start on a 64-byte boundary:
        // always on rank 0; on rank 1 after as many elements as the first half holds.
        let cut = |weight: &str, rank: usize| {
            let suffix = format!(":B->S(0):{weight}@{rank}");
            plan.actors.iter().any(|a| a.name.starts_with("box") && a.name.ends_with(&suffix))
        };
        for (weight, elements_before) in [("w1", 3 * 16), ("b1", 8), ("w2", 8 * 3), ("b2", 1)] {
            let aligned = elements_before * dtype.size() % 64 == 0;
            assert!(!cut(weight, 0), "{weight} is cut out on rank 0");
            assert_eq!(cut(weight, 1), !aligned, "{weight} on rank 1 ({elements_before} elements before its rows)");
        }
        let windowed = plan.actors.iter().filter(|a| a.name.starts_with("adamw_update") && !a.windows.is_empty());
        assert!(windowed.count() > 4, "rank 0's four updates and rank 1's of w1 read windows");
        // The updated rows of every weight are all-gathered on every device; each weight's
        // gradient is reduce-scattered to the rows its device updates: those whose rows
        // split evenly in one bucket each way (b2's 3 elements do not: it keeps its own);
        // what is still all-reduced is scalars (the fetched loss, the clipping norm).
        let confs: Vec<_> = (0..plan.actors.len()).filter_map(|a| plan.collective_conf(a)).collect();
        let collectives: Vec<(&str, usize)> = confs.iter().map(|c| (c.op_name(), c.shape.iter().product())).collect();
        let tensors =
            |flat: CollectiveOp| confs.iter().filter(|c| c.op.flat() == flat).map(|c| c.op.parts()).sum::<usize>();
        let count = |name: &str| collectives.iter().filter(|(op, _)| *op == name).count();
        assert_eq!(tensors(CollectiveOp::AllGather { dim: 0 }), 2 * 4, "{collectives:?}");
        assert_eq!(tensors(CollectiveOp::ReduceScatter { dim: 0 }), 2 * 4, "{collectives:?}");
        for op in ["all_gather", "reduce_scatter", "all_gather_bucket", "reduce_scatter_bucket"] {
            assert_eq!(count(op), 2, "{op}: {collectives:?}");
        }
        assert!(collectives.iter().all(|&(op, elements)| op != "all_reduce" || elements == 1), "{collectives:?}");
        let want = reference_losses(steps, dtype);
        assert_close(&format!("zero1 {dtype}"), &run_losses(&compiled, steps, dtype), &want, tolerance);
    }
}

/// ZeRO's buckets sum each element in the order one collective per tensor does: with
/// sharded moments (zero1) or sharded weights and moments (zero2), with clipping (every
/// update waits for every gradient) or without (each update runs once its gradient is in,
/// so gathers of updated weights come between the gradients' reduce-scatters), buckets are
/// made and the losses are the same bits as without them.
#[test]
fn zero_buckets_change_no_bit() {
    for clip in [true, false] {
        for (name, layout) in [("zero1", data_parallel(2)), ("zero2", zero())] {
            let run = |bucket_bytes: u64| {
                let g = Graph::new();
                let train = model_clipped(&g, DType::F32, Some(&layout), clip);
                for (state, _) in &train.states {
                    g.set_layout(*state, &layout.mesh, NdSbp(vec![S(0)])).unwrap();
                }
                let options =
                    ParallelOptions { bucket_bytes, ..ParallelOptions::new(layout.mesh.clone()).train(&train) };
                let compiled = g.compile_parallel(&[train.loss], &train.updates, &options).unwrap();
                let plan = &compiled.plan;
                let buckets: Vec<&str> = (0..plan.actors.len())
                    .filter_map(|a| plan.collective_conf(a))
                    .filter(|c| c.op.is_bucket())
                    .map(|c| c.op_name())
                    .collect();
                let losses: Vec<u64> = run_losses(&compiled, 12, DType::F32).iter().map(|l| l.to_bits()).collect();
                (losses, buckets)
            };
            let ((bucketed, buckets), (separate, none)) = (run(1 << 20), run(0));
            assert!(buckets.contains(&"reduce_scatter_bucket"), "{name}, clip {clip}: {buckets:?}");
            assert!(buckets.contains(&"all_gather_bucket"), "{name}, clip {clip}: {buckets:?}");
            assert!(none.is_empty(), "{none:?}");
            assert_eq!(bucketed, separate, "{name}, clip {clip}: losses, bit for bit");
        }
    }
}

/// The digits-size MLP (784-1024-1024-10, batch 256, AdamW) in `g`, its batch split over
/// two cpu devices: the step and the mesh.
fn digits_mlp_on_two(g: &Graph) -> (TrainStep<'_>, Mesh) {
    let x = g.input("x", [256, 784], DType::F32).unwrap();
    let y = g.input("y", [256], DType::I64).unwrap();
    let sizes = [784, 1024, 1024, 10];
    let mut h = x;
    for layer in 0..3 {
        let shape = [sizes[layer], sizes[layer + 1]];
        let w = g.variable(&format!("w{layer}"), shape, DType::F32, Init::Kaiming { seed: 1 }).unwrap();
        let b = g.variable(&format!("b{layer}"), [sizes[layer + 1]], DType::F32, Init::Zeros).unwrap();
        h = h.matmul(&w).unwrap().add(&b).unwrap();
        if layer < 2 {
            h = h.relu().unwrap();
        }
    }
    let train = g.minimize(h.sparse_cross_entropy(&y).unwrap(), &Optimizer::adamw(1e-3, 0.0)).unwrap();
    let mesh = Mesh::cpu(&[2], &["dp"]).unwrap();
    for t in [x, y] {
        g.set_layout(t, &mesh, NdSbp(vec![S(0)])).unwrap();
    }
    (train, mesh)
}

/// Bytes per device of [`digits_mlp_on_two`], data parallel, with the moments replicated or
/// split `S(0)`, its collectives on `streams`.
fn zero1_bytes_per_device(sharded: bool, streams: CollectiveStreams) -> u64 {
    let g = Graph::new();
    let (train, mesh) = digits_mlp_on_two(&g);
    // Replicated: pinned, since states left to the compiler are sharded in process.
    let layout = if sharded { S(0) } else { Sbp::Broadcast };
    for (state, _) in &train.states {
        g.set_layout(*state, &mesh, NdSbp(vec![layout])).unwrap();
    }
    let options = ParallelOptions { collective_streams: streams, ..ParallelOptions::new(mesh) }.train(&train);
    let plan = g.compile_parallel(&[train.loss], &train.updates, &options).unwrap().plan;
    let devices = plan.memory().unwrap().report().devices;
    assert_eq!(devices.len(), 2);
    // Gathered weights held once for the process (`RegstDesc::home`) live on device 0:
    // device 1 holds the same but for their bytes.
    let held_on_device_0: u64 =
        plan.regst_descs.iter().filter(|d| d.home.is_some()).map(|d| d.bytes.next_multiple_of(64)).sum();
    assert_eq!(held_on_device_0 > 0, sharded, "only sharded weights are gathered, and held once");
    assert_eq!(devices[0].1, devices[1].1 + held_on_device_0, "{devices:?}");
    devices[0].1
}

/// Sharding the moments saves half of them on each device; the all-gathered weights write
/// the variables' registers (no second copy), and the rows each device updates are read in
/// place (no two-slot register of them). Since updates write in place over one buffer per
/// variable and moment (`tests/in_place_updates.rs`), the replicated plan holds each of
/// them once too, and since the sharded updates write their rows where they lie in the
/// gathered weight, so does the sharded plan: 23.0 MB per device sharded against 40.2 MB
/// replicated, 2.3 of a weight's bytes (34.2 MB while a gathered weight kept two buffers
/// and its rows one of their own; before in-place updates: 41.1 against 63.1 MB). With the
/// collectives on the compute streams their buffers share memory with the activations'
/// too (they are on the chain), and each plan holds less again: 20.0 and 32.7 MB. (Device
/// 1 of the sharded plan holds less still: the gathered weights are held once for the
/// process, on device 0.)
#[test]
fn sharded_optimizer_state_saves_over_twice_the_weights_per_device() {
    let weights = ((784 + 1) * 1024 + (1024 + 1) * 1024 + (1024 + 1) * 10) * 4;
    let bytes = |sharded| zero1_bytes_per_device(sharded, CollectiveStreams::CommStreams);
    let (sharded, replicated) = (bytes(true), bytes(false));
    assert!(
        sharded + 2 * weights <= replicated,
        "{sharded} bytes sharded + twice {weights} of weights > {replicated} replicated"
    );
    let on_compute = |sharded| zero1_bytes_per_device(sharded, CollectiveStreams::ComputeStreams);
    let (sharded_inline, replicated_inline) = (on_compute(true), on_compute(false));
    assert!(sharded_inline + weights <= replicated_inline, "{sharded_inline} + {weights} > {replicated_inline}");
    assert!(sharded_inline <= sharded && replicated_inline <= replicated, "more memory on the compute streams");
}

#[test]
fn data_times_tensor_parallel_trains_like_one_device() {
    check("dp2xtp2", dp_tp());
}

/// One pre-LayerNorm attention block with an MLP on token ids, in f64 (so the comparison is
/// tight): Megatron tensor parallelism splits the heads (Q/K/V column-split) and the MLP's
/// hidden units, and the second matrix of each pair is row-split. Unless composed, the
/// attention is one `attention` op on `[B, T, H, d]` (causal, no mask input), or packed, on
/// one projection to `[B, T, H, 3, d]`.
fn attention<'g>(g: &'g Graph, layout: Option<&Layout>, attn: Attn) -> TrainStep<'g> {
    let fused = attn != Attn::Composed;
    let (batch, time, vocab, d, heads) = (4usize, 4usize, 7usize, 8usize, 2usize);
    let hd = d / heads;
    let ids = g.input("ids", [batch, time], DType::I64).unwrap();
    let targets = g.input("targets", [batch * time], DType::I64).unwrap();
    let mask = (!fused).then(|| g.input("mask", [time, time], DType::F64).unwrap());
    let normal = |seed| Init::Normal { mean: 0.0, std: 0.3, seed };
    let var = |name: &str, shape: Vec<usize>, init| g.variable(name, shape, DType::F64, init).unwrap();
    let emb = var("emb", vec![vocab, d], normal(1));
    let gamma = var("gamma", vec![d], Init::Ones);
    let beta = var("beta", vec![d], Init::Zeros);
    let (wq, wk, wv) =
        (var("wq", vec![d, d], normal(3)), var("wk", vec![d, d], normal(4)), var("wv", vec![d, d], normal(5)));
    let bq = var("bq", vec![d], normal(8));
    let wo = var("wo", vec![d, d], normal(6));
    let w1 = var("w1", vec![d, 2 * d], normal(7));
    let w2 = var("w2", vec![2 * d, vocab], normal(9));
    if let Some(layout) = layout {
        for (name, sbp) in &layout.pins {
            g.set_layout(g.by_name(name).unwrap(), &layout.mesh, NdSbp(sbp.clone())).unwrap();
        }
    }
    let (b, t) = (batch as isize, time as isize);
    let x = emb.embedding(&ids).unwrap().reshape(&[b * t, d as isize]).unwrap();
    let h = x.layer_norm(&gamma, &beta, 1e-5).unwrap();
    let heads_of = |r: regflow::graph::Tensor<'g>| r.reshape(&[b, t, heads as isize, hd as isize]).unwrap();
    let q = heads_of(h.matmul(&wq).unwrap().add(&bq).unwrap());
    let k = heads_of(h.matmul(&wk).unwrap());
    let v = heads_of(h.matmul(&wv).unwrap());
    let scale = 1.0 / (hd as f64).sqrt();
    let merged = match mask {
        None if attn == Attn::Packed => {
            // The same projections packed, their columns grouped by head ([d, H, 3, hd]), made
            // from the three weights (and q's bias) so the step is the same function of them.
            let grouped = |w: regflow::graph::Tensor<'g>| w.reshape(&[d as isize, heads as isize, 1, hd as isize]);
            let (gq, gk, gv) = (grouped(wq).unwrap(), grouped(wk).unwrap(), grouped(wv).unwrap());
            let w_qkv = gq.concat(&[gk, gv], 2).unwrap().reshape(&[d as isize, 3 * d as isize]).unwrap();
            let zeros = g.constant(0.0, [heads, 2, hd], DType::F64).unwrap();
            let b_qkv = bq.reshape(&[heads as isize, 1, hd as isize]).unwrap().concat(&[zeros], 1).unwrap();
            let b_qkv = b_qkv.reshape(&[3 * d as isize]).unwrap();
            let qkv = h.matmul(&w_qkv).unwrap().add(&b_qkv).unwrap();
            let qkv = qkv.reshape(&[b, t, heads as isize, 3, hd as isize]).unwrap();
            qkv.attention_packed(scale, true).unwrap().reshape(&[b * t, d as isize]).unwrap()
        }
        None => q.attention(&k, &v, scale, true).unwrap().reshape(&[b * t, d as isize]).unwrap(),
        Some(mask) => {
            let split = |r: regflow::graph::Tensor<'g>| r.permute(&[0, 2, 1, 3]).unwrap();
            let (q, k, v) = (split(q), split(k), split(v));
            let scores = q.matmul_transposed(&k, false, true).unwrap().mul_scalar(scale).unwrap();
            let attn = scores.add(&mask).unwrap().softmax(-1).unwrap().matmul(&v).unwrap();
            attn.permute(&[0, 2, 1, 3]).unwrap().reshape(&[b * t, d as isize]).unwrap()
        }
    };
    let y = x.add(&merged.matmul(&wo).unwrap()).unwrap();
    let logits = y.matmul(&w1).unwrap().gelu().unwrap().matmul(&w2).unwrap();
    let loss = logits.sparse_cross_entropy(&targets).unwrap();
    g.minimize(loss, &Optimizer::adamw(1e-2, 0.0)).unwrap()
}

/// The feeds of `steps` steps: ids, targets, and (unless `fused`) the causal mask.
fn attention_batches(steps: usize, attn: Attn) -> Vec<Vec<(&'static str, HostArray)>> {
    let fused = attn != Attn::Composed;
    let mut rng = SplitMix64::new(9);
    let mask: Vec<f64> = (0..16).map(|i| if i % 4 <= i / 4 { 0.0 } else { -1e9 }).collect();
    (0..steps)
        .map(|_| {
            let ids: Vec<i64> = (0..16).map(|_| (rng.next_u64() % 7) as i64).collect();
            let targets: Vec<i64> = ids.iter().map(|i| (i * 3 + 1) % 7).collect();
            let mut feeds = vec![
                ("ids", HostArray::i64([4, 4], ids).unwrap()),
                ("targets", HostArray::i64([16], targets).unwrap()),
            ];
            if !fused {
                feeds.push(("mask", HostArray::f64([4, 4], mask.clone()).unwrap()));
            }
            feeds
        })
        .collect()
}

fn attention_losses(steps: usize, layout: Option<&Layout>, attn: Attn) -> Vec<f64> {
    let g = Graph::new();
    let train = attention(&g, layout, attn);
    let Some(layout) = layout else {
        let mut s = Session::new(&g);
        return attention_batches(steps, attn)
            .into_iter()
            .map(|batch| {
                let feeds: Vec<_> = batch.into_iter().map(|(n, v)| (g.by_name(n).unwrap(), v)).collect();
                s.step(&train, &feeds).unwrap()
            })
            .collect();
    };
    let options = ParallelOptions::new(layout.mesh.clone()).train(&train);
    let compiled = g.compile_parallel(&[train.loss], &train.updates, &options).unwrap();
    let mut job = Job::builder(compiled.plan.clone()).build().unwrap();
    let mut feeds = job.graph_feeds().unwrap();
    let fetcher = job.fetcher(&compiled.fetches[0]).unwrap();
    let pusher = std::thread::spawn(move || {
        for batch in attention_batches(steps, attn) {
            for (name, value) in &batch {
                feeds.push(name, value).unwrap();
            }
        }
        feeds.close().unwrap();
    });
    let losses: Vec<f64> = std::iter::from_fn(|| fetcher.recv()).map(|p| as_f64(p.bytes(), DType::F64)).collect();
    pusher.join().unwrap();
    job.wait().unwrap();
    losses
}

fn megatron(shape: &[usize], axes: &[&str], tp: usize) -> Layout {
    let on = |sbp: Sbp| {
        let mut v = vec![B; shape.len()];
        v[tp] = sbp;
        v
    };
    let mut pins = vec![
        ("wq", on(S(1))),
        ("bq", on(S(0))),
        ("wk", on(S(1))),
        ("wv", on(S(1))),
        ("wo", on(S(0))),
        ("w1", on(S(1))),
        ("w2", on(S(0))),
    ];
    if let Some(dp) = axes.iter().position(|a| *a == "dp") {
        let mut v = vec![B; shape.len()];
        v[dp] = S(0);
        pins.push(("ids", v.clone()));
        pins.push(("targets", v));
    }
    layout(shape, axes, pins)
}

#[test]
fn tensor_parallel_attention_trains_like_one_device() {
    // The heads really are split: the attention probabilities [B, H, T, T] are S(1) on tp.
    let g = Graph::new();
    let tp = megatron(&[2], &["tp"], 0);
    let train = attention(&g, Some(&tp), Attn::Composed);
    let compiled = g
        .compile_parallel(&[train.loss], &train.updates, &ParallelOptions::new(tp.mesh.clone()).train(&train))
        .unwrap();
    let layouts = &compiled.parallel.as_ref().unwrap().layouts;
    let softmax: Vec<_> =
        layouts.iter().filter(|(n, _)| n.starts_with("softmax") && !n.starts_with("softmax_grad")).collect();
    assert!(!softmax.is_empty() && softmax.iter().all(|(_, l)| l.0 == vec![S(1)]), "{softmax:?}\n{layouts:?}");

    let steps = 20;
    let want = attention_losses(steps, None, Attn::Composed);
    let tp2 = attention_losses(steps, Some(&megatron(&[2], &["tp"], 0)), Attn::Composed);
    assert_close("attention tp2", &tp2, &want, 1e-10);
    assert_close(
        "attention dp2xtp2",
        &attention_losses(steps, Some(&megatron(&[2, 2], &["dp", "tp"], 1)), Attn::Composed),
        &want,
        1e-10,
    );
}

/// The fused `attention` op under the same layouts: its heads split on `tp` (the op and
/// its gradient run on each device's heads, `S(2)`), its batch on `dp`; the losses are the
/// one-device fused step's, and those the composed step's (f64: only the sums' order
/// differs).
#[test]
fn tensor_parallel_fused_attention_trains_like_one_device() {
    let want = attention_losses(20, None, Attn::Fused);
    assert_close("fused vs composed, one device", &want, &attention_losses(20, None, Attn::Composed), 1e-10);
    check_heads_split(Attn::Fused, &want);
}

/// The packed op (`attention_packed`) over one projection to `[B, T, H, 3, hd]`, made from
/// the same three weights, under the same layouts: `qkv`'s heads split on `tp` (`S(2)`),
/// the op and its gradient on each device's heads, and the losses those of the fused op
/// over the projections apart (f64: the packed op's sums are the same).
#[test]
fn tensor_parallel_packed_attention_trains_like_one_device() {
    let want = attention_losses(20, None, Attn::Fused);
    assert_close("packed vs apart, one device", &attention_losses(20, None, Attn::Packed), &want, 1e-10);
    check_heads_split(Attn::Packed, &want);
}

/// The attention model attending by `attn` on `tp2`: the attention op and its gradient
/// have every tensor split on its heads (`[B, T, H, ..]` on H, the forward's `lse [B, H,
/// T]` on its H), and 20 steps on `tp2` and on `dp2 x tp2` give the losses `want`.
fn check_heads_split(attn: Attn, want: &[f64]) {
    let g = Graph::new();
    let tp = megatron(&[2], &["tp"], 0);
    let train = attention(&g, Some(&tp), attn);
    let compiled = g
        .compile_parallel(&[train.loss], &train.updates, &ParallelOptions::new(tp.mesh.clone()).train(&train))
        .unwrap();
    let layouts = &compiled.parallel.as_ref().unwrap().layouts;
    let ops: Vec<_> = layouts.iter().filter(|(n, _)| n.starts_with("attention")).collect();
    assert!(ops.len() >= 2, "{attn:?}: the attention op and its gradient: {layouts:?}");
    let lse = |name: &str| name.starts_with("attention") && !name.starts_with("attention_grad") && name.ends_with(":1");
    assert!(ops.iter().all(|(n, l)| l.0 == vec![if lse(n) { S(1) } else { S(2) }]), "{attn:?}: heads split: {ops:?}");
    let steps = want.len();
    assert_close(&format!("{attn:?} tp2"), &attention_losses(steps, Some(&tp), attn), want, 1e-10);
    let dp_tp = megatron(&[2, 2], &["dp", "tp"], 1);
    assert_close(&format!("{attn:?} dp2xtp2"), &attention_losses(steps, Some(&dp_tp), attn), want, 1e-10);
}

/// How the attention test model attends: the products around a softmax, the fused op over
/// q, k and v apart, or the packed op over one projection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Attn {
    Composed,
    Fused,
    Packed,
}

/// Parallel plans share memory between one-slot registers whose lifetimes do not overlap,
/// one ordering chain per device (the training tests above run with it on): every device
/// needs fewer bytes than without, and the plan states them before running.
#[test]
fn parallel_plans_reuse_memory_per_device() {
    let bytes = |reuse: bool| {
        let g = Graph::new();
        let layout = dp_tp();
        let train = model(&g, DType::F32, Some(&layout));
        let mut options = ParallelOptions::new(layout.mesh.clone()).train(&train);
        options.reuse_memory = reuse;
        let compiled = g.compile_parallel(&[train.loss], &train.updates, &options).unwrap();
        compiled.plan.memory().unwrap().report().devices.iter().map(|(_, b)| *b).collect::<Vec<u64>>()
    };
    let (with, without) = (bytes(true), bytes(false));
    assert_eq!(with.len(), 4);
    for (device, (a, b)) in with.iter().zip(&without).enumerate() {
        assert!(a < b, "device {device}: {a} bytes with reuse, {b} without");
    }
}

/// The collectives of a compiled plan: `(op name, parts)` of each member on device 0.
fn collectives_on_first_device(layout: &Layout, bucket_bytes: u64) -> Vec<(String, u32)> {
    use regflow::graph::plan::{ActorKind, CollectiveOp, KernelConf};
    let g = Graph::new();
    let train = model(&g, DType::F32, Some(layout));
    // Replicated optimizer state, whose gradients are all-reduced (this file's
    // `data_parallel_with_state_left_to_the_compiler_shards_it_in_process` has the other).
    let options =
        ParallelOptions { bucket_bytes, shard_states_in_process: false, ..ParallelOptions::new(layout.mesh.clone()) }
            .train(&train);
    let plan = g.compile_parallel(&[train.loss], &train.updates, &options).unwrap().plan;
    let device = plan.device_of(
        plan.actors
            .iter()
            .position(|a| a.name.contains("x"))
            .map(|a| regflow::graph::plan::ActorIndex(a as u32))
            .unwrap(),
    );
    plan.actors
        .iter()
        .enumerate()
        .filter(|&(a, _)| plan.device_of(regflow::graph::plan::ActorIndex(a as u32)) == device)
        .filter_map(|(_, actor)| match &actor.kind {
            ActorKind::Compute { kernel: KernelConf::Collective(conf) } => {
                let parts = match conf.op {
                    CollectiveOp::AllReduceBucket { parts } => parts,
                    _ => 1,
                };
                Some((conf.op_name().to_string(), parts))
            }
            _ => None,
        })
        .collect()
}

#[test]
fn data_parallel_gradients_are_all_reduced_in_one_bucket() {
    let sorted = |bucket_bytes| {
        let mut collectives = collectives_on_first_device(&data_parallel(2), bucket_bytes);
        collectives.sort();
        collectives
    };
    let all_reduce = || ("all_reduce".to_string(), 1);
    // Four small gradients (w1, b1, w2, b2): one bucket by default, four all-reduces
    // without. The fetched loss (a batch mean, partial on each device) keeps its own.
    assert_eq!(sorted(1 << 20), [all_reduce(), ("all_reduce_bucket".to_string(), 4)]);
    assert_eq!(sorted(0), vec![all_reduce(); 5]);
    // A cap below the two largest gradients (w1: 384 bytes, w2: 192 bytes in f32) leaves
    // them their own all-reduces and buckets the biases (64 and 12 bytes).
    assert_eq!(sorted(100), [all_reduce(), all_reduce(), all_reduce(), ("all_reduce_bucket".to_string(), 2)]);
}

#[test]
fn buckets_change_no_bit_of_the_losses() {
    for dtype in [DType::F32, DType::F64] {
        for p in [2, 3] {
            let layout = data_parallel(p);
            let bucketed = losses_with(12, dtype, &layout, ParallelOptions::new(layout.mesh.clone()));
            let single = losses_with(
                12,
                dtype,
                &layout,
                ParallelOptions { bucket_bytes: 0, ..ParallelOptions::new(layout.mesh.clone()) },
            );
            assert_eq!(bucketed, single, "dp{p} {dtype}");
        }
    }
}

/// Data parallel on cpu devices of one process with the optimizer state left to the
/// compiler (`ParallelOptions::shard_states_in_process`): every state whose rows split on
/// 64-byte boundaries is split `S(0)`, its gradient reduce-scattered instead of
/// all-reduced, and its gathered weight held once for the process; the rest (`b2`'s state:
/// 10 rows of 4 bytes) stays replicated. Losses are bitwise those of replicated state (no clipping here: a global
/// norm would sum each device's rows first).
#[test]
fn data_parallel_with_state_left_to_the_compiler_shards_it_in_process() {
    use regflow::graph::plan::{ActorKind, KernelConf, Plan};
    let compile = |shard: bool| {
        let g = Graph::new();
        let (train, mesh) = digits_mlp_on_two(&g);
        let options = ParallelOptions { shard_states_in_process: shard, ..ParallelOptions::new(mesh) }.train(&train);
        g.compile_parallel(&[train.loss], &train.updates, &options).unwrap()
    };
    let (sharded, replicated) = (compile(true), compile(false));
    let bytes = |plan: &Plan, name: &str| {
        plan.regst_descs[plan.variables.iter().find(|v| v.name == name).unwrap().regst.index()].bytes
    };
    // A parameter pinned replicated counts as replicated; one pinned split (tensor
    // parallel) keeps its state in its own layout.
    for (pin, m_bytes) in [(B, 392 * 4096), (S(1), 784 * 2048)] {
        let g = Graph::new();
        let (train, mesh) = digits_mlp_on_two(&g);
        g.set_layout(g.by_name("w0").unwrap(), &mesh, NdSbp(vec![pin])).unwrap();
        let options = ParallelOptions::new(mesh).train(&train);
        let plan = g.compile_parallel(&[train.loss], &train.updates, &options).unwrap().plan;
        assert_eq!(bytes(&plan, "w0.adam_m@1"), m_bytes, "w0 pinned {pin:?}");
    }
    for state in ["adam_m", "adam_v"] {
        for (param, rows, row_bytes) in [("w0", 784u64, 4096u64), ("w1", 1024, 4096), ("b0", 1024, 4), ("b1", 1024, 4)]
        {
            for device in 0..2 {
                let name = format!("{param}.{state}@{device}");
                assert_eq!(bytes(&sharded.plan, &name), rows / 2 * row_bytes, "{name}");
                assert_eq!(bytes(&replicated.plan, &name), rows * row_bytes, "{name}");
            }
        }
        assert_eq!(bytes(&sharded.plan, &format!("b2.{state}@1")), 40, "10 rows of 4 bytes do not split on 64");
    }
    let ops = |plan: &Plan| -> Vec<String> {
        let mut ops: Vec<String> = plan
            .actors
            .iter()
            .filter(|a| a.name.ends_with("@0"))
            .filter_map(|a| match &a.kind {
                ActorKind::Compute { kernel: KernelConf::Collective(conf) } => Some(conf.op_name().to_string()),
                _ => None,
            })
            .collect();
        ops.sort();
        ops
    };
    let (sharded_ops, replicated_ops) = (ops(&sharded.plan), ops(&replicated.plan));
    assert!(sharded_ops.iter().any(|o| o.starts_with("reduce_scatter")), "{sharded_ops:?}");
    assert!(!replicated_ops.iter().any(|o| o.starts_with("reduce_scatter")), "{replicated_ops:?}");
    // The weights: held once (device 1's is device 0's buffer).
    let held: Vec<&str> = sharded
        .plan
        .regst_descs
        .iter()
        .filter(|d| d.home.is_some())
        .map(|d| {
            let v = sharded.plan.variables.iter().find(|v| sharded.plan.regst_descs[v.regst.index()].name == d.name);
            v.map_or(d.name.as_str(), |v| v.name.as_str())
        })
        .collect();
    assert!(held.contains(&"w0@1") && held.contains(&"w1@1"), "{held:?}");
    assert!(replicated.plan.regst_descs.iter().all(|d| d.home.is_none()));

    // The same losses, bit for bit with the gemm backend, over four steps (each step's
    // loss reads the weights every update before it wrote).
    let run = |compiled: &regflow::graph::CompiledGraph| -> Vec<u32> {
        let mut rng = SplitMix64::new(9);
        let x: Vec<f32> = (0..256 * 784).map(|_| rng.next_normal() as f32).collect();
        let y: Vec<i64> = (0..256).map(|_| (rng.next_u64() % 10) as i64).collect();
        let (x, y) = (HostArray::f32([256, 784], x).unwrap(), HostArray::i64([256], y).unwrap());
        let mut job = Job::builder(compiled.plan.clone()).build().unwrap();
        let mut feeds = job.graph_feeds().unwrap();
        let fetcher = job.fetcher(&compiled.fetches[0]).unwrap();
        let pusher = std::thread::spawn(move || {
            for _ in 0..4 {
                feeds.push("x", &x).unwrap();
                feeds.push("y", &y).unwrap();
            }
            feeds.close().unwrap();
        });
        let losses: Vec<u32> = std::iter::from_fn(|| fetcher.recv())
            .map(|p| f32::from_le_bytes(p.bytes()[..4].try_into().unwrap()).to_bits())
            .collect();
        pusher.join().unwrap();
        job.wait().unwrap();
        losses
    };
    let losses = run(&sharded);
    assert_eq!(losses.len(), 4);
    assert!(f32::from_bits(losses[3]) < f32::from_bits(losses[0]), "{losses:?}");
    let replicated_losses = run(&replicated);
    use regflow::kernels::cpu::gemm_backend::{backend_in_use, GemmBackend};
    if backend_in_use() == Ok(GemmBackend::Blas) {
        // OpenBLAS blocks a product by its sizes (`gemm_backend`'s docs), and the sharded
        // plan's products are not all the replicated one's shapes: the same sums, in an
        // order that may differ in the last bits (on AVX2 hosts, where the products go to
        // OpenBLAS, the fourth loss differs by one unit in the last place).
        let values = |bits: &[u32]| bits.iter().map(|&b| f64::from(f32::from_bits(b))).collect::<Vec<f64>>();
        assert_close("losses, OpenBLAS", &values(&losses), &values(&replicated_losses), 1e-6);
    } else {
        assert_eq!(losses, replicated_losses, "losses, bit for bit");
    }
}
