//! Gradient checks of the elementwise, broadcasting and fill ops against finite
//! differences, on random shapes and seeds.

mod common;

use common::{check_grad, random};
use regflow_graph::{DType, Graph, HostArray, Shape};

#[test]
fn binary_ops_with_broadcasting_match_finite_differences() {
    let cases: [(&[usize], &[usize]); 4] = [(&[3, 4], &[3, 4]), (&[2, 3, 4], &[4]), (&[3, 1], &[1, 5]), (&[], &[2, 2])];
    for (seed, (a, b)) in cases.iter().enumerate() {
        let inputs = [random(*a, seed as u64), random(*b, 100 + seed as u64)];
        check_grad("add", &inputs, |x| x[0].add(&x[1]));
        check_grad("sub", &inputs, |x| x[0].sub(&x[1]));
        check_grad("mul", &inputs, |x| x[0].mul(&x[1]));
        // Keep the divisor away from 0.
        check_grad("div", &inputs, |x| x[0].div(&x[1].mul(&x[1])?.add_scalar(0.5)?));
    }
}

#[test]
fn unary_ops_match_finite_differences() {
    for seed in 0..3u64 {
        let x = [random([2, 5], seed)];
        check_grad("neg", &x, |x| x[0].neg());
        check_grad("relu", &x, |x| x[0].relu());
        check_grad("exp", &x, |x| x[0].exp());
        check_grad("tanh", &x, |x| x[0].tanh());
        check_grad("sigmoid", &x, |x| x[0].sigmoid());
        check_grad("gelu", &x, |x| x[0].gelu());
        check_grad("add_scalar", &x, |x| x[0].add_scalar(3.0));
        check_grad("mul_scalar", &x, |x| x[0].mul_scalar(-1.5));
        // Positive domains for log, sqrt and fractional powers.
        check_grad("log", &x, |x| x[0].mul(&x[0])?.add_scalar(0.1)?.log());
        check_grad("sqrt", &x, |x| x[0].mul(&x[0])?.add_scalar(0.1)?.sqrt());
        check_grad("pow_scalar", &x, |x| x[0].mul(&x[0])?.add_scalar(0.1)?.pow_scalar(1.5));
    }
}

#[test]
fn sum_to_and_broadcast_to_match_finite_differences() {
    check_grad("sum_to", &[random([2, 3, 4], 1)], |x| x[0].sum_to(&Shape::from([3, 1])));
    check_grad("broadcast_to", &[random([3, 1], 2)], |x| x[0].broadcast_to(&Shape::from([2, 3, 4])));
}

#[test]
fn gradients_of_a_reused_tensor_are_summed() {
    // y = x * x + x: dy/dx = 2x + 1.
    let g = Graph::new();
    let x = g.input("x", [3], DType::F64).unwrap();
    let y = x.mul(&x).unwrap().add(&x).unwrap().sum_to(&Shape::scalar()).unwrap();
    let dx = g.grad(y, &[x]).unwrap()[0];
    let value = HostArray::f64([3], vec![1.0, -2.0, 0.5]).unwrap();
    assert_eq!(g.eval(&[(x, value)], &[dx]).unwrap()[0].to_f64_vec(), [3.0, -3.0, 2.0]);
}

#[test]
fn build_errors_name_the_op_and_the_values() {
    let g = Graph::new();
    let a = g.input("a", [2, 3], DType::F32).unwrap();
    let b = g.input("b", [3, 2], DType::F32).unwrap();
    let c = g.input("c", [2, 3], DType::F64).unwrap();
    assert_eq!(
        a.add(&b).unwrap_err().to_string(),
        "add(f32[2, 3], f32[3, 2]): shapes [2, 3] and [3, 2] do not broadcast"
    );
    assert_eq!(a.mul(&c).unwrap_err().to_string(), "mul(f32[2, 3], f64[2, 3]): dtype mismatch: f32 vs f64");
    assert_eq!(g.input("a", [1], DType::F32).unwrap_err().to_string(), "a tensor named 'a' already exists");
    let not_scalar = a.relu().unwrap();
    assert_eq!(
        g.grad(not_scalar, &[a]).unwrap_err().to_string(),
        "loss must be a scalar to differentiate, got f32[2, 3]"
    );
    let other = Graph::new();
    let foreign = other.input("z", [2, 3], DType::F32).unwrap();
    assert_eq!(a.add(&foreign).unwrap_err().to_string(), "add: input 1 belongs to another graph");
}

#[test]
fn feeds_are_checked_by_name_shape_and_dtype() {
    let g = Graph::new();
    let x = g.input("x", [2, 2], DType::F32).unwrap();
    let y = x.relu().unwrap();
    let wrong = HostArray::f32([4], vec![0.0; 4]).unwrap();
    assert_eq!(g.eval(&[(x, wrong)], &[y]).unwrap_err().to_string(), "feed for 'x': got f32[4], expected f32[2, 2]");
    let wrong_dtype = HostArray::f64([2, 2], vec![0.0; 4]).unwrap();
    assert_eq!(
        g.eval(&[(x, wrong_dtype)], &[y]).unwrap_err().to_string(),
        "feed for 'x': got f64[2, 2], expected f32[2, 2]"
    );
    assert_eq!(g.eval(&[], &[y]).unwrap_err().to_string(), "input 'x' has no feed");
    let fed_op = HostArray::f32([2, 2], vec![0.0; 4]).unwrap();
    assert_eq!(
        g.eval(&[(y, fed_op)], &[y]).unwrap_err().to_string(),
        format!("feed for '{}': is not an input or a variable", y.name())
    );
}

/// ReLU's gradient is one `relu_grad` op reading the ReLU's output (not a `step` of its
/// input times the gradient): the gradient where the output is positive, else exactly 0
/// (no `-0` from `-g · 0`, and no NaN from `inf · 0`).
#[test]
fn relu_gradient_is_one_op_on_the_output() {
    let g = Graph::new();
    let x = g.input("x", [6], DType::F64).unwrap();
    let w = g.input("w", [6], DType::F64).unwrap();
    let y = x.relu().unwrap();
    let loss = y.mul(&w).unwrap().sum(&[0], false).unwrap();
    let dx = g.grad(loss, &[x]).unwrap()[0];
    let names: Vec<&str> = g.nodes().iter().map(|n| n.op.name()).collect();
    assert!(names.contains(&"relu_grad") && !names.contains(&"step"), "{names:?}");
    let xs = HostArray::f64([6], vec![-1.0, 0.0, 2.0, -0.0, 3.0, -5.0]).unwrap();
    let ws = HostArray::f64([6], vec![-4.0, 5.0, -6.0, f64::INFINITY, 7.0, f64::NAN]).unwrap();
    let got = g.eval(&[(x, xs), (w, ws)], &[dx]).unwrap().remove(0).to_f64_vec();
    let bits: Vec<u64> = got.iter().map(|v| v.to_bits()).collect();
    let want: Vec<u64> = [0.0, 0.0, -6.0, 0.0, 7.0, 0.0].iter().map(|v: &f64| v.to_bits()).collect();
    assert_eq!(bits, want, "{got:?}");
}
