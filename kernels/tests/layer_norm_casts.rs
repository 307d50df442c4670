//! Layer norm with mixed precision's casts folded in (`graph/src/compile/fold_casts.rs`):
//! an f32 layer norm writing bf16 or f16 gives the bits of the f32 layer norm followed by a
//! `cast`, and its gradient reading a bf16 or f16 `dy` the bits of a `cast` of `dy` to f32
//! followed by the f32 gradient, on odd row lengths and on one thread and three (rows
//! shared). Attributes that pair other dtypes are refused at job build, naming the op and
//! the dtypes.

use regflow_kernels::{compute_once, HostCompute, HostContext, KernelRegistry, KernelSpec};
use regflow_plan::ops::{Cast, LayerNorm, LayerNormGrad, OpAttrs};
use regflow_plan::{DType, DeviceKind, HostArray, KernelConf, OpConf, SplitMix64, TensorMeta};

/// Values in [-2, 2) of `dims` in `dtype` (rounded to it once).
fn random(dims: &[usize], dtype: DType, seed: u64) -> HostArray {
    let mut rng = SplitMix64::new(seed);
    let values: Vec<f64> = (0..dims.iter().product()).map(|_| rng.next_f64() * 4.0 - 2.0).collect();
    HostArray::from_f64(dims.to_vec(), dtype, &values).unwrap()
}

/// The outputs of `op` on `inputs`, of `outputs`, on `threads` threads, as the register
/// kernels run it (16-bit tensors widened unless the op takes them as they are).
fn run(op: &dyn HostCompute, inputs: &[&HostArray], outputs: &[TensorMeta], threads: usize) -> Vec<HostArray> {
    let metas: Vec<TensorMeta> = inputs.iter().map(|a| a.meta()).collect();
    op.check(&metas, outputs).unwrap();
    let mut outs: Vec<HostArray> = outputs.iter().map(HostArray::zeros).collect();
    let views: Vec<_> = inputs.iter().map(|a| a.view()).collect();
    let mut out_views: Vec<_> = outs.iter_mut().map(HostArray::view_mut).collect();
    compute_once(op, &HostContext { threads }, &views, &mut out_views).unwrap();
    drop(out_views);
    outs
}

/// `[rows, features]`: odd row lengths on a few rows, and one past the threshold of row
/// shares (2^15 elements) over several blocks of the gradient's 512 rows.
const SHAPES: [(usize, usize); 6] = [(3, 1), (5, 7), (7, 33), (4, 1023), (2, 1500), (4099, 67)];

#[test]
fn a_layer_norm_writing_16_bits_is_the_f32_layer_norm_cast() {
    for low in [DType::Bf16, DType::F16] {
        for (rows, features) in SHAPES {
            let dims = [rows, features];
            let x = random(&dims, DType::F32, 1);
            let (gamma, beta) = (random(&[features], DType::F32, 2), random(&[features], DType::F32, 3));
            let wide = run(&LayerNorm::new(1e-5), &[&x, &gamma, &beta], &[x.meta()], 1).remove(0);
            let out = TensorMeta::new(dims, low);
            let cast = run(&Cast { to: low }, &[&wide], std::slice::from_ref(&out), 1).remove(0);
            for threads in [1, 3] {
                let op = LayerNorm { out: Some(low), ..LayerNorm::new(1e-5) };
                let folded = run(&op, &[&x, &gamma, &beta], std::slice::from_ref(&out), threads).remove(0);
                assert_eq!(folded.meta(), out);
                let what = format!("{low} {dims:?} on {threads} threads");
                assert_eq!(folded.to_le_bytes(), cast.to_le_bytes(), "{what}");
            }
        }
    }
}

#[test]
fn a_layer_norm_gradient_reading_a_16_bit_dy_is_that_of_the_dy_cast_to_f32() {
    for low in [DType::Bf16, DType::F16] {
        for (rows, features) in SHAPES {
            let dims = [rows, features];
            let (x, gamma) = (random(&dims, DType::F32, 4), random(&[features], DType::F32, 5));
            let dy = random(&dims, low, 6);
            let wide_dy = run(&Cast { to: DType::F32 }, &[&dy], &[x.meta()], 1).remove(0);
            let outputs = [x.meta(), gamma.meta(), gamma.meta()];
            let want = run(&LayerNormGrad::new(1e-5), &[&x, &gamma, &wide_dy], &outputs, 1);
            for threads in [1, 3] {
                let op = LayerNormGrad { dy: Some(low), ..LayerNormGrad::new(1e-5) };
                let got = run(&op, &[&x, &gamma, &dy], &outputs, threads);
                for (o, (got, want)) in got.iter().zip(&want).enumerate() {
                    let what = format!("{low} {dims:?} on {threads} threads, output {o}");
                    // (One feature normalizes to 0: its dx and dgamma are 0.)
                    let zero = want.to_f64_vec().iter().all(|&v| v == 0.0);
                    assert!(!zero || (o < 2 && features == 1), "{what}: all zero");
                    assert_eq!(got.to_le_bytes(), want.to_le_bytes(), "{what}");
                }
            }
        }
    }
}

/// The error the CPU kernel registry gives for `op` on tensors of `inputs` and `outputs`.
fn refusal(op: &dyn OpAttrs, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> String {
    let conf = OpConf::new(op, inputs.to_vec(), (0..inputs.len()).collect(), outputs.to_vec());
    let mut registry = KernelRegistry::new();
    regflow_kernels::cpu::register(&mut registry, DeviceKind::Cpu);
    let bytes = |m: &TensorMeta| (m.shape.numel() * m.dtype.size()) as u64;
    let (input_bytes, output_bytes): (Vec<u64>, Vec<u64>) =
        (inputs.iter().map(bytes).collect(), outputs.iter().map(bytes).collect());
    let spec = KernelSpec {
        actor: "norm",
        device: DeviceKind::Cpu,
        device_index: 0,
        op: Some(&conf),
        input_bytes: &input_bytes,
        output_bytes: &output_bytes,
        input_repeats: &[],
    };
    match registry.make(&KernelConf::Op(conf.clone()), &spec) {
        Ok(_) => panic!("{} on {inputs:?} -> {outputs:?} was accepted", op.attrs()),
        Err(e) => e.0,
    }
}

#[test]
fn other_dtype_pairs_are_refused_naming_the_op_and_the_dtypes() {
    let meta = |dtype: DType| TensorMeta::new([4, 8], dtype);
    let params = |dtype: DType| TensorMeta::new([8], dtype);
    let norm = |x: DType, out: Option<DType>, y: DType| {
        refusal(&LayerNorm { out, ..LayerNorm::new(1e-5) }, &[meta(x), params(x), params(x)], &[meta(y)])
    };
    // An `out` that is no 16-bit float, one from f64, and a 16-bit input.
    let e = norm(DType::F32, Some(DType::F64), DType::F64);
    assert!(e.contains("layer_norm with out = f64") && e.contains("bf16 or f16"), "{e}");
    let e = norm(DType::F32, Some(DType::I64), DType::I64);
    assert!(e.contains("layer_norm") && e.contains("i64"), "{e}");
    let e = norm(DType::F64, Some(DType::Bf16), DType::Bf16);
    assert!(e.contains("layer_norm with out = bf16 needs f32 inputs, got f64"), "{e}");
    let e = norm(DType::Bf16, None, DType::Bf16);
    assert!(e.contains("layer_norm") && e.contains("bf16 input"), "{e}");
    // An output that is not the dtype `out` says.
    let e = norm(DType::F32, Some(DType::Bf16), DType::F16);
    assert!(e.contains("layer_norm") && e.contains("f16") && e.contains("bf16"), "{e}");

    let grad = |x: DType, dy_attr: Option<DType>, dy: DType| {
        let op = LayerNormGrad { dy: dy_attr, ..LayerNormGrad::new(1e-5) };
        refusal(&op, &[meta(x), params(x), meta(dy)], &[meta(x), params(x), params(x)])
    };
    let e = grad(DType::F64, Some(DType::F16), DType::F16);
    assert!(e.contains("layer_norm_grad with dy = f16 needs f32 inputs, got f64"), "{e}");
    let e = grad(DType::F32, Some(DType::F32), DType::F32);
    assert!(e.contains("layer_norm_grad with dy = f32") && e.contains("bf16 or f16"), "{e}");
    let e = grad(DType::F32, Some(DType::Bf16), DType::F32);
    assert!(e.contains("layer_norm_grad") && e.contains("dy must be"), "{e}");
}

/// A layer norm gradient with a base (`LayerNormGrad::base`, `compile/fold_norm_grads.rs`)
/// gives the bits of the gradient followed by an `add` of the base to `dx`, and the same
/// `dgamma` and `dbeta`, in f32 and f64, with a 16-bit `dy` too, on one thread and three.
#[test]
fn a_layer_norm_gradient_with_a_base_is_the_gradient_then_the_add() {
    use regflow_plan::ops::{Binary, BinaryKind};
    for (x_dtype, dy_dtype) in [(DType::F32, None), (DType::F64, None), (DType::F32, Some(DType::Bf16))] {
        for (rows, features) in SHAPES {
            let dims = [rows, features];
            let (x, gamma) = (random(&dims, x_dtype, 7), random(&[features], x_dtype, 8));
            let dy = random(&dims, dy_dtype.unwrap_or(x_dtype), 9);
            let base = random(&dims, x_dtype, 10);
            let outputs = [x.meta(), gamma.meta(), gamma.meta()];
            let plain = LayerNormGrad { dy: dy_dtype, ..LayerNormGrad::new(1e-5) };
            let mut want = run(&plain, &[&x, &gamma, &dy], &outputs, 1);
            want[0] = run(&Binary(BinaryKind::Add), &[&base, &want[0]], &[x.meta()], 1).remove(0);
            for threads in [1, 3] {
                let op = LayerNormGrad { base: true, ..plain };
                let got = run(&op, &[&x, &gamma, &dy, &base], &outputs, threads);
                for (o, (got, want)) in got.iter().zip(&want).enumerate() {
                    let what = format!("output {o}, x {x_dtype}, dy {dy_dtype:?}, {dims:?} on {threads} threads");
                    assert_eq!(got.to_le_bytes(), want.to_le_bytes(), "{what}");
                }
                // With the sum's 16-bit copy as a fourth output: the cast's bits.
                if x_dtype != DType::F32 {
                    continue;
                }
                for low in [DType::Bf16, DType::F16] {
                    let op = LayerNormGrad { base: true, dx_narrow: Some(low), ..plain };
                    let narrow = TensorMeta::new(dims, low);
                    let mut with_copy = outputs.to_vec();
                    with_copy.push(narrow.clone());
                    let got = run(&op, &[&x, &gamma, &dy, &base], &with_copy, threads);
                    let cast = run(&Cast { to: low }, &[&want[0]], &[narrow], 1).remove(0);
                    let what = format!("dx as {low}, dy {dy_dtype:?}, {dims:?} on {threads} threads");
                    assert_eq!(got[3].to_le_bytes(), cast.to_le_bytes(), "{what}");
                    assert_eq!(got[0].to_le_bytes(), want[0].to_le_bytes(), "{what}");
                }
            }
        }
    }
    // A base that is not dx's meta, or missing, is refused naming the op.
    let (x, gamma) = (TensorMeta::new([4, 8], DType::F32), TensorMeta::new([8], DType::F32));
    let outputs = [x.clone(), gamma.clone(), gamma.clone()];
    let op = LayerNormGrad { base: true, ..LayerNormGrad::new(1e-5) };
    let e = refusal(&op, &[x.clone(), gamma.clone(), x.clone(), TensorMeta::new([4, 8], DType::F64)], &outputs);
    assert!(e.contains("layer_norm_grad") && e.contains("the base added to dx must match the input"), "{e}");
    let e = refusal(&op, &[x.clone(), gamma.clone(), x.clone()], &outputs);
    assert!(e.contains("takes 4 inputs and gives 3 outputs, but has 3 and 3"), "{e}");
    let inputs = [x.clone(), gamma.clone(), x.clone(), x.clone()];
    let op = LayerNormGrad { dx_narrow: Some(DType::Bf16), ..op };
    let mut with_copy = outputs.to_vec();
    with_copy.push(TensorMeta::new([4, 8], DType::F16));
    let e = refusal(&op, &inputs, &with_copy);
    assert!(e.contains("the narrow dx must be [4, 8] bf16") || e.contains("narrow dx must be"), "{e}");
    let e = refusal(&LayerNormGrad { dx_narrow: Some(DType::F64), ..op }, &inputs, &with_copy);
    assert!(e.contains("layer_norm_grad with dx_narrow = f64") && e.contains("bf16 or f16"), "{e}");
}

/// A layer norm with a summand (`LayerNorm::residual`, `compile/fold_norm_inputs.rs`)
/// writes the `add` of its two summands (a 16-bit one widened) as its first output and the
/// norm of that sum as its second, with the bits of the add then the norm (then the cast,
/// for a 16-bit output), on one thread and three.
#[test]
fn a_layer_norm_with_a_summand_is_the_add_then_the_norm() {
    use regflow_plan::ops::{Binary, BinaryKind};
    let cases = [
        (DType::F32, DType::F32, None),
        (DType::F64, DType::F64, None),
        (DType::F32, DType::Bf16, Some(DType::Bf16)),
        (DType::F32, DType::F16, Some(DType::F16)),
        (DType::F32, DType::Bf16, None),
    ];
    for (x_dtype, b_dtype, out) in cases {
        for (rows, features) in SHAPES {
            let dims = [rows, features];
            let (a, b) = (random(&dims, x_dtype, 11), random(&dims, b_dtype, 12));
            let (gamma, beta) = (random(&[features], x_dtype, 13), random(&[features], x_dtype, 14));
            let sum = run(&Binary(BinaryKind::Add), &[&a, &b], &[a.meta()], 1).remove(0);
            let norm = LayerNorm { out, ..LayerNorm::new(1e-5) };
            let y_meta = TensorMeta::new(dims, out.unwrap_or(x_dtype));
            let y = run(&norm, &[&sum, &gamma, &beta], std::slice::from_ref(&y_meta), 1).remove(0);
            for threads in [1, 3] {
                let op = LayerNorm { residual: Some(b_dtype), ..norm };
                let got = run(&op, &[&a, &gamma, &beta, &b], &[a.meta(), y_meta.clone()], threads);
                let what = format!("x {x_dtype}, b {b_dtype}, out {out:?}, {dims:?} on {threads} threads");
                assert_eq!(got[0].to_le_bytes(), sum.to_le_bytes(), "{what}: the sum");
                assert_eq!(got[1].to_le_bytes(), y.to_le_bytes(), "{what}: the norm");
            }
            // With a bias added to the summand first (`LayerNorm::summand_bias`): the bits of
            // the bias add, then the residual add, then the norm.
            let bias = random(&[features], b_dtype, 15);
            let biased = run(&Binary(BinaryKind::Add), &[&b, &bias], &[b.meta()], 1).remove(0);
            let sum = run(&Binary(BinaryKind::Add), &[&a, &biased], &[a.meta()], 1).remove(0);
            let y = run(&norm, &[&sum, &gamma, &beta], std::slice::from_ref(&y_meta), 1).remove(0);
            for threads in [1, 3] {
                let op = LayerNorm { residual: Some(b_dtype), summand_bias: true, ..norm };
                let got = run(&op, &[&a, &gamma, &beta, &b, &bias], &[a.meta(), y_meta.clone()], threads);
                let what = format!("x {x_dtype}, b {b_dtype} + bias, out {out:?}, {dims:?} on {threads} threads");
                assert_eq!(got[0].to_le_bytes(), sum.to_le_bytes(), "{what}: the sum");
                assert_eq!(got[1].to_le_bytes(), y.to_le_bytes(), "{what}: the norm");
            }
        }
    }
    // A summand of another shape or dtype, or a missing sum output, is refused naming the op.
    let (x, p) = (TensorMeta::new([4, 8], DType::F32), TensorMeta::new([8], DType::F32));
    let op = LayerNorm { residual: Some(DType::Bf16), ..LayerNorm::new(1e-5) };
    let e =
        refusal(&op, &[x.clone(), p.clone(), p.clone(), TensorMeta::new([4, 8], DType::F16)], &[x.clone(), x.clone()]);
    assert!(e.contains("layer_norm") && e.contains("the summand added to the input must be bf16[4, 8]"), "{e}");
    let e = refusal(
        &op,
        &[x.clone(), p.clone(), p.clone(), TensorMeta::new([4, 8], DType::Bf16)],
        std::slice::from_ref(&x),
    );
    assert!(e.contains("takes 4 inputs and gives 2 output(s), but has 4 and 1"), "{e}");
    let f64_op = LayerNorm { residual: Some(DType::Bf16), ..LayerNorm::new(1e-5) };
    let x64 = TensorMeta::new([4, 8], DType::F64);
    let p64 = TensorMeta::new([8], DType::F64);
    let e =
        refusal(&f64_op, &[x64.clone(), p64.clone(), p64, TensorMeta::new([4, 8], DType::Bf16)], &[x64.clone(), x64]);
    assert!(e.contains("layer_norm with residual = bf16 needs f32 inputs, got f64"), "{e}");
    // A summand's bias of the wrong shape, or one without a summand.
    let op = LayerNorm { summand_bias: true, ..op };
    let inputs =
        [x.clone(), p.clone(), p.clone(), TensorMeta::new([4, 8], DType::Bf16), TensorMeta::new([4], DType::Bf16)];
    let e = refusal(&op, &inputs, &[x.clone(), x.clone()]);
    assert!(e.contains("the summand's bias must be bf16[8], got bf16[4]"), "{e}");
    let e = refusal(&LayerNorm { residual: None, ..op }, &inputs[..3], std::slice::from_ref(&x));
    assert!(e.contains("a bias of the summand needs a summand"), "{e}");
}
