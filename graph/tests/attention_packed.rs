//! The packed `attention` op (`Tensor::attention_packed`): one `qkv [B, T, H, 3, D]` read
//! in place gives the bits of the op over its query, key and value rows apart, forward and
//! backward; finite differences; layouts; refusals stated in logical terms; plan files of
//! the op without the flag read as before.

mod common;

use common::{check_grad, random, to_f32};
use regflow_graph::ops::{Attention, AttentionGrad, HostCompute, OpDef};
use regflow_graph::sbp::Sbp;
use regflow_graph::{DType, Graph, HostArray, Precision, Shape, Tensor, TensorMeta};

/// Row `which` (0 query, 1 key, 2 value) of every position and head of `qkv`, as `[B, T,
/// H, D]`.
fn part<'g>(qkv: &Tensor<'g>, which: usize) -> Tensor<'g> {
    let dims = qkv.shape().dims().to_vec();
    let sliced = qkv.slice(3, which, which + 1).unwrap();
    sliced.reshape(&[dims[0] as isize, dims[1] as isize, dims[2] as isize, dims[4] as isize]).unwrap()
}

/// `(out, lse, dqkv)` of the packed op and of the op over the parts apart, where the
/// gradient is that of `sum(out · r)`, under mixed `precision` if any.
fn packed_and_apart(qkv: &HostArray, scale: f64, causal: bool, precision: Option<Precision>) -> [[Vec<f64>; 3]; 2] {
    let g = Graph::new();
    if let Some(precision) = precision {
        g.mixed_precision(precision).unwrap();
    }
    let x = g.input("qkv", qkv.shape.clone(), qkv.dtype()).unwrap();
    let (packed, packed_lse) = x.attention_packed_with_lse(scale, causal).unwrap();
    let (apart, apart_lse) = part(&x, 0).attention_with_lse(&part(&x, 1), &part(&x, 2), scale, causal).unwrap();
    assert_eq!((packed.meta(), packed_lse.meta()), (apart.meta(), apart_lse.meta()));
    let r = g.input("r", packed.shape(), qkv.dtype()).unwrap();
    let dtype = qkv.dtype();
    let packed_loss = packed.cast(dtype).unwrap().mul(&r).unwrap().sum_to(&Shape::scalar()).unwrap();
    let apart_loss = apart.cast(dtype).unwrap().mul(&r).unwrap().sum_to(&Shape::scalar()).unwrap();
    let packed_grad = g.grad(packed_loss, &[x]).unwrap()[0];
    let apart_grad = g.grad(apart_loss, &[x]).unwrap()[0];
    let r_value = random(packed.shape(), 0xbeef);
    let r_value = if qkv.dtype() == DType::F32 { to_f32(&r_value) } else { r_value };
    let feeds = [(x, qkv.clone()), (r, r_value)];
    let fetched = [packed, packed_lse, packed_grad, apart, apart_lse, apart_grad];
    let values: Vec<Vec<f64>> = g.eval(&feeds, &fetched).unwrap().iter().map(HostArray::to_f64_vec).collect();
    let [a, b, c, d, e, f] = <[Vec<f64>; 6]>::try_from(values).unwrap();
    [[a, b, c], [d, e, f]]
}

#[test]
fn the_packed_op_gives_the_bits_of_the_op_over_its_rows_apart_forward_and_backward() {
    let mut shapes = Vec::new();
    for (b, t, h, d) in [(1, 1, 1, 1), (2, 7, 3, 5), (3, 13, 1, 16), (1, 70, 2, 5), (2, 130, 1, 3), (1, 65, 2, 80)] {
        shapes.push((b, t, h, d, true));
        shapes.push((b, t, h, d, false));
    }
    for (seed, (b, t, h, d, causal)) in shapes.into_iter().enumerate() {
        let scale = 1.0 / (d as f64).sqrt();
        let qkv = random([b, t, h, 3, d], 500 + seed as u64);
        for (dtype, qkv) in [("f64", qkv.clone()), ("f32", to_f32(&qkv))] {
            let [packed, apart] = packed_and_apart(&qkv, scale, causal, None);
            for (name, (p, a)) in ["out", "lse", "dqkv"].iter().zip(packed.iter().zip(&apart)) {
                let same = p.len() == a.len() && p.iter().zip(a).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "{dtype} {name} of b {b}, t {t}, h {h}, d {d}, causal {causal}: {p:?} against {a:?}");
            }
        }
    }
}

#[test]
fn under_mixed_precision_the_packed_op_casts_qkv_once_and_gives_the_bits_of_the_op_apart() {
    for (seed, (b, t, h, d, causal)) in [(2, 9, 3, 16, true), (1, 70, 2, 8, false)].into_iter().enumerate() {
        let qkv = to_f32(&random([b, t, h, 3, d], 700 + seed as u64));
        for precision in [Precision::Bf16, Precision::F16] {
            let [packed, apart] = packed_and_apart(&qkv, 0.25, causal, Some(precision));
            for (name, (p, a)) in ["out", "lse", "dqkv"].iter().zip(packed.iter().zip(&apart)) {
                // The same bits, but for the sign of a zero: apart, each part's gradient is
                // summed with the others' zeros (`slice_grad`), and a gradient that f16
                // rounds to -0 comes out +0.
                let same = p.len() == a.len() && p.iter().zip(a).all(|(x, y)| x.to_bits() == y.to_bits() || x == y);
                assert!(same, "{precision:?} {name} of b {b}, t {t}, h {h}, d {d}, causal {causal}");
            }
        }
    }
    // One cast of qkv (and one of its gradient back), where the op apart casts q, k, v.
    let g = Graph::new();
    g.mixed_precision(Precision::Bf16).unwrap();
    let x = g.input("qkv", [1, 4, 2, 3, 8], DType::F32).unwrap();
    let out = x.attention_packed(0.5, true).unwrap();
    assert_eq!(out.dtype(), DType::Bf16);
    let node = g.nodes().into_iter().find(|n| n.op.name() == "attention").unwrap();
    assert_eq!(g.info(node.inputs[0]).meta, TensorMeta::new(vec![1, 4, 2, 3, 8], DType::Bf16));
}

#[test]
fn packed_attention_gradients_match_finite_differences() {
    for (seed, (b, t, h, d, causal)) in
        [(2, 3, 2, 4, true), (2, 3, 2, 4, false), (1, 1, 1, 1, true)].into_iter().enumerate()
    {
        let inputs = [random([b, t, h, 3, d], 600 + seed as u64)];
        let name = format!("packed attention b {b}, t {t}, h {h}, d {d}, causal {causal}");
        check_grad(&name, &inputs, |x| x[0].attention_packed(0.7, causal));
    }
}

fn meta(dims: &[usize], dtype: DType) -> TensorMeta {
    TensorMeta::new(dims.to_vec(), dtype)
}

/// The message of the packed op applied to inputs of these metas.
fn refusal(metas: &[TensorMeta]) -> String {
    let g = Graph::new();
    let xs: Vec<Tensor<'_>> =
        metas.iter().enumerate().map(|(i, m)| g.input(&format!("x{i}"), m.shape.clone(), m.dtype).unwrap()).collect();
    let error = g.apply(Attention { scale: 0.5, causal: true, packed: true }, &xs).unwrap_err();
    error.to_string()
}

#[test]
fn the_packed_op_refuses_inputs_that_do_not_fit_naming_the_values() {
    let cases: Vec<(Vec<TensorMeta>, Vec<&str>)> = vec![
        (vec![meta(&[2, 3, 4, 8], DType::F32)], vec!["rank 5 [batch, length, heads, 3, head size]", "rank 4"]),
        (vec![meta(&[2, 3, 4, 2, 8], DType::F32)], vec!["3 rows (query, key, value)", "with 2"]),
        (vec![meta(&[2, 3, 4, 3, 8], DType::I64)], vec!["qkv must be floats, got i64"]),
        (vec![meta(&[2, 3, 4, 3, 8], DType::F32); 3], vec!["packed attention takes 1 input (qkv), got 3"]),
    ];
    for (metas, expected) in cases {
        let message = refusal(&metas);
        assert!(message.starts_with("attention("), "{message}");
        for part in expected {
            assert!(message.contains(part), "expected '{part}' in: {message}");
        }
    }
    let g = Graph::new();
    let x = g.input("qkv", [2, 3, 4, 3, 8], DType::F32).unwrap();
    let message = x.attention_packed(f64::NAN, true).unwrap_err().to_string();
    assert!(message.contains("scale must be finite, got NaN"), "{message}");
}

#[test]
fn the_packed_gradient_and_the_kernels_check_its_inputs_and_outputs() {
    let op = AttentionGrad { scale: 0.5, causal: true, packed: true };
    let (qkv, out, lse) =
        (meta(&[2, 3, 4, 3, 8], DType::F32), meta(&[2, 3, 4, 8], DType::F32), meta(&[2, 4, 3], DType::F32));
    let good = vec![qkv.clone(), out.clone(), lse.clone(), out.clone()];
    assert_eq!(op.infer(&good).unwrap(), vec![qkv.clone()]);
    assert_eq!(op.check(&good, std::slice::from_ref(&qkv)), Ok(()));
    let message = op.infer(&[qkv.clone(), qkv.clone(), lse.clone(), out.clone()]).unwrap_err();
    assert!(
        message.contains("out must be f32[2, 3, 4, 8]") && message.contains("got out f32[2, 3, 4, 3, 8]"),
        "{message}"
    );
    let message = op.infer(&good[..3]).unwrap_err();
    assert!(message.contains("packed attention_grad takes 4 inputs (qkv, out, lse, dout), got 3"), "{message}");
    let message = op.check(&good, &[out.clone(), out.clone(), out.clone()]).unwrap_err();
    assert!(message.contains("gives 1 outputs (dqkv), but has 3"), "{message}");
    let message = op.check(&good, std::slice::from_ref(&out)).unwrap_err();
    assert!(message.contains("dqkv must have its input's shape and dtype f32[2, 3, 4, 3, 8]"), "{message}");

    let forward = Attention { scale: 0.5, causal: true, packed: true };
    assert_eq!(forward.check(std::slice::from_ref(&qkv), &[out.clone(), lse.clone()]), Ok(()));
    let message = forward.check(std::slice::from_ref(&qkv), &[qkv.clone(), lse.clone()]).unwrap_err();
    assert!(message.contains("out must be f32[2, 3, 4, 8], got out f32[2, 3, 4, 3, 8]"), "{message}");
}

#[test]
fn the_packed_op_splits_sequences_and_heads_and_counts_the_flops_of_the_op_apart() {
    let qkv = meta(&[2, 8, 4, 3, 16], DType::F32);
    let forward = Attention { scale: 0.25, causal: true, packed: true };
    let outputs = forward.infer(std::slice::from_ref(&qkv)).unwrap();
    let splits: Vec<(Vec<Sbp>, Vec<Sbp>)> = forward
        .sbp_signatures(std::slice::from_ref(&qkv), &outputs)
        .into_iter()
        .map(|s| (s.inputs, s.outputs))
        .collect();
    assert_eq!(
        splits,
        vec![
            (vec![Sbp::Split(0)], vec![Sbp::Split(0), Sbp::Split(0)]),
            (vec![Sbp::Split(2)], vec![Sbp::Split(2), Sbp::Split(1)]),
        ]
    );
    let q = meta(&[2, 8, 4, 16], DType::F32);
    let apart = Attention::new(0.25, true);
    let apart_inputs = [q.clone(), q.clone(), q.clone()];
    assert_eq!(forward.flops(std::slice::from_ref(&qkv), &outputs), apart.flops(&apart_inputs, &outputs));
    let backward = AttentionGrad { scale: 0.25, causal: true, packed: true };
    let grad_inputs = [qkv.clone(), outputs[0].clone(), outputs[1].clone(), outputs[0].clone()];
    let expected = 2.5 * apart.flops(&apart_inputs, &outputs);
    assert_eq!(backward.flops(&grad_inputs, std::slice::from_ref(&qkv)), expected);
}

#[test]
fn plan_files_of_the_op_apart_read_and_write_as_before_and_the_packed_flag_round_trips() {
    // Written before the flag existed, and by the op apart now: no `packed` key.
    let old: Attention = serde_json::from_str(r#"{"scale":0.5,"causal":true}"#).unwrap();
    assert_eq!(old, Attention::new(0.5, true));
    assert_eq!(serde_json::to_string(&old).unwrap(), r#"{"scale":0.5,"causal":true}"#);
    let packed = Attention { scale: 0.5, causal: true, packed: true };
    let text = serde_json::to_string(&packed).unwrap();
    assert_eq!(serde_json::from_str::<Attention>(&text).unwrap(), packed);
    let grad = AttentionGrad { scale: 0.5, causal: false, packed: true };
    let text = serde_json::to_string(&grad).unwrap();
    assert_eq!(serde_json::from_str::<AttentionGrad>(&text).unwrap(), grad);
    let old: AttentionGrad = serde_json::from_str(r#"{"scale":0.5,"causal":false}"#).unwrap();
    assert!(!old.packed);
}
