//! NVRTC over cudarc: kernel sources to PTX at run time, once per (source, architecture)
//! per process, and kept on disk for the next process ([`crate::ptx_cache`]).

use crate::sources::{self, KernelSource};
use crate::{ptx_cache, CudaError};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

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
/// each (source, architecture) is compiled once per process, and kept on disk
/// ([`crate::ptx_cache`]), so once per machine while the source, the options
/// and NVRTC stay the same.
///
/// Threads asking for the same (source, architecture) at once share one compile: the
/// later ones wait for the first (NVRTC takes seconds per source, up to half a minute for
/// the attention kernels). A failed compile is not kept; the next call tries again.
pub fn compile(source: &KernelSource, arch: &str) -> Result<String, CudaError> {
    type Slot = Arc<Mutex<Option<String>>>;
    static CACHE: OnceLock<Mutex<HashMap<(&'static str, String), Slot>>> = OnceLock::new();
    let slot = {
        let mut cache = CACHE.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
        cache.entry((source.name, arch.to_string())).or_default().clone()
    };
    // Held across the compile: one per key, so only the same (source, architecture) waits.
    let mut ptx = slot.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(ptx) = ptx.as_ref() {
        return Ok(ptx.clone());
    }
    let compiled = compile_through(source, arch, ptx_cache::folder().as_deref(), defines()?)?;
    *ptx = Some(compiled.clone());
    Ok(compiled)
}

/// [`compile`] with the macro definitions `defines` (a value of
/// [`DEFINES_VARIABLE`](sources::DEFINES_VARIABLE)) instead of the environment's, and
/// neither the process's cache nor the disk's: a kernel variant compiled to be looked at
/// (`cuda/tests/nvrtc_sources.rs` assembles both attention variants).
pub fn compile_variant(source: &KernelSource, arch: &str, defines: &str) -> Result<String, CudaError> {
    compile_through(source, arch, None, &sources::define_options(defines)?)
}

/// The NVRTC options of [`DEFINES_VARIABLE`](sources::DEFINES_VARIABLE), read once per
/// process (an unset variable defines nothing).
fn defines() -> Result<&'static [String], CudaError> {
    static DEFINES: OnceLock<Result<Vec<String>, CudaError>> = OnceLock::new();
    let read = || match std::env::var(sources::DEFINES_VARIABLE) {
        Ok(value) => sources::define_options(&value),
        Err(std::env::VarError::NotPresent) => Ok(Vec::new()),
        Err(std::env::VarError::NotUnicode(value)) => {
            Err(CudaError::Defines { value: value.to_string_lossy().into_owned(), why: "it is not Unicode".into() })
        }
    };
    DEFINES.get_or_init(read).as_deref().map_err(Clone::clone)
}

/// The options every source is compiled with, beside the architecture and the name.
/// f32 results must match the CPU kernels to 1e-5: no fast math, no flush to zero.
const OPTIONS: [&str; 2] = ["--std=c++17", "-default-device"];
const FTZ: bool = false;
const PRECISE_DIVISION: bool = true;
const PRECISE_SQRT: bool = true;

/// [`compile`] without the process's cache, with the NVRTC options `defines` (macro
/// definitions): the PTX kept in `disk` for exactly this compile, else NVRTC's (then kept
/// there).
pub(crate) fn compile_through(
    source: &KernelSource,
    arch: &str,
    disk: Option<&Path>,
    defines: &[String],
) -> Result<String, CudaError> {
    available()?;
    let fail = |log: String| CudaError::Compile { source_name: source.name, arch: arch.to_string(), log };
    let static_arch = static_arch(arch).ok_or_else(|| {
        fail(format!("regflow knows no NVRTC architecture '{arch}' (it knows compute_75 to compute_121)"))
    })?;
    let key = disk.map(|_| key_of(source, arch, defines));
    if let (Some(disk), Some(key)) = (disk, &key) {
        if let Some(ptx) = ptx_cache::load(disk, key) {
            return Ok(ptx);
        }
    }
    let options = CompileOptions {
        arch: Some(static_arch),
        ftz: Some(FTZ),
        prec_div: Some(PRECISE_DIVISION),
        prec_sqrt: Some(PRECISE_SQRT),
        options: OPTIONS.iter().map(|o| o.to_string()).chain(defines.iter().cloned()).collect(),
        name: Some(format!("{}.cu", source.name)),
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(sources::full_text(source), options).map_err(|e| match e {
        CompileError::CompileError { log, .. } => fail(log.to_string_lossy().into_owned()),
        other => fail(format!("{other:?}")),
    })?;
    let ptx = ptx.to_src();
    if let (Some(disk), Some(key)) = (disk, &key) {
        // A cache that cannot be written only costs the next process the compile; said
        // once per process, so a wrong folder does not go unnoticed.
        static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if !ptx_cache::store(disk, key, &ptx) && !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(
                "the kernel cache folder {} cannot be written ({} names another, or off): NVRTC compiles the \
                 kernels in every process",
                disk.display(),
                ptx_cache::CACHE_VARIABLE
            );
        }
    }
    Ok(ptx)
}

/// Everything the PTX of `source` for `arch` depends on: the text, the architecture, the
/// options and NVRTC's version.
fn key_of(source: &KernelSource, arch: &str, defines: &[String]) -> ptx_cache::CompileKey {
    ptx_cache::CompileKey {
        name: source.name.to_string(),
        arch: arch.to_string(),
        compiler: format!(
            "nvrtc {}; {}; ftz {FTZ}, prec-div {PRECISE_DIVISION}, prec-sqrt {PRECISE_SQRT}{}",
            version().unwrap_or_else(|| "of unknown version".into()),
            OPTIONS.join(" "),
            defines.iter().map(|d| format!(" {d}")).collect::<String>()
        ),
        text: sources::full_text(source),
    }
}

/// NVRTC's version (`13.0`), where it answers; part of every disk cache key, so another
/// NVRTC compiles afresh.
fn version() -> Option<String> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC was found (`available`); the call writes two ints.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    (status == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS).then(|| format!("{major}.{minor}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The disk cache serves exactly the compile it kept: NVRTC's PTX is stored, an entry
    /// for this very compile is returned without NVRTC, another architecture misses.
    #[test]
    fn the_disk_cache_serves_exactly_the_compile_it_kept() {
        if let Err(e) = available() {
            assert!(
                std::env::var_os("REGFLOW_REQUIRE_NVRTC").is_none_or(|v| v != "1"),
                "REGFLOW_REQUIRE_NVRTC=1 but NVRTC is not usable: {e}"
            );
            eprintln!("skipped: {e}");
            return;
        }
        let folder = std::env::temp_dir().join(format!("regflow-nvrtc-cache-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&folder);
        let source = &sources::SOURCES[0];
        let compiled = compile_through(source, "compute_80", Some(&folder), &[]).unwrap();
        assert!(compiled.contains(".target sm_80"), "NVRTC's PTX");
        let key = key_of(source, "compute_80", &[]);
        assert_eq!(ptx_cache::load(&folder, &key).as_deref(), Some(compiled.as_str()), "kept on disk");
        // An entry for exactly this compile is what the next process gets.
        assert!(ptx_cache::store(&folder, &key, "// planted\n"));
        assert_eq!(compile_through(source, "compute_80", Some(&folder), &[]).unwrap(), "// planted\n");
        // Another architecture, or other macro definitions, is another compile; without a
        // folder NVRTC compiles.
        assert!(compile_through(source, "compute_90", Some(&folder), &[]).unwrap().contains(".target sm_90"));
        let defined = ["-DREGFLOW_UNUSED_MACRO=1".to_string()];
        assert_ne!(compile_through(source, "compute_80", Some(&folder), &defined).unwrap(), "// planted\n");
        assert_eq!(compile_through(source, "compute_80", None, &[]).unwrap(), compiled);
        std::fs::remove_dir_all(&folder).unwrap();
    }
}
