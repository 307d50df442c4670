//! Every CUDA kernel source compiles with NVRTC, so a typo fails CI on the CPU machine, not
//! the first GPU run. NVRTC ships as a Python package (`nvidia-cuda-nvrtc`); `.ci/test`
//! installs it and sets `REGFLOW_REQUIRE_NVRTC=1`, which turns a missing NVRTC into a
//! failure for a build with the `cuda` feature. Elsewhere the test skips with a message.

use regflow_cuda::sources::{entries_of, full_text, SOURCES};
use regflow_cuda::{nvrtc, CudaError};

/// The architectures compiled for: Turing (the oldest NVRTC 13 serves), Ampere, Hopper.
const ARCHES: &[&str] = &["compute_75", "compute_80", "compute_90"];

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

#[test]
fn every_source_compiles_for_every_architecture() {
    if !nvrtc_or_skip() {
        return;
    }
    for source in SOURCES {
        for arch in ARCHES {
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
