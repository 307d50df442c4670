//! `attention` and its gradient on CUDA against the CPU kernels: the tensor-core entries
//! (bf16 and f16 heads of 16, 32, 64, 128), the one-thread-per-row entries (f32, f64, other
//! heads, registers off alignment), causal and not, over lengths that are not multiples of
//! a tile (1, 7, 65, 130) and cross-attention (Tq ≠ Tk). Skips without a GPU; a dry run
//! without one checks every launch.

mod common;

use regflow_plan::ops::{Attention, AttentionGrad};
use regflow_plan::{DType, HostArray, Shape, TensorMeta};

fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        // Probabilities and their gradients are rounded to 16 bits before their products
        // on tensor cores, as the CPU does not: a few 2^-8 relative.
        DType::Bf16 => 2e-2,
        DType::F16 => 5e-3,
        _ => 1e-12,
    }
}

fn meta(dims: &[usize], dtype: DType) -> TensorMeta {
    TensorMeta::new(Shape::new(dims.to_vec()), dtype)
}

/// (batch, tq, tk, heads, head size, causal).
type Case = (usize, usize, usize, usize, usize, bool);

const CASES: [Case; 8] = [
    (1, 1, 1, 1, 16, true),
    (2, 7, 7, 3, 16, true),
    (1, 65, 65, 2, 64, true),
    (2, 130, 130, 1, 64, true),
    (1, 33, 33, 2, 128, true),
    (1, 70, 45, 2, 32, false),
    (2, 13, 13, 2, 5, true),
    (1, 9, 20, 1, 24, false),
];

/// The forward and the gradient of one case, on the GPU (aligned registers and, with
/// `skewed`, every register one element off alignment) and on the CPU.
fn check_case(case: Case, dtype: DType, gpu: (&regflow_cuda::Device, &regflow_cuda::Stream)) {
    let (b, tq, tk, h, d, causal) = case;
    let scale = 1.0 / (d as f64).sqrt();
    let what = format!("{dtype} b{b} tq{tq} tk{tk} h{h} d{d} causal {causal}");
    let (q, k, v) = (
        common::array(&[b, tq, h, d], dtype, 1),
        common::array(&[b, tk, h, d], dtype, 2),
        common::array(&[b, tk, h, d], dtype, 3),
    );
    let wide = if dtype == DType::F64 { DType::F64 } else { DType::F32 };
    let forward_outputs = [meta(&[b, tq, h, d], dtype), meta(&[b, h, tq], wide)];
    let forward = common::conf(&Attention { scale, causal }, &[&q, &k, &v], &forward_outputs);
    let rel = tolerance(dtype);
    common::check_both(&format!("attention {what}"), &forward, &[&q, &k, &v], gpu, rel);
    // The gradient from the CPU's forward, so both sides read the same out and lse.
    let mut outs = common::run(&forward, &[&q, &k, &v], None);
    let lse = outs.remove(1);
    let out = outs.remove(0);
    let dout = common::array(&[b, tq, h, d], dtype, 4);
    let inputs: [&HostArray; 6] = [&q, &k, &v, &out, &lse, &dout];
    let grad_outputs = [meta(&[b, tq, h, d], dtype), meta(&[b, tk, h, d], dtype), meta(&[b, tk, h, d], dtype)];
    let grad = common::conf(&AttentionGrad { scale, causal }, &inputs, &grad_outputs);
    common::check_both(&format!("attention_grad {what}"), &grad, &inputs, gpu, rel);
}

#[test]
fn attention_and_its_gradient_match_the_cpu_in_every_float_dtype() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    for dtype in [DType::F32, DType::F64, DType::Bf16, DType::F16] {
        for case in CASES {
            check_case(case, dtype, (&device, &stream));
        }
    }
}

#[test]
fn a_long_bf16_sequence_spans_many_tiles_of_queries_and_keys() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    // GPT-2's head size over 300 positions: five query blocks, each causal key loop
    // ending at its diagonal tile.
    check_case((1, 300, 300, 2, 64, true), DType::Bf16, (&device, &stream));
}
