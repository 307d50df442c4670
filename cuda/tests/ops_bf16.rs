//! bf16 and f16 on CUDA against the CPU kernels (skip without a GPU; a dry run without
//! one): casts between f32, f64, bf16 and f16 (bitwise: both round to nearest even), alone
//! and grouped, and
//! 16-bit products (f32 accumulation, one rounding: within the type's precision of the
//! CPU's).

mod common;

use regflow_plan::ops::{Cast, CastGroup, MatMul};
use regflow_plan::{DType, HostArray, SplitMix64, TensorMeta};

fn random(dims: &[usize], dtype: DType, seed: u64) -> HostArray {
    let mut rng = SplitMix64::new(seed);
    let n: usize = dims.iter().product();
    let values: Vec<f64> = (0..n).map(|_| rng.next_normal() * 3.0).collect();
    HostArray::from_f64(dims.to_vec(), dtype, &values).expect("an array")
}

#[test]
fn casts_between_float_dtypes_match_the_cpu_bit_for_bit() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let floats = [DType::F32, DType::F64, DType::Bf16, DType::F16];
    for from in floats {
        for to in floats {
            // Eight elements per step where aligned, the rest one by one (`EIGHT` in the
            // prelude); skewed registers take the one-element loop throughout.
            for n in [1, 7, 8, 1023, 70_001] {
                let x = random(&[n], from, 3);
                let conf = common::conf(&Cast { to }, &[&x], &[TensorMeta::new([n], to)]);
                let what = format!("cast {from} -> {to} [{n}]");
                common::check_both(&what, &conf, &[&x], (&device, &stream), 0.0);
            }
        }
    }
    // f16's edges: the largest finite value, ties at it, overflow to infinity, subnormals.
    let edges = [65504.0, 65519.0, 65520.0, 70000.0, -70000.0, 6.0e-8, 3.0e-8, 1.0e-5];
    for from in [DType::F32, DType::F64] {
        let x = HostArray::from_f64([edges.len()], from, &edges).expect("an array");
        let conf = common::conf(&Cast { to: DType::F16 }, &[&x], &[TensorMeta::new([edges.len()], DType::F16)]);
        common::check(&format!("cast {from} -> f16 at its edges"), &conf, &[&x], (&device, &stream), 0.0);
    }
}

/// The compiler's fused casts: members of odd sizes (one past a block's chunk, empty, a
/// few elements, more members than one launch takes) converted bitwise as lone casts,
/// aligned and one element off.
#[test]
fn cast_groups_match_the_cpu_bit_for_bit() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let sizes: Vec<usize> = [4097, 0, 1, 7, 70_001, 8].into_iter().chain((0..30).map(|k| 37 * k + 3)).collect();
    for (from, to) in
        [(DType::F32, DType::Bf16), (DType::Bf16, DType::F32), (DType::F32, DType::F16), (DType::F16, DType::F32)]
    {
        let inputs: Vec<HostArray> = sizes.iter().enumerate().map(|(k, &n)| random(&[n], from, k as u64)).collect();
        let refs: Vec<&HostArray> = inputs.iter().collect();
        let outputs: Vec<TensorMeta> = sizes.iter().map(|&n| TensorMeta::new([n], to)).collect();
        let conf = common::conf(&CastGroup { to, members: sizes.len() as u32 }, &refs, &outputs);
        common::check_both(&format!("cast_group {from} -> {to}"), &conf, &refs, (&device, &stream), 0.0);
    }
}

/// `a · b` of `dtype` (`[m, k] · [k, n]`, each stored transposed where asked) on the GPU
/// against the CPU, to `rel`.
fn check_product(
    what: &str,
    dtype: DType,
    rel: f64,
    (m, k, n): (usize, usize, usize),
    (transpose_a, transpose_b): (bool, bool),
    gpu: (&regflow_cuda::Device, &regflow_cuda::Stream),
) {
    let a_dims = if transpose_a { [k, m] } else { [m, k] };
    let b_dims = if transpose_b { [n, k] } else { [k, n] };
    let (a, b) = (random(&a_dims, dtype, (m + k) as u64), random(&b_dims, dtype, (k + n) as u64));
    let op = MatMul { transpose_a, transpose_b };
    let conf = common::conf(&op, &[&a, &b], &[TensorMeta::new([m, n], dtype)]);
    let what = format!("{dtype} {what} {m}x{k}x{n} t{transpose_a}{transpose_b}");
    common::check(&what, &conf, &[&a, &b], gpu, rel);
}

#[test]
fn half_products_match_the_cpu_to_their_precision() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    // One rounding of the result (bf16: 2^-8 relative, f16: 2^-11) plus f32 sums in
    // another order.
    for (dtype, rel) in [(DType::Bf16, 1e-2), (DType::F16, 2e-3)] {
        for sizes in [(1, 1, 1), (7, 33, 5), (33, 1023, 7), (64, 64, 64)] {
            for transposes in [(false, false), (true, false), (false, true)] {
                check_product("matmul", dtype, rel, sizes, transposes, (&device, &stream));
            }
        }
    }
}

#[test]
fn unaligned_half_products_are_staged_and_match_the_cpu() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    // GPT-2's three logits products in miniature: a vocabulary of 1001 makes the logits'
    // leading dimension odd, so each product runs in bands through an aligned scratch
    // (cuda/src/ops/matmul.rs, "aligned staging"): logits = x · tableᵀ (the output
    // staged, bands of the vocabulary), dx = dlogits · table (bands of the inner
    // dimension, summed in f32) and dtable = dlogitsᵀ · x.
    for (dtype, rel) in [(DType::Bf16, 1e-2), (DType::F16, 2e-3)] {
        for (sizes, transposes) in
            [((512, 128, 1001), (false, true)), ((512, 1001, 128), (false, false)), ((1001, 512, 128), (true, false))]
        {
            check_product("staged matmul", dtype, rel, sizes, transposes, (&device, &stream));
        }
    }
}
