//! A reshape of an op's output compiles to a view: no actor and no copy, its readers
//! reading the producer's register under the new shape beside the input's other readers
//! (`graph/src/compile/lower/ops.rs`). Where an op reads both the input and the output, the
//! input is fed, or either is fetched, it stays a copy. Either way a step computes what the
//! reference evaluator does, and training runs to its end on one device and on a
//! data-parallel mesh.

use crate::common;

use regflow::graph::plan::Plan;
use regflow::graph::sbp::{Mesh, NdSbp, Sbp};
use regflow::graph::{
    CompileOptions, CompiledGraph, DType, Graph, HostArray, Init, Optimizer, ParallelOptions, Shape, SplitMix64, Tensor,
};
use regflow::prelude::*;

/// The plan's reshape actors.
fn reshape_actors(plan: &Plan) -> usize {
    common::ops(plan, "reshape").len()
}

fn input_values() -> HostArray {
    let mut rng = SplitMix64::new(5);
    HostArray::f32([4, 6], (0..24).map(|_| rng.next_normal() as f32).collect()).unwrap()
}

/// The losses of `steps` steps of `compiled`, fed the same `x` every step.
fn losses(compiled: &CompiledGraph, steps: usize) -> Vec<f64> {
    let job = Job::builder(compiled.plan.clone()).build().unwrap();
    common::fed_losses(job, &compiled.fetches[0], vec![vec![("x", input_values())]; steps], DType::F32)
}

/// Who else reads the product a reshape reads.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Readers {
    /// Nobody: the reshape alone.
    Alone,
    /// A sum of the product on its own.
    Another,
    /// An op reading the product and the reshape (of the product's own shape) together.
    Together,
}

/// `x · w` reshaped to `[4, 2, 4]`, squared and summed, with the product's other readers.
fn model<'g>(g: &'g Graph, readers: Readers) -> (Tensor<'g>, Tensor<'g>) {
    let x = g.input("x", [4, 6], DType::F32).unwrap();
    let w = g.variable("w", [6, 8], DType::F32, Init::Xavier { seed: 1 }).unwrap();
    let product = x.matmul(&w).unwrap();
    let heads = product.reshape(&[4, 2, 4]).unwrap();
    let mut loss = heads.mul(&heads).unwrap().sum_to(&Shape::scalar()).unwrap();
    match readers {
        Readers::Alone => {}
        Readers::Another => loss = loss.add(&product.sum_to(&Shape::scalar()).unwrap()).unwrap(),
        Readers::Together => {
            let same = product.reshape(&[4, 8]).unwrap();
            loss = loss.add(&same.mul(&product).unwrap().sum_to(&Shape::scalar()).unwrap()).unwrap();
        }
    }
    (x, loss)
}

#[test]
fn a_reshape_of_an_ops_output_is_a_view_that_computes_the_same_values() {
    for readers in [Readers::Alone, Readers::Another, Readers::Together] {
        let g = Graph::new();
        let (x, loss) = model(&g, readers);
        let expected = g.eval(&[(x, input_values())], &[loss]).unwrap()[0].to_f64_vec()[0];
        let train = g.minimize(loss, &Optimizer::sgd(0.05, 0.9, 0.0).with_clip_norm(1.0)).unwrap();
        let compiled = g.compile(&[train.loss], &train.updates, &CompileOptions::default()).unwrap();
        // Every reshape is a view (the backward ones too: the gradients reshaped back),
        // but the one an op reads together with its input.
        let copies = usize::from(readers == Readers::Together);
        assert_eq!(reshape_actors(&compiled.plan), copies, "{readers:?}");
        let losses = losses(&compiled, 6);
        assert_eq!(losses.len(), 6);
        assert!((losses[0] - expected).abs() <= 1e-5 * expected.abs(), "{losses:?} vs {expected}");
        assert!(losses[5] < losses[0], "training moves the loss: {losses:?}");
    }
}

#[test]
fn reshapes_of_fed_inputs_and_fetched_reshapes_stay_copies() {
    let g = Graph::new();
    let x = g.input("x", [4, 6], DType::F32).unwrap();
    let w = g.variable("w", [6, 4], DType::F32, Init::Xavier { seed: 1 }).unwrap();
    // A fed input's registers are the feeder's: reshaping it copies.
    let flat = x.reshape(&[24]).unwrap().reshape(&[4, 6]).unwrap();
    let product = flat.matmul(&w).unwrap();
    // Fetched under its own name: a copy too.
    let fetched = product.reshape(&[16]).unwrap();
    let loss = fetched.sum_to(&Shape::scalar()).unwrap();
    let compiled = g.compile(&[loss, fetched], &[], &CompileOptions::default()).unwrap();
    // x -> [24] copies (fed input); [24] -> [4, 6] is a view (an op's output, read alone);
    // the fetched reshape copies.
    assert_eq!(reshape_actors(&compiled.plan), 2);
    let expected = g.eval(&[(x, input_values())], &[loss]).unwrap()[0].to_f64_vec()[0];
    let got = losses(&compiled, 1)[0];
    assert!((got - expected).abs() <= 1e-5 * expected.abs().max(1.0), "{got} vs {expected}");
}

/// On a data-parallel mesh each device's part of a batch-split product keeps its bytes
/// under the reshape, so the view holds there too, and two devices train like one.
#[test]
fn views_hold_on_a_data_parallel_mesh() {
    let run = |devices: usize| {
        let g = Graph::new();
        let (x, loss) = model(&g, Readers::Another);
        let mesh = Mesh::cpu(&[devices], &["dp"]).unwrap();
        g.set_layout(x, &mesh, NdSbp(vec![Sbp::Split(0)])).unwrap();
        let train = g.minimize(loss, &Optimizer::sgd(0.05, 0.9, 0.0)).unwrap();
        let options = ParallelOptions::new(mesh).train(&train);
        let compiled = g.compile_parallel(&[train.loss], &train.updates, &options).unwrap();
        (reshape_actors(&compiled.plan), losses(&compiled, 4))
    };
    let (one_actors, one) = run(1);
    let (two_actors, two) = run(2);
    assert_eq!((one_actors, two_actors), (0, 0));
    for (a, b) in one.iter().zip(&two) {
        assert!((a - b).abs() <= 1e-5 * a.abs(), "{one:?} vs {two:?}");
    }
}
