//! Matrix products split their output tiles over threads; every output element is one
//! thread's sum in a fixed order, so on gemm (forced here: OpenBLAS tiles by size, see
//! `gemm_backend`) the thread count never changes a result; permuted products share their
//! batch over threads, one product per thread at a time.

mod operands;

use operands::random;
use regflow_kernels::cpu::gemm_backend::{force_backend, GemmBackend};
use regflow_kernels::{HostCompute, HostContext};
use regflow_plan::ops::MatMul;
use regflow_plan::{DType, HostArray, SplitMix64, TensorMeta};

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

/// `op(a) · op(b)` of `[m, k] x [k, n]` with either operand read transposed, or the sum of
/// a batch of 2 such products (`MatMulBatchSum`), on `threads`.
fn shaped_product(
    (m, k, n): (usize, usize, usize),
    (ta, tb): (bool, bool),
    batch_sum: bool,
    threads: usize,
) -> Vec<f64> {
    let stored = |rows, cols, t: bool| if t { [cols, rows] } else { [rows, cols] };
    let mut out = HostArray::zeros(&TensorMeta::new([m, n], DType::F32));
    if batch_sum {
        use regflow_plan::ops::MatMulBatchSum;
        let batched = |[r, c]: [usize; 2], seed: u64| {
            let mut rng = SplitMix64::new(seed);
            HostArray::f32([2, r, c], (0..2 * r * c).map(|_| rng.next_f64() as f32 - 0.5).collect()).unwrap()
        };
        let (a, b) = (batched(stored(m, k, ta), 5), batched(stored(k, n, tb), 6));
        let op = MatMulBatchSum { transpose_a: ta, transpose_b: tb };
        op.compute(&HostContext { threads }, &[a.view(), b.view()], &mut [out.view_mut()]).unwrap();
    } else {
        let (a, b) = (random(stored(m, k, ta), 5, DType::F32), random(stored(k, n, tb), 6, DType::F32));
        let op = MatMul { transpose_a: ta, transpose_b: tb };
        op.compute(&HostContext { threads }, &[a.view(), b.view()], &mut [out.view_mut()]).unwrap();
    }
    out.to_f64_vec()
}

/// Split by rows (more rows than columns) and by columns, both operands' orientations,
/// sizes off the kernels' tiles, the transformer's and the MLP's shapes, products 64 or
/// fewer wide on one side and deeper than 512 (whose blocks must stay out of gemm's path
/// for small products, `GEMM_SMALL_SIDE`), matrix-vector products (whose blocks must stay
/// out of its dot-product path, `GEMM_HORIZONTAL_MAX_ELEMENTS`), and a batch summed into
/// one output: every thread count gives the bits of one thread.
#[test]
fn matmul_blocks_of_rows_or_columns_give_the_bits_of_one_thread() {
    force_backend(Some(GemmBackend::Gemm)).unwrap();
    let shapes = [
        (1024, 64, 256),
        (256, 1024, 64),
        (64, 1024, 1027),
        (999, 131, 130),
        (129, 1000, 257),
        (256, 784, 1024),
        (100, 784, 50),
        (50, 784, 100),
        (128, 600, 64),
        (200, 1000, 33),
        (1, 4096, 1024),
        (1024, 4096, 1),
    ];
    for shape in shapes {
        assert!(shape.0 * shape.1 * shape.2 >= regflow_kernels::cpu::matmul::PARALLEL_MIN_MULTIPLY_ADDS, "{shape:?}");
        for transposes in [(false, false), (true, false), (false, true), (true, true)] {
            for batch_sum in [false, true] {
                let one = shaped_product(shape, transposes, batch_sum, 1);
                assert!(one.iter().any(|&v| v != 0.0));
                for threads in [2, 3, 4] {
                    assert!(
                        one == shaped_product(shape, transposes, batch_sum, threads),
                        "{shape:?} {transposes:?} batch sum {batch_sum}: {threads} threads differ from one"
                    );
                }
            }
        }
    }
}

/// On two threads a product is cut where the threads' speeds put it (`cpu/balance.rs`);
/// pinned at either end of the range the cut may take, the results are still one
/// thread's bits.
#[test]
fn where_a_two_thread_product_is_cut_changes_no_bit() {
    use regflow_kernels::cpu::matmul::pin_stream_thread_share;
    force_backend(Some(GemmBackend::Gemm)).unwrap();
    for shape in [(256, 784, 1024), (999, 131, 130), (129, 1000, 257), (1024, 64, 256)] {
        for transposes in [(false, false), (true, false), (false, true)] {
            let one = shaped_product(shape, transposes, false, 1);
            for share in [0.3, 0.7, 0.0, 1.0] {
                pin_stream_thread_share(Some(share));
                let two = shaped_product(shape, transposes, false, 2);
                pin_stream_thread_share(None);
                assert!(one == two, "{shape:?} {transposes:?}: cut at a share of {share} differs from one thread");
            }
        }
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
