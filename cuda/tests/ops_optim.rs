//! Optimizer updates and the accumulation mean on CUDA against the CPU kernels (skip
//! without a GPU).

mod common;

use regflow_plan::ops::{OpAttrs, OptimizerKind, Update, ACCUMULATE_MEAN};
use regflow_plan::{DType, HostArray, OpConf, SplitMix64, TensorMeta};

fn random(len: usize, dtype: DType, seed: u64, (lo, hi): (f64, f64)) -> HostArray {
    let mut rng = SplitMix64::new(seed);
    let values: Vec<f64> = (0..len).map(|_| lo + (hi - lo) * rng.next_f64()).collect();
    match dtype {
        DType::F32 => HostArray::f32([len], values.iter().map(|&v| v as f32).collect()),
        _ => HostArray::f64([len], values),
    }
    .expect("an array")
}

#[test]
fn sgd_and_adamw_updates_match_the_cpu() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let sgd = OptimizerKind::Sgd { momentum: 0.9, weight_decay: 1e-4 };
    let adamw = OptimizerKind::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
    for dtype in [DType::F32, DType::F64] {
        // Scalars of every dtype the CPU reads: the step counter is f64 in plans, but an
        // i64 or f32 register is read the same way.
        for (lr_dtype, step_dtype) in [(DType::F64, DType::F64), (DType::F32, DType::I64)] {
            for (kind, states) in [(sgd.clone(), 1), (adamw.clone(), 2)] {
                for (n, scale) in [(1, false), (7, true), (1023, false), (70_001, true)] {
                    let mut inputs = vec![
                        random(n, dtype, 1, (-1.0, 1.0)),
                        random(n, dtype, 2, (-1.0, 1.0)),
                        common::scalar(lr_dtype, 3e-3),
                        common::scalar(step_dtype, 7.0),
                    ];
                    inputs.push(random(n, dtype, 3, (-0.1, 0.1)));
                    if states == 2 {
                        // Second moments are non-negative.
                        inputs.push(random(n, dtype, 4, (0.0, 0.01)));
                    }
                    if scale {
                        // Gradient clipping's factor, read on the device.
                        inputs.push(common::scalar(lr_dtype, 0.37));
                    }
                    let refs: Vec<&HostArray> = inputs.iter().collect();
                    let outputs = vec![TensorMeta::new([n], dtype); 1 + states];
                    let op = Update(kind.clone());
                    let conf = common::conf(&op as &dyn OpAttrs, &refs, &outputs);
                    let rel = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
                    let what = format!("{kind:?} {dtype} [{n}] lr {lr_dtype} step {step_dtype} scale {scale}");
                    common::check(&what, &conf, &refs, (&device, &stream), rel);
                }
            }
        }
    }
}

#[test]
fn a_group_of_one_piece_is_its_own_mean() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    // The harness runs one firing at group position 0 of 1: the copy and the scaling by
    // 1/1. Longer groups (the add path) run through the runtime's acc actors.
    for dtype in [DType::F32, DType::F64] {
        for n in [1, 7, 1023, 70_001] {
            let x = random(n, dtype, 5, (-2.0, 2.0));
            let meta = x.meta();
            let conf = OpConf {
                op_type: ACCUMULATE_MEAN.into(),
                attrs: Default::default(),
                inputs: vec![meta.clone()],
                input_map: vec![0],
                outputs: vec![meta],
            };
            common::check(&format!("accumulate_mean {dtype} [{n}]"), &conf, &[&x], (&device, &stream), 0.0);
        }
    }
}

/// A non-finite gradient scale (an overflowed step under loss scaling) skips the update:
/// the parameter and its state come out as they went in, on both devices.
#[test]
fn a_non_finite_gradient_scale_skips_the_update() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let sgd = OptimizerKind::Sgd { momentum: 0.9, weight_decay: 1e-4 };
    let adamw = OptimizerKind::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
    for dtype in [DType::F32, DType::F64] {
        for (kind, states) in [(sgd.clone(), 1), (adamw.clone(), 2)] {
            for skip in [f64::NAN, f64::INFINITY] {
                let n = 1023;
                let mut inputs = vec![
                    random(n, dtype, 1, (-1.0, 1.0)),
                    random(n, dtype, 2, (-1.0, 1.0)),
                    common::scalar(DType::F64, 1e-2),
                    common::scalar(DType::F64, 3.0),
                ];
                inputs.extend((0..states).map(|k| random(n, dtype, 10 + k as u64, (0.0, 1.0))));
                inputs.push(common::scalar(DType::F32, skip));
                let refs: Vec<&HostArray> = inputs.iter().collect();
                let outputs = vec![TensorMeta::new([n], dtype); 1 + states];
                let conf = common::conf(&Update(kind.clone()), &refs, &outputs);
                let what = format!("{kind:?} {dtype} with gradient scale {skip}");
                common::check(&what, &conf, &refs, (&device, &stream), 0.0);
                // And on the CPU, against the inputs themselves.
                let kept = common::run(&conf, &refs, None);
                assert_eq!(kept[0], inputs[0], "{what}: the parameter");
                for k in 0..states {
                    assert_eq!(kept[1 + k], inputs[4 + k], "{what}: state {k}");
                }
            }
        }
    }
}
