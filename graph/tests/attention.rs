//! The fused `attention` op: forward values and gradients against the unfused composition
//! the examples use (two permuted products around a masked softmax), `lse` against a
//! direct computation, finite differences, empty inputs, mixed precision, the kernels'
//! build-time check, and shape errors stated in logical terms.

mod common;

use common::{assert_close, check_grad, graph_inputs, random, to_f32};
use regflow_graph::ops::{Attention, AttentionGrad, HostCompute, OpDef};
use regflow_graph::{DType, Graph, GraphError, HostArray, Precision, Shape, Tensor, TensorMeta};

/// `array` rounded to f32 and held in f64 (the f32 run's inputs, exactly).
fn rounded(array: &HostArray) -> HostArray {
    HostArray::f64(array.shape.clone(), to_f32(array).to_f64_vec()).unwrap()
}

/// Attention as the examples built it before the fused op: scores `[B, H, Tq, Tk]` by a
/// permuted product, a masked softmax (a causal mask of 0 / -1e9, or zeros), the values'
/// weighted sum written back as `[B, Tq, H, D]`.
fn composed<'g>(
    q: &Tensor<'g>,
    k: &Tensor<'g>,
    v: &Tensor<'g>,
    scale: f64,
    causal: bool,
) -> Result<Tensor<'g>, GraphError> {
    let g = q.graph();
    let (queries, keys) = (q.shape().dims()[1], k.shape().dims()[1]);
    let scores = q.matmul_permuted(k, &[0, 2, 1, 3], &[0, 2, 3, 1], &[0, 1, 2, 3])?;
    let mask = if causal { g.causal_mask(queries, q.dtype())? } else { g.constant(0.0, [queries, keys], q.dtype())? };
    let weights = scores.masked_softmax(&mask, scale)?;
    weights.matmul_permuted(v, &[0, 1, 2, 3], &[0, 2, 1, 3], &[0, 2, 1, 3])
}

/// The feeds of `inputs` with `arrays`.
fn fed<'g>(inputs: &[Tensor<'g>], arrays: &[HostArray]) -> Vec<(Tensor<'g>, HostArray)> {
    inputs.iter().copied().zip(arrays.iter().cloned()).collect()
}

/// `out` of the fused op and of the composition for `q`, `k`, `v`.
fn fused_and_composed(arrays: &[HostArray; 3], scale: f64, causal: bool) -> (HostArray, HostArray) {
    let g = Graph::new();
    let xs = graph_inputs(&g, arrays).unwrap();
    let fused = xs[0].attention(&xs[1], &xs[2], scale, causal).unwrap();
    let unfused = composed(&xs[0], &xs[1], &xs[2], scale, causal).unwrap();
    let feeds = fed(&xs, arrays);
    let mut values = g.eval(&feeds, &[fused, unfused]).unwrap();
    let unfused = values.remove(1);
    (values.remove(0), unfused)
}

/// Random `q [b, tq, h, d]`, `k` and `v [b, tk, h, d]`.
fn qkv(b: usize, tq: usize, tk: usize, h: usize, d: usize, seed: u64) -> [HostArray; 3] {
    [random([b, tq, h, d], seed), random([b, tk, h, d], seed + 1), random([b, tk, h, d], seed + 2)]
}

/// Every shape of the forward comparisons: `(b, tq, tk, h, d, causal)`.
fn shapes() -> Vec<(usize, usize, usize, usize, usize, bool)> {
    let mut shapes = Vec::new();
    for b in 1..=3 {
        for t in [1, 7, 13] {
            for h in [1, 3] {
                for d in [1, 5, 16] {
                    shapes.push((b, t, t, h, d, true));
                    shapes.push((b, t, t, h, d, false));
                }
            }
        }
    }
    // Queries and keys of different lengths (not causal), over several blocks of 64.
    for (tq, tk) in [(7, 13), (13, 1), (1, 7), (5, 70), (3, 130), (70, 13), (130, 65)] {
        shapes.push((2, tq, tk, 3, 5, false));
    }
    // Causal over several blocks of queries and keys, and a wide head.
    shapes.extend([
        (1, 70, 70, 2, 5, true),
        (2, 130, 130, 1, 3, true),
        (1, 65, 65, 2, 80, true),
        (1, 9, 66, 2, 80, false),
    ]);
    shapes
}

#[test]
fn attention_equals_the_composition_of_products_and_masked_softmax_in_f64_and_f32() {
    for (seed, (b, tq, tk, h, d, causal)) in shapes().into_iter().enumerate() {
        let name = format!("b {b}, tq {tq}, tk {tk}, h {h}, d {d}, causal {causal}");
        let scale = 1.0 / (d as f64).sqrt();
        let arrays = qkv(b, tq, tk, h, d, seed as u64 * 3);
        let (fused, unfused) = fused_and_composed(&arrays, scale, causal);
        assert_eq!((fused.dtype(), fused.shape.dims()), (DType::F64, &[b, tq, h, d][..]), "{name}");
        assert_close(&format!("f64 {name}"), &fused.to_f64_vec(), &unfused.to_f64_vec(), 1e-12);

        let arrays_f32 = [to_f32(&arrays[0]), to_f32(&arrays[1]), to_f32(&arrays[2])];
        let (fused, unfused) = fused_and_composed(&arrays_f32, scale, causal);
        assert_eq!(fused.dtype(), DType::F32, "{name}");
        assert_close(&format!("f32 {name}"), &fused.to_f64_vec(), &unfused.to_f64_vec(), 1e-5);
        // And against f64 arithmetic on the same (rounded) inputs.
        let exact =
            fused_and_composed(&[rounded(&arrays[0]), rounded(&arrays[1]), rounded(&arrays[2])], scale, causal).1;
        assert_close(&format!("f32 vs f64 {name}"), &fused.to_f64_vec(), &exact.to_f64_vec(), 1e-5);
    }
}

/// `lse[b, h, i]` computed directly: `ln Σ_j e^(s_ij)` over the keys query `i` attends.
fn direct_lse(arrays: &[HostArray; 3], scale: f64, causal: bool) -> Vec<f64> {
    let [b, tq, h, d] = arrays[0].shape.dims().try_into().unwrap();
    let tk = arrays[1].shape.dims()[1];
    let (q, k) = (arrays[0].to_f64_vec(), arrays[1].to_f64_vec());
    let mut lse = Vec::new();
    for seq in 0..b {
        for head in 0..h {
            for i in 0..tq {
                let keys = if causal { i + 1 } else { tk };
                let scores: Vec<f64> = (0..keys)
                    .map(|j| {
                        let (qi, kj) = (((seq * tq + i) * h + head) * d, ((seq * tk + j) * h + head) * d);
                        scale * (0..d).map(|e| q[qi + e] * k[kj + e]).sum::<f64>()
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                lse.push(max + scores.iter().map(|s| (s - max).exp()).sum::<f64>().ln());
            }
        }
    }
    lse
}

/// `(out, lse)` of the fused op.
fn out_and_lse(arrays: &[HostArray; 3], scale: f64, causal: bool) -> (HostArray, HostArray) {
    let g = Graph::new();
    let xs = graph_inputs(&g, arrays).unwrap();
    let (out, lse) = xs[0].attention_with_lse(&xs[1], &xs[2], scale, causal).unwrap();
    let feeds = fed(&xs, arrays);
    let mut values = g.eval(&feeds, &[out, lse]).unwrap();
    let lse = values.remove(1);
    (values.remove(0), lse)
}

#[test]
fn lse_is_each_querys_log_sum_exp_of_its_scaled_scores_in_the_arithmetic_dtype() {
    for (seed, (b, tq, tk, h, d, causal)) in [
        (2, 7, 7, 3, 5, true),
        (2, 7, 7, 3, 5, false),
        (1, 4, 130, 2, 16, false),
        (3, 1, 1, 1, 1, true),
        (1, 150, 150, 2, 4, true),
    ]
    .into_iter()
    .enumerate()
    {
        let name = format!("b {b}, tq {tq}, tk {tk}, h {h}, d {d}, causal {causal}");
        // Large scores (scale 3): the log-sum-exp must not overflow.
        let arrays = qkv(b, tq, tk, h, d, 100 + seed as u64 * 3);
        let (_, lse) = out_and_lse(&arrays, 3.0, causal);
        assert_eq!((lse.dtype(), lse.shape.dims()), (DType::F64, &[b, h, tq][..]), "{name}");
        assert_close(&format!("f64 {name}"), &lse.to_f64_vec(), &direct_lse(&arrays, 3.0, causal), 1e-12);
        let arrays_f32 = [to_f32(&arrays[0]), to_f32(&arrays[1]), to_f32(&arrays[2])];
        let (out, lse) = out_and_lse(&arrays_f32, 3.0, causal);
        assert_eq!((out.dtype(), lse.dtype()), (DType::F32, DType::F32), "{name}");
        let exact = direct_lse(&[rounded(&arrays[0]), rounded(&arrays[1]), rounded(&arrays[2])], 3.0, causal);
        assert_close(&format!("f32 {name}"), &lse.to_f64_vec(), &exact, 1e-5);
    }
}

#[test]
fn attention_with_no_keys_or_no_queries_gives_zeros_and_an_lse_of_minus_infinity() {
    for (b, tq, tk, causal) in [(2, 3, 0, false), (1, 0, 0, true), (0, 4, 4, true), (2, 0, 5, false)] {
        let arrays = qkv(b, tq, tk, 2, 4, 7);
        let (out, lse) = out_and_lse(&arrays, 0.5, causal);
        assert_eq!(out.shape.dims(), [b, tq, 2, 4]);
        assert!(out.to_f64_vec().iter().all(|&v| v == 0.0), "{:?}", out.to_f64_vec());
        assert_eq!(lse.shape.dims(), [b, 2, tq]);
        assert!(lse.to_f64_vec().iter().all(|&v| v == f64::NEG_INFINITY), "{:?}", lse.to_f64_vec());
        // The gradients of q, k and v are zeros (and exist).
        let g = Graph::new();
        let xs = graph_inputs(&g, &arrays).unwrap();
        let loss = xs[0].attention(&xs[1], &xs[2], 0.5, causal).unwrap().sum_to(&Shape::scalar()).unwrap();
        let grads = g.grad(loss, &xs).unwrap();
        let feeds = fed(&xs, &arrays);
        for grad in g.eval(&feeds, &grads).unwrap() {
            assert!(grad.to_f64_vec().iter().all(|&v| v == 0.0), "{:?}", grad.to_f64_vec());
        }
    }
}

/// Gradients of `sum(out · r)` with respect to `q`, `k`, `v`, by the fused op or the
/// composition.
fn gradients(arrays: &[HostArray; 3], scale: f64, causal: bool, fused: bool) -> Vec<Vec<f64>> {
    let g = Graph::new();
    let xs = graph_inputs(&g, arrays).unwrap();
    let out = if fused {
        xs[0].attention(&xs[1], &xs[2], scale, causal).unwrap()
    } else {
        composed(&xs[0], &xs[1], &xs[2], scale, causal).unwrap()
    };
    let r = g.input("r", out.shape(), out.dtype()).unwrap();
    let loss = out.mul(&r).unwrap().sum_to(&Shape::scalar()).unwrap();
    let grads = g.grad(loss, &xs).unwrap();
    let mut feeds = fed(&xs, arrays);
    let r_value = random(out.shape(), 0xfeed);
    feeds.push((r, if out.dtype() == DType::F32 { to_f32(&r_value) } else { r_value }));
    g.eval(&feeds, &grads).unwrap().iter().map(HostArray::to_f64_vec).collect()
}

#[test]
fn attention_gradients_equal_the_compositions_gradients() {
    let cases = [(1, 1, 1, 1, 1, true), (2, 7, 7, 3, 5, true), (2, 7, 7, 3, 5, false), (3, 13, 13, 1, 16, true)];
    let uneven = [(2, 7, 13, 3, 5, false), (1, 13, 1, 3, 16, false), (2, 5, 70, 2, 4, false), (1, 70, 3, 2, 4, false)];
    // Several blocks of 64 queries and keys.
    let blocks = [(1, 130, 130, 2, 3, true), (1, 70, 70, 1, 80, true)];
    for (seed, (b, tq, tk, h, d, causal)) in cases.into_iter().chain(uneven).chain(blocks).enumerate() {
        let name = format!("b {b}, tq {tq}, tk {tk}, h {h}, d {d}, causal {causal}");
        let scale = 1.0 / (d as f64).sqrt();
        let arrays = qkv(b, tq, tk, h, d, 200 + seed as u64 * 3);
        let (fused, unfused) = (gradients(&arrays, scale, causal, true), gradients(&arrays, scale, causal, false));
        for (which, (a, e)) in ["dq", "dk", "dv"].iter().zip(fused.iter().zip(&unfused)) {
            assert_close(&format!("f64 {which} {name}"), a, e, 1e-11);
        }
        let arrays_f32 = [to_f32(&arrays[0]), to_f32(&arrays[1]), to_f32(&arrays[2])];
        let fused_f32 = gradients(&arrays_f32, scale, causal, true);
        for (which, (a, e)) in ["dq", "dk", "dv"].iter().zip(fused_f32.iter().zip(&unfused)) {
            assert_close(&format!("f32 {which} {name}"), a, e, 1e-4);
        }
    }
}

#[test]
fn attention_gradients_match_finite_differences() {
    for (seed, (b, tq, tk, h, d, causal)) in
        [(2, 3, 3, 2, 4, true), (2, 3, 3, 2, 4, false), (1, 3, 4, 2, 3, false), (1, 1, 1, 1, 1, true)]
            .into_iter()
            .enumerate()
    {
        let inputs = qkv(b, tq, tk, h, d, 300 + seed as u64 * 3);
        let name = format!("attention b {b}, tq {tq}, tk {tk}, h {h}, d {d}, causal {causal}");
        check_grad(&name, &inputs, |t| t[0].attention(&t[1], &t[2], 0.7, causal));
    }
}

#[test]
fn a_gradient_through_lse_is_refused_with_a_sentence() {
    let g = Graph::new();
    let q = g.input("q", [2, 3, 2, 4], DType::F64).unwrap();
    let (out, lse) = q.attention_with_lse(&q, &q, 0.5, true).unwrap();
    let loss = out.sum_to(&Shape::scalar()).unwrap().add(&lse.sum_to(&Shape::scalar()).unwrap()).unwrap();
    let message = g.grad(loss, &[q]).unwrap_err().to_string();
    assert!(message.starts_with("attention(") && message.contains("depends on lse"), "{message}");
    // Through out alone it is fine, with lse computed alongside.
    let loss = out.sum_to(&Shape::scalar()).unwrap();
    assert_eq!(g.grad(loss, &[q]).unwrap()[0].meta(), q.meta());
}

/// The message of applying attention to inputs of these metas.
fn refusal(metas: &[TensorMeta], scale: f64, causal: bool) -> String {
    let g = Graph::new();
    let xs: Vec<Tensor<'_>> =
        metas.iter().enumerate().map(|(i, m)| g.input(&format!("x{i}"), m.shape.clone(), m.dtype).unwrap()).collect();
    let error = g.apply(Attention::new(scale, causal), &xs).unwrap_err();
    assert!(matches!(&error, GraphError::Op { op, .. } if op == "attention"), "{error}");
    error.to_string()
}

fn meta(dims: &[usize], dtype: DType) -> TensorMeta {
    TensorMeta::new(dims.to_vec(), dtype)
}

#[test]
fn attention_refuses_inputs_that_do_not_fit_naming_the_values() {
    let f32s = |dims: &[usize]| meta(dims, DType::F32);
    let (q, kv) = (f32s(&[2, 3, 4, 8]), f32s(&[2, 5, 4, 8]));
    let cases: Vec<(Vec<TensorMeta>, f64, bool, Vec<&str>)> = vec![
        (vec![f32s(&[6, 4, 8]), kv.clone(), kv.clone()], 1.0, false, vec!["q must have rank 4", "[6, 4, 8]"]),
        (vec![q.clone(), f32s(&[10, 4, 8]), kv.clone()], 1.0, false, vec!["k must have rank 4", "rank 3"]),
        (
            vec![q.clone(), meta(&[2, 5, 4, 8], DType::F64), kv.clone()],
            1.0,
            false,
            vec!["one dtype", "q f32, k f64 and v f32"],
        ),
        (
            vec![meta(&[2, 3, 4, 8], DType::I64), meta(&[2, 5, 4, 8], DType::I64), meta(&[2, 5, 4, 8], DType::I64)],
            1.0,
            false,
            vec!["must be floats, got i64"],
        ),
        (
            vec![q.clone(), kv.clone(), f32s(&[2, 6, 4, 8])],
            1.0,
            false,
            vec!["k and v must have one shape", "[2, 6, 4, 8]"],
        ),
        (
            vec![q.clone(), f32s(&[2, 5, 2, 8]), f32s(&[2, 5, 2, 8])],
            1.0,
            false,
            vec!["batch, heads and head size", "4 heads of size 8", "2 heads of size 8"],
        ),
        (vec![q.clone(), f32s(&[3, 5, 4, 8]), f32s(&[3, 5, 4, 8])], 1.0, false, vec!["has batch 2", "have batch 3"]),
        (
            vec![q.clone(), f32s(&[2, 5, 4, 6]), f32s(&[2, 5, 4, 6])],
            1.0,
            false,
            vec!["heads of size 8", "heads of size 6"],
        ),
        (vec![q.clone(), kv.clone(), kv.clone()], 1.0, true, vec!["causal", "Tq = 3 queries and Tk = 5 keys"]),
        (vec![q.clone(), kv.clone(), kv.clone()], f64::INFINITY, false, vec!["scale must be finite, got inf"]),
        (vec![q.clone(), kv.clone(), kv.clone()], f64::NAN, false, vec!["scale must be finite, got NaN"]),
        (vec![q.clone(), kv.clone()], 1.0, false, vec!["takes 3 inputs (q, k, v), got 2"]),
    ];
    for (metas, scale, causal, expected) in cases {
        let message = refusal(&metas, scale, causal);
        for part in expected {
            assert!(message.contains(part), "expected '{part}' in: {message}");
        }
    }
    // Non-causal attention takes queries and keys of different lengths.
    let g = Graph::new();
    let (q, kv) = (g.input("q", [2, 3, 4, 8], DType::F32).unwrap(), g.input("kv", [2, 5, 4, 8], DType::F32).unwrap());
    let (out, lse) = q.attention_with_lse(&kv, &kv, 0.3, false).unwrap();
    assert_eq!((out.meta(), lse.meta()), (q.meta(), meta(&[2, 4, 3], DType::F32)));
}

#[test]
fn attention_grad_refuses_an_lse_out_or_dout_that_does_not_fit_its_q() {
    let op = AttentionGrad::new(0.5, true);
    let (q, kv) = (meta(&[2, 3, 4, 8], DType::F32), meta(&[2, 3, 4, 8], DType::F32));
    let lse = meta(&[2, 4, 3], DType::F32);
    let good = vec![q.clone(), kv.clone(), kv.clone(), q.clone(), lse.clone(), q.clone()];
    assert_eq!(op.infer(&good).unwrap(), vec![q.clone(), kv.clone(), kv.clone()]);
    let with = |index: usize, meta: TensorMeta| {
        let mut metas = good.clone();
        metas[index] = meta;
        op.infer(&metas).unwrap_err()
    };
    let message = with(4, meta(&[2, 4, 3], DType::Bf16));
    assert!(message.contains("lse must be f32[2, 4, 3]") && message.contains("got lse bf16[2, 4, 3]"), "{message}");
    let message = with(4, meta(&[2, 3, 4], DType::F32));
    assert!(message.contains("lse must be f32[2, 4, 3]") && message.contains("f32[2, 3, 4]"), "{message}");
    let message = with(3, meta(&[2, 3, 4, 8], DType::F64));
    assert!(
        message.contains("out must be f32[2, 3, 4, 8]") && message.contains("got out f64[2, 3, 4, 8]"),
        "{message}"
    );
    let message = with(5, meta(&[2, 3, 4, 7], DType::F32));
    assert!(message.contains("dout must be f32[2, 3, 4, 8]") && message.contains("[2, 3, 4, 7]"), "{message}");
    let message = op.infer(&good[..5]).unwrap_err();
    assert!(message.contains("takes 6 inputs (q, k, v, out, lse, dout), got 5"), "{message}");
    // f64 inputs take an f64 lse; bf16 inputs an f32 one.
    let f64s = |m: &TensorMeta| TensorMeta::new(m.shape.clone(), DType::F64);
    let bf16s = |m: &TensorMeta| TensorMeta::new(m.shape.clone(), DType::Bf16);
    assert!(op.infer(&good.iter().map(f64s).collect::<Vec<_>>()).is_ok());
    let mut half: Vec<TensorMeta> = good.iter().map(bf16s).collect();
    half[4] = lse;
    assert!(op.infer(&half).is_ok());
}

#[test]
fn the_cpu_kernels_refuse_a_plan_whose_metas_contradict_each_other() {
    let forward = Attention::new(0.5, false);
    let (q, kv) = (meta(&[2, 3, 4, 8], DType::Bf16), meta(&[2, 5, 4, 8], DType::Bf16));
    let lse = meta(&[2, 4, 3], DType::F32);
    let inputs = [q.clone(), kv.clone(), kv.clone()];
    assert_eq!(forward.check(&inputs, &[q.clone(), lse.clone()]), Ok(()));
    let message = forward.check(&inputs, &[q.clone(), meta(&[2, 4, 3], DType::Bf16)]).unwrap_err();
    assert!(message.contains("lse must be f32[2, 4, 3], got lse bf16[2, 4, 3]"), "{message}");
    let message = forward.check(&inputs, &[meta(&[2, 3, 4, 8], DType::F32), lse.clone()]).unwrap_err();
    assert!(message.contains("out must be bf16[2, 3, 4, 8], got out f32[2, 3, 4, 8]"), "{message}");
    let message = forward.check(&inputs[..2], &[q.clone(), lse.clone()]).unwrap_err();
    assert!(message.contains("takes 3 inputs (q, k, v), got 2"), "{message}");
    let message = forward.check(&inputs, std::slice::from_ref(&q)).unwrap_err();
    assert!(message.contains("gives 2 outputs (out, lse), but has 1"), "{message}");
    let causal = Attention::new(0.5, true);
    let message = causal.check(&inputs, &[q.clone(), lse.clone()]).unwrap_err();
    assert!(message.contains("Tq = 3 queries and Tk = 5 keys"), "{message}");

    let backward = AttentionGrad::new(0.5, false);
    let grad_inputs = [q.clone(), kv.clone(), kv.clone(), q.clone(), lse.clone(), q.clone()];
    assert_eq!(backward.check(&grad_inputs, &[q.clone(), kv.clone(), kv.clone()]), Ok(()));
    let message = backward.check(&grad_inputs, &[q.clone(), kv.clone(), q.clone()]).unwrap_err();
    assert!(
        message.contains("dv must have its input's shape and dtype bf16[2, 5, 4, 8], got dv bf16[2, 3, 4, 8]"),
        "{message}"
    );

    // Every float dtype has a CPU kernel of both ops.
    let registry = regflow_kernels::cpu::registry();
    for op_type in ["attention", "attention_grad"] {
        for dtype in [DType::F32, DType::F64, DType::Bf16, DType::F16] {
            let key = regflow_kernels::KernelKey {
                op_type: op_type.into(),
                device: regflow_graph::plan::DeviceKind::Cpu,
                dtype,
            };
            assert!(registry.has_op(&key), "{op_type} {dtype}");
        }
    }
}

#[test]
fn attention_counts_two_products_and_its_gradient_two_and_a_half_times_that() {
    let (q, kv) = (meta(&[2, 8, 3, 16], DType::F32), meta(&[2, 8, 3, 16], DType::F32));
    let inputs = [q.clone(), kv.clone(), kv.clone()];
    let products = 4.0 * 2.0 * 3.0 * 8.0 * 8.0 * 16.0;
    for causal in [false, true] {
        let forward = Attention::new(0.25, causal);
        let outputs = forward.infer(&inputs).unwrap();
        let expected = if causal { products / 2.0 } else { products };
        assert_eq!(forward.flops(&inputs, &outputs), expected);
        let mut grad_inputs = inputs.to_vec();
        grad_inputs.extend(outputs.iter().cloned());
        grad_inputs.push(q.clone());
        let backward = AttentionGrad::new(0.25, causal);
        assert_eq!(backward.flops(&grad_inputs, &inputs), 2.5 * expected);
    }
}

#[test]
fn mixed_precision_attention_reads_bf16_keeps_lse_f32_and_matches_f32() {
    let (b, t, h, d) = (2, 9, 3, 16);
    let arrays = qkv(b, t, t, h, d, 400);
    let arrays_f32 = [to_f32(&arrays[0]), to_f32(&arrays[1]), to_f32(&arrays[2])];
    let scale = 0.25;
    // (out, lse, dq, dk, dv) under `precision`, from f32 inputs.
    let run = |precision: Precision| {
        let g = Graph::new();
        g.mixed_precision(precision).unwrap();
        let xs = graph_inputs(&g, &arrays_f32).unwrap();
        let (out, lse) = xs[0].attention_with_lse(&xs[1], &xs[2], scale, true).unwrap();
        let r = g.input("r", out.shape(), DType::F32).unwrap();
        let loss = out.cast(DType::F32).unwrap().mul(&r).unwrap().sum_to(&Shape::scalar()).unwrap();
        let grads = g.grad(loss, &xs).unwrap();
        let low = precision.low_dtype().unwrap_or(DType::F32);
        assert_eq!((out.dtype(), lse.dtype()), (low, DType::F32));
        // The gradient op reads lse as it is, in f32.
        let grad_node = g.nodes().into_iter().find(|n| n.op.name() == "attention_grad").unwrap();
        assert_eq!(g.info(grad_node.inputs[4]).meta.dtype, DType::F32);
        assert_eq!(g.info(grad_node.inputs[0]).meta.dtype, low);
        let mut feeds: Vec<_> = xs.iter().copied().zip(arrays_f32.iter().cloned()).collect();
        feeds.push((r, to_f32(&random(out.shape(), 0xbeef))));
        let mut fetch = vec![out, lse];
        fetch.extend(grads);
        g.eval(&feeds, &fetch).unwrap()
    };
    let (wide, low) = (run(Precision::F32), run(Precision::Bf16));
    assert_eq!((low[0].dtype(), low[1].dtype(), low[2].dtype()), (DType::Bf16, DType::F32, DType::F32));
    let names = ["out", "lse", "dq", "dk", "dv"];
    for ((name, l), w) in names.iter().zip(&low).zip(&wide) {
        let (l, w) = (l.to_f64_vec(), w.to_f64_vec());
        let largest = w.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        for (i, (a, e)) in l.iter().zip(&w).enumerate() {
            // bf16 keeps 8 bits: its inputs and out are within 2^-8 of f32's.
            assert!((a - e).abs() <= 1e-2 * (e.abs() + largest), "bf16 {name}[{i}]: {a} vs f32 {e}");
        }
    }
    assert_eq!(run(Precision::F16)[0].dtype(), DType::F16);
}
