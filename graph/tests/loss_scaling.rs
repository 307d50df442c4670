//! Loss scaling in the graph, on the reference evaluator: the sequence of scales, skipped
//! steps and updates PyTorch's `GradScaler` gives, worked out by hand for a product whose
//! f16 gradient overflows at known scales; f16 mixed precision turning it on by itself;
//! and options that cannot work refused by name.

use regflow_graph::{DType, Graph, HostArray, Init, LossScale, Optimizer, Precision, Session};

/// `loss = sum(x · w)` in f16 products with `x = [4, 4, 4, 4]`: the weight gradient is
/// `4 · scale` per element in f16, which overflows (past 65504) for scales of 16384 and
/// more, so the scale settles where `4 · scale` fits and grows back every `interval` steps.
#[test]
fn an_overflowing_step_is_skipped_and_the_scale_backs_off_then_grows() {
    let g = Graph::new();
    g.mixed_precision(Precision::F16).unwrap();
    let x = g.input("x", [1, 4], DType::F32).unwrap();
    let w = g.variable("w", [4, 1], DType::F32, Init::Zeros).unwrap();
    let loss = x.matmul(&w).unwrap().sum_all().unwrap();
    let optimizer = Optimizer::sgd(0.5, 0.0, 0.0).with_loss_scale(LossScale::dynamic().with_interval(2));
    let train = g.minimize(loss, &optimizer).unwrap();
    let (scale, factor) = (train.loss_scale.unwrap(), train.grad_factor.unwrap());
    let step = train.updates[0].0;
    let mut s = Session::new(&g);
    let feed = [(x, HostArray::f32([1, 4], vec![4.0; 4]).unwrap())];
    // (scale used, skipped, w after, step counter after), as GradScaler with
    // growth_interval=2 would have them.
    let expected = [
        (65536.0, true, 0.0, 0.0), // the loss's gradient itself overflows f16
        (32768.0, true, 0.0, 0.0), // 4 · 32768 = 131072
        (16384.0, true, 0.0, 0.0), // 4 · 16384 = 65536 rounds past 65504
        (8192.0, false, -2.0, 1.0),
        (8192.0, false, -4.0, 2.0), // the second good step: the scale doubles after it
        (16384.0, true, -4.0, 2.0),
        (8192.0, false, -6.0, 3.0),
        (8192.0, false, -8.0, 4.0),
        (16384.0, true, -8.0, 4.0),
    ];
    for (k, &(want_scale, skipped, want_w, want_step)) in expected.iter().enumerate() {
        let before = s.run(&feed, &[scale, factor]).unwrap();
        let (used, f) = (before[0].to_f64_vec()[0], before[1].to_f64_vec()[0]);
        s.step(&train, &feed).unwrap();
        assert_eq!(used, want_scale, "step {k}: scale");
        assert_eq!(f.is_nan(), skipped, "step {k}: gradient factor {f}");
        if !skipped {
            assert_eq!(f, 1.0 / want_scale, "step {k}: the factor unscales exactly");
        }
        assert_eq!(s.value(w).unwrap().to_f64_vec(), vec![want_w; 4], "step {k}: w");
        assert_eq!(s.value(step).unwrap().to_f64_vec(), vec![want_step], "step {k}: step counter");
    }
}

/// A skipped AdamW step leaves the moments as they were too, and the counter that drives
/// bias correction does not advance: the first good step is AdamW's first step.
#[test]
fn a_skipped_adamw_step_leaves_parameters_moments_and_counter() {
    let g = Graph::new();
    g.mixed_precision(Precision::F16).unwrap();
    let x = g.input("x", [1, 4], DType::F32).unwrap();
    let w = g.variable("w", [4, 1], DType::F32, Init::Constant(0.25)).unwrap();
    let loss = x.matmul(&w).unwrap().sum_all().unwrap();
    let train = g.minimize(loss, &Optimizer::adamw(0.1, 0.0)).unwrap();
    let mut s = Session::new(&g);
    let feed = [(x, HostArray::f32([1, 4], vec![4.0; 4]).unwrap())];
    // The default scale, 65536, overflows three times as above (then 8192 fits).
    for _ in 0..3 {
        s.step(&train, &feed).unwrap();
    }
    for (variable, _) in &train.updates {
        let value = s.value(*variable).unwrap().to_f64_vec();
        match variable.name().as_str() {
            "w" => assert_eq!(value, vec![0.25; 4]),
            "optimizer.step" | "loss_scale.good_steps" => assert_eq!(value, vec![0.0]),
            "loss_scale.scale" => assert_eq!(value, vec![8192.0]),
            name => assert_eq!(value, vec![0.0; 4], "{name}"),
        }
    }
    s.step(&train, &feed).unwrap();
    // AdamW's first step moves every element by lr (bias-corrected m / sqrt(v) = 1).
    let moved = s.value(w).unwrap().to_f64_vec();
    for v in moved {
        assert!((v - (0.25 - 0.1)).abs() < 1e-6, "{v}");
    }
}

#[test]
fn f16_mixed_precision_scales_the_loss_without_being_asked_and_bf16_does_not() {
    let build = |precision: Precision| {
        let g = Graph::new();
        g.mixed_precision(precision).unwrap();
        let x = g.input("x", [2, 3], DType::F32).unwrap();
        let w = g.variable("w", [3, 2], DType::F32, Init::Xavier { seed: 1 }).unwrap();
        let product = x.matmul(&w).unwrap();
        let dtype = product.dtype();
        let train = g.minimize(product.sum_all().unwrap(), &Optimizer::adamw(1e-3, 0.0)).unwrap();
        let names: Vec<String> = train.updates.iter().map(|(v, _)| v.name()).collect();
        (dtype, train.loss_scale.is_some(), names)
    };
    let (dtype, scaled, names) = build(Precision::F16);
    assert_eq!(dtype, DType::F16);
    assert!(scaled);
    assert!(names.contains(&"loss_scale.scale".to_string()) && names.contains(&"loss_scale.good_steps".to_string()));
    let (dtype, scaled, names) = build(Precision::Bf16);
    assert_eq!(dtype, DType::Bf16);
    assert!(!scaled);
    assert!(!names.iter().any(|n| n.starts_with("loss_scale")));
}

#[test]
fn loss_scale_options_that_cannot_work_are_refused_by_name() {
    let cases = [
        (LossScale { init: f64::NAN, ..LossScale::dynamic() }, "optimizer option 'loss_scale.init' is NaN: the initial loss scale must be a finite number > 0"),
        (LossScale::fixed(0.0), "optimizer option 'loss_scale.init' is 0: the initial loss scale must be a finite number > 0"),
        (LossScale::fixed(1e39), "optimizer option 'loss_scale.init' is 1000000000000000000000000000000000000000: the loss scale is kept in f32, whose largest value is 3.4028235e38"),
        (LossScale { growth: 0.5, ..LossScale::dynamic() }, "optimizer option 'loss_scale.growth' is 0.5: the growth factor must be a finite number >= 1 (1 never grows)"),
        (LossScale { backoff: 0.0, ..LossScale::dynamic() }, "optimizer option 'loss_scale.backoff' is 0: the backoff factor must be in (0, 1] (1 never shrinks)"),
        (LossScale { backoff: f64::NAN, ..LossScale::dynamic() }, "optimizer option 'loss_scale.backoff' is NaN: the backoff factor must be in (0, 1] (1 never shrinks)"),
        (LossScale::dynamic().with_interval(0), "optimizer option 'loss_scale.interval' is 0: the scale grows after at least 1 good step"),
    ];
    for (loss_scale, message) in cases {
        let g = Graph::new();
        let w = g.variable("w", [2], DType::F32, Init::Ones).unwrap();
        let loss = w.sum_all().unwrap();
        let err = g.minimize(loss, &Optimizer::sgd(0.1, 0.0, 0.0).with_loss_scale(loss_scale)).unwrap_err();
        assert_eq!(err.to_string(), message);
        // Nothing was added to the graph.
        assert_eq!(g.tensor_count(), 2);
    }
}

#[test]
fn switching_between_bf16_and_f16_once_ops_exist_is_refused() {
    let g = Graph::new();
    g.mixed_precision(Precision::Bf16).unwrap();
    let x = g.input("x", [2, 2], DType::F32).unwrap();
    let _ = x.matmul(&x).unwrap();
    let err = g.mixed_precision(Precision::F16).unwrap_err().to_string();
    assert_eq!(
        err,
        "the graph already runs ops in bf16 mixed precision; switching to f16 would mix both \
         (turn mixed precision on once, before building the model)"
    );
    assert_eq!(g.precision(), Precision::Bf16);
    // Turning it off and on in the same dtype is fine.
    g.mixed_precision(Precision::F32).unwrap();
    g.mixed_precision(Precision::Bf16).unwrap();
}
