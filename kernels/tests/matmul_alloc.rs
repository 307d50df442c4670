//! A matrix product split over threads allocates (almost) nothing once warm: gemm's packing
//! buffer and its "left-hand block packed" flags come from per-thread pools on the calling
//! thread and on every helper thread (`vendor/gemm-common/REGFLOW.md`). What is left is
//! rayon's: its job queue grows a block now and then as jobs are injected from outside the
//! pool (about one allocation per 30 products here), which a bound of one allocation per
//! eight products allows and a per-product allocation (two per product before the helpers'
//! flags were pooled) does not.

use regflow_kernels::cpu::gemm_backend::{force_backend, GemmBackend};
use regflow_kernels::{HostCompute, HostContext};
use regflow_plan::ops::MatMul;
use regflow_plan::{DType, HostArray, TensorMeta};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

/// Counts every allocation of the process (this binary has one test, so nothing else runs).
struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator, only counting.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[test]
fn a_product_split_over_threads_allocates_nothing_per_call_once_warm() {
    // Two pool threads, as on the two-core machines this runs on: each thread's pools are
    // filled once, so a larger machine's pool would only take longer to warm. The products
    // still come from outside the pool, as a stream thread's do.
    rayon::ThreadPoolBuilder::new().num_threads(2).build_global().unwrap();
    // gemm's own threads (OpenBLAS's path splits products itself).
    force_backend(Some(GemmBackend::Gemm)).unwrap();
    let (m, k, n) = (256, 256, 300);
    assert!(m * k * n >= regflow_kernels::cpu::matmul::PARALLEL_MIN_MULTIPLY_ADDS);
    for transpose_b in [false, true] {
        let a = HostArray::f32([m, k], vec![0.5; m * k]).unwrap();
        let b_shape = if transpose_b { [n, k] } else { [k, n] };
        let b = HostArray::f32(b_shape, vec![0.25; k * n]).unwrap();
        let mut out = HostArray::zeros(&TensorMeta::new([m, n], DType::F32));
        let op = MatMul { transpose_a: false, transpose_b };
        let context = HostContext { threads: 2 };
        let mut run = || op.compute(&context, &[a.view(), b.view()], &mut [out.view_mut()]).unwrap();
        for _ in 0..20 {
            run();
        }
        const PRODUCTS: u64 = 400;
        let before = ALLOCATIONS.load(Ordering::Relaxed);
        for _ in 0..PRODUCTS {
            run();
        }
        let allocations = ALLOCATIONS.load(Ordering::Relaxed) - before;
        assert!(
            allocations <= PRODUCTS / 8,
            "{allocations} allocations in {PRODUCTS} two-thread products (b transposed: {transpose_b})"
        );
        assert!(out.to_f64_vec().iter().all(|&v| v == 0.125 * k as f64));
    }
}
