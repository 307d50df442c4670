//! `reduce` (sum, mean, max over any axes), `part_mean` and `max_mask` on CUDA against the
//! CPU kernels (skips without a GPU). Sums over `c` elements compare within 1e-5 · √c (f32):
//! the GPU adds in another order than the CPU.

mod common;

use regflow_plan::ops::{MaxMask, OpAttrs, PartMean, Reduce, ReduceKind};
use regflow_plan::{DType, HostArray, Shape, TensorMeta};

fn meta(dims: &[usize], dtype: DType) -> TensorMeta {
    TensorMeta::new(Shape::new(dims.to_vec()), dtype)
}

fn check(
    what: &str,
    op: &dyn OpAttrs,
    inputs: &[&HostArray],
    out: TensorMeta,
    count: usize,
    gpu: (&regflow_cuda::Device, &regflow_cuda::Stream),
) {
    let rel = if out.dtype == DType::F32 { 1e-5 } else { 1e-12 } * (count.max(1) as f64).sqrt();
    let conf = common::conf(op, inputs, &[out]);
    common::check(what, &conf, inputs, gpu, rel);
}

#[test]
fn reductions_match_the_cpu_over_any_axes() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let gpu = (&device, &stream);
    for dtype in [DType::F32, DType::F64] {
        // Over axis 0, [1023, 33] and [4099, 7] are long column reductions (32 × 32-thread
        // blocks); [70_001] to a scalar is one block of 1024 threads.
        let shapes = [
            vec![1023],
            vec![7, 33],
            vec![33, 7, 5],
            vec![2, 1, 1023],
            vec![3, 0, 4],
            vec![1023, 33],
            vec![4099, 7],
            vec![70_001],
        ];
        for dims in shapes {
            let x = common::array(&dims, dtype, 1);
            let rank = dims.len() as isize;
            let mut axis_sets: Vec<Vec<isize>> = vec![vec![]];
            axis_sets.extend((0..rank).map(|a| vec![a]));
            if rank >= 2 {
                axis_sets.push(vec![0, rank - 1]);
            }
            for axes in axis_sets {
                for kind in [ReduceKind::Sum, ReduceKind::Mean, ReduceKind::Max] {
                    // An empty max is -inf on both, which the harness's difference cannot
                    // compare (-inf - -inf is NaN).
                    if kind == ReduceKind::Max && dims.contains(&0) {
                        continue;
                    }
                    for keepdim in [false, true] {
                        let op = Reduce { kind, axes: axes.clone(), keepdim };
                        let out = op.output_shape(&Shape::new(dims.clone())).expect("a shape");
                        let count = dims.iter().product::<usize>() / out.numel().max(1);
                        let what = format!("reduce {kind:?} {dtype} {dims:?} axes {axes:?} keepdim {keepdim}");
                        check(&what, &op, &[&x], meta(out.dims(), dtype), count, gpu);
                    }
                }
            }
        }
    }
}

#[test]
fn part_mean_divides_by_the_logical_count() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let gpu = (&device, &stream);
    for dtype in [DType::F32, DType::F64] {
        let x = common::array(&[33, 7], dtype, 2);
        let op =
            PartMean { mean: Reduce { kind: ReduceKind::Mean, axes: vec![0], keepdim: false }, logical_count: 1023 };
        check(&format!("part_mean {dtype}"), &op, &[&x], meta(&[7], dtype), 33, gpu);
    }
}

#[test]
fn max_mask_matches_the_cpu_with_a_broadcast_maximum() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let gpu = (&device, &stream);
    for dtype in [DType::F32, DType::F64] {
        for (dims, axis) in [(vec![7, 33], 1), (vec![33, 7, 5], 0), (vec![1023], 0)] {
            let x = common::array(&dims, dtype, 3);
            let max = Reduce { kind: ReduceKind::Max, axes: vec![axis], keepdim: true };
            let m_dims = max.output_shape(&Shape::new(dims.clone())).expect("a shape");
            let m = common::run(&common::conf(&max, &[&x], &[meta(m_dims.dims(), dtype)]), &[&x], None).remove(0);
            check(&format!("max_mask {dtype} {dims:?} axis {axis}"), &MaxMask, &[&x, &m], meta(&dims, dtype), 1, gpu);
        }
    }
}
