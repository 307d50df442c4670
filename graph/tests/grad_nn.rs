//! The neural-network ops (matmul, softmax, cross-entropy, layer norm, embedding,
//! dropout): gradients against finite differences, forward values against hand-computed
//! numbers, stability on huge logits, determinism, and build and run-time errors.

mod common;

use common::{check_grad, eval_op as run, random, random_indices};
use regflow_graph::ops::{EmbeddingGrad, MatMulBatchSum};
use regflow_graph::{DType, Graph, GraphError, HostArray, Shape, Tensor};

fn assert_close(actual: &[f64], expected: &[f64], tolerance: f64) {
    assert_eq!(actual.len(), expected.len(), "{actual:?} vs {expected:?}");
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        assert!((a - e).abs() <= tolerance, "element {i}: {a} vs {e} (all: {actual:?})");
    }
}

fn f64s(shape: impl Into<Shape>, data: &[f64]) -> HostArray {
    HostArray::f64(shape, data.to_vec()).unwrap()
}

/// The stored shape of an operand read as `shape`: its last two axes swapped if `transposed`.
fn stored(shape: &[usize], transposed: bool) -> Shape {
    let mut dims = shape.to_vec();
    let rank = dims.len();
    if transposed {
        dims.swap(rank - 2, rank - 1);
    }
    Shape::new(dims)
}

#[test]
fn matmul_gradients_match_finite_differences_for_every_layout_and_transpose() {
    // (a, b) as read, i.e. op(a) and op(b): plain, batched, shared b, shared a, 2 batch dims.
    let cases: [(&[usize], &[usize]); 5] = [
        (&[3, 4], &[4, 2]),
        (&[2, 3, 4], &[2, 4, 5]),
        (&[2, 3, 4], &[4, 5]),
        (&[3, 4], &[2, 4, 2]),
        (&[2, 1, 2, 3], &[2, 1, 3, 2]),
    ];
    for (seed, (a, b)) in cases.iter().enumerate() {
        for (transpose_a, transpose_b) in [(false, false), (true, false), (false, true), (true, true)] {
            let seed = seed as u64 * 10 + u64::from(transpose_a) * 2 + u64::from(transpose_b);
            let inputs = [random(stored(a, transpose_a), seed), random(stored(b, transpose_b), 500 + seed)];
            let name = format!("matmul {a:?} x {b:?} transposes ({transpose_a}, {transpose_b})");
            check_grad(&name, &inputs, |x| x[0].matmul_transposed(&x[1], transpose_a, transpose_b));
        }
    }
}

#[test]
fn matmul_batch_sum_gradients_match_finite_differences() {
    for (transpose_a, transpose_b) in [(false, false), (true, false), (false, true), (true, true)] {
        let seed = u64::from(transpose_a) * 2 + u64::from(transpose_b);
        let inputs = [random(stored(&[3, 2, 4], transpose_a), seed), random(stored(&[3, 4, 5], transpose_b), 9 + seed)];
        check_grad("matmul_batch_sum", &inputs, |x| {
            x[0].graph().apply1(MatMulBatchSum { transpose_a, transpose_b }, &[x[0], x[1]])
        });
    }
}

#[test]
fn matmul_computes_the_textbook_product_in_f32_and_f64() {
    let a = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
    let b = [7.0, 8.0, 9.0, 10.0, 11.0, 12.0];
    let expected = [58.0, 64.0, 139.0, 154.0];
    let out = run(&[f64s([2, 3], &a), f64s([3, 2], &b)], |x| x[0].matmul(&x[1])).unwrap();
    assert_eq!(out.shape, Shape::from([2, 2]));
    assert_eq!(out.to_f64_vec(), expected);
    let f32s = |shape: [usize; 2], v: &[f64]| HostArray::f32(shape, v.iter().map(|&x| x as f32).collect()).unwrap();
    let out = run(&[f32s([2, 3], &a), f32s([3, 2], &b)], |x| x[0].matmul(&x[1])).unwrap();
    assert_eq!(out.dtype(), DType::F32);
    assert_eq!(out.to_f64_vec(), expected);
    // The same product through transposed reads of the transposed operands.
    let (at, bt) = ([1.0, 4.0, 2.0, 5.0, 3.0, 6.0], [7.0, 9.0, 11.0, 8.0, 10.0, 12.0]);
    let out = run(&[f64s([3, 2], &at), f64s([2, 3], &bt)], |x| x[0].matmul_transposed(&x[1], true, true)).unwrap();
    assert_eq!(out.to_f64_vec(), expected);
}

#[test]
fn batched_matmul_equals_a_loop_of_matrix_products() {
    let (batch, m, k, n) = (3, 4, 5, 2);
    let a = random([batch, m, k], 1);
    let b = random([batch, k, n], 2);
    let shared = random([k, n], 3);
    let batched = run(&[a.clone(), b.clone()], |x| x[0].matmul(&x[1])).unwrap();
    let batched_shared = run(&[a.clone(), shared.clone()], |x| x[0].matmul(&x[1])).unwrap();
    assert_eq!(batched.shape, Shape::from([batch, m, n]));
    let (av, bv) = (a.to_f64_vec(), b.to_f64_vec());
    for i in 0..batch {
        let a_i = f64s([m, k], &av[i * m * k..(i + 1) * m * k]);
        let b_i = f64s([k, n], &bv[i * k * n..(i + 1) * k * n]);
        let single = run(&[a_i.clone(), b_i], |x| x[0].matmul(&x[1])).unwrap().to_f64_vec();
        assert_eq!(&batched.to_f64_vec()[i * m * n..(i + 1) * m * n], &single[..], "batch element {i}");
        let single = run(&[a_i, shared.clone()], |x| x[0].matmul(&x[1])).unwrap().to_f64_vec();
        assert_eq!(&batched_shared.to_f64_vec()[i * m * n..(i + 1) * m * n], &single[..], "shared, element {i}");
    }
    // And against a naive triple loop.
    let out = batched.to_f64_vec();
    for i in 0..batch {
        for r in 0..m {
            for c in 0..n {
                let naive: f64 = (0..k).map(|j| av[i * m * k + r * k + j] * bv[i * k * n + j * n + c]).sum();
                assert!((out[i * m * n + r * n + c] - naive).abs() < 1e-12);
            }
        }
    }
}

#[test]
fn matmul_matches_a_naive_product_past_the_kernel_tile_sizes() {
    let (m, k, n) = (37, 70, 45);
    let (a, b) = (random([m, k], 11).to_f64_vec(), random([k, n], 12).to_f64_vec());
    let naive: Vec<f64> = (0..m * n).map(|o| (0..k).map(|j| a[(o / n) * k + j] * b[j * n + o % n]).sum()).collect();
    let transpose = |v: &[f64], rows: usize, cols: usize| -> Vec<f64> {
        (0..rows * cols).map(|o| v[(o % rows) * cols + o / rows]).collect()
    };
    for (transpose_a, transpose_b) in [(false, false), (true, false), (false, true), (true, true)] {
        let a_stored = if transpose_a { f64s([k, m], &transpose(&a, m, k)) } else { f64s([m, k], &a) };
        let b_stored = if transpose_b { f64s([n, k], &transpose(&b, k, n)) } else { f64s([k, n], &b) };
        let out = run(&[a_stored, b_stored], |x| x[0].matmul_transposed(&x[1], transpose_a, transpose_b)).unwrap();
        assert_close(&out.to_f64_vec(), &naive, 1e-12);
    }
}

#[test]
fn matmul_of_empty_inner_dimension_is_zeros() {
    let out = run(&[f64s([2, 0], &[]), f64s([0, 3], &[])], |x| x[0].matmul(&x[1])).unwrap();
    assert_eq!(out.to_f64_vec(), [0.0; 6]);
}

#[test]
fn softmax_and_log_softmax_gradients_match_finite_differences() {
    for (seed, (shape, axis)) in [(&[3, 4][..], -1), (&[3, 4], 0), (&[2, 3, 4], 1), (&[5], 0)].into_iter().enumerate() {
        let x = [random(shape, seed as u64)];
        check_grad(&format!("softmax {shape:?} axis {axis}"), &x, |x| x[0].softmax(axis));
        check_grad(&format!("log_softmax {shape:?} axis {axis}"), &x, |x| x[0].log_softmax(axis));
    }
}

#[test]
fn softmax_of_one_two_three_matches_hand_computed_values() {
    let expected = [0.09003057317038046, 0.24472847105479767, 0.6652409557748219];
    let out = run(&[f64s([3], &[1.0, 2.0, 3.0])], |x| x[0].softmax(0)).unwrap();
    assert_close(&out.to_f64_vec(), &expected, 1e-15);
    let out = run(&[f64s([3], &[1.0, 2.0, 3.0])], |x| x[0].log_softmax(-1)).unwrap();
    assert_close(&out.to_f64_vec(), &[-2.40760596444438, -1.4076059644443801, -0.4076059644443803], 1e-14);
    // Along axis 0 of a [3, 2]: each column is normalized on its own.
    let out = run(&[f64s([3, 2], &[1.0, 5.0, 2.0, 5.0, 3.0, 5.0])], |x| x[0].softmax(0)).unwrap();
    let third = 1.0 / 3.0;
    assert_close(&out.to_f64_vec(), &[expected[0], third, expected[1], third, expected[2], third], 1e-15);
    let out = run(&[HostArray::f32([3], vec![1.0, 2.0, 3.0]).unwrap()], |x| x[0].softmax(0)).unwrap();
    assert_close(&out.to_f64_vec(), &expected, 1e-7);
}

#[test]
fn softmax_and_log_softmax_stay_finite_on_huge_logits() {
    let logits = f64s([2, 3], &[1000.0, -1000.0, 0.0, -1000.0, -1000.0, -1000.0]);
    let out = run(std::slice::from_ref(&logits), |x| x[0].softmax(-1)).unwrap();
    assert_close(&out.to_f64_vec(), &[1.0, 0.0, 0.0, 1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0], 1e-15);
    let out = run(&[logits], |x| x[0].log_softmax(-1)).unwrap();
    let ln3 = 3f64.ln();
    assert_close(&out.to_f64_vec(), &[0.0, -2000.0, -1000.0, -ln3, -ln3, -ln3], 1e-12);
    let out = run(&[HostArray::f32([2], vec![1000.0, 0.0]).unwrap()], |x| x[0].log_softmax(0)).unwrap();
    assert_eq!(out.to_f64_vec(), [0.0, -1000.0]);
}

#[test]
fn sparse_cross_entropy_gradient_matches_finite_differences() {
    for seed in 0..3u64 {
        let inputs = [random([4, 5], seed), random_indices([4], 5, 100 + seed)];
        check_grad("sparse_cross_entropy", &inputs, |x| x[0].sparse_cross_entropy(&x[1]));
    }
    // Upstream of a matmul and a log-softmax, as in a classifier.
    let inputs = [random([3, 4], 7), random([4, 6], 8), random_indices([3], 6, 9)];
    check_grad("classifier", &inputs, |x| x[0].matmul(&x[1])?.sparse_cross_entropy(&x[2]));
}

/// Over the first `classes` columns (a padded vocabulary): the loss of the unpadded
/// logits, whatever the padding holds; gradients by finite differences, zero in padding
/// columns; `classes` outside `1..=C` refused with a sentence.
#[test]
fn sparse_cross_entropy_of_the_first_columns_ignores_padding() {
    for seed in 0..3u64 {
        let (rows, classes, width) = (4, 5, 8);
        let padded = random([rows, width], seed);
        let values = padded.to_f64_vec();
        let unpadded: Vec<f64> = (0..rows).flat_map(|r| values[r * width..r * width + classes].to_vec()).collect();
        let unpadded = HostArray::from_f64(vec![rows, classes], DType::F64, &unpadded).unwrap();
        let labels = random_indices([rows], classes as i64, 100 + seed);
        let of_first =
            run(&[padded.clone(), labels.clone()], |x| x[0].sparse_cross_entropy_of_first(&x[1], classes)).unwrap();
        let whole = run(&[unpadded, labels.clone()], |x| x[0].sparse_cross_entropy(&x[1])).unwrap();
        assert_eq!(of_first.to_f64_vec(), whole.to_f64_vec(), "seed {seed}");
        let inputs = [padded.clone(), labels.clone()];
        check_grad("sparse_cross_entropy_of_first", &inputs, |x| x[0].sparse_cross_entropy_of_first(&x[1], classes));
        let g = Graph::new();
        let x = g.input("logits", [rows, width], DType::F64).unwrap();
        let y = g.input("labels", [rows], DType::I64).unwrap();
        let loss = x.sparse_cross_entropy_of_first(&y, classes).unwrap();
        let dx = g.grad(loss, &[x]).unwrap()[0];
        let dx = g.eval(&[(x, padded), (y, labels)], &[dx]).unwrap().remove(0).to_f64_vec();
        for r in 0..rows {
            assert!(dx[r * width + classes..(r + 1) * width].iter().all(|&d| d == 0.0), "row {r}: {dx:?}");
        }
    }
    // A label in the padding is out of range; so are 0 classes and more than the columns.
    let labels = HostArray::i64([2], vec![0, 3]).unwrap();
    let err = run(&[random([2, 4], 1), labels], |x| x[0].sparse_cross_entropy_of_first(&x[1], 3)).unwrap_err();
    assert!(err.to_string().contains("label 3 out of range for 3 classes"), "{err}");
    for bad in [0, 5] {
        let err =
            run(&[random([2, 4], 1), random_indices([2], 2, 3)], |x| x[0].sparse_cross_entropy_of_first(&x[1], bad))
                .unwrap_err()
                .to_string();
        assert!(err.contains("sparse_cross_entropy") && err.contains("columns"), "{bad}: {err}");
    }
}

#[test]
fn sparse_cross_entropy_of_a_two_by_three_example_matches_hand_computed_loss() {
    // Row 0: ln(e + e² + e³) - 3; row 1 (uniform logits): ln 3.
    let logits = f64s([2, 3], &[1.0, 2.0, 3.0, 0.0, 0.0, 0.0]);
    let labels = HostArray::i64([2], vec![2, 1]).unwrap();
    let out = run(&[logits, labels.clone()], |x| x[0].sparse_cross_entropy(&x[1])).unwrap();
    assert_eq!(out.shape, Shape::scalar());
    assert_close(&out.to_f64_vec(), &[0.753109126556245], 1e-15);
    let logits = HostArray::f32([2, 3], vec![1.0, 2.0, 3.0, 0.0, 0.0, 0.0]).unwrap();
    let out = run(&[logits, labels], |x| x[0].sparse_cross_entropy(&x[1])).unwrap();
    assert_eq!(out.dtype(), DType::F32);
    assert_close(&out.to_f64_vec(), &[0.753109126556245], 1e-6);
}

#[test]
fn sparse_cross_entropy_stays_finite_on_huge_logits() {
    let logits = f64s([2, 2], &[1000.0, -1000.0, 1000.0, -1000.0]);
    let labels = HostArray::i64([2], vec![0, 1]).unwrap();
    let g = Graph::new();
    let x = g.input("logits", [2, 2], DType::F64).unwrap();
    let y = g.input("labels", [2], DType::I64).unwrap();
    let loss = x.sparse_cross_entropy(&y).unwrap();
    let dx = g.grad(loss, &[x]).unwrap()[0];
    let out = g.eval(&[(x, logits), (y, labels)], &[loss, dx]).unwrap();
    // Row 0 is right (loss 0), row 1 is wrong by 2000.
    assert_eq!(out[0].to_f64_vec(), [1000.0]);
    assert_eq!(out[1].to_f64_vec(), [0.0, 0.0, 0.5, -0.5]);
}

#[test]
fn sparse_cross_entropy_rejects_labels_out_of_range_when_evaluated() {
    let logits = f64s([2, 5], &[0.0; 10]);
    let labels = HostArray::i64([2], vec![1, 7]).unwrap();
    let err = run(&[logits.clone(), labels], |x| x[0].sparse_cross_entropy(&x[1])).unwrap_err();
    assert_eq!(err.to_string(), "sparse_cross_entropy: kernel failed: label 7 out of range for 5 classes");
    let labels = HostArray::i64([2], vec![-1, 0]).unwrap();
    let err = run(&[logits, labels], |x| x[0].sparse_cross_entropy(&x[1])).unwrap_err();
    assert_eq!(err.to_string(), "sparse_cross_entropy: kernel failed: label -1 out of range for 5 classes");
}

#[test]
fn layer_norm_gradients_match_finite_differences() {
    for (seed, shape) in [&[3, 5][..], &[2, 3, 4], &[6]].into_iter().enumerate() {
        let seed = seed as u64;
        let features = *shape.last().unwrap();
        let inputs = [random(shape, seed), random([features], 10 + seed), random([features], 20 + seed)];
        check_grad("layer_norm", &inputs, |x| x[0].layer_norm(&x[1], &x[2], 1e-5));
    }
}

#[test]
fn layer_norm_output_has_zero_mean_and_unit_variance_before_the_affine_part() {
    let (rows, features) = (4, 64);
    let x = random([rows, features], 3);
    // Shift and scale the input: normalization removes both.
    let x = f64s([rows, features], &x.to_f64_vec().iter().map(|v| 5.0 + 3.0 * v).collect::<Vec<_>>());
    let ones = f64s([features], &[1.0; 64]);
    let zeros = f64s([features], &[0.0; 64]);
    let out = run(&[x.clone(), ones, zeros], |x| x[0].layer_norm(&x[1], &x[2], 0.0)).unwrap().to_f64_vec();
    for row in out.chunks(features) {
        let mean = row.iter().sum::<f64>() / features as f64;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / features as f64;
        assert!(mean.abs() < 1e-12, "mean {mean}");
        assert!((var - 1.0).abs() < 1e-12, "variance {var}");
    }
    // gamma scales and beta shifts each feature.
    let gamma = f64s([features], &[2.0; 64]);
    let beta = f64s([features], &[-1.0; 64]);
    let affine = run(&[x, gamma, beta], |x| x[0].layer_norm(&x[1], &x[2], 0.0)).unwrap().to_f64_vec();
    let expected: Vec<f64> = out.iter().map(|v| 2.0 * v - 1.0).collect();
    assert_close(&affine, &expected, 1e-12);
    // A hand-computed row: [1, 3] has mean 2 and variance 1.
    let out = run(&[f64s([1, 2], &[1.0, 3.0]), f64s([2], &[1.0, 1.0]), f64s([2], &[0.0, 0.0])], |x| {
        x[0].layer_norm(&x[1], &x[2], 0.0)
    })
    .unwrap();
    assert_eq!(out.to_f64_vec(), [-1.0, 1.0]);
}

#[test]
fn embedding_gathers_rows_and_scatters_gradients() {
    let table = f64s([3, 2], &[0.0, 1.0, 10.0, 11.0, 20.0, 21.0]);
    let ids = HostArray::i64([2, 2], vec![2, 0, 2, 1]).unwrap();
    let out = run(&[table, ids], |x| x[0].embedding(&x[1])).unwrap();
    assert_eq!(out.shape, Shape::from([2, 2, 2]));
    assert_eq!(out.to_f64_vec(), [20.0, 21.0, 0.0, 1.0, 20.0, 21.0, 10.0, 11.0]);
    for seed in 0..3u64 {
        // More ids than rows, so some rows are hit several times and their gradients add up.
        let inputs = [random([5, 3], seed), random_indices([2, 4], 5, 10 + seed)];
        check_grad("embedding", &inputs, |x| x[0].embedding(&x[1]));
        let inputs = [random_indices([2, 4], 5, 20 + seed), random([2, 4, 3], 30 + seed)];
        check_grad("embedding_grad", &inputs, |x| x[0].graph().apply1(EmbeddingGrad::new(5), &[x[0], x[1]]));
    }
}

#[test]
fn embedding_rejects_ids_out_of_range_when_evaluated() {
    let table = f64s([5, 2], &[0.0; 10]);
    let ids = HostArray::i64([3], vec![0, 9, 1]).unwrap();
    let err = run(&[table, ids], |x| x[0].embedding(&x[1])).unwrap_err();
    assert_eq!(err.to_string(), "embedding: kernel failed: id 9 out of range for 5 rows");
}

#[test]
fn dropout_gradient_matches_finite_differences_and_uses_the_same_mask() {
    for seed in 0..3u64 {
        check_grad("dropout", &[random([4, 6], seed)], |x| x[0].dropout(0.3, 42 + seed));
    }
    let g = Graph::new();
    let x = g.input("x", [1000], DType::F64).unwrap();
    let y = x.dropout(0.5, 7).unwrap();
    let dx = g.grad(y.sum_to(&Shape::scalar()).unwrap(), &[x]).unwrap()[0];
    let out = g.eval(&[(x, f64s([1000], &[1.0; 1000]))], &[y, dx]).unwrap();
    assert_eq!(out[0], out[1], "d sum(dropout(x)) / dx is the mask, the same as dropout(ones)");
    assert!(out[0].to_f64_vec().iter().all(|&v| v == 0.0 || v == 2.0));
}

#[test]
fn dropout_is_deterministic_per_seed_and_keeps_one_minus_p() {
    let n = 100_000;
    let ones = f64s([n], &vec![1.0; n]);
    let p = 0.25;
    let a = run(std::slice::from_ref(&ones), |x| x[0].dropout(p, 1)).unwrap();
    let b = run(std::slice::from_ref(&ones), |x| x[0].dropout(p, 1)).unwrap();
    let c = run(std::slice::from_ref(&ones), |x| x[0].dropout(p, 2)).unwrap();
    assert!(a == b, "same seed, same mask");
    assert!(a != c, "different seeds, different masks");
    let kept = a.to_f64_vec().iter().filter(|&&v| v != 0.0).count();
    let rate = kept as f64 / n as f64;
    assert!((rate - (1.0 - p)).abs() < 0.01, "keep rate {rate}");
    // Kept elements are scaled so the expectation is unchanged.
    assert!(a.to_f64_vec().iter().all(|&v| v == 0.0 || v == 1.0 / (1.0 - p)));
    let mean = a.to_f64_vec().iter().sum::<f64>() / n as f64;
    assert!((mean - 1.0).abs() < 0.02, "mean {mean}");
    // p = 0 keeps everything; f32 uses the same mask as f64.
    assert!(run(std::slice::from_ref(&ones), |x| x[0].dropout(0.0, 3)).unwrap() == ones, "p = 0 keeps everything");
    let f32_out = run(&[HostArray::f32([n], vec![1.0; n]).unwrap()], |x| x[0].dropout(p, 1)).unwrap();
    let kept = |a: &HostArray| a.to_f64_vec().iter().map(|&v| v != 0.0).collect::<Vec<_>>();
    assert!(kept(&f32_out) == kept(&a), "f32 and f64 masks differ");
}

#[test]
fn build_errors_name_the_op_and_the_values() {
    let g = Graph::new();
    let a = g.input("a", [4, 3], DType::F32).unwrap();
    let b = g.input("b", [5, 2], DType::F32).unwrap();
    let err = |r: Result<Tensor<'_>, GraphError>| r.unwrap_err().to_string();
    assert_eq!(err(a.matmul(&b)), "matmul(f32[4, 3], f32[5, 2]): inner dimensions differ: [4, 3] x [5, 2] (3 vs 5)");
    assert_eq!(
        err(a.matmul_transposed(&b, true, false)),
        "matmul(f32[4, 3], f32[5, 2]): inner dimensions differ: [4, 3]ᵀ x [5, 2] (4 vs 5)"
    );
    let v = g.input("v", [3], DType::F32).unwrap();
    assert_eq!(err(v.matmul(&b)), "matmul(f32[3], f32[5, 2]): operands must have rank >= 2, got [3] x [5, 2]");
    let c = g.input("c", [3, 2], DType::F64).unwrap();
    assert_eq!(err(a.matmul(&c)), "matmul(f32[4, 3], f64[3, 2]): dtype mismatch: f32 vs f64");
    let i = g.input("i", [2, 2], DType::I64).unwrap();
    assert_eq!(err(i.matmul(&i)), "matmul(i64[2, 2], i64[2, 2]): needs float inputs, got i64");
    let p = g.input("p", [2, 4, 3], DType::F32).unwrap();
    let q = g.input("q", [3, 3, 2], DType::F32).unwrap();
    assert_eq!(
        err(p.matmul(&q)),
        "matmul(f32[2, 4, 3], f32[3, 3, 2]): batch dimensions differ: [2, 4, 3] x [3, 3, 2] ([2] vs [3])"
    );

    let logits = g.input("logits", [2, 5], DType::F32).unwrap();
    let labels = g.input("labels", [3], DType::I64).unwrap();
    assert_eq!(
        err(logits.sparse_cross_entropy(&labels)),
        "sparse_cross_entropy(f32[2, 5], i64[3]): labels must have shape [2] to match logits [2, 5], got [3]"
    );
    let float_labels = g.input("float_labels", [2], DType::F32).unwrap();
    assert_eq!(
        err(logits.sparse_cross_entropy(&float_labels)),
        "sparse_cross_entropy(f32[2, 5], f32[2]): labels must be i64, got f32"
    );

    let x = g.input("x", [2, 3], DType::F32).unwrap();
    assert_eq!(err(x.dropout(1.0, 0)), "dropout(f32[2, 3]): p must be in [0, 1), got 1");
    assert_eq!(err(x.dropout(-0.1, 0)), "dropout(f32[2, 3]): p must be in [0, 1), got -0.1");
    assert_eq!(err(x.softmax(2)), "softmax(f32[2, 3]): axis 2 is out of range for rank 2");
    assert_eq!(err(i.log_softmax(0)), "log_softmax(i64[2, 2]): needs a float input, got i64");

    let gamma = g.input("gamma", [4], DType::F32).unwrap();
    let beta = g.input("beta", [3], DType::F32).unwrap();
    assert_eq!(
        err(x.layer_norm(&gamma, &beta, 1e-5)),
        "layer_norm(f32[2, 3], f32[4], f32[3]): scale and shift must have shape [3], got [4]"
    );
    let beta64 = g.input("beta64", [3], DType::F64).unwrap();
    assert_eq!(
        err(x.layer_norm(&beta, &beta64, 1e-5)),
        "layer_norm(f32[2, 3], f32[3], f64[3]): dtype mismatch: f32 vs f64"
    );
    assert_eq!(
        err(x.layer_norm(&beta, &beta, -1.0)),
        "layer_norm(f32[2, 3], f32[3], f32[3]): eps must be finite and >= 0, got -1"
    );

    let float_ids = g.input("float_ids", [2], DType::F32).unwrap();
    assert_eq!(err(a.embedding(&float_ids)), "embedding(f32[4, 3], f32[2]): ids must be i64, got f32");
    assert_eq!(err(p.embedding(&labels)), "embedding(f32[2, 4, 3], i64[3]): table must be [V, D], got [2, 4, 3]");
}

#[test]
fn second_derivatives_of_fused_gradient_ops_are_reported_not_wrong() {
    let g = Graph::new();
    let x = g.input("x", [2, 3], DType::F64).unwrap();
    let loss = x.softmax(-1).unwrap().sum_to(&Shape::scalar()).unwrap();
    let dx = g.grad(loss, &[x]).unwrap()[0];
    let second = dx.sum_to(&Shape::scalar()).unwrap();
    assert_eq!(g.grad(second, &[x]).unwrap_err().to_string(), "softmax_grad has no gradient with respect to input 0");
}

/// `causal_mask` is 0 on and below the diagonal and -1e9 above it, in f32, f64 and bf16,
/// and a masked softmax over it equals one over the same mask fed as an input, bit for bit.
#[test]
fn causal_mask_hides_later_keys_like_a_fed_mask() {
    let t = 5;
    let expected: Vec<f64> = (0..t * t).map(|k| if k % t <= k / t { 0.0 } else { -1e9 }).collect();
    for dtype in [DType::F32, DType::F64, DType::Bf16] {
        let g = Graph::new();
        let mask = g.causal_mask(t, dtype).unwrap();
        assert_eq!((mask.dtype(), mask.shape().dims().to_vec()), (dtype, vec![t, t]));
        let made = g.eval(&[], &[mask]).unwrap()[0].to_f64_vec();
        // bf16 rounds -1e9 to its nearest, -998244352.
        let rounded: Vec<f64> = expected.iter().map(|&v| if v == 0.0 { 0.0 } else { made[t - 1] }).collect();
        assert_eq!(made, rounded, "{dtype}");
        assert!((made[t - 1] + 1e9).abs() <= 2e6, "{dtype}: {}", made[t - 1]);
    }
    let scores = random([2, t, t], 3);
    let g = Graph::new();
    let x = g.input("x", [2, t, t], DType::F64).unwrap();
    let fed = g.input("mask", [t, t], DType::F64).unwrap();
    let (made, by_feed) =
        (x.masked_softmax(&g.causal_mask(t, DType::F64).unwrap(), 0.5).unwrap(), x.masked_softmax(&fed, 0.5).unwrap());
    let out = g.eval(&[(x, scores), (fed, f64s([t, t], &expected))], &[made, by_feed]).unwrap();
    assert_eq!(out[0].to_f64_vec(), out[1].to_f64_vec());
    assert_eq!(out[0].to_f64_vec()[1], 0.0, "the first query sees only the first key");
}

/// A causal mask that is not square, not a float, or whose masked value is not a finite
/// negative number is refused, naming what it got.
#[test]
fn causal_masks_that_cannot_mask_are_refused() {
    use regflow_graph::ops::CausalMask;
    use regflow_graph::TensorMeta;
    let g = Graph::new();
    let cases = [
        (CausalMask { masked: -1e9, meta: TensorMeta::new([3, 4], DType::F32) }, "[3, 4]"),
        (CausalMask { masked: -1e9, meta: TensorMeta::new([3, 3], DType::I64) }, "i64"),
        (CausalMask { masked: f64::NEG_INFINITY, meta: TensorMeta::new([3, 3], DType::F32) }, "-inf"),
        (CausalMask { masked: 1.0, meta: TensorMeta::new([3, 3], DType::F32) }, "got 1"),
    ];
    for (op, named) in cases {
        let err = g.apply(op, &[]).unwrap_err().to_string();
        assert!(err.contains(named) && err.contains("causal_mask"), "{named}: {err}");
    }
}
