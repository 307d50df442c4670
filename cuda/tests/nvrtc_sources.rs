//! Every CUDA kernel source compiles with NVRTC, so a typo fails CI on the CPU machine, not
//! the first GPU run. NVRTC ships as a Python package (`nvidia-cuda-nvrtc`); `.ci/test`
//! installs it and sets `REGFLOW_REQUIRE_NVRTC=1`, which turns a missing NVRTC into a
//! failure for a build with the `cuda` feature. Elsewhere the test skips with a message.

use regflow_cuda::sources::{entries_of, full_text, SOURCES};
use regflow_cuda::{nvrtc, CudaError};

/// The architectures compiled for: Turing (the oldest NVRTC 13 serves), Ampere, Hopper.
const ARCHES: &[&str] = &["compute_75", "compute_80", "compute_90"];

/// The attention variant without occupancy caps and with whole tiles, which the compiled
/// default must fit at least as many blocks per SM as (checked with
/// `REGFLOW_ATTENTION_AGAINST_UNBOUNDED=1`; [`ATTENTION_BLOCKS_FLOOR`] in CI).
const UNBOUNDED_WHOLE_TILES: &str = "ATT_OCCUPANCY=0,ATT_PART=64";

/// The blocks per SM (of 128 threads) that each tensor-core attention entry fits today, the
/// least over bf16 and f16, q, k and v apart and packed: (GPU, stage, blocks for heads of
/// 16, 32, 64 and 128). A change that fits fewer fails; one that fits more can raise them.
/// Each is at least the unbounded variant's (2026-11-29: sm_80 fwd 5 4 3 2, dq 4 3 2 2, dkv
/// 3 3 2 2; sm_90 fwd 5 4 3 2, dq 4 3 2 2, dkv 3 2 2 2), which CI no longer compiles: that
/// took two more NVRTC compiles and assemblies of the largest source, about 110 s of CPU.
const ATTENTION_BLOCKS_FLOOR: [(&str, &str, [u32; 4]); 6] = [
    ("sm_80", "fwd", [5, 4, 4, 2]),
    ("sm_80", "dq", [6, 5, 4, 2]),
    ("sm_80", "dkv", [5, 4, 3, 2]),
    ("sm_90", "fwd", [5, 4, 4, 2]),
    ("sm_90", "dq", [6, 5, 4, 2]),
    ("sm_90", "dkv", [5, 3, 3, 2]),
];

fn nvrtc_or_skip() -> bool {
    if !regflow_cuda::BUILT {
        eprintln!("skipped: built without the `cuda` feature (NVRTC is reached through cudarc)");
        return false;
    }
    match nvrtc::available() {
        Ok(()) => true,
        Err(e) if std::env::var_os("REGFLOW_REQUIRE_NVRTC").is_some_and(|v| v == "1") => {
            panic!("REGFLOW_REQUIRE_NVRTC=1 but NVRTC is not usable: {e}")
        }
        Err(e) => {
            eprintln!("skipped: {e}");
            false
        }
    }
}

/// The assembler `REGFLOW_PTXAS` names, where NVRTC is usable too; `None` (after saying
/// why) where either is missing.
fn ptxas_or_skip() -> Option<std::ffi::OsString> {
    if !nvrtc_or_skip() {
        return None;
    }
    let ptxas = std::env::var_os("REGFLOW_PTXAS");
    if ptxas.is_none() {
        eprintln!("skipped: REGFLOW_PTXAS does not name a ptxas to assemble the PTX with");
    }
    ptxas
}

#[test]
fn every_source_compiles_for_every_architecture() {
    if !nvrtc_or_skip() {
        return;
    }
    // NVRTC takes seconds a source (half a minute for the largest) where no PTX is on disk
    // yet, as on a fresh CI machine: `compile_all` compiles an architecture's sources side
    // by side, as a device's first kernel does, and `compile` then reads them from the
    // process's cache (or reports the one that failed; the ptxas checks below read the same).
    for arch in ARCHES {
        nvrtc::compile_all(arch);
        for source in SOURCES {
            let ptx = nvrtc::compile(source, arch).unwrap_or_else(|e| panic!("{e}"));
            for entry in entries_of(source.code) {
                assert!(
                    ptx.contains(&format!(".entry {entry}(")),
                    "{}: no entry {entry} in the PTX for {arch}",
                    source.name
                );
            }
        }
    }
}

/// The PTX of every source assembles with `ptxas` for the real GPUs of the oldest and the
/// newest architecture compiled for: NVRTC passes inline PTX (`asm`, the f16 conversions)
/// through unchecked, so a wrong instruction or constraint would otherwise first fail when
/// the driver loads the module on a GPU. `REGFLOW_PTXAS` names the assembler (`.ci/nvrtc.sh`
/// installs it from the `nvidia-cuda-nvcc` package); without it the test skips.
#[test]
fn every_source_assembles_for_the_real_architectures() {
    let Some(ptxas) = ptxas_or_skip() else { return };
    let gpus = [("compute_75", "sm_75"), ("compute_90", "sm_90")];
    let each: Vec<_> = SOURCES.iter().flat_map(|source| gpus.map(|(arch, gpu)| (source, arch, gpu))).collect();
    // The largest sources take ptxas tens of seconds: assembled side by side, and each
    // (source, GPU) once for the whole test binary (the resource checks below read the
    // same assemblies). `assembled` panics with ptxas's log on a failure.
    in_parallel(&each, |&(source, arch, gpu)| {
        assembled(&ptxas, source, arch, gpu, None);
    });
}

/// Runs `f` on every item, on as many threads as the machine has cores (at most one per
/// item), and returns when all are done; a panic in `f` fails the caller.
fn in_parallel<T: Sync>(items: &[T], f: impl Fn(&T) + Sync) {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(items.len()).max(1);
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                while let Some(item) = items.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)) {
                    f(item);
                }
            });
        }
    });
}

#[test]
fn a_broken_source_is_an_error_with_nvrtcs_log() {
    if !nvrtc_or_skip() {
        return;
    }
    let broken = regflow_cuda::sources::KernelSource {
        name: "broken",
        code: "extern \"C\" __global__ void regflow_broken(float* x) { x[0] = undefined_name; }",
    };
    let e = nvrtc::compile(&broken, "compute_80").unwrap_err();
    let CudaError::Compile { source_name, log, .. } = &e else { panic!("{e:?}") };
    assert_eq!(*source_name, "broken");
    assert!(log.contains("undefined_name"), "{log}");
    assert!(e.to_string().contains("NVRTC could not compile the CUDA kernel source 'broken' for compute_80"), "{e}");
    let e = nvrtc::compile(&SOURCES[0], "compute_1").unwrap_err().to_string();
    assert!(e.contains("no NVRTC architecture 'compute_1'"), "{e}");
    // The prelude is part of what is compiled, once.
    assert_eq!(full_text(&broken).matches("block_sum").count(), 2);
}

/// What `ptxas -v` says of one entry point.
#[derive(Debug, Clone, Copy, Default)]
struct Resources {
    registers: u32,
    spill_stores: u32,
    spill_loads: u32,
    shared_bytes: u32,
}

impl Resources {
    /// Blocks of `threads` an SM of compute capability 8.0 or 9.0 holds at once, as its
    /// registers (65536, given out per warp in units of 256) and its shared memory
    /// (`shared_per_sm`, less 1 KiB the driver keeps per block) allow.
    fn blocks_per_sm(&self, threads: u32, shared_per_sm: u32) -> u32 {
        let per_warp = (self.registers * 32).div_ceil(256) * 256;
        let by_registers = (65536 / per_warp.max(1)) / threads.div_ceil(32);
        by_registers.min(shared_per_sm / (self.shared_bytes + 1024))
    }
}

/// What one (source, GPU, macro definitions) assembled to: every entry's resources.
type Assembly = std::sync::Arc<std::collections::HashMap<String, Resources>>;

/// `source` compiled for `arch` and assembled for `gpu` with `ptxas -v`, once per test
/// process: the compile with the environment's definitions (`defines: None`, what a job
/// compiles: [`nvrtc::compile`]) or with `defines` ([`nvrtc::compile_variant`]). ptxas
/// takes up to half a minute on the largest sources, and three tests look at the same
/// assemblies. A caller asking for one that another thread is assembling waits for it;
/// different ones are assembled side by side.
fn assembled(
    ptxas: &std::ffi::OsStr,
    source: &'static regflow_cuda::sources::KernelSource,
    arch: &'static str,
    gpu: &'static str,
    defines: Option<&'static str>,
) -> Assembly {
    type Key = (&'static str, &'static str, &'static str, Option<&'static str>);
    static DONE: std::sync::OnceLock<
        std::sync::Mutex<std::collections::HashMap<Key, std::sync::Arc<std::sync::OnceLock<Assembly>>>>,
    > = std::sync::OnceLock::new();
    let cell = {
        let mut done = DONE.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
        done.entry((source.name, arch, gpu, defines)).or_default().clone()
    };
    cell.get_or_init(|| {
        let ptx = match defines {
            None => nvrtc::compile(source, arch),
            Some(defines) => nvrtc::compile_variant(source, arch, defines),
        }
        .unwrap_or_else(|e| panic!("{e}"));
        std::sync::Arc::new(resources(ptxas, &ptx, gpu, source.name))
    })
    .clone()
}

/// `ptxas -v`'s resources for every entry of `ptx` (of the source `name`), assembled for `gpu`.
fn resources(
    ptxas: &std::ffi::OsStr,
    ptx: &str,
    gpu: &str,
    name: &str,
) -> std::collections::HashMap<String, Resources> {
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("regflow-ptxas-v-{}-{call}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    let file = dir.join("source.ptx");
    std::fs::write(&file, ptx).expect("the PTX written");
    let out = std::process::Command::new(ptxas)
        .args(["-v", "--gpu-name", gpu, "-o"])
        .arg(dir.join("out.cubin"))
        .arg(&file)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", ptxas.to_string_lossy()));
    let log = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{name}.cu for {gpu}: ptxas failed:\n{log}");
    let _ = std::fs::remove_dir_all(&dir);
    // "Compiling entry function 'NAME' for 'sm_90'", then "N bytes spill stores, M bytes
    // spill loads", then "Used R registers, ..., S bytes smem".
    let number_before = |line: &str, unit: &str| -> Option<u32> {
        let at = line.find(unit)?;
        line[..at].split_whitespace().last()?.parse().ok()
    };
    let mut all = std::collections::HashMap::new();
    let mut current: Option<(String, Resources)> = None;
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            if let Some((name, r)) = current.take() {
                all.insert(name, r);
            }
            let name = rest.split('\'').next().unwrap_or_default().to_string();
            current = Some((name, Resources::default()));
        } else if let Some((_, r)) = current.as_mut() {
            if let Some(n) = number_before(line, " bytes spill stores") {
                r.spill_stores = n;
                r.spill_loads = number_before(line, " bytes spill loads").unwrap_or(0);
            }
            if let Some(n) = number_before(line, " registers") {
                r.registers = n;
                r.shared_bytes = number_before(line, " bytes smem").unwrap_or(0);
            }
        }
    }
    if let Some((name, r)) = current {
        all.insert(name, r);
    }
    all
}

/// The most bytes of spill stores and loads together a capped tensor-core attention entry
/// may have: a few values through local memory, not a loop's working set.
const ATTENTION_SPILL_BYTES: u32 = 64;

/// The tensor-core attention entries for heads of 64 (GPT-2's), over q, k and v apart and
/// packed (`_qkv`), are compiled to fit 4 blocks per SM (the forward and dq) and 3 (dk/dv)
/// on Ampere and Hopper, with at most a few values through local memory (`attention.cu`,
/// `ATT_OCCUPANCY`; [`ATTENTION_SPILL_BYTES`]), and no entry fits fewer blocks than
/// [`ATTENTION_BLOCKS_FLOOR`]: ptxas's register counts and shared memory say how many fit. With
/// `REGFLOW_ATTENTION_AGAINST_UNBOUNDED=1` it also compiles the variant a GPU session times
/// against, unbounded and with whole tiles (`REGFLOW_CUDA_DEFINES="ATT_OCCUPANCY=0,ATT_PART=64"`),
/// checks that no entry fits fewer than it, and prints both variants' figures.
#[test]
fn the_tensor_core_attention_entries_fit_the_blocks_per_sm_they_are_compiled_for() {
    let Some(ptxas) = ptxas_or_skip() else { return };
    let source = SOURCES.iter().find(|s| s.name == "attention").expect("attention.cu");
    let against_unbounded = std::env::var("REGFLOW_ATTENTION_AGAINST_UNBOUNDED").is_ok_and(|v| v == "1");
    // Shared memory per SM: A100 164 KiB, H100 and H200 228 KiB.
    let gpus = [("compute_80", "sm_80", 167_936), ("compute_90", "sm_90", 233_472)];
    // The largest source's assemblies, side by side; those compiled by default are the
    // ones `every_source_assembles_for_the_real_architectures` checks too (once).
    let defines: &[Option<&str>] = if against_unbounded { &[None, Some(UNBOUNDED_WHOLE_TILES)] } else { &[None] };
    let variants: Vec<_> =
        gpus.iter().flat_map(|&(arch, gpu, _)| defines.iter().map(move |&d| (arch, gpu, d))).collect();
    in_parallel(&variants, |&(arch, gpu, defines)| {
        assembled(&ptxas, source, arch, gpu, defines);
    });
    let assembled: Vec<Assembly> =
        variants.iter().map(|&(arch, gpu, defines)| assembled(&ptxas, source, arch, gpu, defines)).collect();
    for ((_, gpu, shared_per_sm), pair) in gpus.into_iter().zip(assembled.chunks(defines.len())) {
        let (now, before) = (&pair[0], pair.get(1));
        for dtype in ["bf16", "f16"] {
            let heads = [16, 32, 64, 128].into_iter().enumerate();
            for ((nth, d), packed) in heads.flat_map(|head| [(head, ""), (head, "_qkv")]) {
                for (stage, wanted) in [("fwd", 4), ("dq", 4), ("dkv", 3)] {
                    let entry = format!("regflow_attention_{stage}_{dtype}_d{d}{packed}");
                    let r = now[&entry];
                    let blocks = r.blocks_per_sm(128, shared_per_sm);
                    eprintln!(
                        "{gpu} {entry}: {} registers, {} / {} bytes spilled (stores / loads), {blocks} blocks per SM",
                        r.registers, r.spill_stores, r.spill_loads
                    );
                    let floor = ATTENTION_BLOCKS_FLOOR
                        .iter()
                        .find(|&&(g, s, _)| g == gpu && s == stage)
                        .map(|(_, _, by_head)| by_head[nth])
                        .expect("a floor for every GPU and stage");
                    assert!(
                        blocks >= floor,
                        "{gpu} {entry} fits {blocks} blocks per SM, fewer than the {floor} of ATTENTION_BLOCKS_FLOOR: {r:?}"
                    );
                    if let Some(before) = before {
                        let old = before[&entry];
                        eprintln!(
                            "  unbounded, whole tiles: {} registers, {} / {} bytes, {} blocks",
                            old.registers,
                            old.spill_stores,
                            old.spill_loads,
                            old.blocks_per_sm(128, shared_per_sm)
                        );
                        let fewer = blocks < old.blocks_per_sm(128, shared_per_sm);
                        assert!(!fewer, "{gpu} {entry} fits fewer blocks per SM than unbounded: {r:?} against {old:?}");
                    }
                    if d == 64 {
                        assert!(blocks >= wanted, "{gpu} {entry} fits {blocks} blocks per SM, not {wanted}: {r:?}");
                        assert!(
                            r.spill_stores + r.spill_loads <= ATTENTION_SPILL_BYTES,
                            "{gpu} {entry} spills more than a few values to local memory: {r:?}"
                        );
                    }
                }
            }
        }
    }
}

/// The column sums (`sum_to`: a bias's gradient, a broadcast's adjoint) keep their values
/// in registers on Hopper: the usual one reduced axis has a loop of its own, apart from the
/// general walk's divisions (`movement.cu`, `sum_reduced`). As one loop, every f32, bf16
/// and f16 entry spilled 24 / 44 bytes on sm_90. On Ampere only the split entries still
/// spill; their figures are printed.
#[test]
fn the_column_sums_keep_their_values_in_registers() {
    let Some(ptxas) = ptxas_or_skip() else { return };
    let source = SOURCES.iter().find(|s| s.name == "movement").expect("movement.cu");
    for (arch, gpu) in [("compute_80", "sm_80"), ("compute_90", "sm_90")] {
        let all = assembled(&ptxas, source, arch, gpu, None);
        for dtype in ["f32", "f64", "bf16", "f16"] {
            for kind in ["sum_to", "sum_to_split", "sum_to_chunks"] {
                let entry = format!("regflow_{kind}_{dtype}");
                let r = all.get(&entry).unwrap_or_else(|| panic!("{gpu}: no entry {entry}"));
                eprintln!(
                    "{gpu} {entry}: {} registers, {} / {} bytes spilled",
                    r.registers, r.spill_stores, r.spill_loads
                );
                let may_spill = gpu == "sm_80" && kind == "sum_to_split";
                assert!(
                    may_spill || r.spill_stores + r.spill_loads == 0,
                    "{gpu} {entry} spills to local memory: {r:?}"
                );
            }
        }
    }
}
