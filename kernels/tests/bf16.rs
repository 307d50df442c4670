//! bf16 kernels: products and elementwise ops compute widened to f32 and round once, so
//! they match the f32 kernels to bf16's precision; `cast` rounds to nearest even; the
//! register kernel (`HostOpKernel`) gives what the reference entry (`compute_once`) gives.

use regflow_kernels::{compute_once, HostContext, HostOpKernel, Kernel, KernelIo, StreamContext};
use regflow_memory::{Arena, MemoryKind};
use regflow_plan::ops::{Binary, BinaryKind, Cast, KeepOnFirst, MatMul, MatMulBatchSum, PermutedMatMul, TakePart};
use regflow_plan::{bf16_from_f64, DType, GroupPosition, HostArray, OpConf, SplitMix64, TensorMeta};

fn values(count: usize, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..count).map(|_| rng.next_f64() as f32 * 2.0 - 1.0).collect()
}

/// The operand as bf16, and as f32 holding exactly the bf16 values (so the two products
/// differ only by the rounding of the result).
fn operand(shape: &[usize], seed: u64) -> (HostArray, HostArray) {
    let numel = shape.iter().product();
    let narrow = HostArray::bf16_from_f32(shape.to_vec(), &values(numel, seed)).unwrap();
    let wide = HostArray::f32(shape.to_vec(), narrow.to_f64_vec().iter().map(|&v| v as f32).collect()).unwrap();
    (narrow, wide)
}

fn run(op: &dyn regflow_kernels::HostCompute, inputs: &[&HostArray], out: TensorMeta) -> Vec<f64> {
    let mut result = HostArray::zeros(&out);
    let views: Vec<_> = inputs.iter().map(|a| a.view()).collect();
    compute_once(op, &HostContext::default(), &views, &mut [result.view_mut()]).unwrap();
    result.to_f64_vec()
}

/// Relative to the largest magnitude: bf16 keeps 8 significant bits (2^-8 ≈ 0.4%).
fn assert_close(what: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = want.iter().fold(1e-6f64, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= 1e-2 * scale, "{what}: element {i} is {g}, f32 gives {w}");
    }
}

#[test]
fn bf16_matmul_matches_f32_matmul_to_bf16_precision_on_odd_shapes() {
    for &(m, k, n) in &[(1, 1, 1), (1, 7, 33), (7, 33, 1), (33, 7, 7), (33, 33, 33)] {
        for (transpose_a, transpose_b) in [(false, false), (true, false), (false, true)] {
            let a_shape = if transpose_a { [k, m] } else { [m, k] };
            let b_shape = if transpose_b { [n, k] } else { [k, n] };
            let ((a16, a32), (b16, b32)) = (operand(&a_shape, 1), operand(&b_shape, 2));
            let op = MatMul { transpose_a, transpose_b };
            let got = run(&op, &[&a16, &b16], TensorMeta::new([m, n], DType::Bf16));
            let want = run(&op, &[&a32, &b32], TensorMeta::new([m, n], DType::F32));
            assert_close(&format!("[{m}, {k}] x [{k}, {n}] {transpose_a} {transpose_b}"), &got, &want);
            // Exactly the f32 result rounded once.
            let rounded: Vec<f64> = want.iter().map(|&v| bf16_from_f64(v).to_f64()).collect();
            assert_eq!(got, rounded);
        }
    }
}

#[test]
fn bf16_batched_products_match_f32() {
    let ((a16, a32), (b16, b32)) = (operand(&[3, 7, 33], 3), operand(&[3, 33, 5], 4));
    let op = MatMulBatchSum::default();
    let got = run(&op, &[&a16, &b16], TensorMeta::new([7, 5], DType::Bf16));
    let want = run(&op, &[&a32, &b32], TensorMeta::new([7, 5], DType::F32));
    assert_close("matmul_batch_sum", &got, &want);

    let ((q16, q32), (k16, k32)) = (operand(&[2, 7, 3, 5], 5), operand(&[2, 7, 3, 5], 6));
    let op = PermutedMatMul { a_axes: vec![0, 2, 1, 3], b_axes: vec![0, 2, 3, 1], out_axes: vec![0, 1, 2, 3] };
    let got = run(&op, &[&q16, &k16], TensorMeta::new([2, 3, 7, 7], DType::Bf16));
    let want = run(&op, &[&q32, &k32], TensorMeta::new([2, 3, 7, 7], DType::F32));
    assert_close("permuted_matmul", &got, &want);
}

#[test]
fn cast_rounds_to_nearest_even_and_widens_exactly() {
    // 1 + 2^-8 lies halfway between bf16 neighbours 1 and 1 + 2^-7: ties go to the even 1;
    // 1 + 3·2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties go to the even 1 + 2^-6.
    let x = HostArray::f32([4], vec![1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, -2.5, 1e-3]).unwrap();
    let narrow = run(&Cast { to: DType::Bf16 }, &[&x], TensorMeta::new([4], DType::Bf16));
    assert_eq!(narrow[..3], [1.0, 1.0 + 1.0 / 64.0, -2.5]);
    assert!((narrow[3] - 1e-3).abs() < 1e-5);
    let narrow = HostArray::bf16_from_f32([4], &narrow.iter().map(|&v| v as f32).collect::<Vec<_>>()).unwrap();
    let back = run(&Cast { to: DType::F64 }, &[&narrow], TensorMeta::new([4], DType::F64));
    assert_eq!(back, narrow.to_f64_vec());
    // f32 → f32 is the identity; integer casts are refused with both dtypes named.
    assert_eq!(run(&Cast { to: DType::F32 }, &[&x], TensorMeta::new([4], DType::F32)), x.to_f64_vec());
    let labels = HostArray::i64([1], vec![3]).unwrap();
    let mut out = HostArray::zeros(&TensorMeta::new([1], DType::F32));
    let err = compute_once(&Cast { to: DType::F32 }, &HostContext::default(), &[labels.view()], &mut [out.view_mut()]);
    assert_eq!(err.unwrap_err(), "casts between float dtypes only, got i64 to f32");
}

/// The register kernel widens through buffers it made at construction; its result is the
/// reference entry's, firing after firing.
#[test]
fn register_kernel_computes_bf16_like_the_reference_entry() {
    let meta = TensorMeta::new([5, 7], DType::Bf16);
    let (a, _) = operand(&[5, 7], 7);
    let (b, _) = operand(&[5, 7], 8);
    let want = run(&Binary(BinaryKind::Mul), &[&a, &b], meta.clone());
    let conf = OpConf::new(&Binary(BinaryKind::Mul), vec![meta.clone(), meta.clone()], vec![0, 1], vec![meta.clone()]);
    let mut kernel = HostOpKernel::new(Binary(BinaryKind::Mul), &conf);
    let arena = Arena::allocate("test", MemoryKind::Host, 3 * 128).unwrap();
    let views = [arena.view(0, 70).unwrap(), arena.view(128, 70).unwrap(), arena.view(256, 70).unwrap()];
    // SAFETY: the views are disjoint and nothing else reads or writes the arena.
    unsafe {
        views[0].as_mut_slice().copy_from_slice(&a.to_le_bytes());
        views[1].as_mut_slice().copy_from_slice(&b.to_le_bytes());
    }
    let context = StreamContext::default();
    for piece in 0..2 {
        let mut io = KernelIo::new(piece, GroupPosition { index: 0, count: 1 }, &views[..2], &views[2..], &context);
        kernel.run(&mut io).unwrap();
        // SAFETY: the kernel has finished with the output.
        let bytes = unsafe { views[2].as_slice() };
        assert_eq!(HostArray::from_le_bytes(&meta, bytes).unwrap().to_f64_vec(), want);
    }
}

/// The boxing steps move bf16 as it is: a part of an axis is that slice of the input's
/// values, and `keep_on_first` the value or zeros.
#[test]
fn bf16_boxing_parts_move_values_exactly() {
    let (x, _) = operand(&[3, 7], 9);
    let all = x.to_f64_vec();
    for index in 0..2 {
        let columns = regflow_plan::part_range(7, 2, index);
        let got = run(&TakePart { dim: 1, parts: 2, index }, &[&x], TensorMeta::new([3, columns.len()], DType::Bf16));
        let want: Vec<f64> =
            (0..3).flat_map(|r| columns.clone().map(move |c| (r, c))).map(|(r, c)| all[r * 7 + c]).collect();
        assert_eq!(got, want, "part {index}");
    }
    assert_eq!(run(&KeepOnFirst { first: true }, &[&x], TensorMeta::new([3, 7], DType::Bf16)), all);
    // Zeros written over what the register held before.
    let mut out = HostArray::bf16_from_f32(vec![3, 7], &[1.0; 21]).unwrap();
    compute_once(&KeepOnFirst { first: false }, &HostContext::default(), &[x.view()], &mut [out.view_mut()]).unwrap();
    assert_eq!(out.to_f64_vec(), vec![0.0; 21]);
}

/// A binary op with one 16-bit operand and an f32 other operand and output (a cast the
/// compiler folded into the op) gives, bit for bit, the f32 op on the operand cast to f32.
/// Mixed dtypes any other way are refused.
#[test]
fn a_16_bit_operand_is_read_widened_to_an_f32_op() {
    use regflow_kernels::HostCompute;
    let meta = |shape: &[usize], dtype| TensorMeta::new(shape.to_vec(), dtype);
    let shapes: [(&[usize], &[usize]); 2] = [(&[5, 7], &[7]), (&[3, 8], &[3, 8])];
    for (narrow_dtype, (a_dims, b_dims)) in [DType::Bf16, DType::F16].into_iter().zip(shapes) {
        let wide = HostArray::f32(a_dims.to_vec(), values(a_dims.iter().product(), 11)).unwrap();
        let narrow = HostArray::from_f64(
            b_dims.to_vec(),
            narrow_dtype,
            &values(b_dims.iter().product(), 12).iter().map(|&v| f64::from(v)).collect::<Vec<_>>(),
        )
        .unwrap();
        let widened = run(&Cast { to: DType::F32 }, &[&narrow], meta(b_dims, DType::F32));
        let widened = HostArray::f32(b_dims.to_vec(), widened.iter().map(|&v| v as f32).collect()).unwrap();
        for kind in [BinaryKind::Add, BinaryKind::Sub, BinaryKind::Mul, BinaryKind::Div, BinaryKind::ReluGrad] {
            let op = Binary(kind);
            let out = meta(a_dims, DType::F32);
            let want = run(&op, &[&wide, &widened], out.clone());
            assert_eq!(run(&op, &[&wide, &narrow], out.clone()), want, "{kind:?}, b {narrow_dtype}");
            // The narrow operand first (where it broadcasts, only `a` may be the larger).
            if a_dims == b_dims {
                let want = run(&op, &[&widened, &wide], out.clone());
                assert_eq!(run(&op, &[&narrow, &wide], out.clone()), want, "{kind:?}, a {narrow_dtype}");
            }
            // The plan's check, which both the CPU and the CUDA kernel run, accepts it.
            let conf = OpConf::new(&op, vec![wide.meta(), narrow.meta()], vec![0, 1], vec![out.clone()]);
            assert!(op.check(&conf.inputs, &conf.outputs).is_ok());
        }
        // A 16-bit output from mixed operands, or a mixed pair without f32, is refused.
        let op = Binary(BinaryKind::Add);
        let refused = [
            (vec![wide.meta(), narrow.meta()], meta(a_dims, narrow_dtype)),
            (vec![meta(a_dims, DType::F64), narrow.meta()], meta(a_dims, DType::F64)),
            (vec![meta(a_dims, DType::Bf16), meta(b_dims, DType::F16)], meta(a_dims, DType::F32)),
        ];
        for (inputs, output) in refused {
            let error = op.check(&inputs, &[output]).unwrap_err();
            assert!(error.contains("must have one dtype, or one operand be bf16 or f16"), "{error}");
        }
    }
}

/// A binary op of f32 operands with a second, 16-bit output (a cast of its result the
/// compiler folded into it) writes the f32 result and, bit for bit, its cast. A second
/// output any other way is refused.
#[test]
fn a_second_output_is_the_result_narrowed_as_a_cast_narrows_it() {
    use regflow_kernels::HostCompute;
    let meta = |dtype| TensorMeta::new([3, 9], dtype);
    let a = HostArray::f32(vec![3, 9], values(27, 21)).unwrap();
    let b = HostArray::f32(vec![3, 9], values(27, 22)).unwrap();
    for narrow in [DType::Bf16, DType::F16] {
        for kind in [BinaryKind::Add, BinaryKind::Sub, BinaryKind::Mul, BinaryKind::Div, BinaryKind::ReluGrad] {
            let op = Binary(kind);
            let want = run(&op, &[&a, &b], meta(DType::F32));
            let want_f32 = HostArray::f32(vec![3, 9], want.iter().map(|&v| v as f32).collect()).unwrap();
            let cast = run(&Cast { to: narrow }, &[&want_f32], meta(narrow));
            let (mut out, mut copy) = (HostArray::zeros(&meta(DType::F32)), HostArray::zeros(&meta(narrow)));
            let views = [a.view(), b.view()];
            compute_once(&op, &HostContext::default(), &views, &mut [out.view_mut(), copy.view_mut()]).unwrap();
            assert_eq!(out.to_f64_vec(), want, "{kind:?} {narrow}");
            assert_eq!(copy.to_f64_vec(), cast, "{kind:?} {narrow}");
            assert!(op.check(&[a.meta(), b.meta()], &[meta(DType::F32), meta(narrow)]).is_ok());
        }
        let op = Binary(BinaryKind::Add);
        let refused = [
            // A 16-bit operand with a second output, an f32 "copy", a copy of another shape.
            (vec![a.meta(), meta(narrow)], vec![meta(DType::F32), meta(narrow)]),
            (vec![a.meta(), b.meta()], vec![meta(DType::F32), meta(DType::F32)]),
            (vec![a.meta(), b.meta()], vec![meta(DType::F32), TensorMeta::new([27], narrow)]),
        ];
        for (inputs, outputs) in refused {
            let error = op.check(&inputs, &outputs).unwrap_err();
            assert!(error.contains("a second output must be the bf16 or f16 copy"), "{error}");
        }
    }
}
