//! Benchmark: regflow's CUDA `matmul` kernel (cuBLAS strided-batched GEMM) on GPT-2's
//! product shapes (the logits' three as the model reads them) and a square one, f32 (no
//! TF32) and bf16 (f32 accumulation), in
//! TFLOP/s. `benches/peers/gemm_torch.py` times `torch.matmul` on the same shapes; the
//! two should be ~1.0× apart, since both are cuBLAS. `benches/gpu/run.sh` runs both.
//!
//! ```text
//! cargo run --release -p regflow-cuda --features cuda --example bench_cuda_gemm -- [--repeats 20]
//! ```
//!
//! The kernel is made by the registry exactly as a plan's actor makes it and launched on
//! one stream; each figure is the median of `--repeats` timed launches, each timed by
//! synchronizing the stream, after three warm-up launches (the first moves the managed
//! pages onto the GPU).

use regflow_cuda::{Device, Stream};
use regflow_kernels::{Execution, KernelIo, KernelRegistry, KernelSpec, StreamContext, StreamScratch};
use regflow_memory::{Arena, MemoryKind};
use regflow_plan::ops::MatMul;
use regflow_plan::{DType, DeviceKind, GroupPosition, HostArray, OpConf, Shape, SplitMix64, TensorMeta};
use std::time::Instant;

/// (m, k, n, transpose_a, transpose_b, what): GPT-2 124M at batch 8 × 1024 tokens, with
/// the tied logits' three products read as the model reads them (the table `[50257, 768]`
/// transposed forward, the logits' gradient transposed for the table's), and one square
/// product. The logits' 16-bit products are staged (`REGFLOW_CUDA_STAGING=0` runs them
/// as they are).
const SHAPES: [(usize, usize, usize, bool, bool, &str); 7] = [
    (8192, 768, 768, false, false, "attention projection"),
    (8192, 768, 3072, false, false, "MLP up"),
    (8192, 3072, 768, false, false, "MLP down"),
    (8192, 768, 50257, false, true, "logits = x·tableT"),
    (8192, 50257, 768, false, false, "dx = dlogits·table"),
    (50257, 8192, 768, true, false, "dtable = dlogitsT·x"),
    (4096, 4096, 4096, false, false, "square"),
];

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn repeats() -> Result<usize, String> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == "--repeats") {
        None => Ok(20),
        Some(i) => match args.get(i + 1).map(|v| v.parse::<usize>()) {
            Some(Ok(n)) if n > 0 => Ok(n),
            _ => Err("--repeats needs a whole number of at least 1".into()),
        },
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let repeats = repeats()?;
    let device = Device::open(0)?;
    let stream = device.stream()?;
    let mut registry = KernelRegistry::new();
    regflow_kernels::cpu::register(&mut registry, DeviceKind::Cpu);
    regflow_cuda::register(&mut registry);
    for dtype in [DType::F32, DType::Bf16] {
        for (m, k, n, ta, tb, what) in SHAPES {
            let seconds = time_matmul(&registry, &device, &stream, dtype, (m, k, n), (ta, tb), repeats)?;
            let tflops = 2.0 * (m * k * n) as f64 / seconds / 1e12;
            println!("regflow gemm {dtype} {m}x{k}x{n} ({what}): {:.3} ms, {tflops:.1} TFLOP/s", seconds * 1e3);
        }
    }
    Ok(())
}

/// The median seconds of one `[m, k] × [k, n]` product of `dtype` on `stream`, each
/// operand stored transposed where asked.
fn time_matmul(
    registry: &KernelRegistry,
    device: &Device,
    stream: &Stream,
    dtype: DType,
    (m, k, n): (usize, usize, usize),
    (transpose_a, transpose_b): (bool, bool),
    repeats: usize,
) -> Result<f64, Box<dyn std::error::Error>> {
    let mut rng = SplitMix64::new((m * 31 + k * 7 + n) as u64);
    let mut random = |dims: [usize; 2]| -> Result<HostArray, Box<dyn std::error::Error>> {
        let values: Vec<f32> = (0..dims[0] * dims[1]).map(|_| 2.0 * rng.next_f64() as f32 - 1.0).collect();
        Ok(match dtype {
            DType::Bf16 => HostArray::bf16_from_f32(dims, &values)?,
            _ => HostArray::f32(dims, values)?,
        })
    };
    let (a, b) =
        (random(if transpose_a { [k, m] } else { [m, k] })?, random(if transpose_b { [n, k] } else { [k, n] })?);
    let out = TensorMeta::new(Shape::new(vec![m, n]), dtype);
    let conf =
        OpConf::new(&MatMul { transpose_a, transpose_b }, vec![a.meta(), b.meta()], vec![0, 1], vec![out.clone()]);
    let bytes = |meta: &TensorMeta| (meta.shape.numel() * meta.dtype.size()) as u64;
    let sizes = [bytes(&a.meta()), bytes(&b.meta()), bytes(&out)];
    let spec = KernelSpec {
        actor: "bench_cuda_gemm",
        device: DeviceKind::Cuda,
        device_index: 0,
        op: Some(&conf),
        input_bytes: &sizes[..2],
        output_bytes: &sizes[2..],
        input_repeats: &[],
    };
    let mut kernel = registry.make(&regflow_plan::KernelConf::Op(conf.clone()), &spec)?;
    if kernel.execution() != Execution::Queued {
        return Err(format!("matmul {dtype} has no CUDA kernel here (it would run on the host)").into());
    }
    let align = |b: u64| b.div_ceil(256) * 256;
    let arena = Arena::new(
        "bench_cuda_gemm",
        MemoryKind::Host,
        device.managed("bench_cuda_gemm", sizes.iter().map(|&b| align(b)).sum())?,
    );
    let (mut offset, mut views) = (0, Vec::new());
    for &size in &sizes {
        views.push(arena.view(offset, size)?);
        offset += align(size);
    }
    for (view, array) in views.iter().zip([&a, &b]) {
        // SAFETY: host-accessible managed memory that no kernel uses yet.
        unsafe { view.as_mut_slice() }.copy_from_slice(&array.to_le_bytes());
    }
    // The scratch the kernel's stream would lend it (aligned staging of 16-bit products).
    let scratch_bytes = kernel.scratch_bytes();
    let scratch = device.managed("bench_cuda_gemm scratch", scratch_bytes.max(1))?;
    let context = StreamContext {
        device: DeviceKind::Cuda,
        device_index: 0,
        threads: 1,
        native: stream.handle().0,
        scratch: StreamScratch { address: scratch.base().as_ptr() as u64, bytes: scratch_bytes },
    };
    let mut times = Vec::with_capacity(repeats);
    for launch in 0..3 + repeats {
        let start = Instant::now();
        let mut io = KernelIo::new(0, GroupPosition { index: 0, count: 1 }, &views[..2], &views[2..], &context);
        kernel.run(&mut io)?;
        stream.synchronize()?;
        if launch >= 3 {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}
