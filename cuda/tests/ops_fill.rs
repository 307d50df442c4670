//! `fill` on CUDA against the CPU kernel (skips without a GPU).

mod common;

use regflow_plan::ops::{CausalMask, Fill};
use regflow_plan::{DType, TensorMeta};

#[test]
fn fill_matches_the_cpu_over_odd_sizes() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    for dtype in [DType::F32, DType::F64, DType::I64, DType::Bf16] {
        for n in [1, 7, 1023, 70_001] {
            let meta = TensorMeta::new([n], dtype);
            let op = Fill::new(-2.5, meta.clone());
            let conf = common::conf(&op, &[], &[meta]);
            common::check(&format!("fill {dtype} [{n}]"), &conf, &[], (&device, &stream), 0.0);
        }
    }
}

#[test]
fn causal_masks_match_the_cpu() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    for dtype in [DType::F32, DType::F64, DType::Bf16] {
        for len in [1, 7, 33, 1024] {
            let meta = TensorMeta::new([len, len], dtype);
            let op = CausalMask { masked: -1e9, meta: meta.clone() };
            let conf = common::conf(&op, &[], &[meta]);
            common::check(&format!("causal_mask {dtype} [{len}, {len}]"), &conf, &[], (&device, &stream), 0.0);
        }
    }
}
