//! Shared test helpers: seeded random arrays and a gradient check of any op against
//! central finite differences in f64.
#![allow(dead_code)]

use regflow_graph::{DType, Graph, GraphError, HostArray, HostData, Shape, SplitMix64, Tensor};

/// Normal(0, 1) f64 values of `shape`, from `seed`.
pub(crate) fn random(shape: impl Into<Shape>, seed: u64) -> HostArray {
    let shape = shape.into();
    let mut rng = SplitMix64::new(seed);
    let data = (0..shape.numel()).map(|_| rng.next_normal()).collect();
    HostArray { shape, data: HostData::F64(data) }
}

/// Uniform integers in `0..high` of `shape`, from `seed` (indices, labels).
pub(crate) fn random_indices(shape: impl Into<Shape>, high: i64, seed: u64) -> HostArray {
    let shape = shape.into();
    let mut rng = SplitMix64::new(seed);
    let data = (0..shape.numel()).map(|_| (rng.next_u64() % high as u64) as i64).collect();
    HostArray { shape, data: HostData::I64(data) }
}

/// One graph input per array, named `x0`, `x1`, … with the array's shape and dtype.
pub(crate) fn graph_inputs<'g>(g: &'g Graph, arrays: &[HostArray]) -> Result<Vec<Tensor<'g>>, GraphError> {
    arrays.iter().enumerate().map(|(i, a)| g.input(&format!("x{i}"), a.shape.clone(), a.dtype())).collect()
}

/// `array`'s values as an f32 array.
pub(crate) fn to_f32(array: &HostArray) -> HostArray {
    HostArray::f32(array.shape.clone(), array.to_f64_vec().iter().map(|&v| v as f32).collect()).unwrap()
}

/// Asserts each `actual` value is within `tolerance · (1 + |expected|)` of `expected`.
pub(crate) fn assert_close(name: &str, actual: &[f64], expected: &[f64], tolerance: f64) {
    assert_eq!(actual.len(), expected.len(), "{name}");
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        assert!((a - e).abs() <= tolerance * (1.0 + e.abs()), "{name}: element {i}: {a} vs {e}");
    }
}

/// Evaluates `build(inputs)` with the arrays fed.
pub(crate) fn eval_op<F>(inputs: &[HostArray], build: F) -> Result<HostArray, GraphError>
where
    F: for<'g> Fn(&[Tensor<'g>]) -> Result<Tensor<'g>, GraphError>,
{
    let g = Graph::new();
    let xs = graph_inputs(&g, inputs)?;
    let y = build(&xs)?;
    let feeds: Vec<_> = xs.into_iter().zip(inputs.iter().cloned()).collect();
    Ok(g.eval(&feeds, &[y])?.remove(0))
}

fn with_element(array: &HostArray, index: usize, delta: f64) -> HostArray {
    let mut out = array.clone();
    if let HostData::F64(v) = &mut out.data {
        v[index] += delta;
    }
    out
}

/// Checks the gradients `graph.grad` builds for `build(inputs)` against central finite
/// differences, for every f64 input (i64 inputs are indices and get no gradient). The
/// loss is `sum(y * r)` with a random `r`, so every output element's gradient matters.
///
/// Panics with the op, the input, the element and both values on a mismatch.
pub(crate) fn check_grad<F>(name: &str, inputs: &[HostArray], build: F)
where
    F: for<'g> Fn(&[Tensor<'g>]) -> Result<Tensor<'g>, GraphError>,
{
    let g = Graph::new();
    let xs = graph_inputs(&g, inputs).unwrap();
    let y = build(&xs).unwrap_or_else(|e| panic!("{name}: building failed: {e}"));
    let r_value = random(y.shape(), 0xfeed);
    let r = g.input("r", y.shape(), DType::F64).unwrap();
    let loss = y.mul(&r).unwrap().sum_to(&Shape::scalar()).unwrap();
    let float_inputs: Vec<usize> = (0..inputs.len()).filter(|&i| inputs[i].dtype() == DType::F64).collect();
    let wrt: Vec<Tensor<'_>> = float_inputs.iter().map(|&i| xs[i]).collect();
    let grads = g.grad(loss, &wrt).unwrap_or_else(|e| panic!("{name}: grad failed: {e}"));

    let feeds = |values: &[HostArray]| -> Vec<(Tensor<'_>, HostArray)> {
        let mut feeds: Vec<_> = xs.iter().copied().zip(values.iter().cloned()).collect();
        feeds.push((r, r_value.clone()));
        feeds
    };
    let analytic = g.eval(&feeds(inputs), &grads).unwrap_or_else(|e| panic!("{name}: eval failed: {e}"));
    let loss_at = |values: &[HostArray]| g.eval(&feeds(values), &[loss]).unwrap()[0].to_f64_vec()[0];
    let eps = 1e-6;
    for (k, &i) in float_inputs.iter().enumerate() {
        let a = analytic[k].to_f64_vec();
        for (e, &autodiff) in a.iter().enumerate() {
            let mut plus = inputs.to_vec();
            plus[i] = with_element(&inputs[i], e, eps);
            let mut minus = inputs.to_vec();
            minus[i] = with_element(&inputs[i], e, -eps);
            let numeric = (loss_at(&plus) - loss_at(&minus)) / (2.0 * eps);
            let tolerance = 1e-6 * (1.0 + numeric.abs().max(autodiff.abs()));
            assert!(
                (autodiff - numeric).abs() <= tolerance,
                "{name}: d loss / d x{i}[{e}]: autodiff {autodiff} vs finite differences {numeric}"
            );
        }
    }
}
