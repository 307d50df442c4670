//! Graph building: ops on tensors of the wrong shape or dtype, bad axes, names used twice,
//! tensors of another graph, gradients and evaluation of what cannot be.

use crate::Catalogue;
use regflow::graph::{DType, Graph, HostArray, Init, Optimizer, Shape};

const OP: &str = "GraphError::Op";

#[test]
fn graph_building() {
    let mut c = Catalogue::new("graphs");
    let g = Graph::new();
    let f = |name: &str, shape: &[usize]| g.input(name, Shape::from(shape), DType::F32).unwrap();
    let a23 = f("a23", &[2, 3]);
    let b45 = f("b45", &[4, 5]);
    let v3 = f("v3", &[3]);
    let v4 = f("v4", &[4]);
    let a32 = f("a32", &[3, 2]);
    let d23 = g.input("d23", [2, 3], DType::F64).unwrap();
    let i23 = g.input("i23", [2, 3], DType::I64).unwrap();
    let labels_f = f("labels_f", &[2]);
    let labels5 = g.input("labels5", [5], DType::I64).unwrap();
    let ids_f = f("ids_f", &[4]);

    c.case("matmul with mismatched inner dims", || a23.matmul(&b45), OP, &["matmul", "[2, 3]", "[4, 5]"]);
    c.case("matmul of a vector", || v3.matmul(&a32), OP, &["matmul", "f32[3]"]);
    c.case("matmul of f32 by f64", || a32.matmul(&d23), OP, &["matmul", "f32", "f64"]);
    c.case("matmul of i64 tensors", || i23.matmul(&i23.transpose(0, 1)?), OP, &["matmul", "i64"]);
    c.case("add of shapes that do not broadcast", || v4.add(&v3), OP, &["add", "[4]", "[3]"]);
    c.case("add of f32 and i64", || a23.add(&i23), OP, &["add", "f32[2, 3]", "i64[2, 3]"]);
    c.case("sub of transposed shapes", || a23.sub(&a32), OP, &["sub", "[2, 3]", "[3, 2]"]);
    c.case("mul of f32 and f64", || a23.mul(&d23), OP, &["mul", "f64"]);
    c.case("div of shapes that do not broadcast", || b45.div(&a23), OP, &["div", "[4, 5]", "[2, 3]"]);
    c.case("cross entropy with float labels", || a23.sparse_cross_entropy(&labels_f), OP, &["labels", "f32"]);
    c.case("cross entropy with labels of another batch", || a23.sparse_cross_entropy(&labels5), OP, &["[5]", "[2]"]);
    c.case("cross entropy of rank-1 logits", || v3.sparse_cross_entropy(&labels5), OP, &["[N, C]", "[3]"]);
    c.case("softmax over an axis out of range", || a23.softmax(5), OP, &["softmax", "5"]);
    c.case("log_softmax over a negative axis out of range", || a23.log_softmax(-3), OP, &["-3"]);
    c.case("softmax of i64", || i23.softmax(1), OP, &["i64"]);
    c.case("sum over an axis out of range", || a23.sum(&[7], false), OP, &["sum", "7"]);
    c.case("mean over an axis out of range", || a23.mean(&[-4], true), OP, &["mean", "-4"]);
    c.case("max over an axis out of range", || a23.max(&[2], false), OP, &["max", "2"]);
    c.case("sum of i64", || i23.sum(&[0], false), OP, &["i64"]);
    c.case("reshape to another element count", || a23.reshape(&[4, 2]), OP, &["reshape", "[4, 2]"]);
    c.case("reshape with two inferred dims", || a23.reshape(&[-1, -1]), OP, &["reshape", "-1"]);
    c.case("reshape with a dim below -1", || a23.reshape(&[-2, 3]), OP, &["reshape", "-2"]);
    c.case("permute that repeats an axis", || a23.permute(&[0, 0]), OP, &["permute", "[0, 0]"]);
    c.case("permute of the wrong length", || a23.permute(&[0, 1, 2]), OP, &["permute", "[0, 1, 2]"]);
    c.case("transpose of an axis out of range", || a23.transpose(0, 2), OP, &["2"]);
    c.case("slice past the end", || a23.slice(1, 1, 4), OP, &["slice", "4", "3"]);
    c.case("slice that starts after it ends", || a23.slice(1, 2, 1), OP, &["slice", "2", "1"]);
    c.case("slice of an axis out of range", || a23.slice(3, 0, 1), OP, &["slice", "3"]);
    c.case("concat of mismatched dims", || a23.concat(&[b45], 0), OP, &["concat", "[2, 3]", "[4, 5]"]);
    c.case("concat over an axis out of range", || a23.concat(&[a23], 2), OP, &["concat", "2"]);
    c.case("concat of f32 and f64", || a23.concat(&[d23], 0), OP, &["concat", "f64"]);
    c.case("concat of nothing", || regflow::graph::ops::concat(&[], 0), OP, &["concat"]);
    c.case("embedding with float ids", || a23.embedding(&ids_f), OP, &["ids", "f32"]);
    c.case("embedding of a rank-1 table", || v3.embedding(&labels5), OP, &["table", "[3]"]);
    c.case("layer norm with a scale of the wrong size", || a23.layer_norm(&v4, &v3, 1e-5), OP, &["[3]", "[4]"]);
    c.case("layer norm with a negative eps", || a23.layer_norm(&v3, &v3, -1.0), OP, &["eps", "-1"]);
    c.case("layer norm with a NaN eps", || a23.layer_norm(&v3, &v3, f64::NAN), OP, &["eps", "NaN"]);
    c.case("dropout with p = 1.5", || a23.dropout(1.5, 0), OP, &["dropout", "1.5"]);
    c.case("dropout with p = 1", || a23.dropout(1.0, 0), OP, &["dropout", "1"]);
    c.case("log of i64", || i23.log(), OP, &["i64"]);
    c.case("sum_to a shape it does not broadcast to", || a23.sum_to(&Shape::from(&[4][..])), OP, &["[4]", "[2, 3]"]);
    c.case("broadcast_to a smaller shape", || a23.broadcast_to(&Shape::from(&[3][..])), OP, &["[2, 3]", "[3]"]);
    c.case(
        "an input named like another input",
        || g.input("a23", [1], DType::F32),
        "GraphError::DuplicateName",
        &["'a23'"],
    );
    c.case(
        "a variable named like an input",
        || g.variable("v3", [3], DType::F32, Init::Zeros),
        "GraphError::DuplicateName",
        &["'v3'"],
    );
    c.case(
        "a uniform initializer with low >= high",
        || g.variable("u", [3], DType::F32, Init::Uniform { low: 1.0, high: 0.0, seed: 0 }),
        OP,
        &["'u'", "[1, 0)"],
    );
    c.case(
        "a normal initializer with a negative std",
        || g.variable("n", [3], DType::F32, Init::Normal { mean: 0.0, std: -1.0, seed: 0 }),
        OP,
        &["'n'", "-1"],
    );
    let other = Graph::new();
    let foreign = other.input("x", [2, 3], DType::F32).unwrap();
    c.case("add of a tensor of another graph", || a23.add(&foreign), "GraphError::ForeignTensor", &["add", "input 1"]);
    c.case("grad of a non-scalar", || g.grad(a23, &[a23]), "GraphError::NonScalarLoss", &["[2, 3]"]);
    c.case(
        "minimize a non-scalar loss",
        || g.minimize(a23, &Optimizer::sgd(0.1, 0.0, 0.0)).map(|_| ()),
        "GraphError::NonScalarLoss",
        &["[2, 3]"],
    );
    let h = Graph::new();
    let x = h.input("x", [2], DType::F32).unwrap();
    let y = h.input("y", [2], DType::F32).unwrap();
    let sum = x.add(&y).unwrap();
    let two = || HostArray::f32([2], vec![1.0, 2.0]).unwrap();
    c.case("eval without a feed for an input", || h.eval(&[(x, two())], &[sum]), "GraphError::MissingFeed", &["'y'"]);
    c.case(
        "eval with a feed of the wrong shape",
        || h.eval(&[(x, two()), (y, HostArray::f32([3], vec![0.0; 3]).unwrap())], &[sum]),
        "GraphError::Feed",
        &["'y'", "[3]", "[2]"],
    );
    c.case(
        "eval with a feed of the wrong dtype",
        || h.eval(&[(x, two()), (y, HostArray::f64([2], vec![0.0; 2]).unwrap())], &[sum]),
        "GraphError::Feed",
        &["'y'", "f64"],
    );
    c.case(
        "eval with a feed for an op output",
        || h.eval(&[(x, two()), (y, two()), (sum, two())], &[sum]),
        "GraphError::Feed",
        &["add"],
    );
    c.finish();
}

#[test]
fn an_initializer_for_an_integer_variable_is_named_in_words() {
    let mut c = Catalogue::new("graphs");
    let g = Graph::new();
    c.case(
        "a Xavier initializer for an i64 variable",
        || g.variable("steps", [3], DType::I64, Init::Xavier { seed: 0 }),
        OP,
        &["'steps'", "i64", "Xavier"],
    );
    c.finish();
}
