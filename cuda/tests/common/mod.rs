//! Runs one op's CUDA kernel and its CPU kernel on the same inputs, for the op-by-op
//! comparisons. Without a GPU but with NVRTC (CI), the CUDA side is a dry run: every
//! factory runs and every launch is checked against its compiled kernel's parameters and
//! CUDA's grid limits, but no values are compared. Without either, the tests skip.

#![allow(dead_code)]

use regflow_cuda::{Device, Stream};
use regflow_kernels::{Execution, KernelIo, KernelRegistry, KernelSpec, StreamContext, StreamScratch};
use regflow_memory::{Arena, ArenaAllocator, MemoryKind};
use regflow_plan::ops::OpAttrs;
use regflow_plan::{DType, DeviceKind, GroupPosition, HostArray, OpConf, TensorMeta};

/// Device 0 and a stream of it: the GPU, or without one a dry-run device where NVRTC is
/// there; `None` (after saying why) where neither is.
pub(crate) fn gpu_or_skip() -> Option<(Device, Stream)> {
    let open = || Device::open(0).and_then(|d| d.stream().map(|s| (d, s)));
    match open() {
        Ok(pair) => Some(pair),
        Err(no_gpu) => match regflow_cuda::enable_dry_run("compute_80").and_then(|()| open()) {
            Ok(pair) => {
                eprintln!("no GPU ({no_gpu}): a dry run, launches checked, values not compared");
                Some(pair)
            }
            Err(e) => {
                eprintln!("skipped (no GPU: {no_gpu}; no dry run: {e})");
                None
            }
        },
    }
}

/// The conf of `op` on `inputs` giving outputs of `outputs`.
pub(crate) fn conf(op: &dyn OpAttrs, inputs: &[&HostArray], outputs: &[TensorMeta]) -> OpConf {
    OpConf::new(op, inputs.iter().map(|a| a.meta()).collect(), (0..inputs.len()).collect(), outputs.to_vec())
}

/// The outputs of `conf`'s kernel for `device` on `inputs`: on the CPU, or on the GPU
/// through managed registers and `stream`.
pub(crate) fn run(conf: &OpConf, inputs: &[&HostArray], gpu: Option<(&Device, &Stream)>) -> Vec<HostArray> {
    run_skewed(conf, inputs, gpu, false)
}

/// [`run`], with every register one element past a 256-byte boundary when `skewed` (as a
/// window into a register may be): the kernels' aligned fast paths are then not taken.
pub(crate) fn run_skewed(
    conf: &OpConf,
    inputs: &[&HostArray],
    gpu: Option<(&Device, &Stream)>,
    skewed: bool,
) -> Vec<HostArray> {
    let mut registry = KernelRegistry::new();
    regflow_kernels::cpu::register(&mut registry, DeviceKind::Cpu);
    regflow_cuda::register(&mut registry);
    let kind = if gpu.is_some() { DeviceKind::Cuda } else { DeviceKind::Cpu };
    let bytes = |m: &TensorMeta| (m.shape.numel() * m.dtype.size()) as u64;
    let input_bytes: Vec<u64> = inputs.iter().map(|a| bytes(&a.meta())).collect();
    let output_bytes: Vec<u64> = conf.outputs.iter().map(bytes).collect();
    let spec = KernelSpec {
        actor: "test",
        device: kind,
        device_index: 0,
        op: Some(conf),
        input_bytes: &input_bytes,
        output_bytes: &output_bytes,
        input_repeats: &[],
    };
    let mut kernel = registry.make(&regflow_plan::KernelConf::Op(conf.clone()), &spec).expect("a kernel");
    // One arena, 256-byte aligned slots (one element further when skewed), inputs then outputs.
    let skews: Vec<u64> = inputs
        .iter()
        .map(|a| a.meta().dtype)
        .chain(conf.outputs.iter().map(|m| m.dtype))
        .map(|dtype| if skewed { dtype.size() as u64 } else { 0 })
        .collect();
    let align = |b: u64| b.div_ceil(256) * 256;
    let total: u64 = input_bytes.iter().chain(&output_bytes).map(|&b| align(b.max(1)) + 256).sum();
    let memory = match gpu {
        Some((device, _)) => device.managed("test", total).expect("managed memory"),
        None => regflow_memory::HostAllocator.allocate("test", MemoryKind::Host, total).expect("host memory"),
    };
    let arena = Arena::new("test", MemoryKind::Host, memory);
    let mut offset = 0;
    let mut slot = |b: u64, skew: u64| {
        let view = arena.view(offset + skew, b).expect("a view");
        offset += align(b.max(1) + skew);
        view
    };
    let ins: Vec<_> = input_bytes.iter().zip(&skews).map(|(&b, &skew)| slot(b, skew)).collect();
    let outs: Vec<_> = output_bytes.iter().zip(&skews[inputs.len()..]).map(|(&b, &skew)| slot(b, skew)).collect();
    for (view, array) in ins.iter().zip(inputs) {
        // SAFETY: host-accessible memory of the arena, not in use by any kernel.
        unsafe { view.as_mut_slice() }.copy_from_slice(&array.to_le_bytes());
    }
    // The scratch a stream would lend this kernel: as much as it asks.
    let scratch_bytes = kernel.scratch_bytes();
    let scratch = match gpu {
        Some((device, _)) if scratch_bytes > 0 => Some(device.managed("test scratch", scratch_bytes).expect("scratch")),
        _ => None,
    };
    let context = StreamContext {
        device: kind,
        device_index: 0,
        threads: 1,
        native: gpu.map_or(0, |(_, s)| s.handle().0),
        scratch: StreamScratch {
            address: scratch.as_ref().map_or(0, |m| m.base().as_ptr() as u64),
            bytes: scratch.as_ref().map_or(0, |_| scratch_bytes),
        },
    };
    let mut io = KernelIo::new(0, GroupPosition { index: 0, count: 1 }, &ins, &outs, &context);
    kernel.run(&mut io).expect("the kernel runs");
    if let Some((_, stream)) = gpu {
        if kernel.execution() == Execution::Queued {
            stream.synchronize().expect("the stream drains");
        }
    }
    conf.outputs
        .iter()
        .zip(&outs)
        // SAFETY: the kernel has completed.
        .map(|(meta, view)| HostArray::from_le_bytes(meta, unsafe { view.as_slice() }).expect("an output"))
        .collect()
}

/// Asserts `gpu` and `cpu` agree elementwise within `rel` relative error (with an
/// absolute floor of `rel` for values near zero); equal infinities agree (their difference is
/// NaN), and so do two NaNs.
pub(crate) fn assert_close(what: &str, gpu: &[HostArray], cpu: &[HostArray], rel: f64) {
    assert_eq!(gpu.len(), cpu.len(), "{what}: output count");
    for (o, (g, c)) in gpu.iter().zip(cpu).enumerate() {
        assert_eq!(g.meta(), c.meta(), "{what}: output {o} meta");
        for (i, (a, b)) in g.to_f64_vec().iter().zip(c.to_f64_vec()).enumerate() {
            let tolerance = rel * b.abs().max(1.0);
            assert!(
                *a == b || (a - b).abs() <= tolerance || (a.is_nan() && b.is_nan()),
                "{what}: output {o}[{i}]: cuda {a}, cpu {b}"
            );
        }
    }
}

/// Runs `conf` on both devices and compares (on a dry-run device: runs both, the CUDA
/// side's launches checked, and compares nothing).
pub(crate) fn check(what: &str, conf: &OpConf, inputs: &[&HostArray], gpu: (&Device, &Stream), rel: f64) {
    let on_gpu = run(conf, inputs, Some(gpu));
    let on_cpu = run(conf, inputs, None);
    if !gpu.0.is_dry() {
        assert_close(what, &on_gpu, &on_cpu, rel);
    }
}

/// [`check`], and again with every register of the CUDA side one element off alignment
/// ([`run_skewed`], for the kernels' unaligned paths), the CPU side computed once.
pub(crate) fn check_both(what: &str, conf: &OpConf, inputs: &[&HostArray], gpu: (&Device, &Stream), rel: f64) {
    let on_cpu = run(conf, inputs, None);
    let aligned = run(conf, inputs, Some(gpu));
    let skewed = run_skewed(conf, inputs, Some(gpu), true);
    if !gpu.0.is_dry() {
        assert_close(what, &aligned, &on_cpu, rel);
        assert_close(&format!("{what}, registers off alignment"), &skewed, &on_cpu, rel);
    }
}

/// A deterministic array of `dims` with values in [-1, 1) (integers for i64).
pub(crate) fn array(dims: &[usize], dtype: DType, seed: u64) -> HostArray {
    let mut rng = regflow_plan::SplitMix64::new(seed);
    let values: Vec<f64> = (0..dims.iter().product::<usize>()).map(|_| 2.0 * rng.next_f64() - 1.0).collect();
    // Integers in -1000..1000 for i64.
    let scale = if dtype == DType::I64 { 1000.0 } else { 1.0 };
    let values: Vec<f64> = values.iter().map(|v| v * scale).collect();
    HostArray::from_f64(dims.to_vec(), dtype, &values).expect("an array")
}

/// A one-element register of `dtype` holding `value` (a learning rate, a step, a norm).
pub(crate) fn scalar(dtype: DType, value: f64) -> HostArray {
    HostArray::from_f64([1], dtype, &[value]).expect("a scalar")
}

/// What tells a child process of a test binary where to write its bytes ([`child_bytes`]).
const CHILD_BYTES_VARIABLE: &str = "REGFLOW_TEST_CHILD_BYTES";

/// The bytes test `test` of this binary computes with every kernel compiled with the macro
/// definitions `defines` (`REGFLOW_CUDA_DEFINES` is read once per process, so another
/// variant of the kernels needs another process): in the parent, starts a child process
/// running that test alone and returns the bytes it computed; in that child, writes
/// `bytes` (what it computed) for the parent and returns `None`, and the test ends there.
pub(crate) fn child_bytes(test: &str, defines: &str, bytes: &[u8]) -> Option<Vec<u8>> {
    if let Some(path) = std::env::var_os(CHILD_BYTES_VARIABLE) {
        std::fs::write(path, bytes).expect("the child writes its values");
        return None;
    }
    let path = std::env::temp_dir().join(format!("regflow-child-bytes-{test}-{}", std::process::id()));
    let exe = std::env::current_exe().expect("the test binary's path");
    let status = std::process::Command::new(exe)
        .args(["--exact", test, "--test-threads=1", "--nocapture"])
        .env(regflow_cuda::sources::DEFINES_VARIABLE, defines)
        .env(CHILD_BYTES_VARIABLE, &path)
        .status()
        .expect("the child starts");
    assert!(status.success(), "{test}'s child with REGFLOW_CUDA_DEFINES={defines} failed: {status}");
    let child = std::fs::read(&path).expect("the child's values");
    let _ = std::fs::remove_file(&path);
    Some(child)
}
