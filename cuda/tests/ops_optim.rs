//! Optimizer updates (one `update`, and an `update_group` of many), the global norm's
//! `sum_squares_group` and the accumulation mean on CUDA against the CPU kernels, and a
//! group against its members' own CUDA updates (skip without a GPU).

mod common;

use regflow_plan::ops::{OpAttrs, OptimizerKind, SumSquaresGroup, Update, UpdateGroup, ACCUMULATE_MEAN};
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

/// The actor inputs and conf of an `update_group` of `kind` over members of `lens`
/// elements: the learning rate, step and (when `scale` is some) gradient scale first, each
/// read by every member (as the compiler fuses only updates sharing them), then each
/// member's param, grad and states.
fn update_group(
    kind: &OptimizerKind,
    dtype: DType,
    lens: &[usize],
    (lr, step): (&HostArray, &HostArray),
    scale: Option<&HostArray>,
) -> (Vec<HostArray>, OpConf) {
    let states = kind.state_count();
    let mut arrays: Vec<HostArray> = [lr, step].into_iter().chain(scale).cloned().collect();
    let (mut metas, mut input_map, mut outputs) = (Vec::new(), Vec::new(), Vec::new());
    for (m, &n) in lens.iter().enumerate() {
        let seed = 100 * m as u64;
        let first = arrays.len();
        arrays.push(random(n, dtype, seed + 1, (-1.0, 1.0)));
        arrays.push(random(n, dtype, seed + 2, (-1.0, 1.0)));
        arrays.push(random(n, dtype, seed + 3, (-0.1, 0.1)));
        if states == 2 {
            // Second moments are non-negative.
            arrays.push(random(n, dtype, seed + 4, (0.0, 0.01)));
        }
        // (param, grad, lr, step, states..., [scale]) of actor inputs.
        let mut member = vec![first, first + 1, 0, 1];
        member.extend((0..states).map(|k| first + 2 + k));
        member.extend(scale.map(|_| 2));
        metas.extend(member.iter().map(|&i| arrays[i].meta()));
        input_map.extend(member);
        outputs.extend(std::iter::repeat_n(TensorMeta::new([n], dtype), 1 + states));
    }
    let op = UpdateGroup { kind: kind.clone(), params: lens.len() as u32, scaled: scale.is_some() };
    (arrays, OpConf { op_type: op.op_type().to_string(), attrs: op.attrs(), inputs: metas, input_map, outputs })
}

/// Member `m`'s own `update` conf and actor inputs, from a group's.
fn member_update(kind: &OptimizerKind, group: &OpConf, arrays: &[HostArray], m: usize) -> (Vec<HostArray>, OpConf) {
    let params = group.outputs.len() / (1 + kind.state_count());
    let per = group.inputs.len() / params;
    let slots = &group.input_map[m * per..(m + 1) * per];
    let inputs: Vec<HostArray> = slots.iter().map(|&i| arrays[i].clone()).collect();
    let outputs = vec![inputs[0].meta(); 1 + kind.state_count()];
    let refs: Vec<&HostArray> = inputs.iter().collect();
    let conf = common::conf(&Update(kind.clone()), &refs, &outputs);
    (inputs, conf)
}

/// Member sizes around the group kernel's 4096-element chunks, repeated to 37 members: two
/// launches of up to 32.
const GROUP_LENS: [usize; 6] = [1, 7, 1023, 4096, 4097, 70_001];

fn group_lens(members: usize) -> Vec<usize> {
    GROUP_LENS.iter().copied().cycle().take(members).collect()
}

/// A fused `update_group` (one launch per 32 members) gives the CPU's `update_group`
/// results, and on a GPU each member's bits are those of its own CUDA `update`.
#[test]
fn update_groups_match_the_cpu_and_each_members_own_update_bit_for_bit() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let sgd = OptimizerKind::Sgd { momentum: 0.9, weight_decay: 1e-4 };
    let adamw = OptimizerKind::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
    for dtype in [DType::F32, DType::F64] {
        for kind in [&sgd, &adamw] {
            // Without a scale, f64 registers; with one, the other dtypes the CPU reads.
            for (lr_dtype, step_dtype, scale) in [(DType::F64, DType::F64, None), (DType::F32, DType::I64, Some(0.37))]
            {
                let (lr, step) = (common::scalar(lr_dtype, 3e-3), common::scalar(step_dtype, 7.0));
                let scale = scale.map(|s| common::scalar(lr_dtype, s));
                let lens = group_lens(37);
                let (arrays, conf) = update_group(kind, dtype, &lens, (&lr, &step), scale.as_ref());
                let refs: Vec<&HostArray> = arrays.iter().collect();
                let what =
                    format!("{kind:?} {dtype} group of {} lr {lr_dtype} step {step_dtype} scale {scale:?}", lens.len());
                let on_gpu = common::run(&conf, &refs, Some((&device, &stream)));
                let on_cpu = common::run(&conf, &refs, None);
                if device.is_dry() {
                    continue;
                }
                let rel = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
                common::assert_close(&what, &on_gpu, &on_cpu, rel);
                let outputs = 1 + kind.state_count();
                for (m, n) in lens.iter().enumerate() {
                    let (inputs, single) = member_update(kind, &conf, &arrays, m);
                    let refs: Vec<&HostArray> = inputs.iter().collect();
                    let alone = common::run(&single, &refs, Some((&device, &stream)));
                    for (k, (fused, alone)) in on_gpu[m * outputs..(m + 1) * outputs].iter().zip(&alone).enumerate() {
                        assert!(
                            fused.to_le_bytes() == alone.to_le_bytes(),
                            "{what}: member {m} [{n}] output {k} differs from its own update's"
                        );
                    }
                }
            }
        }
    }
}

/// A non-finite gradient scale skips the whole group: every member's parameter and states
/// come out as they went in, on both devices.
#[test]
fn a_non_finite_gradient_scale_skips_the_whole_group() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let sgd = OptimizerKind::Sgd { momentum: 0.9, weight_decay: 1e-4 };
    let adamw = OptimizerKind::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
    for dtype in [DType::F32, DType::F64] {
        for kind in [&sgd, &adamw] {
            for skip in [f64::NAN, f64::INFINITY] {
                let (lr, step) = (common::scalar(DType::F64, 1e-2), common::scalar(DType::F64, 3.0));
                let scale = common::scalar(DType::F32, skip);
                let lens = group_lens(37);
                let (arrays, conf) = update_group(kind, dtype, &lens, (&lr, &step), Some(&scale));
                let refs: Vec<&HostArray> = arrays.iter().collect();
                let what = format!("{kind:?} {dtype} group with gradient scale {skip}");
                let states = kind.state_count();
                let per = conf.inputs.len() / lens.len();
                for gpu in [Some((&device, &stream)), None] {
                    let kept = common::run(&conf, &refs, gpu);
                    if gpu.is_some() && device.is_dry() {
                        continue;
                    }
                    let on = if gpu.is_some() { "cuda" } else { "cpu" };
                    for m in 0..lens.len() {
                        let input = |k: usize| &arrays[conf.input_map[m * per + k]];
                        assert_eq!(kept[m * (1 + states)], *input(0), "{what} on {on}: member {m}'s parameter");
                        for k in 0..states {
                            assert_eq!(kept[m * (1 + states) + 1 + k], *input(4 + k), "{what} on {on}: state {k}");
                        }
                    }
                }
            }
        }
    }
}

/// A device's global-norm chain in one op (`sum_squares_group`): with and without a carried
/// total, over two launch pairs (70 tensors), tensors of one chunk, one more, and many;
/// a NaN anywhere makes the total NaN, on both devices.
#[test]
fn sum_squares_groups_match_the_cpu() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let sizes = [1, 7, 8192, 8193, 70_001, 768, 3];
    for dtype in [DType::F32, DType::F64] {
        for carried in [false, true] {
            for (members, nan) in [(1, false), (7, false), (70, false), (70, true)] {
                let mut inputs = Vec::new();
                if carried {
                    inputs.push(common::scalar(dtype, 2.5));
                }
                for m in 0..members {
                    let mut x = random(sizes[m % sizes.len()], dtype, 40 + m as u64, (-1.0, 1.0));
                    if nan && m == 37 {
                        let mut values = x.to_f64_vec();
                        values[0] = f64::NAN;
                        x = HostArray::from_f64([values.len()], dtype, &values).expect("an array");
                    }
                    inputs.push(x);
                }
                let refs: Vec<&HostArray> = inputs.iter().collect();
                let conf = common::conf(&SumSquaresGroup { carried }, &refs, &[TensorMeta::new([1], dtype)]);
                let what = format!("sum_squares_group {dtype}, {members} tensors, carried {carried}, NaN {nan}");
                // Sums of up to 70 · 70,001 squares in a different order than the CPU's.
                let rel = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
                common::check(&what, &conf, &refs, (&device, &stream), rel);
                let on_cpu = common::run(&conf, &refs, None);
                assert_eq!(on_cpu[0].to_f64_vec()[0].is_nan(), nan, "{what}");
            }
        }
    }
}
