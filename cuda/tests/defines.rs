//! `REGFLOW_CUDA_DEFINES` is read by the kernel compiler, and a value that is not a list of
//! macro definitions is an error naming it, not a panic or a setting silently dropped. A
//! test binary of its own: the variable is read once per process.

use regflow_cuda::sources::{DEFINES_VARIABLE, SOURCES};
use regflow_cuda::{nvrtc, CudaError};

#[test]
fn a_defines_value_that_is_not_a_list_of_definitions_is_refused_by_the_compiler() {
    if !regflow_cuda::BUILT {
        eprintln!("skipped: built without the `cuda` feature (NVRTC is reached through cudarc)");
        return;
    }
    // The only test of this binary sets the variable before anything reads it.
    std::env::set_var(DEFINES_VARIABLE, "ATT_PART=16 -DATT_OCCUPANCY=0");
    // Refused before NVRTC is asked, so this holds on a machine without it too.
    let e = nvrtc::compile(&SOURCES[0], "compute_80").unwrap_err();
    assert!(matches!(e, CudaError::Defines { .. }), "{e:?}");
    let said = e.to_string();
    assert!(said.starts_with("REGFLOW_CUDA_DEFINES is \"ATT_PART=16 -DATT_OCCUPANCY=0\", but definition 1"), "{said}");
    assert!(said.contains("NAME or NAME=VALUE"), "{said}");
    // Every later compile says the same.
    assert_eq!(nvrtc::compile(&SOURCES[1], "compute_90").unwrap_err(), e);
}
