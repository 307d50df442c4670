//! `regflow env`: what this machine and build give regflow, for bug reports and setup checks
//! (as PyTorch's `collect_env`): the CPU and the products' backend and instruction set,
//! whether host arenas get huge pages, the CUDA backend, its devices and NVRTC, and the
//! kernel cache.

use regflow::cuda::ptx_cache;
use regflow::kernels::cpu::{gemm_backend, isa, matmul};
use std::path::Path;

/// The report's lines, and the settings that were refused (each a sentence naming its
/// variable): the report is printed whole either way, and the command fails after it when
/// a setting makes no sense.
pub(crate) struct Report {
    /// One line per item, `name: value`.
    pub lines: Vec<String>,
    /// Environment variables whose values regflow refuses.
    pub refused: Vec<String>,
}

/// Notes a setting regflow refused (`e` names it) and what the report shows in its place.
fn refused_setting(e: &str, refused: &mut Vec<String>) -> String {
    refused.push(e.to_string());
    format!("refused ({e})")
}

/// The `blas` backend sends each product where it ran fastest, which at some instruction
/// sets is nowhere (`matmul::prefers_blas`): a line that says so, rather than let "backend
/// blas" mislead.
fn products_note(backend: gemm_backend::GemmBackend, level: isa::Isa) -> Option<String> {
    let side = matmul::BLAS_MIN_SIDE;
    (backend == gemm_backend::GemmBackend::Blas && !matmul::prefers_blas(side, side, side, level))
        .then(|| format!("cpu products: at {} gemm computes every product (faster there than OpenBLAS)", level.name()))
}

/// Collects the report (probes the CUDA driver and NVRTC where the build has them).
pub(crate) fn report() -> Report {
    let mut refused = Vec::new();
    let mut lines = vec![format!("regflow: {}", env!("CARGO_PKG_VERSION"))];
    lines.push(format!("cpu: {}, {} logical cpus", cpu_model(), logical_cpus()));
    let (backend, level) = (gemm_backend::backend_in_use(), isa::isa_in_use());
    let backend_name = match &backend {
        Ok(backend) => backend.name().to_string(),
        Err(e) => refused_setting(e, &mut refused),
    };
    let isa_name = match &level {
        Ok(level) => level.name().to_string(),
        Err(e) => refused_setting(e, &mut refused),
    };
    let openblas = match gemm_backend::openblas_library() {
        Ok(name) => format!("found ({name})"),
        Err(e) => format!("not found ({e})"),
    };
    lines.push(format!("cpu products: backend {backend_name}, instruction set {isa_name}; OpenBLAS {openblas}"));
    if let (Ok(backend), Ok(level)) = (backend, level) {
        lines.extend(products_note(backend, level));
    }
    lines.push(host_memory_line(regflow::memory::huge_page_mode().as_deref()));
    lines.push(format!(
        "cuda backend: {} (feature `cuda`)",
        if regflow::cuda::BUILT { "in this build" } else { "not in this build" }
    ));
    let cache = format!("kernel cache: {}", cache_line(ptx_cache::folder().as_deref()));
    if !regflow::cuda::BUILT {
        lines.push(cache);
        return Report { lines, refused };
    }
    match regflow::cuda::probe() {
        Ok(devices) => {
            for d in devices {
                lines.push(format!(
                    "cuda:{}: {}, {:.1} GiB, {}",
                    d.ordinal,
                    d.name,
                    d.total_bytes as f64 / f64::from(1u32 << 30),
                    d.arch()
                ));
            }
        }
        Err(e) => lines.push(format!("cuda devices: none ({e})")),
    }
    lines.push(match regflow::cuda::nvrtc::available() {
        Ok(()) => "nvrtc: found".to_string(),
        Err(e) => format!("nvrtc: not found ({e})"),
    });
    lines.push(cache);
    Report { lines, refused }
}

/// What becomes of the huge-page advice for host arenas under the kernel's transparent
/// huge page mode `mode` (`None`: the kernel has none).
fn host_memory_line(mode: Option<&str>) -> String {
    let min = regflow::memory::HUGE_PAGE_MIN_BYTES >> 20;
    match mode {
        Some("never") => format!("host arenas: {min} MiB or more advised to huge pages; the kernel's mode is never, so they stay on small pages"),
        Some(mode) => format!("host arenas: {min} MiB or more on huge pages (the kernel's transparent huge pages: {mode})"),
        None => "host arenas: small pages (this kernel has no transparent huge pages)".to_string(),
    }
}

/// `path (N entries, B bytes)`, `path (empty)`, or `off`.
fn cache_line(folder: Option<&Path>) -> String {
    let Some(folder) = folder else {
        return format!("off ({} is off, or neither XDG_CACHE_HOME nor HOME is set)", ptx_cache::CACHE_VARIABLE);
    };
    let entries: Vec<u64> = std::fs::read_dir(folder)
        .map(|dir| {
            dir.flatten()
                .filter(|e| e.file_name().to_string_lossy().ends_with(".ptx"))
                .filter_map(|e| e.metadata().ok().map(|m| m.len()))
                .collect()
        })
        .unwrap_or_default();
    if entries.is_empty() {
        format!("{} (empty)", folder.display())
    } else {
        let count = if entries.len() == 1 { "1 entry".to_string() } else { format!("{} entries", entries.len()) };
        format!("{} ({count}, {} bytes)", folder.display(), entries.iter().sum::<u64>())
    }
}

/// The processor's model name (Linux's `/proc/cpuinfo`), or `unknown processor`.
fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, name)| name.trim().to_string())
        })
        .unwrap_or_else(|| "unknown processor".into())
}

fn logical_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

#[cfg(test)]
mod tests {
    use super::products_note;
    use regflow::kernels::cpu::gemm_backend::GemmBackend;
    use regflow::kernels::cpu::isa::Isa;

    /// Whatever this build and machine are: the note appears for the `blas` backend at
    /// AVX-512 only.
    #[test]
    fn the_products_note_names_avx512_for_the_blas_backend_only() {
        let note = products_note(GemmBackend::Blas, Isa::Avx512);
        assert_eq!(
            note.as_deref(),
            Some("cpu products: at avx512 gemm computes every product (faster there than OpenBLAS)")
        );
        assert_eq!(products_note(GemmBackend::Blas, Isa::Avx2), None);
        assert_eq!(products_note(GemmBackend::Gemm, Isa::Avx512), None);
    }

    /// The host arenas' line says whether the huge-page advice takes, by the kernel's mode.
    #[test]
    fn the_host_arenas_line_follows_the_kernels_huge_page_mode() {
        use super::host_memory_line;
        assert_eq!(
            host_memory_line(Some("madvise")),
            "host arenas: 4 MiB or more on huge pages (the kernel's transparent huge pages: madvise)"
        );
        assert!(host_memory_line(Some("never")).contains("stay on small pages"));
        assert_eq!(host_memory_line(None), "host arenas: small pages (this kernel has no transparent huge pages)");
    }
}
