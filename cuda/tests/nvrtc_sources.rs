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

/// The PTX of every source assembles with `ptxas` for the real GPUs of the oldest and the
/// newest architecture compiled for: NVRTC passes inline PTX (`asm`, the f16 conversions)
/// through unchecked, so a wrong instruction or constraint would otherwise first fail when
/// the driver loads the module on a GPU. `REGFLOW_PTXAS` names the assembler (`.ci/nvrtc.sh`
/// installs it from the `nvidia-cuda-nvcc` package); without it the test skips.
#[test]
fn every_source_assembles_for_the_real_architectures() {
    if !nvrtc_or_skip() {
        return;
    }
    let Some(ptxas) = std::env::var_os("REGFLOW_PTXAS") else {
        eprintln!("skipped: REGFLOW_PTXAS does not name a ptxas to assemble the PTX with");
        return;
    };
    let dir = std::env::temp_dir().join(format!("regflow-ptxas-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    for source in SOURCES {
        for (arch, gpu) in [("compute_75", "sm_75"), ("compute_90", "sm_90")] {
            let ptx = nvrtc::compile(source, arch).unwrap_or_else(|e| panic!("{e}"));
            let file = dir.join(format!("{}-{arch}.ptx", source.name));
            std::fs::write(&file, ptx).expect("the PTX written");
            let out = std::process::Command::new(&ptxas)
                .args(["--gpu-name", gpu, "-o"])
                .arg(dir.join("out.cubin"))
                .arg(&file)
                .output()
                .unwrap_or_else(|e| panic!("cannot run {}: {e}", ptxas.to_string_lossy()));
            assert!(
                out.status.success(),
                "{}.cu for {gpu}: ptxas failed:\n{}",
                source.name,
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
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
