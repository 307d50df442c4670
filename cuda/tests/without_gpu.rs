//! Without a GPU (or without the `cuda` feature) the backend answers with errors that say
//! what is missing; nothing panics.

use regflow_cuda::{probe, CudaError, Device};

#[test]
fn no_gpu_is_an_error_naming_what_is_missing() {
    match probe() {
        Ok(devices) => {
            eprintln!("skipped: this machine has {} CUDA device(s)", devices.len());
        }
        Err(e) => {
            let text = e.to_string();
            match &e {
                CudaError::NotBuilt => {
                    if regflow_cuda::BUILT {
                        panic!("NotBuilt from a build with the backend: {text}");
                    }
                    assert!(text.contains("--features cuda"), "{text}");
                }
                CudaError::MissingLibrary { library, .. } => {
                    assert!(library.contains("libcuda"), "{text}");
                    assert!(text.contains("libcuda.so") && text.contains("LD_LIBRARY_PATH"), "{text}");
                }
                CudaError::NoDevice { count: 0, .. } | CudaError::Call { .. } => {}
                other => panic!("unexpected probe error: {other:?}"),
            }
            // Opening a device says the same, and so does every later call.
            let again = Device::open(0).unwrap_err();
            assert_eq!(again.to_string(), text);
        }
    }
}
