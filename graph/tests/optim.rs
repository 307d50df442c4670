//! Optimizer steps match hand-computed values (PyTorch's definitions), schedules and
//! clipping behave as documented, and a small model trains in a host session.

use regflow_graph::{DType, Graph, HostArray, Init, Optimizer, Schedule, Session, Shape};

fn close(a: &[f64], b: &[f64]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() <= 1e-12 * (1.0 + y.abs()), "{a:?} vs {b:?}");
    }
}

/// loss = sum(w * x): the gradient of w is x.
fn linear_loss(g: &Graph) -> (regflow_graph::Tensor<'_>, regflow_graph::Tensor<'_>, regflow_graph::Tensor<'_>) {
    let x = g.input("x", [2], DType::F64).unwrap();
    let w = g.variable("w", [2], DType::F64, Init::Constant(1.0)).unwrap();
    let loss = w.mul(&x).unwrap().sum_to(&Shape::scalar()).unwrap();
    (x, w, loss)
}

#[test]
fn sgd_with_momentum_and_weight_decay_matches_hand_computed_steps() {
    let g = Graph::new();
    let (x, w, loss) = linear_loss(&g);
    let train = g.minimize(loss, &Optimizer::sgd(0.1, 0.9, 0.01)).unwrap();
    let mut s = Session::new(&g);
    let feed = || vec![(x, HostArray::f64([2], vec![2.0, -1.0]).unwrap())];
    s.step(&train, &feed()).unwrap();
    // g1 = x + 0.01·p0 = [2.01, -0.99]; v1 = g1; p1 = p0 - 0.1·v1.
    let (v1, p1) = ([2.01, -0.99], [1.0 - 0.201, 1.0 + 0.099]);
    close(&s.value(w).unwrap().to_f64_vec(), &p1);
    s.step(&train, &feed()).unwrap();
    // g2 = x + 0.01·p1; v2 = 0.9·v1 + g2; p2 = p1 - 0.1·v2.
    let g2 = [2.0 + 0.01 * p1[0], -1.0 + 0.01 * p1[1]];
    let v2 = [0.9 * v1[0] + g2[0], 0.9 * v1[1] + g2[1]];
    close(&s.value(w).unwrap().to_f64_vec(), &[p1[0] - 0.1 * v2[0], p1[1] - 0.1 * v2[1]]);
    let velocity = g.by_name("w.velocity").unwrap();
    close(&s.value(velocity).unwrap().to_f64_vec(), &v2);
}

#[test]
fn plain_sgd_is_p_minus_lr_g() {
    let g = Graph::new();
    let (x, w, loss) = linear_loss(&g);
    let train = g.minimize(loss, &Optimizer::sgd(0.5, 0.0, 0.0)).unwrap();
    let mut s = Session::new(&g);
    let l = s.step(&train, &[(x, HostArray::f64([2], vec![2.0, -1.0]).unwrap())]).unwrap();
    assert_eq!(l, 1.0); // loss before the update: 1·2 + 1·(-1)
    close(&s.value(w).unwrap().to_f64_vec(), &[0.0, 1.5]);
}

#[test]
fn adamw_matches_hand_computed_steps() {
    let g = Graph::new();
    let (x, w, loss) = linear_loss(&g);
    let (lr, wd, b1, b2, eps) = (0.1, 0.01, 0.9, 0.999, 1e-8);
    let train = g.minimize(loss, &Optimizer::adamw(lr, wd)).unwrap();
    let mut s = Session::new(&g);
    let xs = [2.0, -1.0];
    let mut p = [1.0f64, 1.0];
    let (mut m, mut v) = ([0.0f64; 2], [0.0f64; 2]);
    for t in 1..=3 {
        s.step(&train, &[(x, HostArray::f64([2], xs.to_vec()).unwrap())]).unwrap();
        for i in 0..2 {
            m[i] = b1 * m[i] + (1.0 - b1) * xs[i];
            v[i] = b2 * v[i] + (1.0 - b2) * xs[i] * xs[i];
            let (mh, vh) = (m[i] / (1.0 - b1.powi(t)), v[i] / (1.0 - b2.powi(t)));
            p[i] = p[i] * (1.0 - lr * wd) - lr * mh / (vh.sqrt() + eps);
        }
        close(&s.value(w).unwrap().to_f64_vec(), &p);
    }
    close(&s.value(g.by_name("optimizer.step").unwrap()).unwrap().to_f64_vec(), &[3.0]);
}

#[test]
fn warmup_cosine_schedule_has_the_documented_shape() {
    let s = Schedule::WarmupCosine { peak: 1.0, warmup: 10, total: 110, min: 0.1 };
    assert_eq!(s.at(5.0), 0.5);
    assert_eq!(s.at(10.0), 1.0);
    assert!((s.at(60.0) - 0.55).abs() < 1e-12);
    assert_eq!(s.at(110.0), 0.1);
    assert_eq!(s.at(500.0), 0.1);
    // In the graph, the rate of step k is the schedule at k.
    let g = Graph::new();
    let (x, _, loss) = linear_loss(&g);
    let train = g.minimize(loss, &Optimizer::sgd(0.0, 0.0, 0.0).with_schedule(s.clone())).unwrap();
    let mut session = Session::new(&g);
    let feed = [(x, HostArray::f64([2], vec![0.0, 0.0]).unwrap())];
    for k in 1..=12 {
        let lr = session.run(&feed, &[train.lr]).unwrap()[0].to_f64_vec()[0];
        assert_eq!(lr, s.at(k as f64), "step {k}");
        session.step(&train, &feed).unwrap();
    }
}

#[test]
fn clipping_scales_gradients_to_the_global_norm() {
    let g = Graph::new();
    let (x, w, loss) = linear_loss(&g);
    let train = g.minimize(loss, &Optimizer::sgd(1.0, 0.0, 0.0).with_clip_norm(1.0)).unwrap();
    let mut s = Session::new(&g);
    let feed = [(x, HostArray::f64([2], vec![3.0, 4.0]).unwrap())];
    let clipped = s.run(&feed, &train.grads).unwrap()[0].to_f64_vec();
    assert!((clipped[0] - 0.6).abs() < 1e-6 && (clipped[1] - 0.8).abs() < 1e-6, "{clipped:?}");
    s.step(&train, &feed).unwrap();
    let p = s.value(w).unwrap().to_f64_vec();
    assert!((p[0] - 0.4).abs() < 1e-6 && (p[1] - 0.2).abs() < 1e-6, "{p:?}");
    // A norm below the limit is left alone.
    let small = [(x, HostArray::f64([2], vec![0.3, 0.4]).unwrap())];
    assert_eq!(s.run(&small, &train.grads).unwrap()[0].to_f64_vec(), [0.3, 0.4]);
    assert!(g.minimize(loss, &Optimizer::sgd(1.0, 0.0, 0.0).with_clip_norm(0.0)).is_err());
}

/// The clip factor reaches each update as its last input (no clipped copy is made unless
/// fetched); an update's gradient scale must be one float value, and it takes at most one.
#[test]
fn updates_take_the_clip_factor_as_one_float_value() {
    use regflow_graph::plan::ops::{OptimizerKind, Update};
    let g = Graph::new();
    let (_, w, loss) = linear_loss(&g);
    let train = g.minimize(loss, &Optimizer::sgd(1.0, 0.0, 0.0).with_clip_norm(1.0)).unwrap();
    let update = g.nodes().into_iter().find(|n| n.op.name() == "sgd_update").expect("an update");
    // param, raw gradient, lr, step, velocity, clip factor.
    assert_eq!(update.inputs.len(), 6);
    assert_eq!(update.inputs[1], train.raw_grads[0].id());
    let kind = OptimizerKind::Sgd { momentum: 0.0, weight_decay: 0.0 };
    let scalar = g.input("scalar", [1], DType::F64).unwrap();
    let (vector, labels) = (g.input("v", [2], DType::F64).unwrap(), g.input("i", [1], DType::I64).unwrap());
    for (scale, named) in [(vector, "[2]"), (labels, "i64")] {
        let err = g.apply(Update(kind.clone()), &[w, w, scalar, scalar, w, scale]).unwrap_err().to_string();
        assert!(err.contains("gradient scale") && err.contains(named), "{err}");
    }
    let err = g.apply(Update(kind), &[w, w, scalar, scalar, w, scalar, scalar]).unwrap_err().to_string();
    assert!(err.contains("optional gradient scale") && err.contains("got 7 inputs"), "{err}");
}

#[test]
fn a_linear_model_trains_to_its_target_and_twice_gives_identical_losses() {
    let w_true = [0.5f32, -2.0, 1.0];
    let run = || -> (Vec<f64>, Vec<f64>) {
        let g = Graph::new();
        let x = g.input("x", [8, 3], DType::F32).unwrap();
        let y = g.input("y", [8, 1], DType::F32).unwrap();
        let w = g.variable("w", [1, 3], DType::F32, Init::Normal { mean: 0.0, std: 0.1, seed: 3 }).unwrap();
        // x·wᵀ with broadcasting: [8, 3] * [1, 3], summed to [8, 1].
        let pred = x.mul(&w).unwrap().sum_to(&Shape::from([8, 1])).unwrap();
        let err = pred.sub(&y).unwrap();
        let loss = err.mul(&err).unwrap().sum_to(&Shape::scalar()).unwrap().mul_scalar(1.0 / 8.0).unwrap();
        let train = g.minimize(loss, &Optimizer::sgd(0.1, 0.9, 0.0)).unwrap();
        let mut rng = regflow_graph::SplitMix64::new(11);
        let xs: Vec<f32> = (0..24).map(|_| rng.next_normal() as f32).collect();
        let ys: Vec<f32> = xs.chunks(3).map(|r| r.iter().zip(&w_true).map(|(a, b)| a * b).sum()).collect();
        let feeds = [(x, HostArray::f32([8, 3], xs).unwrap()), (y, HostArray::f32([8, 1], ys).unwrap())];
        let mut s = Session::new(&g);
        let losses = (0..300).map(|_| s.step(&train, &feeds).unwrap()).collect();
        (losses, s.value(w).unwrap().to_f64_vec())
    };
    let (losses, w) = run();
    assert!(losses[299] < 1e-6 && losses[299] < losses[0] * 1e-5, "losses {} -> {}", losses[0], losses[299]);
    for (a, b) in w.iter().zip(w_true) {
        assert!((a - f64::from(b)).abs() < 1e-3, "{w:?}");
    }
    let (again, _) = run();
    assert_eq!(
        losses.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
        again.iter().map(|l| l.to_bits()).collect::<Vec<_>>()
    );
}
