//! The step's scalar ops on CUDA against the CPU kernels (skip without a GPU).

mod common;

use regflow_plan::ops::{ClipFactor, LearningRate, NextStep, Schedule};
use regflow_plan::{DType, TensorMeta};

#[test]
fn schedules_clip_factors_and_steps_match_the_cpu() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let gpu = (&device, &stream);
    let schedules = [
        Schedule::Constant(3e-4),
        Schedule::WarmupCosine { peak: 1e-3, warmup: 10, total: 100, min: 1e-5 },
        Schedule::WarmupCosine { peak: 1e-3, warmup: 0, total: 0, min: 1e-5 },
    ];
    for out in [DType::F32, DType::F64] {
        let meta = TensorMeta::new([1], out);
        for step_dtype in [DType::F32, DType::F64, DType::I64] {
            for step in [0.0, 1.0, 5.0, 10.0, 11.0, 55.0, 100.0, 250.0] {
                let x = common::scalar(step_dtype, step);
                for schedule in &schedules {
                    let op = LearningRate(schedule.clone());
                    let conf = common::conf(&op, &[&x], std::slice::from_ref(&meta));
                    common::check(&format!("{schedule:?} at {step}"), &conf, &[&x], gpu, 1e-12);
                }
                let conf = common::conf(&NextStep, &[&x], std::slice::from_ref(&meta));
                common::check(&format!("next step after {step}"), &conf, &[&x], gpu, 0.0);
            }
        }
        for norm in [0.0, 0.5, 1.0, 3.0, f64::NAN] {
            let x = common::scalar(out, norm);
            let conf = common::conf(&ClipFactor(1.0), &[&x], std::slice::from_ref(&meta));
            common::check(&format!("clip factor of {norm}"), &conf, &[&x], gpu, 1e-15);
        }
    }
}
