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
    let forward = common::conf(&Attention::new(scale, causal), &[&q, &k, &v], &forward_outputs);
    let rel = tolerance(dtype);
    common::check_both(&format!("attention {what}"), &forward, &[&q, &k, &v], gpu, rel);
    // The gradient from the CPU's forward, so both sides read the same out and lse.
    let mut outs = common::run(&forward, &[&q, &k, &v], None);
    let lse = outs.remove(1);
    let out = outs.remove(0);
    let dout = common::array(&[b, tq, h, d], dtype, 4);
    let inputs: [&HostArray; 6] = [&q, &k, &v, &out, &lse, &dout];
    let grad_outputs = [meta(&[b, tq, h, d], dtype), meta(&[b, tk, h, d], dtype), meta(&[b, tk, h, d], dtype)];
    let grad = common::conf(&AttentionGrad::new(scale, causal), &inputs, &grad_outputs);
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

/// What the bits test writes from the child process, and the variant it compiles there.
const BITS_VARIABLE: &str = "REGFLOW_ATTENTION_BITS";
const UNBOUNDED_WHOLE_TILES: &str = "ATT_OCCUPANCY=0,ATT_PART=64";

/// The tensor-core entries' outputs (forward, then gradient) for GPT-2's head size and a
/// smaller one, bf16 and f16, causal and not, as exact values.
fn tensor_core_outputs(gpu: (&regflow_cuda::Device, &regflow_cuda::Stream)) -> Vec<u64> {
    let mut bits = Vec::new();
    for dtype in [DType::Bf16, DType::F16] {
        for (b, tq, tk, h, d, causal) in
            [(1, 200, 200, 2, 64, true), (1, 70, 130, 2, 64, false), (2, 90, 90, 1, 32, true)]
        {
            let scale = 1.0 / (d as f64).sqrt();
            let (q, k, v) = (
                common::array(&[b, tq, h, d], dtype, 11),
                common::array(&[b, tk, h, d], dtype, 12),
                common::array(&[b, tk, h, d], dtype, 13),
            );
            let forward_outputs = [meta(&[b, tq, h, d], dtype), meta(&[b, h, tq], DType::F32)];
            let forward = common::conf(&Attention::new(scale, causal), &[&q, &k, &v], &forward_outputs);
            let mut outs = common::run(&forward, &[&q, &k, &v], Some(gpu));
            let dout = common::array(&[b, tq, h, d], dtype, 14);
            let inputs: [&HostArray; 6] = [&q, &k, &v, &outs[0], &outs[1], &dout];
            let grad_outputs = [meta(&[b, tq, h, d], dtype), meta(&[b, tk, h, d], dtype), meta(&[b, tk, h, d], dtype)];
            let grad = common::conf(&AttentionGrad::new(scale, causal), &inputs, &grad_outputs);
            let grads = common::run(&grad, &inputs, Some(gpu));
            outs.extend(grads);
            bits.extend(outs.iter().flat_map(|o| o.to_f64_vec()).map(f64::to_bits));
        }
    }
    bits
}

/// The occupancy caps and the parts of the tiles change no bit (`attention.cu`,
/// `ATT_OCCUPANCY` and `ATT_PART`): this process runs the entries as compiled by default,
/// a child process of this test binary the same with them unbounded and with whole tiles
/// (`REGFLOW_CUDA_DEFINES`, read once per process), and the values must be identical.
#[test]
fn the_tensor_core_entries_give_the_bits_they_gave_unbounded_and_with_whole_tiles() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let bits = tensor_core_outputs((&device, &stream));
    if let Some(path) = std::env::var_os(BITS_VARIABLE) {
        // The child: hand the values over and stop.
        let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
        std::fs::write(path, bytes).expect("the child writes its values");
        return;
    }
    let path = std::env::temp_dir().join(format!("regflow-attention-bits-{}", std::process::id()));
    let exe = std::env::current_exe().expect("the test binary's path");
    let status = std::process::Command::new(exe)
        .args(["--exact", "the_tensor_core_entries_give_the_bits_they_gave_unbounded_and_with_whole_tiles"])
        .args(["--test-threads=1", "--nocapture"])
        .env(regflow_cuda::sources::DEFINES_VARIABLE, UNBOUNDED_WHOLE_TILES)
        .env(BITS_VARIABLE, &path)
        .status()
        .expect("the child starts");
    assert!(status.success(), "the child with REGFLOW_CUDA_DEFINES={UNBOUNDED_WHOLE_TILES} failed: {status}");
    let bytes = std::fs::read(&path).expect("the child's values");
    let _ = std::fs::remove_file(&path);
    let before: Vec<u64> = bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect();
    assert_eq!(before.len(), bits.len(), "as many values from the child");
    if let Some(at) = bits.iter().zip(&before).position(|(a, b)| a != b) {
        panic!(
            "value {at} of {} differs: {} now, {} unbounded with whole tiles",
            bits.len(),
            f64::from_bits(bits[at]),
            f64::from_bits(before[at])
        );
    }
}
