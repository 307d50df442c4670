//! Row-wise kernels (GELU with its bias, layer norm, the masked softmax, the cross-entropy
//! and its gradient), attention (whole sequences) and binary elementwise ops share their rows over a device's threads
//! when a tensor is large: every row is one thread's work, layer norm's parameter gradients
//! are summed by columns, each over the rows in row order, and the cross-entropy's row
//! losses in row order, so two or three threads give the same bits as one. Below the size
//! threshold they stay on one thread, which the small case checks gives the same bits too.

use regflow_kernels::{HostCompute, HostContext};
use regflow_plan::ops::{
    Attention, AttentionGrad, BiasGelu, BiasGeluGrad, Binary, BinaryKind, LayerNorm, LayerNormGrad, MaskedSoftmax,
    MaskedSoftmaxGrad, PartCrossEntropy, SparseCrossEntropy, SparseCrossEntropyGrad,
};
use regflow_plan::{DType, HostArray, SplitMix64, TensorMeta};

fn random(dims: &[usize], seed: u64) -> HostArray {
    let mut rng = SplitMix64::new(seed);
    let len = dims.iter().product();
    HostArray::f32(dims.to_vec(), (0..len).map(|_| (rng.next_f64() * 4.0 - 2.0) as f32).collect()).unwrap()
}

/// The outputs (as f64, bitwise from f32) of `op` on `inputs` with `threads` threads.
fn run(op: &dyn HostCompute, inputs: &[HostArray], outputs: &[Vec<usize>], threads: usize) -> Vec<Vec<f64>> {
    let mut outs: Vec<HostArray> =
        outputs.iter().map(|d| HostArray::zeros(&TensorMeta::new(d.clone(), DType::F32))).collect();
    let views: Vec<_> = inputs.iter().map(HostArray::view).collect();
    let mut out_views: Vec<_> = outs.iter_mut().map(HostArray::view_mut).collect();
    op.compute(&HostContext { threads }, &views, &mut out_views).unwrap();
    drop(out_views);
    outs.iter().map(HostArray::to_f64_vec).collect()
}

/// Asserts `op` gives the same bits on 1, 2 and 3 threads, and something not all zero.
fn same_on_any_thread_count(what: &str, op: &dyn HostCompute, inputs: &[HostArray], outputs: &[Vec<usize>]) {
    let one = run(op, inputs, outputs, 1);
    for out in &one {
        assert!(out.iter().all(|v| v.is_finite()) && out.iter().any(|&v| v != 0.0), "{what}: {out:?}");
    }
    for threads in [2, 3] {
        assert_eq!(one, run(op, inputs, outputs, threads), "{what} on {threads} threads");
    }
}

/// `[rows, width]` shapes: one past the threshold (2^15 elements) over several blocks of
/// layer norm's gradient (512 rows) and an odd row count, one below.
const SHAPES: [(usize, usize); 2] = [(4099, 67), (33, 64)];

#[test]
fn bias_gelu_and_its_gradient() {
    for (rows, width) in SHAPES {
        let (x, bias, dy) = (random(&[rows, width], 1), random(&[width], 2), random(&[rows, width], 3));
        let out = vec![vec![rows, width]];
        same_on_any_thread_count("bias_gelu", &BiasGelu, &[x.clone(), bias.clone()], &out);
        same_on_any_thread_count("bias_gelu_grad", &BiasGeluGrad, &[x, bias, dy], &out);
    }
}

#[test]
fn layer_norm_and_its_three_gradients() {
    for (rows, width) in SHAPES {
        let (x, gamma, beta, dy) =
            (random(&[rows, width], 4), random(&[width], 5), random(&[width], 6), random(&[rows, width], 7));
        let op = LayerNorm::new(1e-5);
        same_on_any_thread_count("layer_norm", &op, &[x.clone(), gamma.clone(), beta], &[vec![rows, width]]);
        let grad = LayerNormGrad::new(1e-5);
        let outs = [vec![rows, width], vec![width], vec![width]];
        same_on_any_thread_count("layer_norm_grad", &grad, &[x, gamma, dy], &outs);
    }
}

#[test]
fn masked_softmax_with_a_broadcast_and_a_full_mask_and_its_gradient() {
    // Scores [batch, heads, T, T] with a causal mask [T, T] (broadcast), and with a mask of
    // the scores' own shape.
    // 9·4·61·61 = 133 956 elements: past the threshold (2^15).
    let (b, h, t) = (9, 4, 61);
    let scores = random(&[b, h, t, t], 8);
    let causal: Vec<f32> = (0..t * t).map(|i| if i % t <= i / t { 0.0 } else { -1e9 }).collect();
    let causal = HostArray::f32([t, t], causal).unwrap();
    let full = random(&[b, h, t, t], 9);
    let op = MaskedSoftmax { scale: 0.125 };
    let out = vec![vec![b, h, t, t]];
    same_on_any_thread_count("masked_softmax, [T, T] mask", &op, &[scores.clone(), causal.clone()], &out);
    same_on_any_thread_count("masked_softmax, full mask", &op, &[scores.clone(), full], &out);
    let y = run(&op, &[scores, causal], &out, 1).remove(0);
    let y = HostArray::f32([b, h, t, t], y.iter().map(|&v| v as f32).collect()).unwrap();
    let dy = random(&[b, h, t, t], 10);
    same_on_any_thread_count("masked_softmax_grad", &MaskedSoftmaxGrad { scale: 0.125 }, &[y, dy], &out);
}

#[test]
fn attention_and_its_gradient_share_whole_sequences() {
    // 5·2·33·33·16 = 174 240 multiply-adds (past the threshold), and 1·2·5·5·4 below it.
    for (b, t, h, d) in [(5, 33, 2, 16), (1, 5, 2, 4)] {
        for causal in [true, false] {
            let (q, k, v) = (random(&[b, t, h, d], 40), random(&[b, t, h, d], 41), random(&[b, t, h, d], 42));
            let op = Attention::new(0.25, causal);
            let outs = [vec![b, t, h, d], vec![b, h, t]];
            same_on_any_thread_count("attention", &op, &[q.clone(), k.clone(), v.clone()], &outs);
            let mut forward = run(&op, &[q.clone(), k.clone(), v.clone()], &outs, 1).into_iter();
            let mut f32s = |dims: &[usize]| {
                let values = forward.next().unwrap().iter().map(|&x| x as f32).collect();
                HostArray::f32(dims.to_vec(), values).unwrap()
            };
            let (out, lse) = (f32s(&outs[0]), f32s(&outs[1]));
            let dout = random(&[b, t, h, d], 43);
            let grads = vec![vec![b, t, h, d]; 3];
            let grad = AttentionGrad::new(0.25, causal);
            same_on_any_thread_count("attention_grad", &grad, &[q, k, v, out, lse, dout], &grads);
        }
    }
}

#[test]
fn cross_entropy_gradients_and_a_bad_label_named_on_any_thread_count() {
    for (rows, classes) in SHAPES {
        let logits = random(&[rows, classes], 11);
        let labels = HostArray::i64([rows], (0..rows).map(|n| (n * 7 % classes) as i64).collect()).unwrap();
        let dy = HostArray::f32([], vec![1.5]).unwrap();
        let inputs = [logits, labels, dy];
        let out = vec![vec![rows, classes]];
        same_on_any_thread_count("sparse_cross_entropy_grad", &SparseCrossEntropyGrad::default(), &inputs, &out);
        let part = PartCrossEntropy { batch: 2 * rows, grad: true, classes: None };
        same_on_any_thread_count("part_cross_entropy grad", &part, &inputs, &out);
    }
    let (rows, classes) = SHAPES[0];
    let logits = random(&[rows, classes], 12);
    let labels =
        HostArray::i64([rows], (0..rows).map(|n| if n == rows - 1 { classes as i64 } else { 0 }).collect()).unwrap();
    let dy = HostArray::f32([], vec![1.0]).unwrap();
    let mut out = HostArray::zeros(&TensorMeta::new([rows, classes], DType::F32));
    for threads in [1, 2] {
        let error = SparseCrossEntropyGrad::default()
            .compute(&HostContext { threads }, &[logits.view(), labels.view(), dy.view()], &mut [out.view_mut()])
            .unwrap_err();
        assert!(error.contains(&format!("label {classes} out of range for {classes} classes")), "{error}");
    }
}

/// Binary ops cut by the output's leading dimension: operands of the output's shape, and
/// every broadcast (a row, a column, a leading 1, a scalar, a lower rank), on either side.
#[test]
fn binary_ops_with_every_broadcast() {
    for (rows, width) in SHAPES {
        let full = [rows, width];
        let operands: [Vec<usize>; 6] =
            [vec![rows, width], vec![width], vec![rows, 1], vec![1, width], vec![], vec![1]];
        for (k, other) in operands.iter().enumerate() {
            let (x, y) = (random(&full, 20 + k as u64), random(other, 30 + k as u64));
            for kind in [BinaryKind::Add, BinaryKind::Sub, BinaryKind::Mul, BinaryKind::Div, BinaryKind::ReluGrad] {
                let out = vec![full.to_vec()];
                // ReLU's gradient gated by one value, which may be negative, can be all zeros.
                let gated_by_one_value = kind == BinaryKind::ReluGrad && other.iter().product::<usize>() == 1;
                if !gated_by_one_value {
                    same_on_any_thread_count(
                        &format!("{kind:?} {full:?} with {other:?}"),
                        &Binary(kind),
                        &[x.clone(), y.clone()],
                        &out,
                    );
                }
                same_on_any_thread_count(
                    &format!("{kind:?} {other:?} with {full:?}"),
                    &Binary(kind),
                    &[y.clone(), x.clone()],
                    &out,
                );
            }
        }
    }
    // A rank-3 output whose leading dimension one operand broadcasts.
    let (x, y) = (random(&[5, 97, 67], 40), random(&[97, 67], 41));
    same_on_any_thread_count("add [5, 97, 67] with [97, 67]", &Binary(BinaryKind::Add), &[x, y], &[vec![5, 97, 67]]);
}

/// The loss: row losses in blocks of shares past the threshold, summed in row order (over
/// several blocks of rows in the large shape), so the same bits on any thread count; a bad
/// label is named the same way on any thread count, the first in row order.
#[test]
fn cross_entropy_losses_and_a_bad_label_named_on_any_thread_count() {
    for (rows, classes) in SHAPES {
        let logits = random(&[rows, classes], 13);
        let labels = HostArray::i64([rows], (0..rows).map(|n| (n * 5 % classes) as i64).collect()).unwrap();
        let inputs = [logits, labels];
        let scalar = vec![Vec::new()];
        same_on_any_thread_count("sparse_cross_entropy", &SparseCrossEntropy::default(), &inputs, &scalar);
        let part = PartCrossEntropy { batch: 3 * rows, grad: false, classes: None };
        same_on_any_thread_count("part_cross_entropy", &part, &inputs, &scalar);
    }
    // The f64 path too.
    let (rows, classes) = SHAPES[0];
    let mut rng = SplitMix64::new(15);
    let logits: Vec<f64> = (0..rows * classes).map(|_| rng.next_f64() * 40.0 - 20.0).collect();
    let logits = HostArray::f64([rows, classes], logits).unwrap();
    let labels = HostArray::i64([rows], (0..rows).map(|n| (n * 3 % classes) as i64).collect()).unwrap();
    let loss = |threads| {
        let mut out = HostArray::zeros(&TensorMeta::new(Vec::<usize>::new(), DType::F64));
        SparseCrossEntropy::default()
            .compute(&HostContext { threads }, &[logits.view(), labels.view()], &mut [out.view_mut()])
            .unwrap();
        out.to_f64_vec()[0]
    };
    let one = loss(1);
    assert!(one.is_finite() && one > 0.0, "{one}");
    for threads in [2, 3] {
        assert_eq!(one.to_bits(), loss(threads).to_bits(), "f64 loss on {threads} threads");
    }
    let logits = random(&[rows, classes], 14);
    let bad = |n: usize| match n {
        700 => -1,
        3000 => classes as i64,
        _ => 1,
    };
    let labels = HostArray::i64([rows], (0..rows).map(bad).collect()).unwrap();
    let mut out = HostArray::zeros(&TensorMeta::new(Vec::<usize>::new(), DType::F32));
    for threads in [1, 2, 3] {
        let error = SparseCrossEntropy::default()
            .compute(&HostContext { threads }, &[logits.view(), labels.view()], &mut [out.view_mut()])
            .unwrap_err();
        assert!(error.contains(&format!("label -1 out of range for {classes} classes")), "{threads} threads: {error}");
    }
}
