//! A matrix product split over threads allocates nothing once warm: gemm's packing buffer
//! and its "left-hand block packed" flags come from per-thread pools on the calling thread
//! and on its helper (`vendor/gemm-common/REGFLOW.md`), and the helper is the calling
//! thread's own, started once (`kernels/src/cpu/team.rs`); a helper's pool is filled at its
//! first share, which on a loaded machine may come after the warm-up. Under rayon's pool, before the
//! team, injecting jobs from outside the pool grew its queue now and then (about one
//! allocation per 30 products).

use regflow_kernels::cpu::gemm_backend::{force_backend, GemmBackend};
use regflow_kernels::{HostCompute, HostContext};
use regflow_plan::ops::MatMul;
use regflow_plan::{DType, HostArray, TensorMeta};

mod counting;

fn a_product_split_over_threads_allocates_nothing_once_warm() {
    // gemm's path (OpenBLAS's splits products the same way, but its library may allocate).
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
        let before = counting::allocations();
        for _ in 0..PRODUCTS {
            run();
        }
        let allocations = counting::allocations() - before;
        // A helper that took no share during the warm-up (a loaded machine: its stream
        // thread claimed every share first) fills its pool at its first share: the packing
        // buffer and the flags, once. Anything per product would be hundreds.
        let first_use = 2 * (context.threads as u64 - 1);
        assert!(
            allocations <= first_use,
            "{allocations} allocations in {PRODUCTS} two-thread products (b transposed: {transpose_b}); a helper's \
             first share allocates {first_use} at most"
        );
        assert!(out.to_f64_vec().iter().all(|&v| v == 0.125 * k as f64));
    }
}

/// The one test, run without libtest's harness (`harness = false` in Cargo.toml), so that
/// no other thread of the process allocates while its allocations are counted.
fn main() {
    a_product_split_over_threads_allocates_nothing_once_warm();
    println!("test a_product_split_over_threads_allocates_nothing_once_warm ... ok");
}
