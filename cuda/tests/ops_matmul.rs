//! `matmul`, `matmul_batch_sum` and `permuted_matmul` on CUDA (cuBLAS) against the CPU
//! kernels, over odd sizes, every transpose, shared and batched operands (skips without a
//! GPU). f32 tolerance grows with the inner dimension (1e-5 · √k): cuBLAS sums in another
//! order than the CPU's gemm.

mod common;

use regflow_plan::ops::{MatMul, MatMulBatchSum, OpAttrs, PermutedMatMul};
use regflow_plan::{DType, HostArray, Shape, TensorMeta};

fn tolerance(dtype: DType, k: usize) -> f64 {
    match dtype {
        DType::F32 => 1e-5 * (k.max(1) as f64).sqrt(),
        _ => 1e-12 * (k.max(1) as f64).sqrt(),
    }
}

fn check(
    what: &str,
    op: &dyn OpAttrs,
    a: &HostArray,
    b: &HostArray,
    out: &[usize],
    k: usize,
    gpu: (&regflow_cuda::Device, &regflow_cuda::Stream),
) {
    let dtype = a.meta().dtype;
    let conf = common::conf(op, &[a, b], &[TensorMeta::new(Shape::new(out.to_vec()), dtype)]);
    common::check(what, &conf, &[a, b], gpu, tolerance(dtype, k));
}

#[test]
fn matmul_matches_the_cpu_for_every_transpose_and_odd_sizes() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    for dtype in [DType::F32, DType::F64] {
        for (m, k, n) in [(1, 1, 1), (7, 33, 1), (33, 7, 1023), (1023, 33, 7), (64, 1, 64), (3, 0, 5)] {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                let a_dims = if ta { vec![k, m] } else { vec![m, k] };
                let b_dims = if tb { vec![n, k] } else { vec![k, n] };
                let (a, b) = (common::array(&a_dims, dtype, 1), common::array(&b_dims, dtype, 2));
                let op = MatMul { transpose_a: ta, transpose_b: tb };
                check(&format!("matmul {dtype} {m}x{k}x{n} ({ta}, {tb})"), &op, &a, &b, &[m, n], k, (&device, &stream));
            }
        }
    }
}

#[test]
fn batched_matmul_with_a_shared_operand_matches_the_cpu() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    for dtype in [DType::F32, DType::F64] {
        for (ta, tb) in [(false, false), (true, true)] {
            let (m, k, n) = (7, 33, 5);
            let (a_matrix, b_matrix) = (if ta { [k, m] } else { [m, k] }, if tb { [n, k] } else { [k, n] });
            let a_dims = |batch: &[usize]| [batch, &a_matrix[..]].concat();
            let b_dims = |batch: &[usize]| [batch, &b_matrix[..]].concat();
            // Both batched, `b` shared, `a` shared.
            for (ab, bb) in [(&[2, 3][..], &[2, 3][..]), (&[2, 3], &[]), (&[], &[2, 3])] {
                let (a, b) = (common::array(&a_dims(ab), dtype, 3), common::array(&b_dims(bb), dtype, 4));
                let op = MatMul { transpose_a: ta, transpose_b: tb };
                check(
                    &format!("batched matmul {dtype} {ab:?} x {bb:?} ({ta}, {tb})"),
                    &op,
                    &a,
                    &b,
                    &[2, 3, m, n],
                    k,
                    (&device, &stream),
                );
            }
        }
    }
}

#[test]
fn matmul_batch_sum_matches_the_cpu_folded_or_looped() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    for dtype in [DType::F32, DType::F64] {
        let (batch, m, k, n) = (5, 7, 33, 9);
        for (ta, tb) in [(true, false), (false, false), (false, true), (true, true)] {
            let a = common::array(&if ta { [batch, k, m] } else { [batch, m, k] }, dtype, 5);
            let b = common::array(&if tb { [batch, n, k] } else { [batch, k, n] }, dtype, 6);
            let op = MatMulBatchSum { transpose_a: ta, transpose_b: tb };
            check(
                &format!("matmul_batch_sum {dtype} ({ta}, {tb})"),
                &op,
                &a,
                &b,
                &[m, n],
                k * batch,
                (&device, &stream),
            );
        }
    }
}

#[test]
fn permuted_matmul_matches_the_cpu_for_attention_layouts() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    for dtype in [DType::F32, DType::F64] {
        let (b, t, h, d) = (2, 33, 3, 7);
        // Scores: q [b, t, h, d] as [b, h, t, d] times k [b, t, h, d] as [b, h, d, t].
        let (q, kk) = (common::array(&[b, t, h, d], dtype, 7), common::array(&[b, t, h, d], dtype, 8));
        let op = PermutedMatMul { a_axes: vec![0, 2, 1, 3], b_axes: vec![0, 2, 3, 1], out_axes: vec![0, 1, 2, 3] };
        check(&format!("attention scores {dtype}"), &op, &q, &kk, &[b, h, t, t], d, (&device, &stream));
        // Context: probabilities [b, h, t, t] times v as [b, h, t, d], written as [b, t, h, d].
        let (p, v) = (common::array(&[b, h, t, t], dtype, 9), common::array(&[b, t, h, d], dtype, 10));
        let op = PermutedMatMul { a_axes: vec![0, 1, 2, 3], b_axes: vec![0, 2, 1, 3], out_axes: vec![0, 2, 1, 3] };
        check(&format!("attention context {dtype}"), &op, &p, &v, &[b, t, h, d], t, (&device, &stream));
        // A column-major output, and an operand cuBLAS cannot read (the CPU fallback).
        let (x, y) = (common::array(&[3, 4, 5], dtype, 11), common::array(&[3, 5, 2], dtype, 12));
        let op = PermutedMatMul { a_axes: vec![0, 1, 2], b_axes: vec![0, 1, 2], out_axes: vec![0, 2, 1] };
        check(&format!("column-major output {dtype}"), &op, &x, &y, &[3, 2, 4], 5, (&device, &stream));
        let x = common::array(&[4, 5, 3], dtype, 13);
        let op = PermutedMatMul { a_axes: vec![2, 0, 1], b_axes: vec![0, 1, 2], out_axes: vec![0, 1, 2] };
        check(&format!("host fallback {dtype}"), &op, &x, &y, &[3, 4, 2], 5, (&device, &stream));
    }
}
