//! Every op's SBP signatures, checked against the reference semantics of `sbp`: for each
//! listed signature and 2 and 3 devices (uneven parts included), each device runs the
//! op's localized form on its part of the inputs (summands drawn at random, so an op that
//! is not linear in them fails), and gathering the devices' outputs per the signature gives
//! the logical outputs.

use regflow_graph::ops::*;
use regflow_graph::sbp::{gather, local_meta, local_region, scatter, Mesh, NdSbp, Sbp, SbpSignature};
use regflow_graph::{
    DType, Graph, GraphError, HostArray, HostData, HostTensor, HostTensorMut, Init, Optimizer, Shape, SplitMix64,
    TensorMeta,
};
use std::sync::Arc;

/// Normal(0, 1) f64 values of `shape`.
fn random(shape: impl Into<Shape>, seed: u64) -> HostArray {
    let shape = shape.into();
    let mut rng = SplitMix64::new(seed);
    let data = (0..shape.numel()).map(|_| rng.next_normal()).collect();
    HostArray { shape, data: HostData::F64(data) }
}

/// f64 values in `[0.5, 2.5)` (for `log`, `sqrt`, divisors, second moments).
fn positive(shape: impl Into<Shape>, seed: u64) -> HostArray {
    let shape = shape.into();
    let mut rng = SplitMix64::new(seed);
    let data = (0..shape.numel()).map(|_| 0.5 + 2.0 * rng.next_f64()).collect();
    HostArray { shape, data: HostData::F64(data) }
}

/// Integers in `0..high` (ids, labels).
fn indices(shape: impl Into<Shape>, high: u64, seed: u64) -> HostArray {
    let shape = shape.into();
    let mut rng = SplitMix64::new(seed);
    let data = (0..shape.numel()).map(|_| (rng.next_u64() % high) as i64).collect();
    HostArray { shape, data: HostData::I64(data) }
}

fn scalar(value: f64) -> HostArray {
    HostArray { shape: Shape::scalar(), data: HostData::F64(vec![value]) }
}

/// Runs `op` on `inputs` (after inferring its outputs).
fn run(op: &dyn OpDef, inputs: &[HostArray]) -> Result<Vec<HostArray>, String> {
    let metas: Vec<TensorMeta> = inputs.iter().map(HostArray::meta).collect();
    let mut outputs: Vec<HostArray> = op.infer(&metas)?.iter().map(HostArray::zeros).collect();
    let views: Vec<HostTensor<'_>> = inputs.iter().map(HostArray::view).collect();
    let mut out_views: Vec<HostTensorMut<'_>> = outputs.iter_mut().map(HostArray::view_mut).collect();
    op.compute(&HostContext::default(), &views, &mut out_views)?;
    Ok(outputs)
}

/// `value` as `parts` random summands (the last one makes up the difference).
fn summands(value: &HostArray, parts: usize, rng: &mut SplitMix64) -> Vec<HostArray> {
    let mut rest = value.clone();
    let mut out = Vec::with_capacity(parts);
    for _ in 1..parts {
        let mut part = HostArray::zeros(&value.meta());
        match (&mut part.data, &mut rest.data) {
            (HostData::F64(p), HostData::F64(r)) => p.iter_mut().zip(r).for_each(|(p, r)| {
                *p = rng.next_normal();
                *r -= *p;
            }),
            (HostData::I64(p), HostData::I64(r)) => p.iter_mut().zip(r).for_each(|(p, r)| {
                *p = (rng.next_u64() % 7) as i64 - 3;
                *r -= *p;
            }),
            _ => panic!("summands of {} are not drawn in these tests", value.dtype()),
        }
        out.push(part);
    }
    out.push(rest);
    out
}

fn close(actual: &HostArray, expected: &HostArray) -> bool {
    actual.meta() == expected.meta()
        && actual
            .to_f64_vec()
            .iter()
            .zip(expected.to_f64_vec())
            .all(|(&a, e)| (a.is_nan() && e.is_nan()) || (a - e).abs() <= 1e-9 * a.abs().max(e.abs()).max(1.0))
}

/// Checks one signature of `op` on `inputs` over `parts` devices.
fn check_signature(op: &dyn OpDef, inputs: &[HostArray], signature: &SbpSignature, parts: usize) -> Result<(), String> {
    let metas: Vec<TensorMeta> = inputs.iter().map(HostArray::meta).collect();
    let out_metas = op.infer(&metas)?;
    let expected = run(op, inputs)?;
    let mesh = Mesh::cpu(&[parts], &["x"])?;
    let layout = |sbp: &Sbp| NdSbp(vec![*sbp]);
    let in_layouts: Vec<NdSbp> = signature.inputs.iter().map(layout).collect();
    let out_layouts: Vec<NdSbp> = signature.outputs.iter().map(layout).collect();
    if in_layouts.len() != metas.len() || out_layouts.len() != out_metas.len() {
        return Err(format!("signature {signature} does not fit {} inputs, {} outputs", metas.len(), out_metas.len()));
    }
    for (l, m) in in_layouts.iter().zip(&metas).chain(out_layouts.iter().zip(&out_metas)) {
        l.check(&mesh, &m.shape)?;
    }
    let mut rng = SplitMix64::new(parts as u64 * 7919 + metas.len() as u64);
    let locals: Vec<Vec<HostArray>> = inputs
        .iter()
        .zip(&in_layouts)
        .map(|(x, l)| if l.0[0] == Sbp::Partial { summands(x, parts, &mut rng) } else { scatter(x, l, &mesh) })
        .collect();
    // results[output][rank]
    let mut results: Vec<Vec<HostArray>> = vec![Vec::new(); out_metas.len()];
    for rank in 0..parts {
        let coords = mesh.coords(rank);
        let local_inputs: Vec<HostArray> = locals.iter().map(|l| l[rank].clone()).collect();
        let local_in_metas: Vec<TensorMeta> = local_inputs.iter().map(HostArray::meta).collect();
        let local_out_metas: Vec<TensorMeta> =
            out_metas.iter().zip(&out_layouts).map(|(m, l)| local_meta(m, l, &mesh, &coords)).collect();
        let offsets = |ms: &[TensorMeta], ls: &[NdSbp]| -> Vec<Vec<usize>> {
            ms.iter().zip(ls).map(|(m, l)| local_region(&m.shape, l, &mesh, &coords).1).collect()
        };
        let ctx = LocalContext {
            logical_inputs: &metas,
            logical_outputs: &out_metas,
            local_inputs: &local_in_metas,
            local_outputs: &local_out_metas,
            input_offsets: &offsets(&metas, &in_layouts),
            output_offsets: &offsets(&out_metas, &out_layouts),
            input_layouts: &in_layouts,
            output_layouts: &out_layouts,
        };
        let localized = op.localize(&ctx)?;
        let local_op: &dyn OpDef = localized.as_deref().unwrap_or(op);
        // Local shapes that do not line up make the signature unusable on this many
        // devices: the compiler checks this per mesh and drops it (not a wrong result).
        let inferred = local_op.infer(&local_in_metas).map_err(|e| format!("{NOT_APPLICABLE}: {e}"))?;
        if inferred != local_out_metas {
            return Err(format!(
                "{NOT_APPLICABLE}: rank {rank} infers {inferred:?} from its inputs, expected {local_out_metas:?}"
            ));
        }
        for (j, out) in run(local_op, &local_inputs)?.into_iter().enumerate() {
            // A broadcast output must be whole on every device, not only the one gathered.
            if signature.outputs[j] == Sbp::Broadcast && !close(&out, &expected[j]) {
                return Err(format!("rank {rank} holds a different broadcast output {j}"));
            }
            results[j].push(out);
        }
    }
    for (j, locals) in results.iter().enumerate() {
        let gathered = gather(locals, &out_metas[j].shape, &out_layouts[j], &mesh)?;
        if !close(&gathered, &expected[j]) {
            return Err(format!(
                "output {j} gathers to {:?}, expected {:?}",
                gathered.to_f64_vec(),
                expected[j].to_f64_vec()
            ));
        }
    }
    Ok(())
}

/// How `check_signature` says a signature's local shapes do not line up on this many devices.
const NOT_APPLICABLE: &str = "not applicable";

/// Checks every signature `op` lists for `inputs` on 2, 3 and 4 devices, panicking with the
/// op, the shapes and the signature on a wrong result, or when the local shapes line up on
/// none of them; returns the signatures.
fn check_signatures(op: &dyn OpDef, inputs: &[HostArray]) -> Vec<SbpSignature> {
    let metas: Vec<TensorMeta> = inputs.iter().map(HostArray::meta).collect();
    let shapes: Vec<String> = metas.iter().map(ToString::to_string).collect();
    let outputs = op.infer(&metas).unwrap_or_else(|e| panic!("{} on {shapes:?}: {e}", op.name()));
    let signatures = op.sbp_signatures(&metas, &outputs);
    for (i, signature) in signatures.iter().enumerate() {
        let whole = SbpSignature::broadcast(metas.len(), outputs.len());
        assert_ne!(*signature, whole, "{} lists all-broadcast", op.name());
        assert!(!signatures[..i].contains(signature), "{} lists {signature} twice", op.name());
        let mut usable = 0;
        for parts in [2, 3, 4] {
            match check_signature(op, inputs, signature, parts) {
                Ok(()) => usable += 1,
                Err(e) if e.starts_with(NOT_APPLICABLE) => {}
                Err(e) => panic!("{} on {shapes:?}, {signature} over {parts} devices: {e}", op.name()),
            }
        }
        assert!(usable > 0, "{} on {shapes:?}: {signature} lines up on no number of devices", op.name());
    }
    signatures
}

fn has(signatures: &[SbpSignature], inputs: &[Sbp], outputs: &[Sbp]) -> bool {
    signatures.contains(&SbpSignature::new(inputs, outputs))
}

use Sbp::{Broadcast as B, Partial as P, Split as S};

#[test]
fn unary_ops_split_anywhere_and_only_linear_ones_take_summands() {
    let kinds = [
        UnaryKind::Neg,
        UnaryKind::Relu,
        UnaryKind::Step,
        UnaryKind::Exp,
        UnaryKind::Log,
        UnaryKind::Sqrt,
        UnaryKind::Tanh,
        UnaryKind::Sigmoid,
        UnaryKind::Gelu,
        UnaryKind::GeluDerivative,
        UnaryKind::AddScalar(1.5),
        UnaryKind::MulScalar(-2.5),
        UnaryKind::PowScalar(1.5),
    ];
    for kind in kinds {
        for shape in [vec![5, 3], vec![2, 7, 3], vec![]] {
            let signatures = check_signatures(&Unary(kind), &[positive(shape.clone(), 1)]);
            assert_eq!(signatures.len(), shape.len() + usize::from(has(&signatures, &[P], &[P])));
            let linear = matches!(kind, UnaryKind::Neg | UnaryKind::MulScalar(_));
            assert_eq!(has(&signatures, &[P], &[P]), linear, "{kind:?}");
        }
    }
}

#[test]
fn binary_ops_split_operands_that_have_the_dimension_and_broadcast_the_others() {
    let pairs: [(&[usize], &[usize]); 7] = [
        (&[5, 4], &[5, 4]),
        (&[5, 4], &[4]),
        (&[4], &[5, 4]),
        (&[5, 1], &[1, 4]),
        (&[3, 5, 4], &[5, 1]),
        (&[7], &[]),
        (&[2, 3], &[2, 3]),
    ];
    for kind in [BinaryKind::Add, BinaryKind::Sub, BinaryKind::Mul, BinaryKind::Div] {
        for (a, b) in pairs {
            let signatures = check_signatures(&Binary(kind), &[random(a, 2), positive(b, 3)]);
            assert_eq!(has(&signatures, &[P, P], &[P]), matches!(kind, BinaryKind::Add | BinaryKind::Sub));
            assert_eq!(has(&signatures, &[P, B], &[P]), matches!(kind, BinaryKind::Mul | BinaryKind::Div));
            assert_eq!(has(&signatures, &[B, P], &[P]), kind == BinaryKind::Mul);
        }
    }
    let signatures = Binary(BinaryKind::Add).sbp_signatures(
        &[TensorMeta::new([5, 1], DType::F64), TensorMeta::new([4], DType::F64)],
        &[TensorMeta::new([5, 4], DType::F64)],
    );
    assert!(has(&signatures, &[S(0), B], &[S(0)]) && has(&signatures, &[B, S(0)], &[S(1)]));
}

#[test]
fn fill_splits_its_output_and_zeros_are_summands() {
    for value in [2.0, 0.0] {
        for shape in [vec![5, 3], vec![]] {
            let signatures = check_signatures(&Fill::new(value, TensorMeta::new(shape.clone(), DType::F64)), &[]);
            assert_eq!(has(&signatures, &[], &[P]), value == 0.0);
        }
    }
}

#[test]
fn sum_to_and_broadcast_to_map_kept_dimensions_and_sum_the_rest() {
    for (from, to) in
        [(vec![3, 5, 4], vec![5, 1]), (vec![3, 5, 4], vec![4]), (vec![7, 2], vec![]), (vec![5, 7], vec![1, 7])]
    {
        let signatures = check_signatures(&SumTo(Shape(to.clone())), &[random(from.clone(), 4)]);
        assert!(has(&signatures, &[S(0)], &[P]));
        let signatures = check_signatures(&BroadcastTo(Shape(from.clone())), &[random(to.clone(), 5)]);
        assert!(has(&signatures, &[B], &[S(0)]) && has(&signatures, &[P], &[P]));
    }
}

/// `sum_squares`: any split of the input leaves partial sums; a partial input has none
/// (squares of summands are not summands).
#[test]
fn sum_squares_splits_into_partial_sums_and_never_reads_partials() {
    for shape in [vec![3, 5, 4], vec![7]] {
        let signatures = check_signatures(&SumSquares, &[random(shape.clone(), 8)]);
        for d in 0..shape.len() {
            assert!(has(&signatures, &[S(d)], &[P]), "{shape:?} S({d})");
        }
        assert!(!has(&signatures, &[P], &[P]), "{shape:?}");
    }
}

#[test]
fn reductions_split_kept_axes_and_sum_or_average_split_reduced_ones() {
    let x = random([5, 7, 2], 6);
    for kind in [ReduceKind::Sum, ReduceKind::Mean, ReduceKind::Max] {
        for axes in [vec![1], vec![0, 2], vec![], vec![-1]] {
            for keepdim in [false, true] {
                let signatures =
                    check_signatures(&Reduce { kind, axes: axes.clone(), keepdim }, std::slice::from_ref(&x));
                assert_eq!(has(&signatures, &[P], &[P]), kind != ReduceKind::Max);
            }
        }
    }
    let max = |axes: Vec<isize>| {
        run(&Reduce { kind: ReduceKind::Max, axes, keepdim: true }, std::slice::from_ref(&x)).unwrap()
    };
    for m in [max(vec![1]), max(vec![]), max(vec![0, 2])] {
        let signatures = check_signatures(&MaxMask, &[x.clone(), m[0].clone()]);
        assert_eq!(signatures.len(), 3);
    }
}

/// Stored shape of an operand that is read as `[.., rows, cols]`.
fn stored(batch: &[usize], rows: usize, cols: usize, transposed: bool) -> Vec<usize> {
    let mut dims = batch.to_vec();
    dims.extend(if transposed { [cols, rows] } else { [rows, cols] });
    dims
}

#[test]
fn matmuls_split_m_n_k_and_batches() {
    let batches: [(&[usize], &[usize]); 5] = [(&[], &[]), (&[3], &[3]), (&[2], &[]), (&[], &[2]), (&[2, 3], &[2, 3])];
    for (batch_a, batch_b) in batches {
        for (transpose_a, transpose_b) in [(false, false), (true, false), (false, true), (true, true)] {
            let a = random(stored(batch_a, 5, 7, transpose_a), 7);
            let b = random(stored(batch_b, 7, 2, transpose_b), 8);
            let signatures = check_signatures(&MatMul { transpose_a, transpose_b }, &[a.clone(), b.clone()]);
            let batch = batch_a.len().max(batch_b.len());
            assert_eq!(signatures.len(), 5 + batch);
            if !batch_a.is_empty() && !batch_b.is_empty() {
                let signatures = check_signatures(&MatMulBatchSum { transpose_a, transpose_b }, &[a, b]);
                assert!(has(&signatures, &[S(0), S(0)], &[P]));
            }
        }
    }
}

#[test]
fn softmaxes_split_every_axis_but_the_normalized_one() {
    for (shape, axis) in [(vec![5, 7], 1), (vec![5, 7], 0), (vec![3, 5, 2], -1), (vec![3, 5, 2], 1)] {
        let x = random(shape.clone(), 9);
        let dy = random(shape.clone(), 10);
        assert_eq!(check_signatures(&Softmax { axis }, std::slice::from_ref(&x)).len(), shape.len() - 1);
        check_signatures(&LogSoftmax { axis }, std::slice::from_ref(&x));
        for log in [false, true] {
            let y = if log {
                run(&LogSoftmax { axis }, std::slice::from_ref(&x))
            } else {
                run(&Softmax { axis }, std::slice::from_ref(&x))
            };
            let signatures = check_signatures(&SoftmaxGrad { axis, log }, &[y.unwrap().remove(0), dy.clone()]);
            assert!(has(&signatures, &[B, P], &[P]));
        }
    }
}

#[test]
fn masked_softmax_splits_scores_with_the_mask_where_it_has_the_axis() {
    // A causal mask broadcast over batch and heads, and a mask with a broadcast column.
    for (shape, mask) in [(vec![2, 3, 4, 4], vec![4, 4]), (vec![5, 3], vec![5, 1])] {
        let (x, mask) = (random(shape.clone(), 15), random(mask, 16));
        let signatures = check_signatures(&MaskedSoftmax { scale: 0.5 }, &[x.clone(), mask.clone()]);
        assert_eq!(signatures.len(), shape.len() - 1);
        let y = run(&MaskedSoftmax { scale: 0.5 }, &[x, mask]).unwrap().remove(0);
        let signatures = check_signatures(&MaskedSoftmaxGrad { scale: 0.5 }, &[y, random(shape, 17)]);
        assert!(has(&signatures, &[B, P], &[P]));
    }
    let x = random([2, 3, 4, 4], 18);
    let signatures = check_signatures(&MaskedSoftmax { scale: 0.5 }, &[x, random([4, 4], 19)]);
    assert!(has(&signatures, &[S(1), B], &[S(1)]) && has(&signatures, &[S(2), S(0)], &[S(2)]));
}

#[test]
fn attention_splits_sequences_heads_and_free_queries_and_its_gradient_takes_summands_of_dout() {
    // Three sequences and three heads over 2, 3 and 4 devices: uneven and empty parts.
    for (causal, keys) in [(true, 5), (false, 5), (false, 3)] {
        let (q, k, v) = (random([3, 5, 3, 4], 26), random([3, keys, 3, 4], 27), random([3, keys, 3, 4], 28));
        let op = Attention::new(0.4, causal);
        let signatures = check_signatures(&op, &[q.clone(), k.clone(), v.clone()]);
        assert!(has(&signatures, &[S(0), S(0), S(0)], &[S(0), S(0)]), "{causal}");
        assert!(has(&signatures, &[S(2), S(2), S(2)], &[S(2), S(1)]), "{causal}");
        assert_eq!(has(&signatures, &[S(1), B, B], &[S(1), S(2)]), !causal);
        let outputs = run(&op, &[q.clone(), k.clone(), v.clone()]).unwrap();
        let dout = random([3, 5, 3, 4], 29);
        let grad = AttentionGrad::new(0.4, causal);
        let inputs = [q, k, v, outputs[0].clone(), outputs[1].clone(), dout];
        let signatures = check_signatures(&grad, &inputs);
        assert!(has(&signatures, &[B, B, B, B, B, P], &[P, P, P]), "{causal}");
        assert!(has(&signatures, &[S(2), S(2), S(2), S(2), S(1), S(2)], &[S(2), S(2), S(2)]), "{causal}");
        assert_eq!(has(&signatures, &[B, S(1), S(1), B, B, B], &[P, S(1), S(1)]), !causal);
    }
}

#[test]
fn permuted_matmuls_split_batches_rows_columns_and_sums_where_the_tensors_store_them() {
    let (q, k) = (random([2, 3, 2, 4], 23), random([2, 3, 2, 4], 24));
    let scores = PermutedMatMul { a_axes: vec![0, 2, 1, 3], b_axes: vec![0, 2, 3, 1], out_axes: vec![0, 1, 2, 3] };
    let signatures = check_signatures(&scores, &[q.clone(), k.clone()]);
    // Heads: stored axis 2 of q and k, axis 1 of the scores; the inner `d` gives summands.
    assert!(has(&signatures, &[S(2), S(2)], &[S(1)]) && has(&signatures, &[S(3), S(3)], &[P]));
    let weights = random([2, 2, 3, 3], 25);
    let values = PermutedMatMul { a_axes: vec![0, 1, 2, 3], b_axes: vec![0, 2, 1, 3], out_axes: vec![0, 2, 1, 3] };
    let signatures = check_signatures(&values, &[weights, k]);
    assert!(has(&signatures, &[S(1), S(2)], &[S(2)]) && has(&signatures, &[S(2), B], &[S(1)]));
}

#[test]
fn bias_gelu_splits_anywhere_with_the_bias_split_along_the_last_axis() {
    let (x, bias, dy) = (random([4, 6], 20), random([6], 21), random([4, 6], 22));
    let signatures = check_signatures(&BiasGelu, &[x.clone(), bias.clone()]);
    assert!(has(&signatures, &[S(0), B], &[S(0)]) && has(&signatures, &[S(1), S(0)], &[S(1)]));
    let signatures = check_signatures(&BiasGeluGrad, &[x, bias, dy]);
    assert!(has(&signatures, &[B, B, P], &[P]) && has(&signatures, &[S(1), S(0), S(1)], &[S(1)]));
}

#[test]
fn layer_norm_splits_rows_and_its_parameter_gradients_become_partial() {
    for shape in [vec![5, 7], vec![3, 5, 4], vec![2, 3]] {
        let features = *shape.last().unwrap();
        let (x, dy) = (random(shape.clone(), 11), random(shape.clone(), 12));
        let (gamma, beta) = (random([features], 13), random([features], 14));
        let signatures = check_signatures(&LayerNorm::new(1e-5), &[x.clone(), gamma.clone(), beta]);
        assert_eq!(signatures.len(), shape.len() - 1);
        let signatures = check_signatures(&LayerNormGrad::new(1e-5), &[x, gamma, dy]);
        assert!(has(&signatures, &[S(0), B, S(0)], &[S(0), P, P]));
    }
}

#[test]
fn cross_entropy_splits_the_batch_into_summands_of_the_mean() {
    for rows in [7, 2, 6] {
        let (logits, labels) = (random([rows, 5], 15), indices([rows], 5, 16));
        let signatures = check_signatures(&SparseCrossEntropy::default(), &[logits.clone(), labels.clone()]);
        assert!(has(&signatures, &[S(0), S(0)], &[P]));
        let signatures = check_signatures(&SparseCrossEntropyGrad::default(), &[logits, labels, scalar(1.7)]);
        assert!(has(&signatures, &[S(0), S(0), B], &[S(0)]));
    }
}

#[test]
fn embeddings_split_ids_features_and_vocabulary() {
    for ids_shape in [vec![7], vec![3, 5], vec![2]] {
        let (table, ids) = (random([11, 4], 17), indices(ids_shape.clone(), 11, 18));
        let signatures = check_signatures(&Embedding, &[table, ids.clone()]);
        assert!(has(&signatures, &[S(0), B], &[P]));
        let mut dy_shape = ids_shape.clone();
        dy_shape.push(4);
        let signatures = check_signatures(&EmbeddingGrad::new(11), &[ids, random(dy_shape, 19)]);
        assert!(has(&signatures, &[S(0), S(0)], &[P]) && has(&signatures, &[B, B], &[S(0)]));
    }
}

#[test]
fn reshapes_split_dimensions_with_the_same_elements_before_them() {
    // Factored or merged dimensions keep a split on their outermost factor: [6, 4] ->
    // [6, 2, 2] also maps S(1) -> S(1), [4, 6] -> [2, 2, 6] S(0) -> S(0), and [2, 3, 5] ->
    // [6, 5] S(0) -> S(0) (each where the device count divides the smaller dimension).
    let cases: [(&[usize], &[isize], usize); 8] = [
        (&[6, 4], &[6, 2, 2], 2),
        (&[4, 6], &[2, 2, 6], 2),
        (&[2, 3, 5], &[6, -1], 2),
        (&[8, 6], &[2, 4, 3, 2], 2),
        (&[4, 7], &[28], 1),
        (&[5, 7], &[7, 5], 0),
        (&[6, 1, 4], &[6, 4, 1], 2),
        (&[5, 7], &[5, 7], 2),
    ];
    for (from, spec, splits) in cases {
        let signatures = check_signatures(&Reshape(spec.to_vec()), &[random(from, 20)]);
        assert_eq!(signatures.len(), splits + 1, "{from:?} -> {spec:?}: {signatures:?}");
    }
}

#[test]
fn permute_slice_and_concat_split_the_matching_axes() {
    let x = random([5, 7, 3], 21);
    for perm in [vec![2, 0, 1], vec![1, 0, 2], vec![-1, 0, 1]] {
        let signatures = check_signatures(&Permute(perm), std::slice::from_ref(&x));
        assert_eq!(signatures.len(), 4);
    }
    for (axis, start, end) in [(0, 1, 4), (-1, 1, 3), (1, 0, 7)] {
        let signatures = check_signatures(&Slice { axis, start, end }, std::slice::from_ref(&x));
        assert_eq!(signatures.len(), 3);
        let mut dims = x.shape.dims().to_vec();
        let axis_index = Shape(dims.clone()).axis(axis).unwrap();
        let size = dims[axis_index];
        dims[axis_index] = end - start;
        check_signatures(&SliceGrad { axis, start, size }, &[random(dims, 22)]);
    }
    let signatures = check_signatures(&Concat { axis: 1 }, &[random([5, 3], 23), random([5, 4], 24)]);
    assert!(has(&signatures, &[S(0), S(0)], &[S(0)]) && has(&signatures, &[P, P], &[P]));
    let parts = [random([2, 5], 25), random([3, 5], 26), random([1, 5], 27)];
    assert_eq!(check_signatures(&Concat { axis: 0 }, &parts).len(), 2);
    check_signatures(&Concat { axis: -1 }, &[random([7, 2], 28), random([7, 1], 29)]);
}

#[test]
fn dropout_draws_each_part_of_the_mask_at_its_logical_index() {
    for shape in [vec![7, 5], vec![3, 5, 4]] {
        let signatures = check_signatures(&Dropout { p: 0.4, seed: 99 }, &[random(shape.clone(), 30)]);
        assert_eq!(signatures.len(), shape.len() + 1);
    }
}

#[test]
fn optimizer_updates_split_with_their_parameter() -> Result<(), GraphError> {
    for optimizer in [Optimizer::sgd(0.1, 0.9, 0.01), Optimizer::adamw(0.01, 0.1).with_clip_norm(1.0)] {
        let g = Graph::new();
        let x = g.input("x", [5, 3], DType::F64)?;
        let w = g.variable("w", [5, 3], DType::F64, Init::Zeros)?;
        g.minimize(x.mul(&w)?.sum_all()?, &optimizer)?;
        let mut updates = 0;
        for node in g.nodes() {
            let metas: Vec<TensorMeta> = node.inputs.iter().map(|&id| g.info(id).meta).collect();
            let outputs = node.op.infer(&metas).unwrap();
            match node.op.name() {
                "sgd_update" | "adamw_update" => {
                    let inputs: Vec<HostArray> = (0..metas.len())
                        .map(|i| match i {
                            2 => scalar(0.05),
                            3 => scalar(3.0),
                            _ => positive(metas[i].shape.clone(), 31 + i as u64),
                        })
                        .collect();
                    assert_eq!(check_signatures(&*node.op, &inputs).len(), 2);
                    updates += 1;
                }
                "next_step" | "learning_rate" | "clip_factor" => {
                    assert!(node.op.sbp_signatures(&metas, &outputs).is_empty(), "{}", node.op.name());
                }
                _ => {}
            }
        }
        assert_eq!(updates, 1);
    }
    Ok(())
}

/// An op that claims extra signatures, optionally without its own `localize`: what the
/// checker must reject.
#[derive(Debug)]
struct Claim {
    op: Arc<dyn OpDef>,
    signature: SbpSignature,
    localize: bool,
}

impl OpDef for Claim {
    fn name(&self) -> &'static str {
        self.op.name()
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        self.op.infer(inputs)
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        self.op.grad(ctx)
    }

    fn sbp_signatures(&self, _inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        vec![self.signature.clone()]
    }

    fn localize(&self, ctx: &LocalContext<'_>) -> Result<Option<Arc<dyn OpDef>>, String> {
        if self.localize {
            self.op.localize(ctx)
        } else {
            Ok(None)
        }
    }
}

impl OpAttrs for Claim {
    fn op_type(&self) -> &'static str {
        self.op.op_type()
    }

    fn attrs(&self) -> serde_json::Value {
        self.op.attrs()
    }
}

impl HostCompute for Claim {
    fn compute(
        &self,
        context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        self.op.compute(context, inputs, outputs)
    }
}

/// `op` claiming `signature`, with its own `localize` or none.
fn claim(op: impl OpDef + 'static, inputs: &[Sbp], outputs: &[Sbp], localize: bool) -> Claim {
    Claim { op: Arc::new(op), signature: SbpSignature::new(inputs, outputs), localize }
}

#[test]
fn the_checker_rejects_invalid_signatures_and_missing_localization() {
    let x = random([5, 7], 40);
    let reduce = |kind| Reduce { kind, axes: vec![1], keepdim: false };
    let claims = [
        (claim(Unary(UnaryKind::Relu), &[P], &[P], true), vec![x.clone()]),
        (claim(Unary(UnaryKind::AddScalar(1.0)), &[P], &[P], true), vec![x.clone()]),
        (claim(Binary(BinaryKind::Add), &[P, B], &[P], true), vec![x.clone(), x.clone()]),
        (claim(Binary(BinaryKind::Div), &[B, P], &[P], true), vec![x.clone(), positive([5, 7], 41)]),
        (claim(Binary(BinaryKind::Mul), &[P, P], &[P], true), vec![x.clone(), x.clone()]),
        (claim(reduce(ReduceKind::Max), &[S(1)], &[P], true), vec![x.clone()]),
        // Valid with `localize` (the mean divides by the logical count), not without.
        (claim(reduce(ReduceKind::Mean), &[S(1)], &[P], false), vec![x.clone()]),
        (claim(Softmax { axis: 1 }, &[S(1)], &[S(1)], true), vec![x.clone()]),
        (claim(Reshape(vec![7, 5]), &[S(0)], &[S(0)], true), vec![x.clone()]),
        (claim(Dropout { p: 0.5, seed: 3 }, &[S(0)], &[S(0)], false), vec![x.clone()]),
        (claim(MatMul::default(), &[S(1), B], &[P], true), vec![x.clone(), random([7, 3], 42)]),
        (claim(SparseCrossEntropy::default(), &[S(0), S(0)], &[P], false), vec![x.clone(), indices([5], 7, 43)]),
        (claim(Embedding, &[S(0), B], &[P], false), vec![random([11, 4], 44), indices([6], 11, 45)]),
    ];
    for (claim, inputs) in claims {
        let caught = [2, 3].iter().any(|&parts| check_signature(&claim, &inputs, &claim.signature, parts).is_err());
        assert!(caught, "{} {} (localize: {}) passed the checker", claim.name(), claim.signature, claim.localize);
    }
}

#[test]
fn cast_splits_anywhere_and_takes_summands_only_when_widening() {
    for shape in [vec![5, 3], vec![2, 7, 3], vec![]] {
        let rank = shape.len();
        // f64 → f64 keeps the width: summands pass through.
        let same = check_signatures(&Cast { to: DType::F64 }, &[random(shape.clone(), 1)]);
        assert!(has(&same, &[P], &[P]));
        // Narrowing would round every summand: only splits.
        for to in [DType::F32, DType::Bf16] {
            let narrow = check_signatures(&Cast { to }, &[random(shape.clone(), 2)]);
            assert!(!has(&narrow, &[P], &[P]), "cast to {to}");
            assert_eq!(narrow.len(), rank, "cast to {to}");
        }
    }
}
