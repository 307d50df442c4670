//! NVRTC over cudarc: kernel sources to PTX at run time, once per (source, architecture)
//! per process.

use crate::sources::{self, KernelSource};
use crate::CudaError;
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// Whether NVRTC (`libnvrtc`) can be loaded; cudarc panics on its first call otherwise.
pub fn available() -> Result<(), CudaError> {
    // SAFETY: only tries to open the library by its candidate names.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Ok(());
    }
    Err(CudaError::MissingLibrary {
        library: "libnvrtc (NVRTC, the CUDA runtime compiler)",
        searched: crate::distinct(cudarc::get_lib_name_candidates("nvrtc")).join(", "),
        hint: "install the CUDA toolkit or `pip install nvidia-cuda-nvrtc`, and add the folder holding \
               libnvrtc.so.13 to LD_LIBRARY_PATH",
    })
}

/// Architectures NVRTC accepts as `--gpu-architecture`, by name.
fn static_arch(arch: &str) -> Option<&'static str> {
    const KNOWN: &[&str] = &[
        "compute_75",
        "compute_80",
        "compute_86",
        "compute_87",
        "compute_89",
        "compute_90",
        "compute_100",
        "compute_103",
        "compute_110",
        "compute_120",
        "compute_121",
    ];
    KNOWN.iter().copied().find(|&known| known == arch)
}

/// Compiles every kernel source for `arch` at once, a thread each, into the cache that
/// [`compile`] reads: NVRTC takes about a second per source, and a job's first kernels would
/// otherwise wait for them one after another. A source that fails is left for [`compile`]
/// to report when it is asked for.
pub fn compile_all(arch: &str) {
    std::thread::scope(|scope| {
        for source in sources::SOURCES {
            scope.spawn(move || {
                let _ = compile(source, arch);
            });
        }
    });
}

/// Compiles `source` (after the shared prelude) to PTX for the virtual architecture
/// `arch` (`compute_90`); the driver JIT-compiles the PTX for the exact device. Cached, so
/// each (source, architecture) is compiled once per process.
pub fn compile(source: &KernelSource, arch: &str) -> Result<String, CudaError> {
    static CACHE: OnceLock<Mutex<HashMap<(&'static str, String), String>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let key = (source.name, arch.to_string());
    if let Some(ptx) = cache.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
        return Ok(ptx.clone());
    }
    available()?;
    let fail = |log: String| CudaError::Compile { source_name: source.name, arch: arch.to_string(), log };
    let static_arch = static_arch(arch).ok_or_else(|| {
        fail(format!("regflow knows no NVRTC architecture '{arch}' (it knows compute_75 to compute_121)"))
    })?;
    let options = CompileOptions {
        arch: Some(static_arch),
        // f32 results must match the CPU kernels to 1e-5: no fast-math, no flush to zero.
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        options: vec!["--std=c++17".into(), "-default-device".into()],
        name: Some(format!("{}.cu", source.name)),
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(sources::full_text(source), options).map_err(|e| match e {
        CompileError::CompileError { log, .. } => fail(log.to_string_lossy().into_owned()),
        other => fail(format!("{other:?}")),
    })?;
    let ptx = ptx.to_src();
    cache.lock().unwrap_or_else(|p| p.into_inner()).insert(key, ptx.clone());
    Ok(ptx)
}
