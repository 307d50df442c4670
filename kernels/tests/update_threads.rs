//! Optimizer updates of large parameters run in contiguous shares over the device's
//! threads; each element's update reads only its own entries, so the thread count never
//! changes a bit of the result; a gradient scale is the update of the scaled gradient.

use regflow_kernels::cpu::optim::PARALLEL_MIN_ELEMENTS;
use regflow_kernels::{HostCompute, HostContext};
use regflow_plan::ops::{OptimizerKind, Update};
use regflow_plan::{DType, HostArray, SplitMix64, TensorMeta};

fn random(len: usize, seed: u64) -> HostArray {
    let mut rng = SplitMix64::new(seed);
    HostArray::f32([len], (0..len).map(|_| rng.next_normal() as f32).collect()).unwrap()
}

/// Every output of one update of `kind` (with `states` state tensors) on `threads` threads.
fn update(kind: OptimizerKind, states: usize, threads: usize, len: usize) -> Vec<Vec<f64>> {
    let scalar = |v: f32| HostArray::f32([1], vec![v]).unwrap();
    let mut inputs = vec![random(len, 1), random(len, 2), scalar(1e-2), scalar(3.0)];
    inputs.extend((0..states).map(|s| random(len, 3 + s as u64)));
    // Second moments are non-negative.
    if states == 2 {
        inputs[5] = HostArray::f32([len], inputs[5].to_f64_vec().iter().map(|v| (v * v) as f32).collect()).unwrap();
    }
    let mut outputs: Vec<HostArray> =
        (0..=states).map(|_| HostArray::zeros(&TensorMeta::new([len], DType::F32))).collect();
    let views: Vec<_> = inputs.iter().map(HostArray::view).collect();
    let mut outs: Vec<_> = outputs.iter_mut().map(HostArray::view_mut).collect();
    Update(kind).compute(&HostContext { threads }, &views, &mut outs).unwrap();
    drop(outs);
    outputs.iter().map(HostArray::to_f64_vec).collect()
}

#[test]
fn updates_do_not_depend_on_the_thread_count() {
    let len = PARALLEL_MIN_ELEMENTS + 1_001;
    let adamw = OptimizerKind::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
    let sgd = OptimizerKind::Sgd { momentum: 0.9, weight_decay: 1e-4 };
    for (kind, states) in [(adamw, 2), (sgd, 1)] {
        let one = update(kind.clone(), states, 1, len);
        for threads in [2, 3] {
            assert_eq!(one, update(kind.clone(), states, threads, len), "{kind:?} on {threads} threads");
        }
        assert!(one.iter().all(|out| out.iter().any(|&v| v != 0.0)));
    }
}

/// A gradient scale (the clip factor, the update's optional last input) gives the bits of
/// the update of the gradient multiplied by it first, as a separate `g · factor` did.
#[test]
fn a_gradient_scale_is_the_update_of_the_scaled_gradient() {
    let adamw = OptimizerKind::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
    let sgd = OptimizerKind::Sgd { momentum: 0.9, weight_decay: 1e-4 };
    let len = 1_001;
    let factor = 0.371_f32;
    for (kind, states) in [(adamw, 2), (sgd, 1)] {
        let run = |inputs: &[HostArray]| {
            let mut outputs: Vec<HostArray> =
                (0..=states).map(|_| HostArray::zeros(&TensorMeta::new([len], DType::F32))).collect();
            let views: Vec<_> = inputs.iter().map(HostArray::view).collect();
            let mut outs: Vec<_> = outputs.iter_mut().map(HostArray::view_mut).collect();
            Update(kind.clone()).compute(&HostContext { threads: 1 }, &views, &mut outs).unwrap();
            drop(outs);
            outputs.iter().map(HostArray::to_f64_vec).collect::<Vec<_>>()
        };
        let scalar = |v: f32| HostArray::f32([1], vec![v]).unwrap();
        let grad = random(len, 2);
        let scaled = HostArray::f32([len], grad.to_f64_vec().iter().map(|&g| g as f32 * factor).collect()).unwrap();
        let mut plain = vec![random(len, 1), scaled, scalar(1e-2), scalar(3.0)];
        plain.extend((0..states).map(|s| HostArray::f32([len], vec![0.01 * (s + 1) as f32; len]).unwrap()));
        let mut with_scale = plain.clone();
        with_scale[1] = grad;
        with_scale.push(scalar(factor));
        assert_eq!(run(&with_scale), run(&plain), "{kind:?}");
        // One input more than the optional scale is refused.
        with_scale.push(scalar(1.0));
        let views: Vec<_> = with_scale.iter().map(HostArray::view).collect();
        let mut outputs: Vec<HostArray> =
            (0..=states).map(|_| HostArray::zeros(&TensorMeta::new([len], DType::F32))).collect();
        let mut outs: Vec<_> = outputs.iter_mut().map(HostArray::view_mut).collect();
        let err = Update(kind.clone()).compute(&HostContext { threads: 1 }, &views, &mut outs).unwrap_err();
        assert!(err.contains("optional gradient scale"), "{err}");
    }
}
