//! Every instruction set the matrix products dispatch to (the widest the processor has,
//! and the AVX2 and scalar kernels forced below it) computes the product to f32 accuracy,
//! so the fallbacks cannot rot on machines whose default is wider. Either operand may be
//! read transposed: `aᵀ · b` (a weight's gradient) is the product whose right-hand panels
//! the microkernel reads with a unit column stride, a loop of its own since the vendored
//! gemm-common's patch 7. One test, because the forced level is process-wide. The levels
//! cap gemm's dispatch, so the products here run on gemm whatever backend the build would
//! pick (`matmul_backends.rs` covers OpenBLAS).

use regflow_kernels::cpu::gemm_backend::{force_backend, GemmBackend};
use regflow_kernels::cpu::isa::{force_isa, isa_in_use, Isa};
use regflow_kernels::{HostCompute, HostContext};
use regflow_plan::ops::MatMul;
use regflow_plan::{DType, HostArray, SplitMix64, TensorMeta};

fn random(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..rows * cols).map(|_| (rng.next_f64() * 2.0 - 1.0) as f32).collect()
}

/// Which operands are read transposed: `(aᵀ, bᵀ)`.
type Transposes = (bool, bool);

/// `op(a) · op(b)` for `a: [m, k]` (or `[k, m]` read transposed) and `b: [k, n]` (or
/// `[n, k]`), by the kernel.
fn kernel_product(
    a: &[f32],
    b: &[f32],
    (m, k, n): (usize, usize, usize),
    (transpose_a, transpose_b): Transposes,
    threads: usize,
) -> Vec<f64> {
    let a = HostArray::f32(if transpose_a { [k, m] } else { [m, k] }, a.to_vec()).unwrap();
    let b = HostArray::f32(if transpose_b { [n, k] } else { [k, n] }, b.to_vec()).unwrap();
    let mut out = HostArray::zeros(&TensorMeta::new([m, n], DType::F32));
    let op = MatMul { transpose_a, transpose_b };
    op.compute(&HostContext { threads }, &[a.view(), b.view()], &mut [out.view_mut()]).unwrap();
    out.to_f64_vec()
}

/// Asserts `got` is the product to within f32 rounding: `k · ε · Σ|a·b|` per element.
fn assert_close(
    got: &[f64],
    a: &[f32],
    b: &[f32],
    (m, k, n): (usize, usize, usize),
    (transpose_a, transpose_b): Transposes,
    what: &str,
) {
    for i in 0..m {
        for j in 0..n {
            let (mut exact, mut magnitude) = (0.0f64, 0.0f64);
            for p in 0..k {
                let b_pj = if transpose_b { b[j * k + p] } else { b[p * n + j] };
                let a_ip = if transpose_a { a[p * m + i] } else { a[i * k + p] };
                let term = a_ip as f64 * b_pj as f64;
                exact += term;
                magnitude += term.abs();
            }
            let tolerance = (k as f64 + 2.0) * f32::EPSILON as f64 * magnitude + f32::MIN_POSITIVE as f64;
            let error = (got[i * n + j] - exact).abs();
            assert!(
                error <= tolerance,
                "{what}: [{i}, {j}] of {m}x{k}x{n} is {} (exact {exact}, off by {error} > {tolerance})",
                got[i * n + j]
            );
        }
    }
}

#[test]
fn every_forced_isa_computes_products_to_f32_accuracy() {
    force_backend(Some(GemmBackend::Gemm)).unwrap();
    let widest = isa_in_use().unwrap();
    let shapes = [(1, 1, 1), (7, 33, 1), (1, 1023, 33), (33, 7, 1023), (1023, 33, 7), (33, 1023, 65), (130, 257, 129)];
    for forced in [None, Some(Isa::Avx512), Some(Isa::Avx2), Some(Isa::Scalar)] {
        force_isa(forced);
        let in_use = isa_in_use().unwrap();
        assert_eq!(in_use, forced.map_or(widest, |isa| isa.min(widest)), "forced {forced:?} on a {widest} machine");
        for (seed, &(m, k, n)) in shapes.iter().enumerate() {
            let a = random(m, k, 2 * seed as u64);
            let b = random(k, n, 2 * seed as u64 + 1);
            for transposes in [(false, false), (false, true), (true, false), (true, true)] {
                for threads in [1, 2] {
                    let got = kernel_product(&a, &b, (m, k, n), transposes, threads);
                    let what = format!("{in_use} (forced {forced:?}), (aᵀ, bᵀ) {transposes:?}, {threads} threads");
                    assert_close(&got, &a, &b, (m, k, n), transposes, &what);
                }
            }
        }
    }
    force_isa(None);
    assert_eq!(isa_in_use().unwrap(), widest);
}

#[test]
fn isa_names_parse_back() {
    for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512] {
        assert_eq!(Isa::parse(isa.name()), Ok(Some(isa)));
    }
    assert_eq!(Isa::parse("auto"), Ok(None));
    assert!(Isa::parse("sse9").unwrap_err().contains("REGFLOW_CPU_ISA"));
}
