//! The step's scalar ops on CUDA against the CPU kernels (skip without a GPU; a dry run,
//! launches checked, with NVRTC alone).

mod common;

use regflow_plan::ops::{ClipFactor, LearningRate, LossScaleUpdate, NextStep, Schedule, UnscaleFactor};
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

/// Loss scaling's scalars: the step counter that stays on a skipped step, the unscaling
/// factor (NaN for a norm that overflowed; the norm's square root in its own dtype), and
/// the scale's back-off and growth, bit for bit as the CPU computes them.
#[test]
fn loss_scaling_scalars_match_the_cpu() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let gpu = (&device, &stream);
    let step_meta = TensorMeta::new([1], DType::F64);
    for factor_dtype in [DType::F32, DType::F64] {
        for factor in [0.125, 1.0 / 65536.0, f64::NAN, f64::INFINITY] {
            let (step, f) = (common::scalar(DType::F64, 41.0), common::scalar(factor_dtype, factor));
            let conf = common::conf(&NextStep, &[&step, &f], std::slice::from_ref(&step_meta));
            common::check(&format!("next step with factor {factor} ({factor_dtype})"), &conf, &[&step, &f], gpu, 0.0);
        }
    }
    for dtype in [DType::F32, DType::F64] {
        let meta = TensorMeta::new([1], dtype);
        for clip_norm in [None, Some(1.0)] {
            for squared_norm in [0.0, 2.5e9, 1e30, f64::INFINITY, f64::NAN] {
                for scale in [1.0, 1024.0, 65536.0] {
                    let (norm, s) = (common::scalar(dtype, squared_norm), common::scalar(DType::F32, scale));
                    let conf = common::conf(&UnscaleFactor { clip_norm }, &[&norm, &s], std::slice::from_ref(&meta));
                    let what =
                        format!("unscale factor of {squared_norm} at scale {scale}, clip {clip_norm:?} ({dtype})");
                    common::check(&what, &conf, &[&norm, &s], gpu, 0.0);
                }
            }
        }
    }
    let op = LossScaleUpdate { growth: 2.0, backoff: 0.5, interval: 3 };
    for (scale, good, factor) in [
        (65536.0, 0.0, f64::NAN),
        (1024.0, 1.0, 0.5),
        (1024.0, 2.0, 0.5),
        (3.0e38, 2.0, 0.5),
        (1.0, 7.0, f64::INFINITY),
    ] {
        let inputs =
            [common::scalar(DType::F32, scale), common::scalar(DType::F64, good), common::scalar(DType::F32, factor)];
        let outputs = [inputs[0].meta(), inputs[1].meta()];
        let refs: Vec<&_> = inputs.iter().collect();
        let conf = common::conf(&op, &refs, &outputs);
        common::check(
            &format!("loss scale update of {scale} after {good} good steps, factor {factor}"),
            &conf,
            &refs,
            gpu,
            0.0,
        );
    }
}
