//! Mixed precision in the graph: where autocast puts casts, what stays f32, the gradient
//! of `cast`, and the refusal of f16.

use regflow_graph::ops::Cast;
use regflow_graph::{DType, Graph, HostArray, Init, Optimizer, Precision, Shape, SplitMix64, TensorSource};

/// `sum(cast(cast(x, to), f64) * r)`: the gradient of `x` is `r` passed back through the
/// casts, so `r` rounded to `to` (the straight-through derivative of a rounding).
fn cast_gradient(to: DType) -> (Vec<f64>, Vec<f64>) {
    let g = Graph::new();
    let mut rng = SplitMix64::new(9);
    let values = |rng: &mut SplitMix64| (0..6).map(|_| rng.next_normal()).collect::<Vec<f64>>();
    let (xs, rs) = (values(&mut rng), values(&mut rng));
    let x = g.input("x", [2, 3], DType::F64).unwrap();
    let r = g.input("r", [2, 3], DType::F64).unwrap();
    // Applied as an op (not `Tensor::cast`, which skips a cast to the same dtype).
    let narrow = g.apply1(Cast { to }, &[x]).unwrap();
    let wide = g.apply1(Cast { to: DType::F64 }, &[narrow]).unwrap();
    let loss = wide.mul(&r).unwrap().sum_to(&[].into()).unwrap();
    let grads = g.grad(loss, &[x]).unwrap();
    assert_eq!(grads[0].dtype(), DType::F64);
    let feeds = [(x, HostArray::f64([2, 3], xs).unwrap()), (r, HostArray::f64([2, 3], rs.clone()).unwrap())];
    (g.eval(&feeds, &grads).unwrap()[0].to_f64_vec(), rs)
}

#[test]
fn cast_gradient_is_the_incoming_gradient_cast_back() {
    let (grad, r) = cast_gradient(DType::F64);
    assert_eq!(grad, r);
    let (grad, r) = cast_gradient(DType::F32);
    assert_eq!(grad, r.iter().map(|&v| f64::from(v as f32)).collect::<Vec<_>>());
    let (grad, r) = cast_gradient(DType::Bf16);
    // The kernels round f64 to bf16 correctly (`bf16_from_f64`), not as `half` does (twice).
    assert_eq!(grad, r.iter().map(|&v| regflow_graph::plan::bf16_from_f64(v).to_f64()).collect::<Vec<_>>());
    for (g, r) in grad.iter().zip(&r) {
        assert!((g - r).abs() <= 4e-3 * r.abs(), "{g} vs {r}");
    }
}

#[test]
fn autocast_runs_products_in_bf16_and_keeps_weights_losses_and_state_f32() {
    let g = Graph::new();
    g.mixed_precision(Precision::Bf16).unwrap();
    assert_eq!(g.precision(), Precision::Bf16);
    let x = g.input("x", [4, 6], DType::F32).unwrap();
    let y = g.input("y", [4], DType::I64).unwrap();
    let w = g.variable("w", [6, 8], DType::F32, Init::Kaiming { seed: 1 }).unwrap();
    let b = g.variable("b", [8], DType::F32, Init::Zeros).unwrap();
    let w2 = g.variable("w2", [8, 3], DType::F32, Init::Xavier { seed: 2 }).unwrap();
    let h = x.matmul(&w).unwrap();
    assert_eq!(h.dtype(), DType::Bf16);
    // A bias (stretched over the rows) joins the bf16 stream; relu stays bf16.
    let a = h.add(&b).unwrap().relu().unwrap();
    assert_eq!(a.dtype(), DType::Bf16);
    // A full-size f32 operand widens the bf16 one instead.
    assert_eq!(a.add(&g.input("residual", [4, 8], DType::F32).unwrap()).unwrap().dtype(), DType::F32);
    let logits = a.matmul(&w2).unwrap();
    assert_eq!(logits.dtype(), DType::Bf16);
    assert_eq!(logits.softmax(-1).unwrap().dtype(), DType::F32);
    let loss = logits.sparse_cross_entropy(&y).unwrap();
    assert_eq!(loss.dtype(), DType::F32);
    // `w` is cast once however many products read it.
    let casts_before = g.nodes().iter().filter(|n| n.op.name() == "cast").count();
    x.matmul(&w).unwrap();
    assert_eq!(g.nodes().iter().filter(|n| n.op.name() == "cast").count(), casts_before);

    let train = g.minimize(loss, &Optimizer::adamw(1e-2, 0.0)).unwrap();
    for id in 0..g.tensor_count() {
        let info = g.info(regflow_graph::TensorId(id as u32));
        if matches!(info.source, TensorSource::Variable { .. }) && info.meta.dtype.is_float() {
            assert_ne!(info.meta.dtype, DType::Bf16, "variable '{}' is bf16", info.name);
        }
    }
    // Master weights and their optimizer state (the step counter is f64).
    for (variable, value) in &train.updates {
        assert_ne!(variable.dtype(), DType::Bf16, "'{}' is updated in bf16", variable.name());
        assert_eq!(value.dtype(), variable.dtype());
    }
    for name in ["w", "b", "w2"] {
        assert!(train.updates.iter().any(|(v, _)| v.name() == name && v.dtype() == DType::F32));
    }
    // Gradient products run in bf16 too.
    let products = g.nodes().into_iter().filter(|n| n.op.name() == "matmul").collect::<Vec<_>>();
    assert!(products.len() >= 4);
    assert!(products.iter().all(|n| g.info(n.outputs[0]).meta.dtype == DType::Bf16));
}

#[test]
fn f16_runs_products_in_f16_and_f32_is_the_default() {
    let g = Graph::new();
    assert_eq!(g.precision(), Precision::F32);
    // Off, nothing is cast.
    let x = g.input("x", [2, 3], DType::F32).unwrap();
    let w = g.variable("w", [3, 2], DType::F32, Init::Zeros).unwrap();
    assert_eq!(x.matmul(&w).unwrap().dtype(), DType::F32);
    assert!(g.nodes().iter().all(|n| n.op.name() != "cast"));
    // On, the same classes as bf16 with f16 as the low dtype: products in f16, reductions
    // in f32, the cross-entropy reading f16 logits as they are.
    g.mixed_precision(Precision::F16).unwrap();
    assert_eq!(g.precision(), Precision::F16);
    let product = x.matmul(&w).unwrap();
    assert_eq!(product.dtype(), DType::F16);
    assert_eq!(product.sum_all().unwrap().dtype(), DType::F32);
    let labels = g.input("labels", [2], DType::I64).unwrap();
    let loss = product.sparse_cross_entropy(&labels).unwrap();
    assert_eq!(loss.dtype(), DType::F32);
    assert_eq!(f32_casts_shaped(&g, &[2, 2]), 1, "only the reduction's input is widened, not the logits");
}

#[test]
fn cast_refuses_integers_naming_both_dtypes() {
    let g = Graph::new();
    let y = g.input("y", [2], DType::I64).unwrap();
    let err = y.cast(DType::F32).unwrap_err().to_string();
    assert_eq!(err, "cast(i64[2]): casts between float dtypes only (f32, f64, bf16, f16), not i64 to f32");
}

/// The cross-entropy under mixed precision reads bf16 logits as they are: no f32 copy of the
/// logits and no cast of their gradient; the loss is f32 and the gradient bf16, and both
/// equal the cast-then-f32 path bit for bit (widening is exact; the gradient is rounded
/// once from f32 either way).
#[test]
fn cross_entropy_widens_bf16_logits_as_it_loads_and_matches_the_cast_path_bitwise() {
    let mut rng = SplitMix64::new(5);
    let (rows, classes) = (6, 11);
    let logit_values: Vec<f64> = (0..rows * classes).map(|_| 4.0 * rng.next_normal()).collect();
    let labels: Vec<i64> = (0..rows).map(|r| (r * 7 % classes) as i64).collect();
    let run = |widen: bool| {
        let g = Graph::new();
        let x = g.input("x", [rows, classes], DType::F32).unwrap();
        let y = g.input("y", [rows], DType::I64).unwrap();
        let logits = x.cast(DType::Bf16).unwrap();
        // The cast path: what autocast did before the cross-entropy read bf16 directly.
        let read = if widen { logits } else { logits.cast(DType::F32).unwrap() };
        let loss = read.sparse_cross_entropy(&y).unwrap();
        assert_eq!(loss.dtype(), DType::F32);
        let grad = g.grad(loss, &[logits]).unwrap()[0];
        assert_eq!(grad.dtype(), DType::Bf16, "the gradient of bf16 logits is bf16");
        let casts = g.nodes().iter().filter(|n| n.op.name() == "cast").count();
        let feeds = [
            (x, HostArray::f32([rows, classes], logit_values.iter().map(|&v| v as f32).collect()).unwrap()),
            (y, HostArray::i64([rows], labels.clone()).unwrap()),
        ];
        let out = g.eval(&feeds, &[loss, grad]).unwrap();
        (out[0].to_f64_vec(), out[1].to_f64_vec(), casts)
    };
    let (loss, grad, casts) = run(true);
    let (cast_loss, cast_grad, cast_casts) = run(false);
    assert_eq!(loss, cast_loss);
    assert_eq!(grad, cast_grad);
    // x -> bf16 only; the cast path adds the f32 copy and its gradient's cast back.
    assert_eq!((casts, cast_casts), (1, 3));

    // Autocast picks the direct read for bf16 logits.
    let g = Graph::new();
    g.mixed_precision(Precision::Bf16).unwrap();
    let x = g.input("x", [rows, 4], DType::F32).unwrap();
    let y = g.input("y", [rows], DType::I64).unwrap();
    let w = g.variable("w", [4, classes], DType::F32, Init::Xavier { seed: 3 }).unwrap();
    let logits = x.matmul(&w).unwrap();
    assert_eq!(logits.dtype(), DType::Bf16);
    let loss = logits.sparse_cross_entropy(&y).unwrap();
    let grad = g.grad(loss, &[logits]).unwrap()[0];
    assert_eq!((loss.dtype(), grad.dtype()), (DType::F32, DType::Bf16));
    assert_eq!(f32_casts_shaped(&g, &[rows, classes]), 0, "no f32 copy of the logits");
}

/// The masked softmax reads bf16 scores as they are (attention's `[B, H, T, T]`, the
/// largest activations of a transformer) and stores bf16 probabilities: no f32 copy of the
/// scores, the probabilities or their gradients. The probabilities equal the f32 path's
/// cast to bf16 bit for bit, with the mask f32 or bf16 (cast to f32 either way); the
/// scores' gradient, computed from the rounded probabilities, is within bf16's rounding of
/// the f32 path's.
#[test]
fn masked_softmax_widens_bf16_scores_as_it_loads_and_matches_the_cast_path() {
    let mut rng = SplitMix64::new(9);
    let (heads, t) = (3, 7);
    let score_values: Vec<f64> = (0..heads * t * t).map(|_| 3.0 * rng.next_normal()).collect();
    let causal: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { -1e9 } else { 0.0 }).collect();
    let upstream: Vec<f64> = (0..heads * t * t).map(|_| rng.next_normal()).collect();
    for mask_dtype in [DType::F32, DType::Bf16] {
        let run = |widen: bool| {
            let g = Graph::new();
            let x = g.input("x", [heads, t, t], DType::F32).unwrap();
            let m = g.input("mask", [t, t], DType::F32).unwrap();
            let up = g.input("up", [heads, t, t], DType::F32).unwrap();
            let scores = x.cast(DType::Bf16).unwrap();
            // The mask as the model holds it, then read in f32 either way.
            let mask = m.cast(mask_dtype).unwrap().cast(DType::F32).unwrap();
            let probs = if widen {
                scores.masked_softmax(&mask, 0.25).unwrap()
            } else {
                let wide = scores.cast(DType::F32).unwrap().masked_softmax(&mask, 0.25).unwrap();
                wide.cast(DType::Bf16).unwrap()
            };
            assert_eq!(probs.dtype(), DType::Bf16);
            // A weighted sum of the probabilities, so the gradient is not trivial.
            let loss = probs.cast(DType::F32).unwrap().mul(&up).unwrap().sum_to(&Shape::scalar()).unwrap();
            let grad = g.grad(loss, &[scores]).unwrap()[0];
            assert_eq!(grad.dtype(), DType::Bf16, "the gradient of bf16 scores is bf16");
            let feeds = [
                (x, HostArray::f32([heads, t, t], score_values.iter().map(|&v| v as f32).collect()).unwrap()),
                (m, HostArray::f32([t, t], causal.clone()).unwrap()),
                (up, HostArray::f32([heads, t, t], upstream.iter().map(|&v| v as f32).collect()).unwrap()),
            ];
            let out = g.eval(&feeds, &[probs, grad]).unwrap();
            (out[0].to_f64_vec(), out[1].to_f64_vec())
        };
        let ((probs, grad), (cast_probs, cast_grad)) = (run(true), run(false));
        assert_eq!(probs, cast_probs, "probabilities, mask {mask_dtype}");
        // The gradients differ by the probabilities' rounding (2^-9 relative), carried
        // through y·(dy - Σ dy·y): a few bf16 steps of the largest element at most.
        let largest = cast_grad.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let worst = grad.iter().zip(&cast_grad).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(largest > 0.1, "a gradient worth comparing: {largest}");
        assert!(worst <= 1e-2 * largest, "gradients differ by {worst} (largest {largest}), mask {mask_dtype}");
    }

    // Autocast reads the bf16 scores of a product directly, casting only a bf16 mask.
    for mask_dtype in [DType::F32, DType::Bf16] {
        let g = Graph::new();
        g.mixed_precision(Precision::Bf16).unwrap();
        let q = g.input("q", [heads, t, 4], DType::F32).unwrap();
        let k = g.variable("k", [4, t], DType::F32, Init::Xavier { seed: 3 }).unwrap();
        let v = g.variable("v", [t, 4], DType::F32, Init::Xavier { seed: 4 }).unwrap();
        let mask = g.input("mask", [t, t], mask_dtype).unwrap();
        let scores = q.matmul(&k).unwrap();
        assert_eq!(scores.dtype(), DType::Bf16);
        let probs = scores.masked_softmax(&mask, 0.5).unwrap();
        let out = probs.matmul(&v).unwrap();
        let loss = out.sum_to(&Shape::scalar()).unwrap();
        let grads = g.grad(loss, &[scores, probs]).unwrap();
        assert_eq!((probs.dtype(), grads[0].dtype(), grads[1].dtype()), (DType::Bf16, DType::Bf16, DType::Bf16));
        let copies = f32_casts_shaped(&g, &[heads, t, t]);
        assert_eq!(copies, 0, "no f32 copy of the scores, probabilities or gradients (mask {mask_dtype})");
    }
}

/// Scores and masks of other dtype pairs, and a gradient whose dtype is not the
/// probabilities', are refused with both dtypes named.
#[test]
fn masked_softmax_refuses_dtype_pairs_it_does_not_widen() {
    let g = Graph::new();
    let x = g.input("x", [2, 3], DType::F64).unwrap();
    let mask = g.input("mask", [3], DType::F32).unwrap();
    let err = x.masked_softmax(&mask, 1.0).unwrap_err().to_string();
    assert!(err.contains("f64") && err.contains("f32") && err.contains("bf16 or f16 and f32"), "{err}");
    let y = g.input("y", [2, 3], DType::F32).unwrap();
    let dy = g.input("dy", [2, 3], DType::Bf16).unwrap();
    let bad = regflow_graph::ops::MaskedSoftmaxGrad { scale: 1.0 };
    let err = g.apply(bad, &[y, dy]).unwrap_err().to_string();
    assert!(err.contains("f32") && err.contains("bf16"), "{err}");
}

/// How many casts in `g` make an f32 tensor of `dims`: an f32 copy of bf16 values.
fn f32_casts_shaped(g: &Graph, dims: &[usize]) -> usize {
    g.nodes()
        .iter()
        .filter(|n| n.op.name() == "cast")
        .flat_map(|n| n.outputs.iter())
        .filter(|&&t| g.info(t).meta.dtype == DType::F32 && g.info(t).meta.shape.dims() == dims)
        .count()
}
