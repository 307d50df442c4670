//! A dry run (no GPU, NVRTC only) checks each launch against the compiled kernel: a wrong
//! argument count or size, or a grid beyond CUDA's limits, is an error naming the entry.

use regflow_cuda::{args, enable_dry_run, launch, Device, Grid, StreamHandle};

#[test]
fn launches_that_do_not_fit_their_kernel_are_refused() {
    if let Ok(devices) = regflow_cuda::probe() {
        eprintln!("skipped: this machine has {} GPU(s); a dry run is for machines without", devices.len());
        return;
    }
    if let Err(e) = enable_dry_run("compute_80") {
        eprintln!("skipped (no NVRTC): {e}");
        return;
    }
    let device = Device::open(0).unwrap();
    assert!(device.is_dry());
    let fill = device.function("regflow_fill_f32").unwrap();
    let (out, n) = (0x1000u64, 7u64);
    let stream = StreamHandle(0);
    // SAFETY: a dry run reads no argument.
    unsafe {
        launch(stream, fill, Grid::linear(n), &mut args![out, 1.5f32, n]).unwrap();
        let e = launch(stream, fill, Grid::linear(n), &mut args![out, 1.5f64, n]).unwrap_err().to_string();
        assert!(e.contains("launch of regflow_fill_f32") && e.contains("[8, 4, 8]") && e.contains("[8, 8, 8]"), "{e}");
        let e = launch(stream, fill, Grid::linear(n), &mut args![out, 1.5f32]).unwrap_err().to_string();
        assert!(e.contains("takes 3 parameter(s)") && e.contains("passes 2"), "{e}");
        let too_wide = Grid { blocks: (1, 1, 1), threads: (2048, 1, 1), shared_bytes: 0 };
        let e = launch(stream, fill, too_wide, &mut args![out, 1.5f32, n]).unwrap_err().to_string();
        assert!(e.contains("beyond CUDA's limits"), "{e}");
    }
    let e = device.function("regflow_fill_f8").unwrap_err().to_string();
    assert!(e.contains("did you mean"), "{e}");
}
