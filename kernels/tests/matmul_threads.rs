//! Matrix products split their output tiles over threads; every output element is one
//! thread's sum in a fixed order, so on gemm (forced here: OpenBLAS tiles by size, see
//! `gemm_backend`) the thread count never changes a result; permuted products share their
//! batch over threads, one product per thread at a time.

use regflow_kernels::cpu::gemm_backend::{force_backend, GemmBackend};
use regflow_kernels::{HostCompute, HostContext};
use regflow_plan::ops::MatMul;
use regflow_plan::{DType, HostArray, SplitMix64, TensorMeta};

fn random(shape: [usize; 2], seed: u64, dtype: DType) -> HostArray {
    let mut rng = SplitMix64::new(seed);
    let values: Vec<f64> = (0..shape[0] * shape[1]).map(|_| rng.next_f64() * 2.0 - 1.0).collect();
    match dtype {
        DType::F32 => HostArray::f32(shape, values.iter().map(|&v| v as f32).collect()),
        _ => HostArray::f64(shape, values),
    }
    .unwrap()
}

fn product(threads: usize, dtype: DType) -> Vec<f64> {
    // Large enough to be split over the threads (`PARALLEL_MIN_MULTIPLY_ADDS`), with
    // sizes that are not multiples of the kernel's tiles.
    let (m, k, n) = (250, 270, 251);
    assert!(m * k * n >= regflow_kernels::cpu::matmul::PARALLEL_MIN_MULTIPLY_ADDS);
    let (a, b) = (random([m, k], 1, dtype), random([k, n], 2, dtype));
    let mut out = HostArray::zeros(&TensorMeta::new([m, n], dtype));
    MatMul::default().compute(&HostContext { threads }, &[a.view(), b.view()], &mut [out.view_mut()]).unwrap();
    out.to_f64_vec()
}

#[test]
fn matmul_results_do_not_depend_on_the_thread_count() {
    force_backend(Some(GemmBackend::Gemm)).unwrap();
    for dtype in [DType::F32, DType::F64] {
        let one = product(1, dtype);
        assert_eq!(one, product(2, dtype));
        assert_eq!(one, product(3, dtype));
        assert!(one.iter().any(|&v| v != 0.0));
    }
}

/// Attention's scores `[B, H, T, T]` from `q` and `k` stored `[B, T, H, d]`, on `threads`.
fn permuted_product(threads: usize) -> Vec<f64> {
    use regflow_plan::ops::PermutedMatMul;
    let (b, t, h, d) = (3, 7, 5, 4);
    let mut rng = SplitMix64::new(3);
    let mut draw = || -> HostArray {
        HostArray::f32([b, t, h, d], (0..b * t * h * d).map(|_| rng.next_f64() as f32 - 0.5).collect()).unwrap()
    };
    let (q, k) = (draw(), draw());
    let op = PermutedMatMul { a_axes: vec![0, 2, 1, 3], b_axes: vec![0, 2, 3, 1], out_axes: vec![0, 1, 2, 3] };
    let mut out = HostArray::zeros(&TensorMeta::new([b, h, t, t], DType::F32));
    op.compute(&HostContext { threads }, &[q.view(), k.view()], &mut [out.view_mut()]).unwrap();
    out.to_f64_vec()
}

#[test]
fn permuted_matmul_shares_its_batch_over_threads_without_changing_a_result() {
    let one = permuted_product(1);
    // 15 products over 2, 3 and more threads than products.
    for threads in [2, 3, 16] {
        assert_eq!(one, permuted_product(threads), "{threads} threads");
    }
    assert!(one.iter().all(|v| v.is_finite()) && one.iter().any(|&v| v != 0.0));
}
