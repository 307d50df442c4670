//! Benchmark: the CPU matrix product kernel (`matmul`, f32) on the MLP's shapes and a square
//! one, at 1 and 2 threads. Prints GFLOP/s (best and median of several runs), the
//! instruction set gemm dispatched to, and the share of the processor's peak;
//! `benches/peers/gemm.sh` runs it beside numpy's BLAS.
//!
//! ```text
//! cargo run --release --example bench_gemm -- [runs] [max threads] [MxKxN[:tn|nt|tt],...]
//! REGFLOW_CPU_ISA=avx2 cargo run --release --example bench_gemm   # force a narrower ISA
//! REGFLOW_CPU_GEMM=blas cargo run --release --example bench_gemm  # OpenBLAS's products
//! REGFLOW_BENCH_PREFETCH=ab cargo run --release --example bench_gemm -- 40 1  # prefetch on vs off
//! REGFLOW_BENCH_BACKENDS=ab cargo run --release --example bench_gemm -- 40 2  # gemm vs OpenBLAS
//! REGFLOW_BENCH_CUT=ab cargo run --release --example bench_gemm -- 40 2  # learned cut vs middle
//! ```
//!
//! With `REGFLOW_BENCH_PREFETCH=ab` it also times each shape on each thread count with gemm's
//! microkernel prefetch on and off ([`set_microkernel_prefetch`]), alternated call by call
//! within the process (on, off, off, on, ... so neither always runs first), and prints the
//! ratio of their total times: this host's speed drifts by a third between seconds, so
//! only calls that close together compare. `REGFLOW_BENCH_BACKENDS=ab` does the same with
//! the two backends ([`force_backend`]: gemm, then OpenBLAS where
//! [`prefers_blas`](regflow::kernels::cpu::matmul::prefers_blas) sends the shape, as
//! `REGFLOW_CPU_GEMM=blas` would), and needs OpenBLAS installed. `REGFLOW_BENCH_CUT=ab`
//! times gemm's two-thread products cut where the threads' measured speeds put the cut
//! (the default) against cut at the middle ([`pin_stream_thread_share`]), on two threads.

#[path = "common/cpu_time.rs"]
mod cpu_time;
use cpu_time::process_cpu_seconds;
use regflow::kernels::cpu::gemm_backend::{backend_in_use, force_backend, GemmBackend};
use regflow::kernels::cpu::isa::{isa_in_use, Isa};
use regflow::kernels::cpu::matmul::{pin_stream_thread_share, set_microkernel_prefetch};
use regflow::kernels::{HostCompute, HostContext};
use regflow::plan::ops::MatMul;
use regflow::plan::{DType, HostArray, SplitMix64, TensorMeta};
use std::time::Instant;

/// A product `op(a) · op(b)` of `m x k` by `k x n`, each operand read transposed (stored
/// `[k, m]` or `[n, k]`) where its flag says: a training step's weight gradient is `hᵀ · dy`
/// (`tn`), its input gradient `dy · wᵀ` (`nt`).
#[derive(Clone, Copy, Debug)]
struct Shape {
    m: usize,
    k: usize,
    n: usize,
    transpose_a: bool,
    transpose_b: bool,
}

impl Shape {
    const fn plain(m: usize, k: usize, n: usize) -> Shape {
        Shape { m, k, n, transpose_a: false, transpose_b: false }
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}x{}", self.m, self.k, self.n)?;
        if self.transpose_a || self.transpose_b {
            let flag = |t: bool| if t { 't' } else { 'n' };
            write!(f, ":{}{}", flag(self.transpose_a), flag(self.transpose_b))?;
        }
        Ok(())
    }
}

/// `m x k x n`: `[m, k] · [k, n]`. The first two are the MLP's first layers at batch 256,
/// the last the second layer's input gradient `dy · wᵀ`, which reads `w` transposed.
const SHAPES: [Shape; 4] = [
    Shape::plain(256, 784, 1024),
    Shape::plain(256, 1024, 1024),
    Shape::plain(1024, 1024, 1024),
    Shape { transpose_b: true, ..Shape::plain(256, 1024, 1024) },
];

fn main() -> Result<(), regflow::Report> {
    let runs: usize = std::env::args().nth(1).map(|s| s.parse()).transpose()?.unwrap_or(9);
    let max_threads: usize = std::env::args().nth(2).map(|s| s.parse()).transpose()?.unwrap_or(2);
    let isa = isa_in_use()?;
    let cpu = Processor::read();
    let per_core = cpu.peak_gflops_per_core(isa);
    println!(
        "cpu: {} ({} logical cpus, {:.0} MHz stated, {:.0} MHz measured), load average {}",
        cpu.model,
        cpu.logical_cpus,
        cpu.nominal_mhz,
        cpu.mhz,
        load_average()
    );
    let backend = backend_in_use()?;
    // The ISA caps gemm's dispatch only; OpenBLAS picks its own kernels.
    println!("backend: {backend}");
    println!("isa: {isa} ({} f32 lanes)", isa.f32_lanes());
    println!(
        "peak: {per_core:.1} GFLOP/s per core = {} FMA units x {} f32 lanes x 2 x {:.0} MHz measured ({})",
        cpu.fma_units(isa),
        isa.f32_lanes(),
        cpu.mhz,
        cpu.fma_assumption(isa)
    );
    let shapes = match std::env::args().nth(3) {
        Some(list) => list.split(',').map(parse_shape).collect::<Result<Vec<_>, _>>()?,
        None => SHAPES.to_vec(),
    };
    for &shape in &shapes {
        let Shape { m, k, n, transpose_a, transpose_b } = shape;
        let mut rng = SplitMix64::new(7);
        let mut values = |len: usize| (0..len).map(|_| rng.next_f64() as f32 - 0.5).collect::<Vec<f32>>();
        let a = HostArray::f32(if transpose_a { [k, m] } else { [m, k] }, values(m * k))?;
        let b = HostArray::f32(if transpose_b { [n, k] } else { [k, n] }, values(k * n))?;
        let product = MatMul { transpose_a, transpose_b };
        let mut out = HostArray::zeros(&TensorMeta::new([m, n], DType::F32));
        for threads in 1..=max_threads {
            let context = HostContext { threads };
            let mut multiply = || product.compute(&context, &[a.view(), b.view()], &mut [out.view_mut()]);
            for _ in 0..2 {
                multiply()?;
            }
            let mut rates = Vec::with_capacity(runs);
            let (cpu_start, wall_start) = (process_cpu_seconds(), Instant::now());
            for _ in 0..runs {
                let start = Instant::now();
                multiply()?;
                rates.push(2.0 * (m * k * n) as f64 / start.elapsed().as_secs_f64() / 1e9);
            }
            // Below `threads` when other processes took the cores (or a thread idled); the
            // GFLOP per CPU-second is what the threads did with the time they got.
            let cpu_seconds = process_cpu_seconds() - cpu_start;
            let busy = cpu_seconds / wall_start.elapsed().as_secs_f64();
            let per_cpu_second = 2.0 * (m * k * n * runs) as f64 / cpu_seconds / 1e9;
            rates.sort_by(f64::total_cmp);
            let (best, median) = (rates[runs - 1], rates[runs / 2]);
            println!(
                "regflow f32 {shape} threads {threads}: best {best:.1} GFLOP/s, median {median:.1} GFLOP/s, {:.0}% of peak, {busy:.2} cpus busy, {per_cpu_second:.1} GFLOP per cpu-second",
                100.0 * best / (per_core * threads as f64)
            );
        }
        let ab_prefetch = std::env::var("REGFLOW_BENCH_PREFETCH").is_ok_and(|v| v == "ab");
        let ab_backends = std::env::var("REGFLOW_BENCH_BACKENDS").is_ok_and(|v| v == "ab");
        let ab_cut = std::env::var("REGFLOW_BENCH_CUT").is_ok_and(|v| v == "ab");
        for threads in 1..=max_threads {
            let context = HostContext { threads };
            let mut multiply = || product.compute(&context, &[a.view(), b.view()], &mut [out.view_mut()]);
            let gflop = 2.0 * (m * k * n) as f64 / 1e9;
            let label = format!("regflow f32 {shape} threads {threads}");
            if ab_prefetch {
                let times = alternated(&mut multiply, runs, &mut |on| {
                    set_microkernel_prefetch(on);
                    Ok(())
                })?;
                set_microkernel_prefetch(true);
                report_ab(&label, gflop, ("prefetch on", "off"), "off takes", "of on", times);
            }
            if ab_cut && threads == 2 {
                let times = alternated(&mut multiply, runs, &mut |learned| {
                    pin_stream_thread_share(if learned { None } else { Some(0.5) });
                    Ok(())
                })?;
                pin_stream_thread_share(None);
                report_ab(
                    &label,
                    gflop,
                    ("cut learned", "at the middle"),
                    "the middle takes",
                    "of the learned cut",
                    times,
                );
            }
            if ab_backends {
                let chosen = backend_in_use()?;
                let times = alternated(&mut multiply, runs, &mut |gemm| {
                    force_backend(Some(if gemm { GemmBackend::Gemm } else { GemmBackend::Blas }))
                })?;
                force_backend(Some(chosen))?;
                report_ab(&label, gflop, ("gemm", "OpenBLAS"), "OpenBLAS takes", "of gemm", times);
            }
        }
    }
    Ok(())
}

/// Seconds per call of `multiply` under two settings that `set(true)` and `set(false)`
/// choose: `rounds` rounds of true, false, false, true (each setting first in every other
/// place), so that both see the same minutes of the host. The setting is left as the last
/// round's `true`; callers restore their own.
fn alternated(
    multiply: &mut dyn FnMut() -> Result<(), String>,
    rounds: usize,
    set: &mut dyn FnMut(bool) -> Result<(), String>,
) -> Result<(Vec<f64>, Vec<f64>), String> {
    let (mut yes, mut no) = (Vec::with_capacity(2 * rounds), Vec::with_capacity(2 * rounds));
    for _ in 0..rounds {
        for setting in [true, false, false, true] {
            set(setting)?;
            let start = Instant::now();
            multiply()?;
            let seconds = start.elapsed().as_secs_f64();
            if setting {
                yes.push(seconds)
            } else {
                no.push(seconds)
            }
        }
    }
    Ok((yes, no))
}

/// Prints an A/B timing from [`alternated`]: each setting's median GFLOP/s (`gflop` per
/// call) and the second's total time as a multiple of the first's, as
/// `<label>, <first> / <second> alternated: median … GFLOP/s, <slower> …x the time <of>`.
fn report_ab(
    label: &str,
    gflop: f64,
    (first, second): (&str, &str),
    slower: &str,
    of: &str,
    times: (Vec<f64>, Vec<f64>),
) {
    let (a, b) = times;
    println!(
        "{label}, {first} / {second} alternated: median {:.1} / {:.1} GFLOP/s, {slower} {:.3}x the time {of}",
        gflop / median_of(&a),
        gflop / median_of(&b),
        b.iter().sum::<f64>() / a.iter().sum::<f64>()
    );
}

/// The median of `values` (not empty).
fn median_of(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

/// `MxKxN`, optionally `:tn`, `:nt` or `:tt` (which operands are read transposed), or why not.
fn parse_shape(text: &str) -> Result<Shape, String> {
    let (sizes, flags) = text.split_once(':').unwrap_or((text, "nn"));
    let sizes: Vec<usize> =
        sizes.split('x').map(str::parse).collect::<Result<_, _>>().map_err(|e| format!("shape {text:?}: {e}"))?;
    let (transpose_a, transpose_b) = match flags {
        "nn" => (false, false),
        "tn" => (true, false),
        "nt" => (false, true),
        "tt" => (true, true),
        _ => return Err(format!("shape {text:?}: the flags after ':' are nn, tn, nt or tt")),
    };
    match sizes[..] {
        [m, k, n] if m.min(k).min(n) > 0 => Ok(Shape { m, k, n, transpose_a, transpose_b }),
        _ => Err(format!("shape {text:?}: expected MxKxN with three sizes above 0, as 256x784x1024")),
    }
}

/// What `/proc/cpuinfo` says about the first processor.
#[derive(Debug)]
struct Processor {
    model: String,
    vendor: String,
    family: u32,
    /// The clock `/proc/cpuinfo` states (a VM often shows the base clock).
    nominal_mhz: f64,
    /// The clock the peak is computed at: measured where it can be, else the nominal one.
    mhz: f64,
    logical_cpus: usize,
}

/// The clock this core runs at now, measured: a chain of dependent integer additions
/// retires one per cycle on every x86-64 core of the last decade, so additions per second
/// are cycles per second. Best of five 20 ms runs. `/proc/cpuinfo` on a VM states the base
/// clock, while the core boosts: the MLP's products then read 116 % of that "peak".
fn measured_mhz() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        let rounds: u64 = 10_000_000;
        let best = (0..5)
            .map(|_| {
                let start = std::time::Instant::now();
                // SAFETY: register arithmetic only: no memory, no stack, no flags read after.
                unsafe {
                    std::arch::asm!(
                        "2:",
                        "add {x}, 1",
                        "add {x}, 1",
                        "add {x}, 1",
                        "add {x}, 1",
                        "sub {n}, 1",
                        "jnz 2b",
                        x = inout(reg) 0u64 => _,
                        n = inout(reg) rounds => _,
                        options(nomem, nostack),
                    );
                }
                start.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min);
        // Four dependent additions per round: four cycles.
        Some(rounds as f64 * 4.0 / best / 1e6)
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

impl Processor {
    fn read() -> Processor {
        let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let field = |name: &str| {
            info.lines()
                .find(|line| line.split(':').next().is_some_and(|key| key.trim() == name))
                .and_then(|line| line.split_once(':'))
                .map(|(_, value)| value.trim().to_string())
                .unwrap_or_default()
        };
        let nominal: f64 = field("cpu MHz").parse().unwrap_or(0.0);
        Processor {
            model: field("model name"),
            vendor: field("vendor_id"),
            family: field("cpu family").parse().unwrap_or(0),
            nominal_mhz: nominal,
            mhz: measured_mhz().unwrap_or(nominal),
            logical_cpus: info.lines().filter(|line| line.starts_with("processor")).count(),
        }
    }

    /// FMA instructions of `isa`'s width one core retires per cycle (an assumption).
    fn fma_units(&self, isa: Isa) -> usize {
        match isa {
            Isa::Scalar => 2,
            // Zen 4 splits a 512-bit FMA over its two 256-bit units.
            Isa::Avx512 if self.is_amd() && self.family == 25 => 1,
            Isa::Avx2 | Isa::Avx512 => 2,
        }
    }

    fn fma_assumption(&self, isa: Isa) -> &'static str {
        match isa {
            Isa::Avx512 if self.is_amd() && self.family == 25 => {
                "assumed: Zen 4, two 256-bit FMA units, one 512-bit FMA per cycle"
            }
            Isa::Avx512 => "assumed: two 512-bit FMA units, as Skylake-SP Gold/Platinum and later Xeons, Zen 5",
            _ => "assumed: two FMA units, as Zen 2-4 and Intel since Haswell",
        }
    }

    fn is_amd(&self) -> bool {
        self.vendor.contains("AMD")
    }

    fn peak_gflops_per_core(&self, isa: Isa) -> f64 {
        (self.fma_units(isa) * isa.f32_lanes() * 2) as f64 * self.mhz / 1e3
    }
}

fn load_average() -> String {
    let loads = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    loads.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
}
