//! `attention` and its gradient on CUDA against the CPU kernels: the tensor-core entries
//! (bf16 and f16 heads of 16, 32, 64, 128), the one-thread-per-row entries (f32, f64, other
//! heads, registers off alignment), causal and not, over lengths that are not multiples of
//! a tile (1, 7, 65, 130) and cross-attention (Tq ≠ Tk); the packed op (one `qkv`) against
//! the CPU and, bit for bit, against the GPU's op over the same rows apart. Skips without a
//! GPU; a dry run without one checks every launch.

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

/// Row `which` (0 query, 1 key, 2 value) of every position and head of a packed `qkv [B,
/// T, H, 3, D]`, as its own `[B, T, H, D]` array.
fn part_of(qkv: &HostArray, which: usize) -> HostArray {
    let &[b, t, h, three, d] = qkv.shape.dims() else { panic!("qkv {} is not rank 5", qkv.shape) };
    let values = qkv.to_f64_vec();
    let rows = values.chunks_exact(d).skip(which).step_by(three);
    let part: Vec<f64> = rows.flatten().copied().collect();
    HostArray::from_f64(vec![b, t, h, d], qkv.dtype(), &part).expect("a part")
}

/// The packed op and its gradient on the GPU: against the CPU's packed kernels (aligned and
/// off alignment), and bit for bit against the GPU's op over `q`, `k` and `v` apart (the
/// same entries' arithmetic, only the addresses and strides differ), `dqkv` holding `dq`,
/// `dk` and `dv` side by side.
fn check_packed_case(case: Case, dtype: DType, gpu: (&regflow_cuda::Device, &regflow_cuda::Stream)) {
    let (b, t, _, h, d, causal) = case;
    let scale = 1.0 / (d as f64).sqrt();
    let what = format!("packed {dtype} b{b} t{t} h{h} d{d} causal {causal}");
    let qkv = common::array(&[b, t, h, 3, d], dtype, 21);
    let wide = if dtype == DType::F64 { DType::F64 } else { DType::F32 };
    let forward_outputs = [meta(&[b, t, h, d], dtype), meta(&[b, h, t], wide)];
    let packed = Attention { scale, causal, packed: true };
    let forward = common::conf(&packed, &[&qkv], &forward_outputs);
    let rel = tolerance(dtype);
    common::check_both(&format!("attention {what}"), &forward, &[&qkv], gpu, rel);
    let outs = common::run(&forward, &[&qkv], Some(gpu));
    let dout = common::array(&[b, t, h, d], dtype, 22);
    let inputs: [&HostArray; 4] = [&qkv, &outs[0], &outs[1], &dout];
    let grad_packed = AttentionGrad { scale, causal, packed: true };
    let grad = common::conf(&grad_packed, &inputs, &[meta(&[b, t, h, 3, d], dtype)]);
    common::check_both(&format!("attention_grad {what}"), &grad, &inputs, gpu, rel);
    let grads = common::run(&grad, &inputs, Some(gpu));

    let (q, k, v) = (part_of(&qkv, 0), part_of(&qkv, 1), part_of(&qkv, 2));
    let apart = common::conf(&Attention::new(scale, causal), &[&q, &k, &v], &forward_outputs);
    let apart_outs = common::run(&apart, &[&q, &k, &v], Some(gpu));
    let apart_inputs: [&HostArray; 6] = [&q, &k, &v, &apart_outs[0], &apart_outs[1], &dout];
    let grad_outputs: [TensorMeta; 3] = std::array::from_fn(|_| meta(&[b, t, h, d], dtype));
    let apart_grad = common::conf(&AttentionGrad::new(scale, causal), &apart_inputs, &grad_outputs);
    let apart_grads = common::run(&apart_grad, &apart_inputs, Some(gpu));
    if gpu.0.is_dry() {
        return;
    }
    let bits = |a: &HostArray| a.to_f64_vec().into_iter().map(f64::to_bits).collect::<Vec<u64>>();
    assert_eq!(bits(&outs[0]), bits(&apart_outs[0]), "out of {what}");
    assert_eq!(bits(&outs[1]), bits(&apart_outs[1]), "lse of {what}");
    for (which, name) in ["dq", "dk", "dv"].iter().enumerate() {
        assert_eq!(bits(&part_of(&grads[0], which)), bits(&apart_grads[which]), "{name} of {what}");
    }
}

#[test]
fn packed_attention_and_its_gradient_match_the_cpu_and_the_op_apart_bit_for_bit() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    for dtype in [DType::F32, DType::F64, DType::Bf16, DType::F16] {
        // Causal cases (queries as many as keys): tensor-core heads, row heads, odd heads.
        for case in CASES.into_iter().filter(|c| c.1 == c.2) {
            check_packed_case(case, dtype, (&device, &stream));
        }
        check_packed_case((1, 70, 70, 2, 32, false), dtype, (&device, &stream));
    }
    // GPT-2's head size over many tiles.
    check_packed_case((1, 300, 300, 2, 64, true), DType::Bf16, (&device, &stream));
}

/// The entries as before the thirtieth and fortieth sessions' changes that keep the bits:
/// unbounded registers, whole tiles, tiles loaded by the general loop and the rows' lse
/// and dots through registers (`attention.cu`: `ATT_OCCUPANCY`, `ATT_PART`,
/// `ATT_TILE_LOADS`).
const UNBOUNDED_WHOLE_TILES: &str = "ATT_OCCUPANCY=0,ATT_PART=64,ATT_TILE_LOADS=0";

/// The tensor-core entries' outputs (forward, then gradient) for GPT-2's head size and a
/// smaller one, bf16 and f16, causal and not (and their packed twins where queries and
/// keys are as many), as exact values.
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
            if tq == tk {
                // The packed twins of the same entries.
                let qkv = common::array(&[b, tq, h, 3, d], dtype, 15);
                let packed = common::conf(&Attention { scale, causal, packed: true }, &[&qkv], &forward_outputs);
                let packed_outs = common::run(&packed, &[&qkv], Some(gpu));
                let inputs: [&HostArray; 4] = [&qkv, &packed_outs[0], &packed_outs[1], &dout];
                let grad = AttentionGrad { scale, causal, packed: true };
                let grad = common::conf(&grad, &inputs, &[meta(&[b, tq, h, 3, d], dtype)]);
                let packed_grads = common::run(&grad, &inputs, Some(gpu));
                outs.extend(packed_outs.into_iter().chain(packed_grads));
            }
            bits.extend(outs.iter().flat_map(|o| o.to_f64_vec()).map(f64::to_bits));
        }
    }
    bits
}

/// The occupancy caps, the parts of the tiles and the unrolled tile loads change no bit
/// (`attention.cu`, `ATT_OCCUPANCY`, `ATT_PART`, `ATT_TILE_LOADS`): this process runs the
/// entries as compiled by default, a child process of this test binary the same with them
/// unbounded, with whole tiles and the tiles' general loads (`REGFLOW_CUDA_DEFINES`, read
/// once per process, `common::child_bytes`), and the values must be identical.
#[test]
fn the_tensor_core_entries_give_the_bits_they_gave_unbounded_and_with_whole_tiles() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let bits = tensor_core_outputs((&device, &stream));
    if device.is_dry() {
        // Launches checked above; a dry run has no values to compare, and the other
        // variant's compile and resources are checked by `nvrtc_sources.rs` (its child
        // here compiled `attention.cu` again for half a minute of CI's time).
        eprintln!("dry run: the launches are checked, the child with other tiles is not started");
        return;
    }
    let own: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
    let test = "the_tensor_core_entries_give_the_bits_they_gave_unbounded_and_with_whole_tiles";
    let Some(bytes) = common::child_bytes(test, UNBOUNDED_WHOLE_TILES, &own) else { return };
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
