//! Data movement on CUDA against the CPU kernels (skip without a GPU): reshape,
//! broadcast_to, permute, slice, slice_grad, concat, the boxing steps take_part,
//! keep_on_first and to_global, sum_to, embedding and its gradient, and both on a
//! device's rows of a vocabulary-parallel table (vocab_part).

mod common;

use regflow_cuda::{Device, Stream};
use regflow_plan::ops::{
    BroadcastTo, Concat, Embedding, EmbeddingGrad, KeepOnFirst, OpAttrs, Permute, Reshape, Slice, SliceGrad,
    SumSquares, SumTo, TakePart, ToGlobal, VocabPart,
};
use regflow_plan::{DType, HostArray, Shape, SplitMix64, TensorMeta};

const ANY: [DType; 4] = [DType::F32, DType::F64, DType::I64, DType::Bf16];

/// Values of `dtype`: integers in -1000..1000 for i64, else uniform in [-2, 2).
fn random(shape: &[usize], dtype: DType, seed: u64) -> HostArray {
    let mut rng = SplitMix64::new(seed);
    let n: usize = shape.iter().product();
    let values: Vec<f64> = (0..n).map(|_| 4.0 * rng.next_f64() - 2.0).collect();
    let scale = if dtype == DType::I64 { 500.0 } else { 1.0 };
    let values: Vec<f64> = values.iter().map(|v| v * scale).collect();
    HostArray::from_f64(shape.to_vec(), dtype, &values).expect("an array")
}

/// Ids of `shape` drawn from `0..vocab` by `seed`.
fn random_ids(shape: &[usize], vocab: usize, seed: u64) -> HostArray {
    let mut rng = SplitMix64::new(seed);
    let n: usize = shape.iter().product();
    HostArray::i64(shape.to_vec(), (0..n).map(|_| (rng.next_u64() % vocab as u64) as i64).collect()).expect("ids")
}

fn check(what: &str, op: &dyn OpAttrs, inputs: &[&HostArray], out: TensorMeta, gpu: (&Device, &Stream), rel: f64) {
    let conf = common::conf(op, inputs, &[out]);
    common::check(what, &conf, inputs, gpu, rel);
}

#[test]
fn reshape_broadcast_and_permute_move_every_element_exactly() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let gpu = (&device, &stream);
    for dtype in ANY {
        for n in [1, 7, 1023, 70_001] {
            let x = random(&[n], dtype, 1);
            check(
                &format!("reshape {dtype} [{n}]"),
                &Reshape(vec![1, -1]),
                &[&x],
                TensorMeta::new([1, n], dtype),
                gpu,
                0.0,
            );
        }
        let cases: &[(&[usize], &[usize])] =
            &[(&[1], &[7]), (&[7], &[3, 7]), (&[3, 1], &[3, 1023]), (&[], &[70_001]), (&[2, 1, 3], &[4, 2, 5, 3])];
        for &(from, to) in cases {
            let x = random(from, dtype, 2);
            let op = BroadcastTo(Shape::new(to));
            check(
                &format!("broadcast_to {dtype} {from:?} -> {to:?}"),
                &op,
                &[&x],
                TensorMeta::new(to, dtype),
                gpu,
                0.0,
            );
        }
        let perms: &[(&[usize], &[isize])] = &[
            (&[1], &[0]),
            (&[7, 1023], &[1, 0]),
            (&[3, 5, 7], &[2, 0, 1]),
            (&[70_001, 3], &[-1, 0]),
            (&[2, 3, 1, 5, 2, 1, 3, 2], &[7, 6, 5, 4, 3, 2, 1, 0]),
        ];
        for &(dims, perm) in perms {
            let x = random(dims, dtype, 3);
            let op = Permute(perm.to_vec());
            let axes = op.resolve(&Shape::new(dims)).expect("a permutation");
            let out: Vec<usize> = axes.iter().map(|&a| dims[a]).collect();
            check(&format!("permute {dtype} {dims:?} by {perm:?}"), &op, &[&x], TensorMeta::new(out, dtype), gpu, 0.0);
        }
    }
}

#[test]
fn slices_their_gradients_and_concat_move_every_element_exactly() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let gpu = (&device, &stream);
    for dtype in ANY {
        // (input dims, axis, start, end)
        let slices: &[(&[usize], isize, usize, usize)] = &[
            (&[7], 0, 0, 1),
            (&[7], 0, 3, 7),
            (&[3, 1023], -1, 5, 1000),
            (&[70_001, 2], 0, 1, 70_000),
            (&[2, 7, 3], 1, 2, 5),
        ];
        for &(dims, axis, start, end) in slices {
            let x = random(dims, dtype, 4);
            let op = Slice { axis, start, end };
            let (a, _) = op.resolve(&Shape::new(dims)).expect("a slice");
            let mut out = dims.to_vec();
            out[a] = end - start;
            let what = format!("{dtype} {dims:?} axis {axis} {start}..{end}");
            check(&format!("slice {what}"), &op, &[&x], TensorMeta::new(out.clone(), dtype), gpu, 0.0);
            let dy = random(&out, dtype, 5);
            let grad = SliceGrad { axis, start, size: dims[a] };
            check(&format!("slice_grad {what}"), &grad, &[&dy], TensorMeta::new(dims, dtype), gpu, 0.0);
        }
        // Concat along each axis of [.., k, ..] pieces.
        let parts: &[(&[&[usize]], isize)] = &[
            (&[&[1]], 0),
            (&[&[7], &[1], &[1023]], 0),
            (&[&[3, 7], &[3, 1], &[3, 70_001]], 1),
            (&[&[2, 5, 3], &[4, 5, 3]], -3),
        ];
        for &(shapes, axis) in parts {
            let inputs: Vec<HostArray> =
                shapes.iter().enumerate().map(|(i, d)| random(d, dtype, 10 + i as u64)).collect();
            let refs: Vec<&HostArray> = inputs.iter().collect();
            let a = Shape::new(shapes[0]).axis(axis).expect("an axis");
            let mut out = shapes[0].to_vec();
            out[a] = shapes.iter().map(|d| d[a]).sum();
            check(
                &format!("concat {dtype} {shapes:?} axis {axis}"),
                &Concat { axis },
                &refs,
                TensorMeta::new(out, dtype),
                gpu,
                0.0,
            );
        }
    }
}

/// A device's part of one axis (uneven splits and an empty part included), the
/// first-keeps-the-value step and `to_global`'s copy, as boxing inserts them, move every
/// element exactly.
#[test]
fn boxing_parts_move_every_element_exactly() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let gpu = (&device, &stream);
    for dtype in ANY {
        // (input dims, dim, parts)
        let splits: &[(&[usize], usize, usize)] =
            &[(&[7], 0, 2), (&[1, 5], 0, 2), (&[3, 1023], 1, 4), (&[70_001, 2], 0, 3), (&[2, 7, 3], 1, 2)];
        for &(dims, dim, parts) in splits {
            let x = random(dims, dtype, 6);
            for index in 0..parts {
                let mut out = dims.to_vec();
                out[dim] = regflow_plan::part_range(dims[dim], parts, index).len();
                let op = TakePart { dim, parts, index };
                let what = format!("take_part {dtype} {dims:?} dim {dim} part {index} of {parts}");
                check(&what, &op, &[&x], TensorMeta::new(out, dtype), gpu, 0.0);
            }
        }
        let x = random(&[3, 1023], dtype, 7);
        for first in [true, false] {
            let what = format!("keep_on_first {dtype} first={first}");
            check(&what, &KeepOnFirst { first }, &[&x], TensorMeta::new([3, 1023], dtype), gpu, 0.0);
        }
        check(&format!("to_global {dtype}"), &ToGlobal, &[&x], TensorMeta::new([3, 1023], dtype), gpu, 0.0);
    }
}

#[test]
fn sum_to_matches_the_cpu() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let cases: &[(&[usize], &[usize])] = &[
        (&[1], &[1]),
        (&[7], &[]),
        (&[1023, 3], &[3]),
        (&[3, 1023], &[3, 1]),
        // Long column sums (32 × 32-thread blocks), as a bias gradient over the batch.
        (&[1023, 33], &[33]),
        (&[4099, 7], &[7]),
        (&[70_001], &[1]),
        // Few outputs over long ranges: the chunked two-launch sum (a gradient's norm).
        (&[300, 701], &[]),
        // Few column blocks over long ranges: the split two-launch column sum (a bias
        // gradient of a wide batch), with an uneven last split and a merged reduced range.
        (&[4099, 96], &[96]),
        (&[2, 1500, 40], &[1, 1, 40]),
        (&[3, 70_001], &[3, 1]),
        (&[70_001, 3], &[1, 3]),
        (&[2, 3, 5, 7], &[3, 1, 7]),
        (&[7, 1], &[7, 1]),
    ];
    for dtype in [DType::F32, DType::F64, DType::Bf16] {
        for &(from, to) in cases {
            let x = random(from, dtype, 6);
            // The GPU adds each output's summands in 32 interleaved slices (in order when
            // there are fewer than 32) and the CPU an innermost run's partial sum at once:
            // f32 may differ by rounding, scaled by the summand count (up to 70_001 values
            // of magnitude 2). bf16 adds in f32 on both and rounds once: the sums agree to
            // bf16's precision.
            let rel = match dtype {
                DType::F32 => 1e-3,
                DType::Bf16 => 1e-2,
                _ => 1e-9,
            };
            let op = SumTo(Shape::new(to));
            check(
                &format!("sum_to {dtype} {from:?} -> {to:?}"),
                &op,
                &[&x],
                TensorMeta::new(to, dtype),
                (&device, &stream),
                rel,
            );
        }
    }
}

/// `sum_squares` takes sum_to's paths to a scalar (one block, chunks) with each summand
/// squared as it loads; against the CPU's squares summed in order.
#[test]
fn sum_squares_matches_the_cpu() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let shapes: &[&[usize]] = &[&[1], &[7], &[1023, 3], &[70_001], &[300, 701], &[2, 3, 5, 7], &[768, 3072]];
    for dtype in [DType::F32, DType::F64] {
        for &from in shapes {
            let x = random(from, dtype, 9);
            let rel = if dtype == DType::F32 { 1e-3 } else { 1e-9 };
            let what = format!("sum_squares {dtype} {from:?}");
            check(&what, &SumSquares, &[&x], TensorMeta::new([], dtype), (&device, &stream), rel);
        }
    }
}

/// A whole input to one value reads it in memory order (`sum_flat`: one block up to 32768
/// elements, chunks past it); these lengths sit on the edges of its packs (4 f32, 2 f64, 8
/// bf16 and f16 per 16 bytes), of its 1024-thread block, of the one-block limit and of the
/// chunks. NaN and infinities reach the sum as on the CPU. The sums with more than one
/// output beside them still take the column and chunked paths.
#[test]
fn flat_sums_to_one_value_match_the_cpu_at_every_edge() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let gpu = (&device, &stream);
    let lengths = [1, 7, 1023, 1024, 1025, 4097, 32_767, 32_768, 32_769, 70_001, (1 << 20) + 3];
    // f32 sums of up to a million summands differ from the CPU's serial order by rounding.
    let rel = |dtype| match dtype {
        DType::F32 => 1e-3,
        DType::Bf16 | DType::F16 => 1e-2,
        _ => 1e-9,
    };
    let scalar = |dtype| TensorMeta::new([], dtype);
    // Each also with the input one element off 16-byte alignment (a window into a
    // register): the packs then load element by element, the same summands in the same order.
    fn check_both_alignments(
        what: &str,
        op: &dyn OpAttrs,
        inputs: &[&HostArray],
        out: TensorMeta,
        gpu: (&Device, &Stream),
        rel: f64,
    ) {
        let conf = common::conf(op, inputs, &[out]);
        common::check_both(what, &conf, inputs, gpu, rel);
    }
    for dtype in [DType::F32, DType::F64, DType::Bf16, DType::F16] {
        for n in lengths {
            let x = random(&[n], dtype, 10);
            check_both_alignments(
                &format!("sum_to {dtype} [{n}] -> []"),
                &SumTo(Shape::scalar()),
                &[&x],
                scalar(dtype),
                gpu,
                rel(dtype),
            );
            if matches!(dtype, DType::F32 | DType::F64) {
                check_both_alignments(
                    &format!("sum_squares {dtype} [{n}]"),
                    &SumSquares,
                    &[&x],
                    scalar(dtype),
                    gpu,
                    rel(dtype),
                );
            }
        }
        // To an all-ones shape: the same flat sum.
        let x = random(&[3, 11_000], dtype, 11);
        let ones = TensorMeta::new([1, 1], dtype);
        check_both_alignments(
            &format!("sum_to {dtype} [3, 11000] -> [1, 1]"),
            &SumTo(Shape::new([1, 1])),
            &[&x],
            ones,
            gpu,
            rel(dtype),
        );
    }
    for dtype in [DType::F32, DType::F64] {
        for (n, at, value) in [(1025, 1000, f64::NAN), (70_001, 65_536, f64::NAN), (70_001, 3, f64::INFINITY)] {
            let mut values = random(&[n], dtype, 12).to_f64_vec();
            values[at] = value;
            let x = HostArray::from_f64(vec![n], dtype, &values).expect("an array");
            let what = format!("{dtype} [{n}] with {value} at {at}");
            check_both_alignments(
                &format!("sum_to {what}"),
                &SumTo(Shape::scalar()),
                &[&x],
                scalar(dtype),
                gpu,
                rel(dtype),
            );
            check_both_alignments(&format!("sum_squares {what}"), &SumSquares, &[&x], scalar(dtype), gpu, rel(dtype));
            // Two outputs: the column sum (short) or the chunked sum (long) of before.
            let pairs = HostArray::from_f64(vec![n, 2], dtype, &[values.clone(), values].concat()).expect("an array");
            let two = TensorMeta::new([1, 2], dtype);
            check_both_alignments(
                &format!("sum_to {what}, two outputs"),
                &SumTo(Shape::new([1, 2])),
                &[&pairs],
                two,
                gpu,
                rel(dtype),
            );
        }
    }
}

/// A row-major [rows, cols] matrix summed over its rows to [cols] or [1, cols] (a bias
/// gradient) takes the row sums (`sum_rows`: 16-byte loads of 4 f32, 2 f64 or 8 bf16/f16
/// columns per thread where the rows are 16-byte aligned, element by element where not;
/// slices of rows, then `sum_row_slices` adds each column's slices): GPT-2's shapes, ragged column groups
/// (7, 9 columns), one slice (3 rows), leading axes merged into the rows, each also with
/// its registers off alignment. NaN and infinities in one column reach that column alone.
#[test]
fn row_sums_to_columns_match_the_cpu_aligned_or_not() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let gpu = (&device, &stream);
    let rel = |dtype| match dtype {
        DType::F32 => 1e-3,
        DType::Bf16 | DType::F16 => 1e-2,
        _ => 1e-9,
    };
    let both = |what: &str, x: &HostArray, to: &[usize], dtype: DType| {
        let conf = common::conf(&SumTo(Shape::new(to)), &[x], &[TensorMeta::new(to, dtype)]);
        common::check_both(what, &conf, &[x], gpu, rel(dtype));
    };
    let shapes: &[&[usize]] =
        &[&[8192, 768], &[8192, 3072], &[1000, 7], &[3, 1024], &[5000, 9], &[2, 4099, 40], &[0, 5]];
    for dtype in [DType::F32, DType::F64, DType::Bf16, DType::F16] {
        for &from in shapes {
            let x = random(from, dtype, 13);
            let cols = from[from.len() - 1];
            both(&format!("sum_to {dtype} {from:?} -> [{cols}]"), &x, &[cols], dtype);
            both(&format!("sum_to {dtype} {from:?} -> [1, {cols}]"), &x, &[1, cols], dtype);
        }
        // Column 3 has a NaN, column 5 an infinity, column 6 both infinities (NaN).
        for (rows, cols) in [(5000, 9), (8192, 64)] {
            let mut values = random(&[rows, cols], dtype, 14).to_f64_vec();
            values[4000 * cols + 3] = f64::NAN;
            values[17 * cols + 5] = f64::INFINITY;
            values[10 * cols + 6] = f64::INFINITY;
            values[4999 * cols + 6] = f64::NEG_INFINITY;
            let x = HostArray::from_f64(vec![rows, cols], dtype, &values).expect("an array");
            both(&format!("sum_to {dtype} [{rows}, {cols}] with NaN and infinities"), &x, &[cols], dtype);
        }
    }
}

#[test]
fn embedding_and_its_gradient_match_the_cpu() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let gpu = (&device, &stream);
    for dtype in [DType::F32, DType::F64] {
        for (vocab, features, ids_shape) in
            [(1, 1, vec![1]), (7, 3, vec![2, 7]), (1023, 7, vec![1023]), (70_001, 2, vec![3, 5]), (5, 1023, vec![70])]
        {
            let table = random(&[vocab, features], dtype, 7);
            // Repeated ids, so the gradient adds several rows into one.
            let ids = random_ids(&ids_shape, vocab, 8);
            let mut out = ids_shape.clone();
            out.push(features);
            let what = format!("{dtype} table [{vocab}, {features}] ids {ids_shape:?}");
            check(
                &format!("embedding {what}"),
                &Embedding,
                &[&table, &ids],
                TensorMeta::new(out.clone(), dtype),
                gpu,
                0.0,
            );
            let dy = random(&out, dtype, 9);
            // Each row sums its ids' dy rows in id order, as the CPU does: the CPU's bits.
            let grad = EmbeddingGrad::new(vocab);
            check(
                &format!("embedding_grad {what}"),
                &grad,
                &[&ids, &dy],
                TensorMeta::new([vocab, features], dtype),
                gpu,
                0.0,
            );
        }
        // A batch of GPT-2's size over a few rows: rows summing thousands of ids (the
        // order of f32 additions shows in their bits), and rows no id falls on.
        let (vocab, features, ids_shape) = (11, 5, vec![8, 1024]);
        let ids = random_ids(&ids_shape, 4, 15);
        let dy = random(&[8, 1024, features], dtype, 16);
        let grad = EmbeddingGrad::new(vocab);
        let what = format!("embedding_grad {dtype} table [{vocab}, {features}] ids {ids_shape:?} in 0..4");
        check(&what, &grad, &[&ids, &dy], TensorMeta::new([vocab, features], dtype), gpu, 0.0);
    }
    // With a base (a tied table's other gradient, folded in by the compiler): more rows
    // than the table (a padded vocabulary's), of the table's dtype or 16-bit beside f32;
    // each element the bits of an add of the scatter and the base.
    for (dtype, base_dtype) in
        [(DType::F32, DType::F32), (DType::F32, DType::Bf16), (DType::F32, DType::F16), (DType::F64, DType::F64)]
    {
        let (vocab, features) = (70, 5);
        let ids = random_ids(&[3, 40], vocab, 17);
        let dy = random(&[3, 40, features], dtype, 18);
        let base = random(&[vocab + 7, features], base_dtype, 19);
        let grad = EmbeddingGrad { base: Some(base_dtype), ..EmbeddingGrad::new(vocab) };
        let what = format!(
            "embedding_grad {dtype} table [{vocab}, {features}] with a {base_dtype} base of {} rows",
            vocab + 7
        );
        check(&what, &grad, &[&ids, &dy, &base], TensorMeta::new([vocab, features], dtype), gpu, 0.0);
    }
}

/// A vocabulary-parallel table: each device's rows (uneven, one part empty) gather what
/// they hold and read zeros for ids held elsewhere; the gradient scatters into the rows held.
#[test]
fn vocab_parts_match_the_cpu() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let gpu = (&device, &stream);
    for dtype in [DType::F32, DType::F64] {
        for (vocab, features, parts) in [(7, 3, 2), (1023, 7, 3), (2, 5, 3)] {
            let ids_shape = vec![4, 9];
            let ids = random_ids(&ids_shape, vocab, 11);
            let mut out = ids_shape.clone();
            out.push(features);
            for part in 0..parts {
                let held = regflow_plan::part_range(vocab, parts, part);
                let rows = regflow_plan::ops::Rows { vocab_size: vocab, held: held.clone() };
                let table = random(&[held.len(), features], dtype, 12 + part as u64);
                let what = format!("{dtype} rows {held:?} of {vocab}, {features} features");
                let gather = VocabPart { rows: rows.clone(), grad: false };
                check(
                    &format!("vocab_part {what}"),
                    &gather,
                    &[&table, &ids],
                    TensorMeta::new(out.clone(), dtype),
                    gpu,
                    0.0,
                );
                let dy = random(&out, dtype, 13);
                let scatter = VocabPart { rows, grad: true };
                let table_meta = TensorMeta::new([held.len(), features], dtype);
                check(&format!("vocab_part grad {what}"), &scatter, &[&ids, &dy], table_meta, gpu, 0.0);
            }
        }
    }
}
