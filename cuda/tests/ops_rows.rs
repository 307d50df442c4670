//! The row-wise ops on CUDA (softmax family, masked softmax, layer norm and its gradient,
//! also with a bf16 or f16 output or dy, sparse cross-entropy and its gradient) against
//! the CPU kernels, over odd row lengths (1, 7, 33, 1023: not multiples of a block) and
//! row counts (skips without a GPU).

mod common;

use regflow_plan::ops::{
    Cast, LayerNorm, LayerNormGrad, LogSoftmax, MaskedSoftmax, MaskedSoftmaxGrad, OpAttrs, PartCrossEntropy, Softmax,
    SoftmaxGrad, SparseCrossEntropy, SparseCrossEntropyGrad,
};
use regflow_plan::{DType, HostArray, OpConf, Shape, TensorMeta};

fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        // f32 arithmetic on both sides, one rounding each: a sum in another order may round
        // the other way (2^-8 relative).
        DType::Bf16 => 1e-2,
        // As bf16, with f16's 11 bits.
        DType::F16 => 2e-3,
        _ => 1e-12,
    }
}

fn meta(dims: &[usize], dtype: DType) -> TensorMeta {
    TensorMeta::new(Shape::new(dims.to_vec()), dtype)
}

fn check(
    what: &str,
    op: &dyn OpAttrs,
    inputs: &[&HostArray],
    outputs: &[TensorMeta],
    gpu: (&regflow_cuda::Device, &regflow_cuda::Stream),
) {
    let conf = common::conf(op, inputs, outputs);
    common::check(what, &conf, inputs, gpu, tolerance(outputs[0].dtype));
}

const LENS: [usize; 4] = [1, 7, 33, 1023];

#[test]
fn softmax_and_its_gradients_match_the_cpu_along_every_axis() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let gpu = (&device, &stream);
    for dtype in [DType::F32, DType::F64] {
        for len in LENS {
            for (dims, axis) in [(vec![5, len], -1), (vec![len, 3], 0), (vec![2, len, 3], 1), (vec![len], 0)] {
                let x = common::array(&dims, dtype, 1);
                let out = [meta(&dims, dtype)];
                check(&format!("softmax {dtype} {dims:?} axis {axis}"), &Softmax { axis }, &[&x], &out, gpu);
                check(&format!("log_softmax {dtype} {dims:?} axis {axis}"), &LogSoftmax { axis }, &[&x], &out, gpu);
                let y = common::run(&common::conf(&Softmax { axis }, &[&x], &out), &[&x], None).remove(0);
                let dy = common::array(&dims, dtype, 2);
                for log in [false, true] {
                    let op = SoftmaxGrad { axis, log };
                    check(&format!("softmax_grad {dtype} {dims:?} axis {axis} log {log}"), &op, &[&y, &dy], &out, gpu);
                }
            }
        }
    }
}

#[test]
fn masked_softmax_and_its_gradient_match_the_cpu_with_broadcast_masks() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let gpu = (&device, &stream);
    for dtype in [DType::F32, DType::F64] {
        // f32 rows of up to 1024 take the warp-per-row entries (8, 16, 24 or 32 elements
        // per lane: 250, 768; 256 and 1024 fill every lane), longer ones (1500) and f64
        // the block-per-row ones.
        for len in LENS.into_iter().chain([250, 256, 768, 1024, 1500]) {
            let dims = vec![2, 3, 5, len];
            let x = common::array(&dims, dtype, 3);
            // A full mask, one per (batch, key) as attention's padding mask, a causal-like
            // [rows, len] one, one value per row, and a scalar.
            for mask_dims in [dims.clone(), vec![2, 1, 1, len], vec![5, len], vec![5, 1], vec![1]] {
                let mask = common::array(&mask_dims, dtype, 4);
                let op = MaskedSoftmax { scale: 0.125 };
                check(
                    &format!("masked_softmax {dtype} {dims:?} mask {mask_dims:?}"),
                    &op,
                    &[&x, &mask],
                    &[meta(&dims, dtype)],
                    gpu,
                );
            }
            let (y, dy) = (common::array(&dims, dtype, 5), common::array(&dims, dtype, 6));
            let op = MaskedSoftmaxGrad { scale: 0.125 };
            check(&format!("masked_softmax_grad {dtype} {dims:?}"), &op, &[&y, &dy], &[meta(&dims, dtype)], gpu);
        }
    }
    // Mixed precision: bf16 scores, widened as they load, with an f32 mask give bf16
    // probabilities computed in f32; bf16 probabilities and their gradient give the
    // scores a bf16 gradient. Rows of 256 and 1024 fill every lane (the warp entries'
    // path without bounds tests), as attention's do.
    for len in LENS.into_iter().chain([250, 256, 768, 1024, 1500]) {
        let dims = vec![2, 3, 5, len];
        let x = common::array(&dims, DType::Bf16, 3);
        // A bf16 mask has no device entry (they read it as f32): the CPU kernel runs.
        for (mask_dims, mask_dtype) in
            [(dims.clone(), DType::F32), (vec![5, len], DType::F32), (vec![5, 1], DType::F32), (vec![1], DType::F32)]
                .into_iter()
                .chain([(vec![5, len], DType::Bf16)])
        {
            let mask = common::array(&mask_dims, mask_dtype, 4);
            let op = MaskedSoftmax { scale: 0.125 };
            let what = format!("masked_softmax bf16 {dims:?} mask {mask_dtype} {mask_dims:?}");
            check(&what, &op, &[&x, &mask], &[meta(&dims, DType::Bf16)], gpu);
        }
        let (y, dy) = (common::array(&dims, DType::Bf16, 5), common::array(&dims, DType::Bf16, 6));
        let op = MaskedSoftmaxGrad { scale: 0.125 };
        let what = format!("masked_softmax_grad bf16 {dims:?}");
        check(&what, &op, &[&y, &dy], &[meta(&dims, DType::Bf16)], gpu);
    }
}

/// Row lengths for the warp-per-row entries' two layouts: 256, 512, 768 and 1024 fill all
/// 32·N places of a lane (8, 16, 24, 32 per lane), so aligned registers take them in 16-byte
/// runs (and registers one element off alignment element by element); 8 and 1000 do not
/// fill them (bounds-tested, element by element).
const RUN_LENS: [usize; 6] = [8, 256, 512, 768, 1000, 1024];

/// The scores of `rows` rows of `len` in `dtype`, NaN at one place of row 1 (its softmax
/// and gradient rows are NaN, as on the CPU).
fn scores_with_a_nan(dims: &[usize], len: usize, dtype: DType, seed: u64) -> HostArray {
    let mut values = common::array(dims, dtype, seed).to_f64_vec();
    values[len + len / 2] = f64::NAN;
    HostArray::from_f64(dims.to_vec(), dtype, &values).expect("scores")
}

/// A causal-like [rows, len] mask: row i sees its first (i + 1)·len / rows keys, and the
/// last row none (fully masked: its probabilities are NaN, as on the CPU).
fn causal_mask(rows: usize, len: usize) -> HostArray {
    let values: Vec<f32> = (0..rows * len)
        .map(|p| if p / len + 1 < rows && p % len < (p / len + 1) * len / rows { 0.0 } else { f32::NEG_INFINITY })
        .collect();
    HostArray::f32(Shape::new(vec![rows, len]), values).expect("a mask")
}

#[test]
fn masked_softmax_in_runs_and_element_by_element_matches_the_cpu_with_causal_masks_and_nan() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let gpu = (&device, &stream);
    let rows = 6;
    // f32 scores take runs of 4, bf16 ones runs of 8 (their mask, f32, two accesses a run).
    for dtype in [DType::F32, DType::Bf16] {
        for len in RUN_LENS {
            let dims = vec![2, rows, len];
            let x = scores_with_a_nan(&dims, len, dtype, 12);
            // Causal, one row broadcast over the rows, one value per row, one scalar.
            let masks = [
                causal_mask(rows, len),
                common::array(&[len], DType::F32, 13),
                common::array(&[rows, 1], DType::F32, 14),
                common::array(&[1], DType::F32, 15),
            ];
            let op = MaskedSoftmax { scale: 0.125 };
            for mask in &masks {
                let what = format!("masked_softmax {dtype} {dims:?} mask {:?}", mask.meta().shape.dims());
                let conf = common::conf(&op, &[&x, mask], &[meta(&dims, dtype)]);
                common::check_both(&what, &conf, &[&x, mask], gpu, tolerance(dtype));
            }
            // The gradient at the causal softmax: NaN rows stay NaN.
            let softmax = common::conf(&op, &[&x, &masks[0]], &[meta(&dims, dtype)]);
            let y = common::run(&softmax, &[&x, &masks[0]], None).remove(0);
            let dy = common::array(&dims, dtype, 16);
            let what = format!("masked_softmax_grad {dtype} {dims:?}");
            let conf = common::conf(&MaskedSoftmaxGrad { scale: 0.125 }, &[&y, &dy], &[meta(&dims, dtype)]);
            common::check_both(&what, &conf, &[&y, &dy], gpu, tolerance(dtype));
        }
    }
}

#[test]
fn layer_norm_in_runs_and_element_by_element_matches_the_cpu() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let gpu = (&device, &stream);
    let (rows, dtype) = (37, DType::F32);
    for len in RUN_LENS {
        let dims = vec![rows, len];
        let (x, gamma, beta) =
            (common::array(&dims, dtype, 17), common::array(&[len], dtype, 18), common::array(&[len], dtype, 19));
        let what = format!("layer_norm {dtype} {dims:?}");
        let conf = common::conf(&LayerNorm::new(1e-5), &[&x, &gamma, &beta], &[meta(&dims, dtype)]);
        common::check_both(&what, &conf, &[&x, &gamma, &beta], gpu, tolerance(dtype));
        let dy = common::array(&dims, dtype, 20);
        let outputs = [meta(&dims, dtype), meta(&[len], dtype), meta(&[len], dtype)];
        let conf = common::conf(&LayerNormGrad::new(1e-5), &[&x, &gamma, &dy], &outputs);
        let what = format!("layer_norm_grad {dtype} {dims:?}");
        check_layer_norm_grad(&what, &conf, &[&x, &gamma, &dy], rows, gpu);
        let what = format!("{what}, registers off alignment");
        check_layer_norm_grad_skewed(&what, &conf, &[&x, &gamma, &dy], rows, gpu, true);
    }
}

#[test]
fn layer_norm_and_its_gradient_match_the_cpu() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let gpu = (&device, &stream);
    for dtype in [DType::F32, DType::F64] {
        // Every row length over a few rows, then long column sums for dgamma and dbeta
        // (32 × 32-thread blocks).
        let few_rows = LENS.into_iter().flat_map(|len| [1, 7, 33].map(|rows| (rows, len)));
        // Rows that fit a warp at each of its widths (8, 16, 24 and 32 per lane), more
        // rows than the warp-per-row gradient has warps (1024), and a GPT-2 width.
        let warp_widths = [(2500, 250), (1100, 300), (2049, 768), (1030, 1000), (33, 1500)];
        for (rows, len) in few_rows.chain([(1023, 33), (4099, 7)]).chain(warp_widths) {
            let dims = vec![rows, len];
            let (x, gamma, beta) =
                (common::array(&dims, dtype, 7), common::array(&[len], dtype, 8), common::array(&[len], dtype, 9));
            let op = LayerNorm::new(1e-5);
            check(&format!("layer_norm {dtype} {dims:?}"), &op, &[&x, &gamma, &beta], &[meta(&dims, dtype)], gpu);
            let dy = common::array(&dims, dtype, 10);
            let outputs = [meta(&dims, dtype), meta(&[len], dtype), meta(&[len], dtype)];
            let conf = common::conf(&LayerNormGrad::new(1e-5), &[&x, &gamma, &dy], &outputs);
            check_layer_norm_grad(&format!("layer_norm_grad {dtype} {dims:?}"), &conf, &[&x, &gamma, &dy], rows, gpu);
        }
    }
}

/// A layer norm writing bf16 or f16 from f32 (`LayerNorm::out`) and its gradient reading a
/// bf16 or f16 dy (`LayerNormGrad::dy`), mixed precision's casts folded into them: on the
/// GPU bitwise the f32 op and a cast (on the GPU) of its output, or of dy to f32 first, and
/// within the 16-bit dtype's rounding of the CPU kernels; in runs and element by element,
/// over odd row lengths and those of the warp-per-row and block-per-row entries.
#[test]
fn layer_norm_with_16_bit_output_or_dy_matches_the_cast_and_the_f32_op() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let gpu = (&device, &stream);
    for low in [DType::Bf16, DType::F16] {
        for (rows, len) in [(7, 1), (5, 33), (37, 8), (37, 256), (9, 768), (11, 1000), (3, 1024), (33, 1500)] {
            let dims = vec![rows, len];
            let x = common::array(&dims, DType::F32, 21);
            let (gamma, beta) = (common::array(&[len], DType::F32, 22), common::array(&[len], DType::F32, 23));
            let what = format!("layer_norm f32 -> {low} {dims:?}");
            let op = LayerNorm { out: Some(low), ..LayerNorm::new(1e-5) };
            let folded = common::conf(&op, &[&x, &gamma, &beta], &[meta(&dims, low)]);
            common::check_both(&what, &folded, &[&x, &gamma, &beta], gpu, tolerance(low));
            let plain = common::conf(&LayerNorm::new(1e-5), &[&x, &gamma, &beta], &[meta(&dims, DType::F32)]);
            let y = common::run(&plain, &[&x, &gamma, &beta], Some(gpu)).remove(0);
            let cast = common::run(&common::conf(&Cast { to: low }, &[&y], &[meta(&dims, low)]), &[&y], Some(gpu));
            let fused = common::run(&folded, &[&x, &gamma, &beta], Some(gpu));
            if !device.is_dry() {
                assert_eq!(fused[0].to_le_bytes(), cast[0].to_le_bytes(), "{what}: not the cast's bits");
            }

            let dy = common::array(&dims, low, 24);
            let wide_dy = HostArray::from_f64(dims.clone(), DType::F32, &dy.to_f64_vec()).expect("dy in f32");
            let outputs = [meta(&dims, DType::F32), meta(&[len], DType::F32), meta(&[len], DType::F32)];
            let op = LayerNormGrad { dy: Some(low), ..LayerNormGrad::new(1e-5) };
            let folded = common::conf(&op, &[&x, &gamma, &dy], &outputs);
            let what = format!("layer_norm_grad f32, dy {low} {dims:?}");
            check_layer_norm_grad(&what, &folded, &[&x, &gamma, &dy], rows, gpu);
            check_layer_norm_grad_skewed(
                &format!("{what}, off alignment"),
                &folded,
                &[&x, &gamma, &dy],
                rows,
                gpu,
                true,
            );
            let plain = common::conf(&LayerNormGrad::new(1e-5), &[&x, &gamma, &wide_dy], &outputs);
            let want = common::run(&plain, &[&x, &gamma, &wide_dy], Some(gpu));
            let got = common::run(&folded, &[&x, &gamma, &dy], Some(gpu));
            if !device.is_dry() {
                for (o, (got, want)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(got.to_le_bytes(), want.to_le_bytes(), "{what}: output {o} not the f32 dy's bits");
                }
            }
        }
    }
}

/// Compares dx within the usual tolerance, and dgamma and dbeta (sums over `rows`) within
/// √rows times it: the CPU adds the rows serially, whose rounding grows with their count,
/// the GPU in 32 interleaved slices (modelled on the host, the f32 sums of [4099, 7] differ
/// by 1.5 times the flat tolerance, and by 0.02 times the scaled one).
fn check_layer_norm_grad(
    what: &str,
    conf: &OpConf,
    inputs: &[&HostArray],
    rows: usize,
    gpu: (&regflow_cuda::Device, &regflow_cuda::Stream),
) {
    check_layer_norm_grad_skewed(what, conf, inputs, rows, gpu, false);
}

/// [`check_layer_norm_grad`], with every CUDA register one element off alignment when
/// `skewed` (the element-by-element path).
fn check_layer_norm_grad_skewed(
    what: &str,
    conf: &OpConf,
    inputs: &[&HostArray],
    rows: usize,
    gpu: (&regflow_cuda::Device, &regflow_cuda::Stream),
    skewed: bool,
) {
    let on_gpu = common::run_skewed(conf, inputs, Some(gpu), skewed);
    let on_cpu = common::run(conf, inputs, None);
    if gpu.0.is_dry() {
        return;
    }
    let rel = tolerance(conf.outputs[0].dtype);
    common::assert_close(&format!("{what} dx"), &on_gpu[..1], &on_cpu[..1], rel);
    let params = (&on_gpu[1..3], &on_cpu[1..3]);
    common::assert_close(&format!("{what} dgamma, dbeta"), params.0, params.1, rel * (rows.max(1) as f64).sqrt());
    // A 16-bit copy of dx (`LayerNormGrad::dx_narrow`): within its own rounding.
    if let (Some(gpu_copy), Some(cpu_copy)) = (on_gpu.get(3), on_cpu.get(3)) {
        let rel = tolerance(gpu_copy.dtype());
        common::assert_close(
            &format!("{what} dx's copy"),
            std::slice::from_ref(gpu_copy),
            std::slice::from_ref(cpu_copy),
            rel,
        );
    }
}

#[test]
fn sparse_cross_entropy_and_its_gradient_match_the_cpu() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let gpu = (&device, &stream);
    // bf16 logits (mixed precision) give an f32 loss and take an f32 dy; their gradient is
    // bf16.
    for dtype in [DType::F32, DType::F64, DType::Bf16] {
        let loss = if dtype == DType::Bf16 { DType::F32 } else { dtype };
        for classes in LENS {
            for rows in [1, 7, 33, 1023] {
                let logits = common::array(&[rows, classes], dtype, 11);
                let labels =
                    HostArray::i64(Shape::new(vec![rows]), (0..rows).map(|r| ((r * 7919) % classes) as i64).collect())
                        .expect("labels");
                let what = format!("sparse_cross_entropy {dtype} [{rows}, {classes}]");
                check(&what, &SparseCrossEntropy::default(), &[&logits, &labels], &[meta(&[], loss)], gpu);
                let dy = match loss {
                    DType::F32 => HostArray::f32(Shape::new(vec![]), vec![0.75]),
                    _ => HostArray::f64(Shape::new(vec![]), vec![0.75]),
                }
                .expect("dy");
                let what = format!("sparse_cross_entropy_grad {dtype} [{rows}, {classes}]");
                check(
                    &what,
                    &SparseCrossEntropyGrad::default(),
                    &[&logits, &labels, &dy],
                    &[meta(&[rows, classes], dtype)],
                    gpu,
                );
                // A device's rows of a batch 3 times as large (data parallelism).
                let part = |grad| PartCrossEntropy { batch: 3 * rows, grad, classes: None };
                let what = format!("part_cross_entropy {dtype} [{rows}, {classes}] of {}", 3 * rows);
                check(&what, &part(false), &[&logits, &labels], &[meta(&[], loss)], gpu);
                let outputs = [meta(&[rows, classes], dtype)];
                check(&format!("{what}, grad"), &part(true), &[&logits, &labels, &dy], &outputs, gpu);
            }
        }
    }
}

/// Over the first `classes` columns of wider rows (a padded vocabulary, 50257 of 50264 in
/// GPT-2's): the loss and its gradient (zero in padding columns) match the CPU's, alone and
/// as a device's part.
#[test]
fn sparse_cross_entropy_of_the_first_columns_matches_the_cpu() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let gpu = (&device, &stream);
    for dtype in [DType::F32, DType::Bf16] {
        for (classes, width) in [(1, 8), (5, 8), (1000, 1024), (5021, 5024)] {
            let rows = 37;
            let logits = common::array(&[rows, width], dtype, 5);
            let labels =
                HostArray::i64(Shape::new(vec![rows]), (0..rows).map(|r| ((r * 7919) % classes) as i64).collect())
                    .expect("labels");
            let dy = HostArray::f32(Shape::new(vec![]), vec![0.75]).expect("dy");
            let what = format!("sparse_cross_entropy {dtype} of the first {classes} of [{rows}, {width}]");
            let op = SparseCrossEntropy { classes: Some(classes) };
            check(&what, &op, &[&logits, &labels], &[meta(&[], DType::F32)], gpu);
            let grad = SparseCrossEntropyGrad { classes: Some(classes) };
            let outputs = [meta(&[rows, width], dtype)];
            check(&format!("{what}, grad"), &grad, &[&logits, &labels, &dy], &outputs, gpu);
            let part = PartCrossEntropy { batch: 2 * rows, grad: true, classes: Some(classes) };
            check(&format!("{what}, a part's grad"), &part, &[&logits, &labels, &dy], &outputs, gpu);
        }
    }
}

#[test]
fn cross_entropy_of_rows_with_masked_and_nan_logits_matches_the_cpu() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let gpu = (&device, &stream);
    // Row 0: its first 700 logits -inf (a masked vocabulary: each thread's first values
    // add nothing to the running sum); row 1: one NaN (the loss and the row's gradient are
    // NaN, as on the CPU); row 2: all finite, the largest last (every thread rescales).
    let (rows, classes) = (3, 1001);
    let mut values: Vec<f32> = (0..rows * classes).map(|i| ((i * 7919) % 97) as f32 / 13.0 - 3.0).collect();
    values[..700].fill(f32::NEG_INFINITY);
    values[classes + 500] = f32::NAN;
    for j in 0..classes {
        values[2 * classes + j] = j as f32 / 100.0;
    }
    let logits = HostArray::f32(Shape::new(vec![rows, classes]), values).expect("logits");
    let labels = HostArray::i64(Shape::new(vec![rows]), vec![900, 3, 1000]).expect("labels");
    check(
        "sparse_cross_entropy, masked and NaN rows",
        &SparseCrossEntropy::default(),
        &[&logits, &labels],
        &[meta(&[], DType::F32)],
        gpu,
    );
    // Each row's loss alone, so the NaN row does not hide the others.
    for r in [0, 2] {
        let row = HostArray::f32(
            Shape::new(vec![1, classes]),
            logits.to_f64_vec()[r * classes..(r + 1) * classes].iter().map(|&v| v as f32).collect(),
        )
        .expect("a row");
        let label = HostArray::i64(Shape::new(vec![1]), vec![[900, 3, 1000][r]]).expect("a label");
        check(
            &format!("sparse_cross_entropy, row {r}"),
            &SparseCrossEntropy::default(),
            &[&row, &label],
            &[meta(&[], DType::F32)],
            gpu,
        );
    }
    let dy = HostArray::f32(Shape::new(vec![]), vec![0.75]).expect("dy");
    let what = "sparse_cross_entropy_grad, masked and NaN rows";
    check(
        what,
        &SparseCrossEntropyGrad::default(),
        &[&logits, &labels, &dy],
        &[meta(&[rows, classes], DType::F32)],
        gpu,
    );
    // The same rows padded to 1008 columns, so that every row starts aligned to eight
    // elements and is read eight at a time (`softmax_stats` in rows.cu): the masked and the
    // NaN row on that path too, in f32 and bf16.
    let width = 1008;
    let all = logits.to_f64_vec();
    let padded: Vec<f64> = (0..rows * width)
        .map(|i| if i % width < classes { all[i / width * classes + i % width] } else { 0.0 })
        .collect();
    for dtype in [DType::F32, DType::Bf16] {
        let logits = HostArray::from_f64(vec![rows, width], dtype, &padded).expect("padded logits");
        let what = format!("{dtype} rows padded to {width}");
        let op = SparseCrossEntropy { classes: Some(classes) };
        for r in [0, 2] {
            let row = HostArray::from_f64(vec![1, width], dtype, &padded[r * width..(r + 1) * width]).expect("a row");
            let label = HostArray::i64(Shape::new(vec![1]), vec![[900, 3, 1000][r]]).expect("a label");
            check(
                &format!("sparse_cross_entropy, {what}, row {r}"),
                &op,
                &[&row, &label],
                &[meta(&[], DType::F32)],
                gpu,
            );
        }
        let grad = SparseCrossEntropyGrad { classes: Some(classes) };
        let outputs = [meta(&[rows, width], dtype)];
        check(&format!("sparse_cross_entropy_grad, {what}"), &grad, &[&logits, &labels, &dy], &outputs, gpu);
    }
}

/// A layer norm gradient with a base added to dx (`LayerNormGrad::base`) and the sum's
/// bf16 or f16 copy (`LayerNormGrad::dx_narrow`), the residual gradient's `add` folded in
/// (`graph/src/compile/fold_norm_grads.rs`): on the GPU bitwise the gradient, then an
/// `add` of the base, then a cast, each on the GPU; within the usual tolerance of the CPU
/// kernels; in runs and element by element (registers off alignment), on the warp-per-row
/// and block-per-row entries, in f32 (with an f32 or a 16-bit dy) and f64.
#[test]
fn layer_norm_grad_with_a_base_and_a_copy_matches_the_add_and_the_cast() {
    use regflow_plan::ops::{Binary, BinaryKind};
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let gpu = (&device, &stream);
    let cases =
        [(DType::F32, None), (DType::F32, Some(DType::Bf16)), (DType::F32, Some(DType::F16)), (DType::F64, None)];
    for (dtype, dy_dtype) in cases {
        // 2500 rows of 768: more rows than warps, so the warps load their next rows ahead.
        for (rows, len) in [(7, 1), (5, 33), (37, 256), (9, 768), (2500, 768), (33, 1500)] {
            let dims = vec![rows, len];
            let (x, gamma) = (common::array(&dims, dtype, 31), common::array(&[len], dtype, 32));
            let dy = common::array(&dims, dy_dtype.unwrap_or(dtype), 33);
            let base = common::array(&dims, dtype, 34);
            let outputs = [meta(&dims, dtype), meta(&[len], dtype), meta(&[len], dtype)];
            let plain_op = LayerNormGrad { dy: dy_dtype, ..LayerNormGrad::new(1e-5) };
            let plain = common::conf(&plain_op, &[&x, &gamma, &dy], &outputs);
            let mut want = common::run(&plain, &[&x, &gamma, &dy], Some(gpu));
            let add = common::conf(&Binary(BinaryKind::Add), &[&base, &want[0]], &[meta(&dims, dtype)]);
            want[0] = common::run(&add, &[&base, &want[0]], Some(gpu)).remove(0);
            // The copies a folded f32 sum may carry: none, bf16, f16 (f64 has none).
            let copies: &[Option<DType>] =
                if dtype == DType::F32 { &[None, Some(DType::Bf16), Some(DType::F16)] } else { &[None] };
            for &copy in copies {
                let op = LayerNormGrad { base: true, dx_narrow: copy, ..plain_op };
                let mut with_copy = outputs.to_vec();
                with_copy.extend(copy.map(|low| meta(&dims, low)));
                let folded = common::conf(&op, &[&x, &gamma, &dy, &base], &with_copy);
                let what = format!("layer_norm_grad {dtype}, dy {dy_dtype:?}, copy {copy:?}, {dims:?}");
                let inputs = [&x, &gamma, &dy, &base];
                check_layer_norm_grad(&what, &folded, &inputs, rows, gpu);
                check_layer_norm_grad_skewed(&format!("{what}, off alignment"), &folded, &inputs, rows, gpu, true);
                let got = common::run(&folded, &inputs, Some(gpu));
                if device.is_dry() {
                    continue;
                }
                for (o, (got, want)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(got.to_le_bytes(), want.to_le_bytes(), "{what}: output {o} not the add's bits");
                }
                if let Some(low) = copy {
                    let cast = common::conf(&Cast { to: low }, &[&want[0]], &[meta(&dims, low)]);
                    let cast = common::run(&cast, &[&want[0]], Some(gpu)).remove(0);
                    assert_eq!(got[3].to_le_bytes(), cast.to_le_bytes(), "{what}: the copy is not the cast's bits");
                }
            }
        }
    }
}

/// A layer norm with a summand (`LayerNorm::residual`), the residual add before it folded
/// in (`graph/src/compile/fold_norm_inputs.rs`): on the GPU bitwise an `add` (on the GPU)
/// then the norm, the sum as its first output; within the usual tolerance of the CPU
/// kernels; in runs and element by element, on the warp-per-row and block-per-row entries,
/// in f32 with an f32, bf16 or f16 summand (and a bf16 output) and in f64; with and without
/// a bias added to the summand first (`LayerNorm::summand_bias`).
#[test]
fn layer_norm_with_a_summand_matches_the_add_then_the_norm() {
    use regflow_plan::ops::{Binary, BinaryKind};
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let gpu = (&device, &stream);
    let cases = [
        (DType::F32, DType::F32, None),
        (DType::F32, DType::Bf16, Some(DType::Bf16)),
        (DType::F32, DType::F16, None),
        (DType::F64, DType::F64, None),
    ];
    for (dtype, b_dtype, out) in cases {
        // 2500 rows of 768: GPT-2's width over more rows than one wave of warps.
        for (rows, len) in [(7, 1), (5, 33), (37, 256), (9, 768), (2500, 768), (33, 1500)] {
            let dims = vec![rows, len];
            let (a, b) = (common::array(&dims, dtype, 41), common::array(&dims, b_dtype, 42));
            let (gamma, beta) = (common::array(&[len], dtype, 43), common::array(&[len], dtype, 44));
            let y_meta = meta(&dims, out.unwrap_or(dtype));
            let norm = LayerNorm { out, ..LayerNorm::new(1e-5) };
            let plain = common::conf(&norm, &[&a, &gamma, &beta], std::slice::from_ref(&y_meta));
            let add_of = |x: &HostArray, y: &HostArray, to: DType| {
                let add = common::conf(&Binary(BinaryKind::Add), &[x, y], &[meta(&dims, to)]);
                common::run(&add, &[x, y], Some(gpu)).remove(0)
            };
            // The folded op on `inputs` against the CPU, and its sum and y against `sum`
            // (the GPU's own adds) and the GPU's norm of it, bit for bit.
            let check = |op: &LayerNorm, inputs: &[&HostArray], sum: HostArray, what: &str| {
                let folded = common::conf(op, inputs, &[meta(&dims, dtype), y_meta.clone()]);
                common::check_both(what, &folded, inputs, gpu, tolerance(out.unwrap_or(dtype)));
                let got = common::run(&folded, inputs, Some(gpu));
                let y = common::run(&plain, &[&sum, &gamma, &beta], Some(gpu)).remove(0);
                if !device.is_dry() {
                    assert_eq!(got[0].to_le_bytes(), sum.to_le_bytes(), "{what}: the sum is not the adds' bits");
                    assert_eq!(got[1].to_le_bytes(), y.to_le_bytes(), "{what}: y is not the norm's bits");
                }
            };
            let op = LayerNorm { residual: Some(b_dtype), ..norm };
            let what = format!("layer_norm {dtype} + {b_dtype} -> {out:?} {dims:?}");
            check(&op, &[&a, &gamma, &beta, &b], add_of(&a, &b, dtype), &what);
            // With a bias added to the summand first (`LayerNorm::summand_bias`): the bias
            // add's bits, then the residual add's, then the norm's.
            let bias = common::array(&[len], b_dtype, 45);
            let biased = add_of(&b, &bias, b_dtype);
            let op = LayerNorm { summand_bias: true, ..op };
            let what = format!("{what}, the summand biased");
            check(&op, &[&a, &gamma, &beta, &b, &bias], add_of(&a, &biased, dtype), &what);
        }
    }
}
