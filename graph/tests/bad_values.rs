//! Values that cannot mean anything are refused where they are given, with an error that
//! names the option or tensor and the value: optimizer options, a loss with nothing to
//! train, shapes whose size overflows, meshes past the device-id width, host arrays whose
//! values do not fill their shape.

use regflow_graph::plan::DeviceKind;
use regflow_graph::sbp::{Mesh, MAX_DEVICES_PER_NODE};
use regflow_graph::{ArrayError, DType, Graph, GraphError, HostArray, Init, Optimizer, Schedule, Shape};

/// A loss that trains `w`.
fn loss(g: &Graph) -> regflow_graph::Tensor<'_> {
    let x = g.input("x", [2], DType::F64).unwrap();
    let w = g.variable("w", [2], DType::F64, Init::Constant(1.0)).unwrap();
    w.mul(&x).unwrap().sum_to(&Shape::scalar()).unwrap()
}

/// The error `minimize` gives for `optimizer`, checked to be an `OptimizerOption` naming
/// `option`; returns its message.
fn refused(optimizer: Optimizer, option: &str) -> String {
    let g = Graph::new();
    let err = g.minimize(loss(&g), &optimizer).unwrap_err();
    let GraphError::OptimizerOption { option: named, .. } = &err else { panic!("not an option error: {err}") };
    assert_eq!(*named, option, "{err}");
    err.to_string()
}

#[test]
fn learning_rates_that_are_nan_infinite_or_negative_are_refused() {
    assert_eq!(
        refused(Optimizer::sgd(f64::NAN, 0.0, 0.0), "lr"),
        "optimizer option 'lr' is NaN: the learning rate must be a finite number >= 0"
    );
    assert_eq!(
        refused(Optimizer::adamw(f64::INFINITY, 0.0), "lr"),
        "optimizer option 'lr' is inf: the learning rate must be a finite number >= 0"
    );
    assert_eq!(
        refused(Optimizer::adamw(-0.1, 0.0), "lr"),
        "optimizer option 'lr' is -0.1: the learning rate must be a finite number >= 0"
    );
    // Zero is a rate (a frozen step), not a mistake.
    let g = Graph::new();
    assert!(g.minimize(loss(&g), &Optimizer::sgd(0.0, 0.0, 0.0)).is_ok());
}

#[test]
fn momentum_and_weight_decay_out_of_range_are_refused() {
    assert_eq!(
        refused(Optimizer::sgd(0.1, 1.0, 0.0), "momentum"),
        "optimizer option 'momentum' is 1: momentum must be in [0, 1)"
    );
    assert!(refused(Optimizer::sgd(0.1, -0.5, 0.0), "momentum").contains("is -0.5"));
    assert_eq!(
        refused(Optimizer::sgd(0.1, 0.9, -1e-4), "weight_decay"),
        "optimizer option 'weight_decay' is -0.0001: weight decay must be a finite number >= 0"
    );
    assert!(refused(Optimizer::adamw(0.1, f64::NAN), "weight_decay").contains("is NaN"));
}

#[test]
fn adam_betas_and_eps_out_of_range_are_refused() {
    let with = |beta1: f64, beta2: f64, eps: f64| {
        let mut optimizer = Optimizer::adamw(1e-3, 0.0);
        optimizer.kind = regflow_graph::OptimizerKind::AdamW { beta1, beta2, eps, weight_decay: 0.0 };
        optimizer
    };
    assert_eq!(refused(with(1.0, 0.999, 1e-8), "beta1"), "optimizer option 'beta1' is 1: beta1 must be in [0, 1)");
    assert_eq!(refused(with(0.9, 1.5, 1e-8), "beta2"), "optimizer option 'beta2' is 1.5: beta2 must be in [0, 1)");
    assert!(refused(with(0.9, f64::NAN, 1e-8), "beta2").contains("is NaN"));
    assert_eq!(
        refused(with(0.9, 0.999, 0.0), "eps"),
        "optimizer option 'eps' is 0: Adam's eps must be a finite number > 0"
    );
    assert!(refused(with(0.9, 0.999, f64::INFINITY), "eps").contains("is inf"));
}

#[test]
fn clip_norms_that_are_not_positive_and_finite_are_refused() {
    let sgd = || Optimizer::sgd(0.1, 0.0, 0.0);
    assert_eq!(
        refused(sgd().with_clip_norm(0.0), "clip_norm"),
        "optimizer option 'clip_norm' is 0: the clipping norm must be a finite number > 0"
    );
    assert!(refused(sgd().with_clip_norm(f64::NAN), "clip_norm").contains("is NaN"));
    assert!(refused(sgd().with_clip_norm(f64::INFINITY), "clip_norm").contains("is inf"));
    assert!(refused(sgd().with_clip_norm(-1.0), "clip_norm").contains("is -1"));
}

#[test]
fn schedules_with_no_steps_or_a_warmup_past_their_total_are_refused() {
    let schedule = |peak: f64, warmup: u64, total: u64, min: f64| {
        Optimizer::sgd(0.1, 0.0, 0.0).with_schedule(Schedule::WarmupCosine { peak, warmup, total, min })
    };
    assert_eq!(
        refused(schedule(0.1, 200, 100, 0.0), "warmup"),
        "optimizer option 'warmup' is 200: the warm-up must not be longer than the schedule's total of 100 steps"
    );
    assert_eq!(
        refused(schedule(0.1, 0, 0, 0.0), "total"),
        "optimizer option 'total' is 0: the schedule needs at least 1 step"
    );
    assert!(refused(schedule(f64::NAN, 1, 10, 0.0), "peak").contains("is NaN"));
    assert!(refused(schedule(0.1, 1, 10, -0.01), "min").contains("is -0.01"));
    assert!(refused(Optimizer::sgd(0.1, 0.0, 0.0).with_schedule(Schedule::Constant(-1.0)), "lr").contains("is -1"));
    // A warm-up as long as the schedule is fine.
    let g = Graph::new();
    assert!(g.minimize(loss(&g), &schedule(0.1, 10, 10, 0.0)).is_ok());
}

#[test]
fn minimizing_a_loss_no_variable_reaches_names_the_loss() {
    let g = Graph::new();
    let x = g.input("x", [2], DType::F64).unwrap();
    g.variable("w", [2], DType::F64, Init::Zeros).unwrap();
    let only_inputs = x.mul(&x).unwrap().sum_to(&Shape::scalar()).unwrap();
    let err = g.minimize(only_inputs, &Optimizer::sgd(0.1, 0.0, 0.0)).unwrap_err();
    assert_eq!(err, GraphError::NothingToTrain { loss: only_inputs.name() });
    assert_eq!(
        err.to_string(),
        format!("loss '{}' depends on no trainable variable: minimize has nothing to train", only_inputs.name())
    );
}

#[test]
fn inputs_and_variables_whose_size_overflows_are_refused_with_their_shape() {
    let huge = [1usize << 40, 1 << 40];
    let g = Graph::new();
    let err = g.input("x", huge, DType::F32).unwrap_err();
    assert_eq!(err, GraphError::TooLarge { tensor: "input 'x'".into(), shape: Shape::from(huge), dtype: DType::F32 });
    assert!(
        err.to_string().starts_with("input 'x' of shape [1099511627776, 1099511627776] (f32) is too large"),
        "{err}"
    );
    let err = g.variable("w", huge, DType::F64, Init::Zeros).unwrap_err();
    assert!(matches!(&err, GraphError::TooLarge { tensor, .. } if tensor == "variable 'w'"), "{err}");
    // Fits as a count of elements, not as bytes.
    let err = g.input("bytes", [usize::MAX / 4], DType::F64).unwrap_err();
    assert!(err.to_string().starts_with(&format!("input 'bytes' of shape [{}] (f64)", usize::MAX / 4)), "{err}");
}

#[test]
fn op_results_whose_size_overflows_are_refused_naming_the_op_and_its_inputs() {
    let g = Graph::new();
    let a = g.input("a", [1usize << 40, 1], DType::F32).unwrap();
    let b = g.input("b", [1, 1usize << 40], DType::F32).unwrap();
    let err = a.matmul(&b).unwrap_err();
    let GraphError::TooLarge { tensor, shape, dtype } = &err else { panic!("{err}") };
    assert_eq!((shape, *dtype), (&Shape::from([1usize << 40, 1 << 40]), DType::F32));
    assert_eq!(tensor, "matmul0:0 (the result of matmul(f32[1099511627776, 1], f32[1, 1099511627776]))");
    // A broadcast that multiplies out.
    assert!(matches!(a.add(&b), Err(GraphError::TooLarge { .. })));
    // Concatenations whose bytes, then whose length, pass usize::MAX.
    let c = g.input("c", [usize::MAX / 4], DType::F32).unwrap();
    assert!(matches!(c.concat(&[c], 0), Err(GraphError::TooLarge { .. })));
    let err = c.concat(&[c, c, c, c], 0).unwrap_err();
    assert!(
        matches!(&err, GraphError::Op { op, message, .. } if op == "concat" && message.contains("axis 0")),
        "{err}"
    );
}

#[test]
fn meshes_past_the_device_id_width_or_empty_are_refused_with_their_size() {
    let err = Mesh::cpu(&[70_000], &["dp"]).unwrap_err();
    assert_eq!(
        err,
        format!(
            "mesh shape [70000] holds 70000 devices, but one node indexes at most {MAX_DEVICES_PER_NODE} devices of a \
             kind (device indices are 16-bit)"
        )
    );
    let mesh = Mesh::of_kind(DeviceKind::Sim, &[256, 256], &["dp", "tp"]).unwrap();
    assert_eq!(mesh.size(), MAX_DEVICES_PER_NODE);
    assert_eq!(mesh.devices().last().map(|d| d.index), Some(u16::MAX));
    assert!(Mesh::cpu(&[1 << 40, 1 << 40], &["a", "b"]).unwrap_err().contains("holds more than"));
    assert_eq!(
        Mesh::cpu(&[2, 0], &["dp", "tp"]).unwrap_err(),
        "mesh shape [2, 0] has an empty axis: axis 1 ('tp') holds 0 devices"
    );
    assert_eq!(Mesh::cpu(&[], &[]).unwrap_err(), "a mesh needs at least one axis, got shape []");
    assert_eq!(
        Mesh::cpu(&[2, 2], &["dp"]).unwrap_err(),
        "mesh shape [2, 2] has 2 axes and needs one name per axis, got 1 name ('dp')"
    );
    assert_eq!(
        Mesh::cpu(&[2, 2], &["dp", "dp"]).unwrap_err(),
        "mesh axis names must be distinct and non-empty, got 'dp', 'dp'"
    );
}

#[test]
fn host_arrays_whose_values_do_not_fill_their_shape_say_so() {
    let err = HostArray::f32([2, 3], vec![0.0; 5]).unwrap_err();
    assert_eq!(err, ArrayError::Length { shape: Shape::from([2, 3]), dtype: DType::F32, needed: 6, got: 5 });
    assert_eq!(err.to_string(), "a [2, 3] f32 array needs 6 values; got 5");
    assert_eq!(HostArray::i64([4], vec![1; 7]).unwrap_err().to_string(), "a [4] i64 array needs 4 values; got 7");
    assert!(matches!(HostArray::f64([1 << 40, 1 << 40], vec![]), Err(ArrayError::TooLarge { .. })));
}
