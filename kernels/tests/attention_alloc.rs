//! Attention allocates nothing per firing once warm, forward and backward, on one thread
//! or with sequences shared over two: its tiles of scores are on the stack and its
//! products' packing buffers come from gemm's per-thread pools (the workspace's patch,
//! `vendor/gemm-common/REGFLOW.md`), filled at a thread's first product.

use regflow_kernels::{HostCompute, HostContext};
use regflow_plan::ops::{Attention, AttentionGrad};
use regflow_plan::{DType, HostArray, TensorMeta};

mod counting;

fn attention_and_its_gradient_allocate_nothing_once_warm() {
    // 4 sequences of 80 positions (two blocks of queries and keys), 2 heads of 300 values.
    let (b, t, h, d) = (4, 80, 2, 300);
    let meta = |dims: &[usize]| TensorMeta::new(dims.to_vec(), DType::F32);
    let filled = |dims: &[usize], step: f32| {
        let len = dims.iter().product::<usize>();
        HostArray::f32(dims.to_vec(), (0..len).map(|i| ((i % 17) as f32 - 8.0) * step).collect()).unwrap()
    };
    let (q, k, v) = (filled(&[b, t, h, d], 0.01), filled(&[b, t, h, d], 0.02), filled(&[b, t, h, d], 0.1));
    let dout = filled(&[b, t, h, d], 0.05);
    let (mut out, mut lse) = (HostArray::zeros(&meta(&[b, t, h, d])), HostArray::zeros(&meta(&[b, h, t])));
    let mut grads: Vec<HostArray> = (0..3).map(|_| HostArray::zeros(&meta(&[b, t, h, d]))).collect();
    for threads in [1, 2] {
        let context = HostContext { threads };
        let mut run = || {
            let forward = Attention::new(0.05, true);
            forward.compute(&context, &[q.view(), k.view(), v.view()], &mut [out.view_mut(), lse.view_mut()]).unwrap();
            let backward = AttentionGrad::new(0.05, true);
            let inputs = [q.view(), k.view(), v.view(), out.view(), lse.view(), dout.view()];
            let [dq, dk, dv] = &mut grads[..] else { unreachable!() };
            backward.compute(&context, &inputs, &mut [dq.view_mut(), dk.view_mut(), dv.view_mut()]).unwrap();
        };
        for _ in 0..3 {
            run();
        }
        let before = counting::allocations();
        for _ in 0..10 {
            run();
        }
        let allocations = counting::allocations() - before;
        // A helper that took no share during the warm-up (a loaded machine: its stream
        // thread claimed every sequence first) fills its pool at its first shares: the
        // packing buffer and the flags, and the buffer again each time a larger product of
        // the seven (two forward, five backward) comes first (3 seen under load). Anything
        // per firing would be 20 or more (10 firings of each op).
        let first_use = 9 * (threads as u64 - 1);
        assert!(
            allocations <= first_use,
            "{allocations} allocations in 10 firings of each on {threads} thread(s); a helper's first share \
             allocates {first_use} at most"
        );
    }
    assert!(lse.to_f64_vec().iter().all(|v| v.is_finite()));
    assert!(grads.iter().all(|g| g.to_f64_vec().iter().any(|&v| v != 0.0)));
}

/// The one test, run without libtest's harness (`harness = false` in Cargo.toml), so that
/// no other thread of the process allocates while its allocations are counted.
fn main() {
    attention_and_its_gradient_allocate_nothing_once_warm();
    println!("test attention_and_its_gradient_allocate_nothing_once_warm ... ok");
}
