//! Reductions and shape ops (`sum`, `mean`, `max`, `reshape`, `permute`, `transpose`,
//! `slice`, `concat`): gradients against finite differences on random shapes, forward
//! values on hand-computed cases, integer data movement, and build-time errors.

mod common;

use common::{check_grad, random};
use regflow_graph::ops::{concat, SliceGrad};
use regflow_graph::{DType, Graph, GraphError, HostArray, HostData, Shape, SplitMix64, Tensor};

/// A shape of `rank` dimensions, each in 1..=4.
fn random_shape(rng: &mut SplitMix64, rank: usize) -> Vec<usize> {
    (0..rank).map(|_| 1 + (rng.next_u64() % 4) as usize).collect()
}

/// 0, 1, 2, ... as i64 of `shape`.
fn iota_i64(shape: &[usize]) -> HostArray {
    let n: usize = shape.iter().product();
    HostArray::i64(shape, (0..n as i64).collect()).unwrap()
}

/// Evaluates `build` on one fed input and returns the output.
fn eval1<F>(value: HostArray, build: F) -> HostArray
where
    F: for<'g> Fn(Tensor<'g>) -> Tensor<'g>,
{
    let g = Graph::new();
    let x = g.input("x", value.shape.clone(), value.dtype()).unwrap();
    let y = build(x);
    g.eval(&[(x, value)], &[y]).unwrap().remove(0)
}

#[test]
fn reductions_match_finite_differences_on_random_shapes_and_axes() {
    let mut rng = SplitMix64::new(7);
    for seed in 0..6u64 {
        let rank = 1 + (rng.next_u64() % 3) as usize;
        let shape = random_shape(&mut rng, rank);
        // A random non-empty subset of the axes, some written negative.
        let mut axes: Vec<isize> = (0..rank as isize).filter(|_| rng.next_u64().is_multiple_of(2)).collect();
        if axes.is_empty() {
            axes.push(-1);
        } else if seed % 2 == 1 {
            axes[0] -= rank as isize;
        }
        let x = [random(Shape::new(shape.clone()), seed)];
        for keepdim in [false, true] {
            let name = |op: &str| format!("{op} {shape:?} axes {axes:?} keepdim {keepdim}");
            check_grad(&name("sum"), &x, |x| x[0].sum(&axes, keepdim));
            check_grad(&name("mean"), &x, |x| x[0].mean(&axes, keepdim));
            // Normal samples have no ties, so max is differentiable at them.
            check_grad(&name("max"), &x, |x| x[0].max(&axes, keepdim));
        }
    }
    let x = [random([2, 3, 4], 11)];
    check_grad("sum_squares", &x, |x| x[0].sum_squares());
    check_grad("sum_all", &x, |x| x[0].sum_all());
    check_grad("mean_all", &x, |x| x[0].mean_all());
    check_grad("max over every axis", &x, |x| x[0].max(&[], true));
}

#[test]
fn shape_ops_match_finite_differences_on_random_shapes() {
    let mut rng = SplitMix64::new(3);
    for seed in 0..4u64 {
        let shape = random_shape(&mut rng, 3);
        let x = [random(Shape::new(shape.clone()), seed)];
        check_grad("reshape", &x, |x| x[0].reshape(&[-1, shape[2] as isize]));
        check_grad("reshape to a vector", &x, |x| x[0].reshape(&[-1]));
        check_grad("permute", &x, |x| x[0].permute(&[2, 0, 1]));
        check_grad("permute with negative axes", &x, |x| x[0].permute(&[-2, -1, 0]));
        check_grad("transpose", &x, |x| x[0].transpose(0, -1));
        let axis = (rng.next_u64() % 3) as usize;
        let start = (rng.next_u64() % shape[axis] as u64) as usize;
        let end = start + 1 + (rng.next_u64() % (shape[axis] - start) as u64) as usize;
        check_grad(&format!("slice {shape:?} axis {axis} {start}..{end}"), &x, |x| {
            x[0].slice(axis as isize, start, end)
        });
        let mut other = shape.clone();
        other[axis] = 1 + (rng.next_u64() % 3) as usize;
        let inputs = [
            random(Shape::new(shape.clone()), seed),
            random(Shape::new(other.clone()), 50 + seed),
            random(Shape::new(shape.clone()), 90 + seed),
        ];
        check_grad(&format!("concat {shape:?} {other:?} axis {axis}"), &inputs, |x| concat(x, axis as isize));
    }
}

#[test]
fn composed_shape_ops_match_finite_differences() {
    let x = [random([2, 3, 4], 21), random([3, 2], 22)];
    check_grad("permute, reshape, slice, concat, reduce", &x, |x| {
        let a = x[0].permute(&[1, 0, 2])?.reshape(&[3, -1])?.slice(1, 2, 7)?;
        let b = x[1].concat(&[a], -1)?;
        b.max(&[1], true)?.add(&b.mean(&[0], false)?)?.sum(&[0], false)
    });
}

#[test]
fn slice_grad_pads_with_zeros_and_differentiates_to_a_slice() {
    let x = [random([2, 3], 31)];
    check_grad("slice_grad", &x, |x| x[0].graph().apply1(SliceGrad { axis: 1, start: 2, size: 6 }, &[x[0]]));
    let value = HostArray::f64([2, 2], vec![1.0, 2.0, 3.0, 4.0]).unwrap();
    let padded = eval1(value, |x| x.graph().apply1(SliceGrad { axis: 0, start: 1, size: 4 }, &[x]).unwrap());
    assert_eq!(padded.shape, Shape::from([4, 2]));
    assert_eq!(padded.to_f64_vec(), [0.0, 0.0, 1.0, 2.0, 3.0, 4.0, 0.0, 0.0]);
}

#[test]
fn reductions_compute_hand_checked_values() {
    let x = || HostArray::f64([2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
    let sum1 = eval1(x(), |x| x.sum(&[1], false).unwrap());
    assert_eq!((&sum1.shape, sum1.to_f64_vec()), (&Shape::from([2]), vec![6.0, 15.0]));
    let sum1_keep = eval1(x(), |x| x.sum(&[-1], true).unwrap());
    assert_eq!((&sum1_keep.shape, sum1_keep.to_f64_vec()), (&Shape::from([2, 1]), vec![6.0, 15.0]));
    let mean0 = eval1(x(), |x| x.mean(&[0], false).unwrap());
    assert_eq!((&mean0.shape, mean0.to_f64_vec()), (&Shape::from([3]), vec![2.5, 3.5, 4.5]));
    let max_all = eval1(x(), |x| x.max(&[], false).unwrap());
    assert_eq!((&max_all.shape, max_all.to_f64_vec()), (&Shape::scalar(), vec![6.0]));
    let max_keep = eval1(x(), |x| x.max(&[0, 1], true).unwrap());
    assert_eq!((&max_keep.shape, max_keep.to_f64_vec()), (&Shape::from([1, 1]), vec![6.0]));
    assert_eq!(eval1(x(), |x| x.sum_all().unwrap()).to_f64_vec(), [21.0]);
    assert_eq!(eval1(x(), |x| x.mean_all().unwrap()).to_f64_vec(), [3.5]);
    let negative = HostArray::f32([2, 2], vec![-3.0, -1.0, -2.0, -5.0]).unwrap();
    let max_f32 = eval1(negative, |x| x.max(&[1], false).unwrap());
    assert_eq!(max_f32.data, HostData::F32(vec![-1.0, -2.0]));
}

#[test]
fn max_gradient_goes_to_the_maximum_and_ties_share_it_evenly() {
    let g = Graph::new();
    let x = g.input("x", [2, 3], DType::F64).unwrap();
    let loss = x.max(&[1], false).unwrap().mul_scalar(6.0).unwrap().sum_all().unwrap();
    let dx = g.grad(loss, &[x]).unwrap()[0];
    let value = HostArray::f64([2, 3], vec![1.0, 7.0, -2.0, 3.0, 0.5, 3.0]).unwrap();
    let out = g.eval(&[(x, value)], &[dx]).unwrap();
    assert_eq!(out[0].to_f64_vec(), [0.0, 6.0, 0.0, 3.0, 0.0, 3.0]);
}

#[test]
fn permute_moves_every_element_to_its_new_position() {
    let out = eval1(iota_i64(&[2, 3, 4]), |x| x.permute(&[2, 0, 1]).unwrap());
    assert_eq!(out.shape, Shape::from([4, 2, 3]));
    let mut expected = Vec::new();
    for k in 0..4 {
        for i in 0..2 {
            for j in 0..3 {
                // out[k, i, j] = x[i, j, k]
                expected.push(i * 12 + j * 4 + k);
            }
        }
    }
    assert_eq!(out.data, HostData::I64(expected));
    let transposed = eval1(iota_i64(&[2, 3]), |x| x.transpose(-1, 0).unwrap());
    assert_eq!(transposed.shape, Shape::from([3, 2]));
    assert_eq!(transposed.data, HostData::I64(vec![0, 3, 1, 4, 2, 5]));
    let same = eval1(iota_i64(&[2, 3]), |x| x.permute(&[0, 1]).unwrap());
    assert_eq!(same.data, HostData::I64(vec![0, 1, 2, 3, 4, 5]));
}

#[test]
fn reshape_slice_and_concat_move_integer_data() {
    let flat = eval1(iota_i64(&[2, 3]), |x| x.reshape(&[-1]).unwrap());
    assert_eq!((flat.shape, flat.data), (Shape::from([6]), HostData::I64(vec![0, 1, 2, 3, 4, 5])));
    let inferred = eval1(iota_i64(&[2, 3]), |x| x.reshape(&[3, -1]).unwrap());
    assert_eq!(inferred.shape, Shape::from([3, 2]));

    let columns = eval1(iota_i64(&[2, 4]), |x| x.slice(1, 1, 3).unwrap());
    assert_eq!((columns.shape, columns.data), (Shape::from([2, 2]), HostData::I64(vec![1, 2, 5, 6])));
    let rows = eval1(iota_i64(&[3, 2]), |x| x.slice(-2, 2, 3).unwrap());
    assert_eq!(rows.data, HostData::I64(vec![4, 5]));

    let g = Graph::new();
    let a = g.input("a", [2, 2], DType::I64).unwrap();
    let b = g.input("b", [2, 1], DType::I64).unwrap();
    let side = a.concat(&[b], 1).unwrap();
    let stacked = concat(&[a, a], 0).unwrap();
    let feeds =
        [(a, HostArray::i64([2, 2], vec![1, 2, 3, 4]).unwrap()), (b, HostArray::i64([2, 1], vec![5, 6]).unwrap())];
    let out = g.eval(&feeds, &[side, stacked]).unwrap();
    assert_eq!(out[0].shape, Shape::from([2, 3]));
    assert_eq!(out[0].data, HostData::I64(vec![1, 2, 5, 3, 4, 6]));
    assert_eq!(out[1].shape, Shape::from([4, 2]));
    assert_eq!(out[1].data, HostData::I64(vec![1, 2, 3, 4, 1, 2, 3, 4]));
}

#[test]
fn f32_shape_ops_compute_the_same_values() {
    let value = HostArray::f32([2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
    let out = eval1(value, |x| {
        let t = x.transpose(0, 1).unwrap().reshape(&[2, 3]).unwrap().slice(1, 1, 3).unwrap();
        t.concat(&[t], 0).unwrap()
    });
    assert_eq!(out.shape, Shape::from([4, 2]));
    assert_eq!(out.data, HostData::F32(vec![4.0, 2.0, 3.0, 6.0, 4.0, 2.0, 3.0, 6.0]));
}

#[test]
fn build_errors_name_the_op_and_the_values() {
    let g = Graph::new();
    let x = g.input("x", [2, 3], DType::F64).unwrap();
    let cube = g.input("cube", [2, 3, 4], DType::F64).unwrap();
    let wide = g.input("wide", [3, 4], DType::F64).unwrap();
    let single = g.input("single", [2, 3], DType::F32).unwrap();
    let labels = g.input("labels", [2, 3], DType::I64).unwrap();
    let error = |result: Result<Tensor<'_>, GraphError>| result.unwrap_err().to_string();

    assert_eq!(
        error(x.reshape(&[4, 2])),
        "reshape(f64[2, 3]): cannot reshape [2, 3] (6 elements) to [4, 2] (8 elements)"
    );
    assert_eq!(error(x.reshape(&[-1, -1])), "reshape(f64[2, 3]): at most one dimension may be -1, got [-1, -1]");
    assert_eq!(
        error(x.reshape(&[4, -1])),
        "reshape(f64[2, 3]): cannot reshape [2, 3] (6 elements) to [4, -1]: 6 is not a multiple of 4"
    );
    assert_eq!(error(x.reshape(&[-2, -3])), "reshape(f64[2, 3]): invalid dimension -2 in [-2, -3]");

    assert_eq!(
        error(cube.permute(&[0, 0, 1])),
        "permute(f64[2, 3, 4]): [0, 0, 1] is not a permutation of 0..3: axis 0 appears twice"
    );
    assert_eq!(
        error(cube.permute(&[1, 0])),
        "permute(f64[2, 3, 4]): permutation [1, 0] has 2 axes, but the input has rank 3"
    );
    assert_eq!(error(cube.permute(&[0, 1, 3])), "permute(f64[2, 3, 4]): axis 3 out of range for rank 3");
    assert_eq!(error(x.transpose(0, -3)), "transpose(f64[2, 3]): axis -3 out of range for rank 2");

    assert_eq!(error(x.sum(&[3], false)), "sum(f64[2, 3]): axis 3 out of range for rank 2");
    assert_eq!(error(x.mean(&[1, -1], true)), "mean(f64[2, 3]): axes [1, -1] name axis 1 twice");
    assert_eq!(error(labels.max(&[0], false)), "max(i64[2, 3]): needs a float input, got i64");

    assert_eq!(error(x.slice(1, 2, 4)), "slice(f64[2, 3]): slice 2..4 out of bounds for axis 1 of size 3");
    assert_eq!(
        error(x.slice(-1, 2, 2)),
        "slice(f64[2, 3]): slice 2..2 of axis 1 is empty: start must be less than end"
    );
    assert_eq!(error(x.slice(2, 0, 1)), "slice(f64[2, 3]): axis 2 out of range for rank 2");

    assert_eq!(
        error(x.concat(&[wide], 1)),
        "concat(f64[2, 3], f64[3, 4]): input 1 has shape [3, 4], input 0 has [2, 3]: they must agree on every axis but 1"
    );
    assert_eq!(
        error(x.concat(&[cube], 0)),
        "concat(f64[2, 3], f64[2, 3, 4]): input 1 has shape [2, 3, 4], input 0 has [2, 3]: they must agree on every \
         axis but 0"
    );
    assert_eq!(
        error(x.concat(&[single], 0)),
        "concat(f64[2, 3], f32[2, 3]): dtype mismatch: input 1 is f32, input 0 is f64"
    );
    assert_eq!(error(x.concat(&[x], -3)), "concat(f64[2, 3], f64[2, 3]): axis -3 out of range for rank 2");
    assert_eq!(error(concat(&[], 0)), "concat(): needs at least one input");
}

/// `sum_squares` is the bits of `x · x` summed to a scalar, in f32 and f64, and refuses
/// integers naming the dtype.
#[test]
fn sum_squares_equals_the_square_then_sum_bit_for_bit() {
    for (seed, shape) in [(1u64, vec![7]), (2, vec![33, 65]), (3, vec![2, 3, 5, 7]), (4, vec![1000, 70])] {
        let values = random(Shape::new(shape.clone()), seed);
        for dtype in [DType::F32, DType::F64] {
            let value = match dtype {
                DType::F32 => HostArray::f32(shape.clone(), values.to_f64_vec().iter().map(|&v| v as f32).collect()),
                _ => Ok(values.clone()),
            }
            .unwrap();
            let fused = eval1(value.clone(), |x| x.sum_squares().unwrap()).to_f64_vec();
            let apart = eval1(value, |x| x.mul(&x).unwrap().sum_to(&Shape::scalar()).unwrap()).to_f64_vec();
            assert_eq!(fused, apart, "{dtype} {shape:?}");
        }
    }
    let g = Graph::new();
    let ids = g.input("ids", [3], DType::I64).unwrap();
    let err = ids.sum_squares().unwrap_err().to_string();
    assert!(err.contains("sum_squares") && err.contains("i64"), "{err}");
}
