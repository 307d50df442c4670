//! Elementwise ops on CUDA against the CPU kernels (skip without a GPU): every unary kind,
//! binary ops with and without broadcasting (and with one 16-bit operand), bias GELU and its gradient, dropout; in f32,
//! f64 and bf16 (whose kernels compute in f32 and round each output once, as the CPU's).

mod common;

use regflow_plan::ops::{BiasGelu, BiasGeluGrad, Binary, BinaryKind, Dropout, DropoutPart, OpAttrs, Unary, UnaryKind};
use regflow_plan::{DType, HostArray, Shape, SplitMix64, TensorMeta};

/// Odd sizes: one element, less than a warp, less than a block, more than one grid-stride
/// pass would need with small grids.
const SIZES: &[usize] = &[1, 7, 1023, 70_001];

/// The float dtypes with CUDA elementwise kernels.
const FLOATS: [DType; 3] = [DType::F32, DType::F64, DType::Bf16];

/// Relative tolerance of a dtype (f32 differs by a few ulp in exp/tanh and where the device
/// fuses a multiply-add; in bf16 that may move a result across a rounding boundary, one
/// bf16 ulp: at most 2^-7 relative).
fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::Bf16 => 1e-2,
        _ => 1e-12,
    }
}

/// Values uniform in [lo, hi) of `dtype`.
fn random(shape: &[usize], dtype: DType, seed: u64, (lo, hi): (f64, f64)) -> HostArray {
    let mut rng = SplitMix64::new(seed);
    let n: usize = shape.iter().product();
    let values: Vec<f64> = (0..n).map(|_| lo + (hi - lo) * rng.next_f64()).collect();
    HostArray::from_f64(shape.to_vec(), dtype, &values).expect("an array")
}

fn check(
    what: &str,
    op: &dyn OpAttrs,
    inputs: &[&HostArray],
    outputs: &[TensorMeta],
    gpu: (&regflow_cuda::Device, &regflow_cuda::Stream),
    rel: f64,
) {
    let conf = common::conf(op, inputs, outputs);
    // Registers off alignment take the kernels' one-element loops (`EIGHT` in the prelude).
    common::check_both(what, &conf, inputs, gpu, rel);
}

#[test]
fn every_unary_kind_matches_the_cpu() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let kinds = [
        (UnaryKind::Neg, (-5.0, 5.0)),
        (UnaryKind::Relu, (-5.0, 5.0)),
        (UnaryKind::Step, (-5.0, 5.0)),
        (UnaryKind::Exp, (-20.0, 20.0)),
        (UnaryKind::Log, (1e-3, 100.0)),
        (UnaryKind::Sqrt, (0.0, 100.0)),
        (UnaryKind::Tanh, (-10.0, 10.0)),
        (UnaryKind::Sigmoid, (-30.0, 30.0)),
        (UnaryKind::Gelu, (-8.0, 8.0)),
        (UnaryKind::GeluDerivative, (-8.0, 8.0)),
        (UnaryKind::AddScalar(0.1), (-5.0, 5.0)),
        (UnaryKind::MulScalar(-1.7), (-5.0, 5.0)),
        (UnaryKind::PowScalar(2.5), (0.0, 4.0)),
        (UnaryKind::PowScalar(-1.0), (0.5, 4.0)),
    ];
    for dtype in FLOATS {
        for &(kind, range) in &kinds {
            for &n in SIZES {
                let x = random(&[n], dtype, n as u64, range);
                check(
                    &format!("{kind:?} {dtype} [{n}]"),
                    &Unary(kind),
                    &[&x],
                    &[x.meta()],
                    (&device, &stream),
                    tolerance(dtype),
                );
            }
        }
    }
}

#[test]
fn binary_ops_match_the_cpu_with_and_without_broadcasting() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let shapes: &[(&[usize], &[usize])] = &[
        (&[1], &[1]),
        (&[7], &[7]),
        (&[70_001], &[70_001]),
        (&[3, 1023], &[1023]),
        (&[70_001, 1], &[1, 3]),
        (&[2, 1, 7], &[5, 1]),
        (&[], &[7, 3]),
        (&[1023], &[]),
        (&[2, 3, 1, 5, 1, 2, 1, 3, 2], &[3, 1, 5, 7, 2, 1, 3, 1]),
        // Rows of a multiple of eight read contiguously by both operands (a bias on either
        // side, over a merged batch): eight elements per step.
        (&[5, 64], &[64]),
        (&[64], &[5, 64]),
        (&[3, 8, 16], &[16]),
        (&[33, 768], &[33, 768]),
        // A row-wise scale (inner stride 0) and a rank-3 broadcast: the index map.
        (&[9, 24], &[9, 1]),
        (&[8, 1, 16], &[1, 4, 16]),
    ];
    for dtype in FLOATS {
        for kind in [BinaryKind::Add, BinaryKind::Sub, BinaryKind::Mul, BinaryKind::Div, BinaryKind::ReluGrad] {
            for (i, &(a_dims, b_dims)) in shapes.iter().enumerate() {
                let a = random(a_dims, dtype, 2 * i as u64, (-3.0, 3.0));
                // Divisors away from zero; ReLU outputs on both sides of it (the mask).
                let range = if kind == BinaryKind::ReluGrad { (-3.0, 3.0) } else { (0.5, 3.0) };
                let b = random(b_dims, dtype, 2 * i as u64 + 1, range);
                let out = Shape::broadcast(&Shape::new(a_dims), &Shape::new(b_dims)).expect("broadcasts");
                let what = format!("{kind:?} {dtype} {a_dims:?} with {b_dims:?}");
                check(
                    &what,
                    &Binary(kind),
                    &[&a, &b],
                    &[TensorMeta::new(out, dtype)],
                    (&device, &stream),
                    tolerance(dtype),
                );
            }
        }
    }
}

/// One operand bf16 or f16, the other and the output f32 (a cast folded into the op by
/// the compiler): the 16-bit operand is widened exactly, as the CPU's host kernel widens
/// it, so only the f32 op's rounding may differ.
#[test]
fn binary_ops_with_a_16_bit_operand_match_the_cpu() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let shapes: &[(&[usize], &[usize])] =
        &[(&[7], &[7]), (&[70_001], &[70_001]), (&[33, 768], &[33, 768]), (&[5, 64], &[64]), (&[9, 24], &[9, 1])];
    for narrow in [DType::Bf16, DType::F16] {
        for kind in [BinaryKind::Add, BinaryKind::Sub, BinaryKind::Mul, BinaryKind::Div, BinaryKind::ReluGrad] {
            for (i, &(a_dims, b_dims)) in shapes.iter().enumerate() {
                for narrow_side in ["a", "b"] {
                    let (a_dtype, b_dtype) =
                        if narrow_side == "a" { (narrow, DType::F32) } else { (DType::F32, narrow) };
                    let a = random(a_dims, a_dtype, 2 * i as u64, (-3.0, 3.0));
                    let range = if kind == BinaryKind::ReluGrad { (-3.0, 3.0) } else { (0.5, 3.0) };
                    let b = random(b_dims, b_dtype, 2 * i as u64 + 1, range);
                    let out = Shape::broadcast(&Shape::new(a_dims), &Shape::new(b_dims)).expect("broadcasts");
                    let what = format!("{kind:?} {a_dtype} {a_dims:?} with {b_dtype} {b_dims:?}");
                    check(
                        &what,
                        &Binary(kind),
                        &[&a, &b],
                        &[TensorMeta::new(out, DType::F32)],
                        (&device, &stream),
                        tolerance(DType::F32),
                    );
                }
            }
        }
    }
}

/// f32 operands with a second output, the result narrowed to bf16 or f16 (a cast folded
/// into the op by the compiler): both outputs match the CPU's.
#[test]
fn binary_ops_with_a_narrowed_second_output_match_the_cpu() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    for narrow in [DType::Bf16, DType::F16] {
        for kind in [BinaryKind::Add, BinaryKind::Sub, BinaryKind::Mul, BinaryKind::Div, BinaryKind::ReluGrad] {
            for (i, dims) in [&[7usize][..], &[70_001], &[33, 768]].into_iter().enumerate() {
                let a = random(dims, DType::F32, 2 * i as u64, (-3.0, 3.0));
                let range = if kind == BinaryKind::ReluGrad { (-3.0, 3.0) } else { (0.5, 3.0) };
                let b = random(dims, DType::F32, 2 * i as u64 + 1, range);
                let outputs = [TensorMeta::new(dims.to_vec(), DType::F32), TensorMeta::new(dims.to_vec(), narrow)];
                let what = format!("{kind:?} f32 {dims:?} and its {narrow} copy");
                check(&what, &Binary(kind), &[&a, &b], &outputs, (&device, &stream), tolerance(DType::F32));
            }
        }
    }
}

#[test]
fn bias_gelu_and_its_gradient_match_the_cpu() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    for dtype in FLOATS {
        // Widths of a multiple of eight take eight elements per step.
        for (rows, width) in [(1, 1), (1, 7), (3, 1023), (70_001, 3), (7, 1), (5, 64), (33, 768)] {
            let x = random(&[rows, width], dtype, 1, (-6.0, 6.0));
            let bias = random(&[width], dtype, 2, (-1.0, 1.0));
            let dy = random(&[rows, width], dtype, 3, (-2.0, 2.0));
            let what = format!("{dtype} [{rows}, {width}]");
            let rel = tolerance(dtype);
            check(&format!("bias_gelu {what}"), &BiasGelu, &[&x, &bias], &[x.meta()], (&device, &stream), rel);
            check(
                &format!("bias_gelu_grad {what}"),
                &BiasGeluGrad,
                &[&x, &bias, &dy],
                &[x.meta()],
                (&device, &stream),
                rel,
            );
        }
    }
}

#[test]
fn dropout_drops_exactly_what_the_cpu_drops() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    for dtype in FLOATS {
        for p in [0.0, 0.1, 0.5, 0.9] {
            for &n in SIZES {
                let x = random(&[n], dtype, 5, (0.5, 2.0));
                let op = Dropout { p, seed: 1234 + n as u64 };
                // The mask is bit-exact and the scaling one multiply (in f32 for bf16, then
                // one rounding, as on the CPU): no tolerance.
                check(&format!("dropout p {p} {dtype} [{n}]"), &op, &[&x], &[x.meta()], (&device, &stream), 0.0);
            }
        }
        // A part of a [6, 70_001] tensor starting at (2, 1000).
        let x = random(&[3, 1023], dtype, 6, (0.5, 2.0));
        let op = DropoutPart {
            dropout: Dropout { p: 0.3, seed: 99 },
            logical: Shape::new([6, 70_001]),
            offsets: vec![2, 1000],
        };
        check(&format!("dropout_part {dtype}"), &op, &[&x], &[x.meta()], (&device, &stream), 0.0);
    }
}

#[test]
fn bf16_elementwise_ops_have_cuda_kernels() {
    // A bf16 op without one would run its CPU kernel on the host (slow, and a dry run
    // would not notice).
    let queued = regflow_cuda::queued_ops();
    for op in ["unary", "binary", "bias_gelu", "bias_gelu_grad", "dropout", "dropout_part"] {
        assert!(queued.iter().any(|k| k.op_type == op && k.dtype == DType::Bf16), "{op} bf16");
    }
}
