//! The fused ops the transformer uses (`masked_softmax`, `bias_gelu`): gradients against
//! finite differences, forward values against the composition of the unfused ops they
//! replace (in f64 and f32), and shape errors stated in logical terms.

mod common;

use common::{assert_close, check_grad, eval_op as run, random, to_f32};
use regflow_graph::{DType, Graph, GraphError, HostArray, Tensor};

/// A causal mask `[t, t]`: 0 where column <= row, `masked` above the diagonal.
fn causal(t: usize, masked: f64) -> HostArray {
    let values = (0..t * t).map(|k| if k % t <= k / t { 0.0 } else { masked }).collect();
    HostArray::f64([t, t], values).unwrap()
}

#[test]
fn masked_softmax_gradients_match_finite_differences_for_scores_and_mask() {
    // Scores with a broadcast causal mask, a full-shape mask, and a mask of one column.
    let cases: [(&[usize], &[usize]); 3] = [(&[2, 2, 3, 3], &[3, 3]), (&[2, 4, 5], &[2, 4, 5]), (&[3, 4], &[3, 1])];
    for (seed, (x, mask)) in cases.iter().enumerate() {
        let inputs = [random(x.to_vec(), seed as u64), random(mask.to_vec(), 50 + seed as u64)];
        check_grad(&format!("masked_softmax {x:?} + {mask:?}"), &inputs, |t| t[0].masked_softmax(&t[1], 0.37));
    }
}

#[test]
fn masked_softmax_equals_scale_add_softmax_in_f64_and_f32() {
    let (x, mask) = (random([2, 3, 4, 4], 1), causal(4, -1e9));
    fn fused<'g>(t: &[Tensor<'g>]) -> Result<Tensor<'g>, GraphError> {
        t[0].masked_softmax(&t[1], 0.25)
    }
    fn unfused<'g>(t: &[Tensor<'g>]) -> Result<Tensor<'g>, GraphError> {
        t[0].mul_scalar(0.25)?.add(&t[1])?.softmax(-1)
    }
    let expected = run(&[x.clone(), mask.clone()], unfused).unwrap().to_f64_vec();
    assert_close("f64", &run(&[x.clone(), mask.clone()], fused).unwrap().to_f64_vec(), &expected, 1e-14);
    let fused_f32 = run(&[to_f32(&x), to_f32(&mask)], fused).unwrap();
    assert_eq!(fused_f32.dtype(), DType::F32);
    assert_close("f32", &fused_f32.to_f64_vec(), &expected, 1e-6);
    // Masked positions get exactly 0: the first query attends only to itself.
    assert_eq!(fused_f32.to_f64_vec()[..4], [1.0, 0.0, 0.0, 0.0]);
}

#[test]
fn masked_softmax_refuses_a_mask_that_does_not_broadcast_and_a_non_finite_scale() {
    let g = Graph::new();
    let x = g.input("x", [2, 3, 3], DType::F32).unwrap();
    let wide = g.input("wide", [3, 4], DType::F32).unwrap();
    let message = x.masked_softmax(&wide, 1.0).unwrap_err().to_string();
    assert!(message.contains("does not broadcast") && message.contains("[3, 4]"), "{message}");
    let mask = g.input("mask", [3, 3], DType::F32).unwrap();
    let message = x.masked_softmax(&mask, f64::INFINITY).unwrap_err().to_string();
    assert!(message.contains("scale must be finite"), "{message}");
    let mask64 = g.input("mask64", [3, 3], DType::F64).unwrap();
    let error = x.masked_softmax(&mask64, 1.0).unwrap_err();
    assert!(matches!(&error, GraphError::Op { op, .. } if op == "masked_softmax"), "{error}");
    assert!(error.to_string().contains("must be one float dtype, or bf16 or f16 and f32"), "{error}");
}

#[test]
fn bias_gelu_gradients_match_finite_differences() {
    for (seed, shape) in [vec![4, 3], vec![2, 3, 5]].into_iter().enumerate() {
        let bias = random([*shape.last().unwrap()], 70 + seed as u64);
        let inputs = [random(shape.clone(), 60 + seed as u64), bias];
        check_grad(&format!("bias_gelu {shape:?}"), &inputs, |t| t[0].bias_gelu(&t[1]));
    }
}

#[test]
fn bias_gelu_equals_add_then_gelu_in_f64_and_f32() {
    let (x, bias) = (random([6, 5], 3).to_f64_vec(), random([5], 4));
    // Values far out on both sides too, where tanh saturates.
    let x: Vec<f64> = x.iter().enumerate().map(|(i, v)| if i % 7 == 0 { v * 40.0 } else { *v }).collect();
    let x = HostArray::f64([6, 5], x).unwrap();
    let expected = run(&[x.clone(), bias.clone()], |t| t[0].add(&t[1])?.gelu()).unwrap().to_f64_vec();
    fn fused<'g>(t: &[Tensor<'g>]) -> Result<Tensor<'g>, GraphError> {
        t[0].bias_gelu(&t[1])
    }
    assert_close("f64", &run(&[x.clone(), bias.clone()], fused).unwrap().to_f64_vec(), &expected, 1e-15);
    assert_close("f32", &run(&[to_f32(&x), to_f32(&bias)], fused).unwrap().to_f64_vec(), &expected, 2e-6);
}

#[test]
fn bias_gelu_refuses_a_bias_that_is_not_the_last_axis() {
    let g = Graph::new();
    let x = g.input("x", [4, 3], DType::F32).unwrap();
    let bias = g.input("bias", [4], DType::F32).unwrap();
    let message = x.bias_gelu(&bias).unwrap_err().to_string();
    assert!(message.contains("the bias must have shape [3]") && message.contains("[4]"), "{message}");
}

/// Attention's orders: `[B, T, H, d]` read as `[B, H, T, d]` (its own inverse), and as
/// `[B, H, d, T]`.
const HEADS_FIRST: [usize; 4] = [0, 2, 1, 3];
const HEADS_FIRST_T: [usize; 4] = [0, 2, 3, 1];
const SAME: [usize; 4] = [0, 1, 2, 3];

/// Shapes of `a` and `b`, then the axis orders of `a`, `b` and the output.
type PermutedCase = (&'static [usize], &'static [usize], &'static [usize], &'static [usize], &'static [usize]);

#[test]
fn permuted_matmul_gradients_match_finite_differences_for_attention_orders_and_others() {
    // (a, b, a_axes, b_axes, out_axes): scores and weighted values as attention uses them,
    // a rank-3 product with every tensor permuted, and a plain transpose of rank 2.
    let cases: [PermutedCase; 4] = [
        (&[2, 3, 2, 4], &[2, 3, 2, 4], &HEADS_FIRST, &HEADS_FIRST_T, &SAME),
        (&[2, 2, 3, 3], &[2, 3, 2, 4], &SAME, &HEADS_FIRST, &HEADS_FIRST),
        (&[3, 2, 4], &[5, 2, 4], &[1, 0, 2], &[1, 2, 0], &[2, 0, 1]),
        (&[4, 3], &[5, 4], &[1, 0], &[1, 0], &[1, 0]),
    ];
    for (seed, (a, b, a_axes, b_axes, out_axes)) in cases.into_iter().enumerate() {
        let inputs = [random(a.to_vec(), 80 + seed as u64), random(b.to_vec(), 90 + seed as u64)];
        let name = format!("permuted_matmul {a:?}{a_axes:?} x {b:?}{b_axes:?} -> {out_axes:?}");
        check_grad(&name, &inputs, |t| t[0].matmul_permuted(&t[1], a_axes, b_axes, out_axes));
    }
}

#[test]
fn permuted_matmul_equals_permute_matmul_permute_in_f64_and_f32() {
    let (q, k) = (random([2, 5, 3, 4], 5), random([2, 5, 3, 4], 6));
    fn unfused<'g>(t: &[Tensor<'g>]) -> Result<Tensor<'g>, GraphError> {
        let (heads_first, heads_first_t) = ([0, 2, 1, 3], [0, 2, 3, 1]);
        let scores = t[0].permute(&heads_first)?.matmul(&t[1].permute(&heads_first_t)?)?;
        scores.matmul(&t[1].permute(&heads_first)?)?.permute(&heads_first)
    }
    fn fused<'g>(t: &[Tensor<'g>]) -> Result<Tensor<'g>, GraphError> {
        let scores = t[0].matmul_permuted(&t[1], &HEADS_FIRST, &HEADS_FIRST_T, &SAME)?;
        scores.matmul_permuted(&t[1], &SAME, &HEADS_FIRST, &HEADS_FIRST)
    }
    let expected = run(&[q.clone(), k.clone()], unfused).unwrap();
    let actual = run(&[q.clone(), k.clone()], fused).unwrap();
    assert_eq!(actual.shape, expected.shape);
    assert_close("f64", &actual.to_f64_vec(), &expected.to_f64_vec(), 1e-13);
    let actual = run(&[to_f32(&q), to_f32(&k)], fused).unwrap();
    assert_close("f32", &actual.to_f64_vec(), &expected.to_f64_vec(), 1e-5);
}

#[test]
fn permuted_matmul_refuses_orders_that_are_not_permutations_and_mismatched_sizes() {
    let g = Graph::new();
    let a = g.input("a", [2, 3, 4], DType::F32).unwrap();
    let b = g.input("b", [2, 4, 5], DType::F32).unwrap();
    let message = a.matmul_permuted(&b, &[0, 1, 1], &[0, 1, 2], &[0, 1, 2]).unwrap_err().to_string();
    assert!(message.contains("a_axes [0, 1, 1] is not an order of the 3 axes"), "{message}");
    let message = a.matmul_permuted(&b, &[0, 1, 2], &[0, 2, 1], &[0, 1, 2]).unwrap_err().to_string();
    assert!(message.contains("inner dimensions differ") && message.contains("(4 vs 5)"), "{message}");
    let message = a.matmul_permuted(&b, &[1, 0, 2], &[0, 1, 2], &[0, 1, 2]).unwrap_err().to_string();
    assert!(message.contains("batch dimensions differ"), "{message}");
    assert_eq!(a.matmul_permuted(&b, &[0, 1, 2], &[0, 1, 2], &[0, 2, 1]).unwrap().shape().dims(), [2, 5, 3]);
}
