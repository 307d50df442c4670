//! Every matrix product backend the machine has (gemm always, OpenBLAS where the system's
//! library loads) computes plain, transposed, batched and batch-summed products to f32
//! accuracy on any thread count, with the same bits from run to run (and, for gemm, on any
//! thread count), and a backend the machine lacks is refused with an error that says how
//! to get it. One test for the products, because the backend and
//! the instruction-set cap are process-wide.

use regflow_kernels::cpu::gemm_backend::{backend_in_use, force_backend, GemmBackend};
use regflow_kernels::cpu::isa::{force_isa, Isa};
use regflow_kernels::cpu::matmul::prefers_blas;
use regflow_kernels::{HostCompute, HostContext};
use regflow_plan::ops::{MatMul, MatMulBatchSum};
use regflow_plan::{DType, HostArray, SplitMix64, TensorMeta};

fn random(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..len).map(|_| (rng.next_f64() * 2.0 - 1.0) as f32).collect()
}

/// One product case: `batch` products of `op(a) [m, k] · op(b) [k, n]`, summed over the batch
/// if `sum`.
#[derive(Clone, Copy, Debug)]
struct Case {
    batch: usize,
    m: usize,
    k: usize,
    n: usize,
    transpose_a: bool,
    transpose_b: bool,
    sum: bool,
}

impl Case {
    fn a_dims(&self) -> [usize; 2] {
        if self.transpose_a {
            [self.k, self.m]
        } else {
            [self.m, self.k]
        }
    }

    fn b_dims(&self) -> [usize; 2] {
        if self.transpose_b {
            [self.n, self.k]
        } else {
            [self.k, self.n]
        }
    }

    fn with_batch(&self, dims: [usize; 2]) -> Vec<usize> {
        if self.batch == 0 {
            dims.to_vec()
        } else {
            vec![self.batch, dims[0], dims[1]]
        }
    }

    /// The kernel's result (f32, widened).
    fn kernel(&self, a: &[f32], b: &[f32], threads: usize) -> Vec<f64> {
        let a = HostArray::f32(self.with_batch(self.a_dims()), a.to_vec()).unwrap();
        let b = HostArray::f32(self.with_batch(self.b_dims()), b.to_vec()).unwrap();
        let out_dims = if self.sum { vec![self.m, self.n] } else { self.with_batch([self.m, self.n]) };
        let mut out = HostArray::zeros(&TensorMeta::new(out_dims, DType::F32));
        let (ta, tb) = (self.transpose_a, self.transpose_b);
        let (summed, plain) =
            (MatMulBatchSum { transpose_a: ta, transpose_b: tb }, MatMul { transpose_a: ta, transpose_b: tb });
        let op: &dyn HostCompute = if self.sum { &summed } else { &plain };
        op.compute(&HostContext { threads }, &[a.view(), b.view()], &mut [out.view_mut()]).unwrap();
        out.to_f64_vec()
    }

    /// Asserts `got` is the product to within f32 rounding (`(k·batch + 2) · ε · Σ|a·b|`).
    fn assert_close(&self, got: &[f64], a: &[f32], b: &[f32], what: &str) {
        let Case { m, k, n, .. } = *self;
        let count = self.batch.max(1);
        let at = |a: &[f32], g: usize, i: usize, p: usize| element(a, g, (m, k), self.transpose_a, (i, p));
        let bt = |b: &[f32], g: usize, p: usize, j: usize| element(b, g, (k, n), self.transpose_b, (p, j));
        let outputs = if self.sum { 1 } else { count };
        for out_g in 0..outputs {
            for i in 0..m {
                for j in 0..n {
                    let (mut exact, mut magnitude) = (0.0f64, 0.0f64);
                    let groups: Vec<usize> = if self.sum { (0..count).collect() } else { vec![out_g] };
                    for &g in &groups {
                        for p in 0..k {
                            let term = at(a, g, i, p) as f64 * bt(b, g, p, j) as f64;
                            exact += term;
                            magnitude += term.abs();
                        }
                    }
                    let terms = (k * groups.len()) as f64;
                    let tolerance = (terms + 2.0) * f32::EPSILON as f64 * magnitude + f32::MIN_POSITIVE as f64;
                    let value = got[(out_g * m + i) * n + j];
                    assert!(
                        (value - exact).abs() <= tolerance,
                        "{what}: {self:?} [{out_g}, {i}, {j}] is {value}, exact {exact} (tolerance {tolerance})"
                    );
                }
            }
        }
    }
}

/// Element `(r, c)` of batch element `g` of an operand read as `rows x cols`, stored that way
/// or transposed.
fn element(x: &[f32], g: usize, (rows, cols): (usize, usize), transposed: bool, (r, c): (usize, usize)) -> f32 {
    let base = g * rows * cols;
    if transposed {
        x[base + c * rows + r]
    } else {
        x[base + r * cols + c]
    }
}

#[test]
fn every_built_backend_computes_every_kind_of_product_on_any_thread_count() {
    let mut cases = Vec::new();
    // Small and skinny products stay on gemm whatever the backend (`BLAS_MIN_SIDE`); the
    // last two reach OpenBLAS in a `blas` build below AVX-512 (`prefers_blas`).
    let sizes = [(0, 1, 1, 1), (0, 7, 33, 1), (0, 33, 7, 1023), (3, 17, 9, 5), (2, 100, 97, 130), (0, 250, 270, 251)];
    assert!(sizes[4..].iter().all(|&(_, m, k, n)| m.min(k).min(n) >= regflow_kernels::cpu::matmul::BLAS_MIN_SIDE));
    for (batch, m, k, n) in sizes {
        for transpose_a in [false, true] {
            for transpose_b in [false, true] {
                for sum in [false, true] {
                    if sum && batch == 0 {
                        continue;
                    }
                    cases.push(Case { batch, m, k, n, transpose_a, transpose_b, sum });
                }
            }
        }
    }
    let built: Vec<GemmBackend> =
        [GemmBackend::Gemm, GemmBackend::Blas].into_iter().filter(|b| b.is_available()).collect();
    if built.len() == 1 {
        eprintln!("skipped: the `blas` backend's cases (no OpenBLAS here: {:?})", GemmBackend::Blas.availability());
    }
    // At AVX-512 the `blas` backend leaves every product to gemm (`prefers_blas`): capped
    // at AVX2 as well, so that OpenBLAS is checked on every machine.
    let widest = regflow_kernels::cpu::isa::isa_in_use().unwrap();
    let mut levels = vec![widest];
    if widest == Isa::Avx512 {
        levels.push(Isa::Avx2);
    }
    for isa in levels {
        force_isa(Some(isa));
        assert_eq!(regflow_kernels::cpu::isa::isa_in_use().unwrap(), isa);
        check_backends(&built, &cases, isa);
    }
    force_isa(None);
    force_backend(None).unwrap();
    assert_eq!(backend_in_use().unwrap(), GemmBackend::Gemm, "gemm is the default, OpenBLAS or not");
}

/// Every case on every built backend at instruction-set level `isa`.
fn check_backends(built: &[GemmBackend], cases: &[Case], isa: Isa) {
    // gemm's one-thread results, which the `blas` backend gives bit for bit wherever it
    // leaves a product to gemm.
    let mut by_gemm = Vec::new();
    for &backend in built {
        force_backend(Some(backend)).unwrap();
        assert_eq!(backend_in_use().unwrap(), backend);
        for (seed, case) in cases.iter().enumerate() {
            let count = case.batch.max(1);
            let a = random(count * case.m * case.k, 2 * seed as u64);
            let b = random(count * case.k * case.n, 2 * seed as u64 + 1);
            let one = case.kernel(&a, &b, 1);
            case.assert_close(&one, &a, &b, &format!("{backend}, 1 thread"));
            match backend {
                GemmBackend::Gemm => by_gemm.push(one.clone()),
                GemmBackend::Blas => {
                    let to_blas = prefers_blas(case.m, case.k, case.n, isa);
                    if !to_blas {
                        assert_eq!(one, by_gemm[seed], "{case:?} at {isa} is left to gemm");
                    }
                }
            }
            // The 250x270x251 product is past the split threshold, so it is split.
            for threads in [2, 3] {
                let split = case.kernel(&a, &b, threads);
                case.assert_close(&split, &a, &b, &format!("{backend}, {threads} threads"));
                assert_eq!(split, case.kernel(&a, &b, threads), "{backend}, {case:?}: {threads} threads, run twice");
                // OpenBLAS tiles each share by its own sizes (gemm_backend's module docs).
                if backend == GemmBackend::Gemm {
                    assert_eq!(one, split, "{backend}, {case:?}, {threads} threads");
                }
            }
        }
    }
}

#[test]
fn a_backend_the_machine_lacks_is_refused_with_the_way_to_get_it() {
    assert!(GemmBackend::Gemm.is_available());
    if !GemmBackend::Blas.is_available() {
        let error = force_backend(Some(GemmBackend::Blas)).unwrap_err();
        assert!(error.contains("libopenblas") && error.contains("REGFLOW_OPENBLAS"), "{error}");
    }
}

#[test]
fn backend_names_parse_back_and_a_wrong_one_names_the_variable() {
    for backend in [GemmBackend::Gemm, GemmBackend::Blas] {
        assert_eq!(GemmBackend::parse(backend.name()), Ok(Some(backend)));
    }
    assert_eq!(GemmBackend::parse("auto"), Ok(None));
    let error = GemmBackend::parse("mkl").unwrap_err();
    assert!(error.contains("REGFLOW_CPU_GEMM") && error.contains("gemm or blas"), "{error}");
}
