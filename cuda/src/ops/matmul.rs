//! `matmul`, `matmul_batch_sum` and `permuted_matmul` on CUDA: cuBLAS strided-batched
//! GEMMs (f32 and f64), transposes and axis orders expressed as cuBLAS's op flags, leading
//! dimensions and batch strides, never as copies (see [`crate::blas`] for the row-major to
//! column-major mapping). Every call's arguments are worked out when the actor is made;
//! a firing only queues them.

use super::{function, op_conf, queued, stream, suffix, Entry};
use crate::blas::{Blas, Gemm, MatrixLayout};
use crate::driver::{launch, Function, Grid};
use regflow_kernels::cpu::matmul::{layout, Layout};
use regflow_kernels::cpu::permuted_matmul::{permuted_layout, PermutedLayout};
use regflow_kernels::{HostCompute, HostOpKernel, Kernel, KernelError, KernelIo, KernelSpec};
use regflow_plan::ops::{MatMul, MatMulBatchSum, PermutedMatMul};
use regflow_plan::{DType, OpConf};
use std::sync::Arc;

/// f32, f64, and bf16 (cuBLAS with f32 accumulation, rounded once to bf16, as the CPU's
/// bf16 products).
const FLOAT: &[DType] = &[DType::F32, DType::F64, DType::Bf16, DType::F16];

pub(super) const ENTRIES: &[Entry] = &[
    ("matmul", FLOAT, || Arc::new(make_matmul)),
    ("matmul_batch_sum", FLOAT, || Arc::new(make_batch_sum)),
    ("permuted_matmul", FLOAT, || Arc::new(make_permuted)),
];

/// One queued cuBLAS call: its arguments, where its operands start (bytes from the
/// registers' bases) and its `beta` (1 accumulates into the output).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Call {
    pub(crate) gemm: Gemm,
    pub(crate) offsets: (u64, u64, u64),
    pub(crate) beta: f64,
}

/// A product kernel: its cuBLAS calls, in order, and a zero fill for an empty inner
/// dimension (cuBLAS is not asked to compute a product of no terms).
#[derive(Debug)]
struct ProductKernel {
    blas: Blas,
    dtype: DType,
    /// The actor inputs holding `a` and `b`.
    inputs: (usize, usize),
    calls: Vec<Call>,
    /// The fill kernel and the output's element count, when the output is all zeros.
    zero: Option<(Function, u64)>,
}

impl Kernel for ProductKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let (a, b, c) = (io.input_addr(self.inputs.0), io.input_addr(self.inputs.1), io.output_addr(0));
        let stream = stream(io);
        if let Some((fill, n)) = self.zero {
            // SAFETY: the output holds `n` elements of the dtype; the fill kernel takes
            // (pointer, value of the dtype, count).
            unsafe {
                match self.dtype {
                    DType::F64 => launch(stream, fill, Grid::linear(n), &mut args![c, 0.0f64, n]),
                    DType::Bf16 | DType::F16 => launch(stream, fill, Grid::linear(n), &mut args![c, 0u16, n]),
                    _ => launch(stream, fill, Grid::linear(n), &mut args![c, 0.0f32, n]),
                }
            }?;
        }
        for call in &self.calls {
            let (oa, ob, oc) = call.offsets;
            // SAFETY: the calls were planned from the registers' metas (checked at build):
            // every element they reach lies inside the input and output registers, which
            // the actor protocol keeps alive and unwritten by others until the stream has
            // run them.
            unsafe { self.blas.gemm(stream, self.dtype, &call.gemm, (a + oa, b + ob, c + oc), 1.0, call.beta) }?;
        }
        Ok(())
    }
}

/// Checks the conf's metas by the CPU kernel's rules for `op` (errors name the actor).
fn checked<T: HostCompute>(spec: &KernelSpec<'_>, conf: &OpConf, op: &T) -> Result<(), KernelError> {
    op.check(&conf.inputs, &conf.outputs)
        .map_err(|m| KernelError(format!("actor '{}': op '{}': {m}", spec.actor, conf.op_type)))
}

/// The kernel of `conf` queuing `calls`, with a zero fill when `zero` (an empty inner
/// dimension or batch sum).
fn product(spec: &KernelSpec<'_>, conf: &OpConf, calls: Vec<Call>, zero: bool) -> Result<Box<dyn Kernel>, KernelError> {
    let dtype = conf.outputs[0].dtype;
    let fail = |e: crate::CudaError| KernelError(format!("actor '{}': {e}", spec.actor));
    let zero = if zero {
        Some((function(spec, &format!("regflow_fill_{}", suffix(dtype)))?, conf.outputs[0].shape.numel() as u64))
    } else {
        None
    };
    Ok(queued(ProductKernel {
        blas: Blas::open(usize::from(spec.device_index)).map_err(fail)?,
        dtype,
        inputs: (conf.input_map[0], conf.input_map[1]),
        calls,
        zero,
    }))
}

/// Why cuBLAS cannot take a product the CPU rules accept, as an actor's error.
fn unplannable(spec: &KernelSpec<'_>, conf: &OpConf, why: String) -> KernelError {
    KernelError(format!("actor '{}': op '{}' cannot be queued on cuBLAS: {why}", spec.actor, conf.op_type))
}

fn make_matmul(spec: &KernelSpec<'_>) -> Result<Box<dyn Kernel>, KernelError> {
    let conf = op_conf(spec)?;
    let op: MatMul = conf.parse_attrs().map_err(KernelError)?;
    checked(spec, conf, &op)?;
    let l =
        layout(&conf.inputs[0].shape, op.transpose_a, &conf.inputs[1].shape, op.transpose_b).map_err(KernelError)?;
    let (calls, zero) = matmul_calls(&l, op.transpose_a, op.transpose_b).map_err(|why| unplannable(spec, conf, why))?;
    product(spec, conf, calls, zero)
}

fn make_batch_sum(spec: &KernelSpec<'_>) -> Result<Box<dyn Kernel>, KernelError> {
    let conf = op_conf(spec)?;
    let op: MatMulBatchSum = conf.parse_attrs().map_err(KernelError)?;
    checked(spec, conf, &op)?;
    let l =
        layout(&conf.inputs[0].shape, op.transpose_a, &conf.inputs[1].shape, op.transpose_b).map_err(KernelError)?;
    let (calls, zero) = batch_sum_calls(&l, op.transpose_a, op.transpose_b, conf.outputs[0].dtype.size() as u64)
        .map_err(|why| unplannable(spec, conf, why))?;
    product(spec, conf, calls, zero)
}

/// A permuted product whose matrices cuBLAS can read (one unit stride each) queues
/// strided-batched GEMMs; one it cannot (an operand whose last two logical axes are both
/// strided, e.g. read through `[.., k, batch, m]`) runs its CPU kernel on the host over the
/// same managed registers, rather than failing a plan the CPU runs.
fn make_permuted(spec: &KernelSpec<'_>) -> Result<Box<dyn Kernel>, KernelError> {
    let conf = op_conf(spec)?;
    let op: PermutedMatMul = conf.parse_attrs().map_err(KernelError)?;
    checked(spec, conf, &op)?;
    let l = permuted_layout(&op, &conf.inputs[0].shape, &conf.inputs[1].shape).map_err(KernelError)?;
    match permuted_calls(&l, conf.outputs[0].dtype.size() as u64) {
        Ok((calls, zero)) => product(spec, conf, calls, zero),
        Err(_) => Ok(Box::new(HostOpKernel::new(op, conf))),
    }
}

/// The calls of a `matmul`: one strided-batched GEMM over the whole batch (a shared operand
/// has batch stride 0), and whether the output is zero-filled instead (`k == 0`).
pub(crate) fn matmul_calls(l: &Layout, ta: bool, tb: bool) -> Result<(Vec<Call>, bool), String> {
    let count: usize = l.batch.iter().product();
    if count == 0 || l.m == 0 || l.n == 0 {
        return Ok((Vec::new(), false));
    }
    if l.k == 0 {
        return Ok((Vec::new(), true));
    }
    let (a, b, c) = (
        MatrixLayout::row_major(l.m, l.k, ta),
        MatrixLayout::row_major(l.k, l.n, tb),
        MatrixLayout::row_major(l.m, l.n, false),
    );
    let gemm = Gemm::plan(a, b, c, count, (l.a_step, l.b_step, l.m * l.n))?;
    Ok((vec![Call { gemm, offsets: (0, 0, 0), beta: 0.0 }], false))
}

/// The calls of a `matmul_batch_sum` (`c = Σ_i op(a_i)·op(b_i)`). When the batch continues
/// both operands' inner dimension (`a_i` stored `[k, m]` read transposed and `b_i` stored
/// `[k, n]`, the weight gradient of a batched layer), the batch is folded into the inner
/// dimension: one GEMM with `k' = batch · k`. Otherwise one GEMM per batch element, each
/// but the first accumulating (`beta = 1`) in batch order, deterministically.
pub(crate) fn batch_sum_calls(l: &Layout, ta: bool, tb: bool, size: u64) -> Result<(Vec<Call>, bool), String> {
    let count: usize = l.batch.iter().product();
    if l.m == 0 || l.n == 0 {
        return Ok((Vec::new(), false));
    }
    if count == 0 || l.k == 0 {
        return Ok((Vec::new(), true));
    }
    let (a, b, c) = (
        MatrixLayout::row_major(l.m, l.k, ta),
        MatrixLayout::row_major(l.k, l.n, tb),
        MatrixLayout::row_major(l.m, l.n, false),
    );
    if l.a_step == l.k * a.col_stride && l.b_step == l.k * b.row_stride {
        let wide = l.k * count;
        let gemm = Gemm::plan(MatrixLayout { cols: wide, ..a }, MatrixLayout { rows: wide, ..b }, c, 1, (0, 0, 0))?;
        return Ok((vec![Call { gemm, offsets: (0, 0, 0), beta: 0.0 }], false));
    }
    let gemm = Gemm::plan(a, b, c, 1, (0, 0, 0))?;
    let calls = (0..count)
        .map(|i| Call {
            gemm,
            offsets: ((i * l.a_step) as u64 * size, (i * l.b_step) as u64 * size, 0),
            beta: if i == 0 { 0.0 } else { 1.0 },
        })
        .collect();
    Ok((calls, false))
}

/// One logical batch axis of a permuted product: its extent and the three tensors'
/// strides along it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BatchAxis {
    len: usize,
    a: usize,
    b: usize,
    out: usize,
}

/// The logical batch axes, without axes of one element and with neighbours merged where
/// all three tensors step over them as one (`stride[d] == stride[d + 1] · len[d + 1]`).
fn merged_batch(l: &PermutedLayout) -> Vec<BatchAxis> {
    let mut axes: Vec<BatchAxis> = Vec::new();
    for d in 0..l.batch.len() {
        let axis = BatchAxis { len: l.batch[d], a: l.a_strides[d], b: l.b_strides[d], out: l.out_strides[d] };
        if axis.len == 1 {
            continue;
        }
        match axes.last_mut() {
            Some(p) if p.a == axis.a * axis.len && p.b == axis.b * axis.len && p.out == axis.out * axis.len => {
                *p = BatchAxis { len: p.len * axis.len, ..axis };
            }
            _ => axes.push(axis),
        }
    }
    axes
}

/// The calls of a `permuted_matmul`. Each operand's matrix is read through its last two
/// logical axes' strides (one must be 1: a matrix stored row- or column-major). The batch
/// is the logical batch axes, merged where contiguous; cuBLAS's strided batch takes one
/// stride per operand, so the longest merged axis becomes cuBLAS's batch and any other
/// axes (attention's `[batch, heads]` when heads are not adjacent in every tensor) are
/// looped over: one strided-batched call per outer index, their offsets listed here.
pub(crate) fn permuted_calls(l: &PermutedLayout, size: u64) -> Result<(Vec<Call>, bool), String> {
    let r = l.batch.len();
    let count: usize = l.batch.iter().product();
    if count == 0 || l.m == 0 || l.n == 0 {
        return Ok((Vec::new(), false));
    }
    if l.k == 0 {
        return Ok((Vec::new(), true));
    }
    let matrix = |rows, cols, s: &[usize]| MatrixLayout { rows, cols, row_stride: s[r], col_stride: s[r + 1] };
    let (a, b, c) = (matrix(l.m, l.k, &l.a_strides), matrix(l.k, l.n, &l.b_strides), matrix(l.m, l.n, &l.out_strides));
    let mut axes = merged_batch(l);
    let inner = axes.iter().enumerate().max_by_key(|(_, x)| x.len).map(|(i, _)| i);
    let inner = inner.map(|i| axes.remove(i)).unwrap_or(BatchAxis { len: 1, a: 0, b: 0, out: 0 });
    let gemm = Gemm::plan(a, b, c, inner.len, (inner.a, inner.b, inner.out))?;
    // An odometer over the outer axes, in order.
    let outer: usize = axes.iter().map(|x| x.len).product();
    let mut calls = Vec::with_capacity(outer);
    let mut index = vec![0usize; axes.len()];
    for _ in 0..outer {
        let offset =
            |f: fn(&BatchAxis) -> usize| axes.iter().zip(&index).map(|(x, &i)| i * f(x)).sum::<usize>() as u64 * size;
        calls.push(Call { gemm, offsets: (offset(|x| x.a), offset(|x| x.b), offset(|x| x.out)), beta: 0.0 });
        for d in (0..axes.len()).rev() {
            index[d] += 1;
            if index[d] < axes[d].len {
                break;
            }
            index[d] = 0;
        }
    }
    Ok((calls, false))
}

#[cfg(test)]
mod tests {
    use super::*;
    use regflow_plan::Shape;

    /// Evaluates `calls` on the host as cuBLAS would (f64, element offsets), into `out`.
    fn evaluate(calls: &[Call], zero: bool, a: &[f64], b: &[f64], out: &mut [f64]) {
        if zero {
            out.fill(0.0);
        }
        for call in calls {
            let (oa, ob, oc) = (call.offsets.0 as usize / 8, call.offsets.1 as usize / 8, call.offsets.2 as usize / 8);
            call.gemm.reference(&a[oa..], &b[ob..], &mut out[oc..], 1.0, call.beta);
        }
    }

    fn values(n: usize, seed: usize) -> Vec<f64> {
        (0..n).map(|i| ((i * 7919 + seed * 31) % 23) as f64 - 11.0).collect()
    }

    /// The CPU kernel's result for `op` on `a` and `b`.
    fn cpu(
        op: &dyn regflow_kernels::HostCompute,
        a: &regflow_plan::HostArray,
        b: &regflow_plan::HostArray,
        out: &Shape,
    ) -> Vec<f64> {
        let mut o = regflow_plan::HostArray::zeros(&regflow_plan::TensorMeta::new(out.dims().to_vec(), DType::F64));
        op.compute(&Default::default(), &[a.view(), b.view()], &mut [o.view_mut()]).unwrap();
        o.to_f64_vec()
    }

    fn array(dims: &[usize], seed: usize) -> regflow_plan::HostArray {
        let n = dims.iter().product();
        regflow_plan::HostArray::f64(dims.to_vec(), values(n, seed)).unwrap()
    }

    #[test]
    fn matmul_calls_reproduce_the_cpu_kernel() {
        let cases: &[(&[usize], &[usize], bool, bool)] = &[
            (&[3, 4], &[4, 5], false, false),
            (&[4, 3], &[4, 5], true, false),
            (&[3, 4], &[5, 4], false, true),
            (&[4, 3], &[5, 4], true, true),
            (&[2, 3, 1, 4], &[2, 3, 4, 7], false, false),
            (&[2, 3, 4], &[4, 7], false, false),
            (&[3, 4], &[2, 7, 4], false, true),
            (&[1, 1], &[1, 1], false, false),
            (&[2, 3, 0], &[0, 4], false, false),
        ];
        for &(ad, bd, ta, tb) in cases {
            let op = MatMul { transpose_a: ta, transpose_b: tb };
            let l = layout(&Shape::from(ad), ta, &Shape::from(bd), tb).unwrap();
            let mut od: Vec<usize> = l.batch.to_vec();
            od.extend([l.m, l.n]);
            let (a, b) = (array(ad, 1), array(bd, 2));
            let want = cpu(&op, &a, &b, &Shape::from(od.as_slice()));
            let (calls, zero) = matmul_calls(&l, ta, tb).unwrap();
            assert!(calls.len() <= 1, "one strided-batched call per matmul");
            let mut got = vec![f64::NAN; want.len()];
            evaluate(&calls, zero, &a.to_f64_vec(), &b.to_f64_vec(), &mut got);
            assert_eq!(got, want, "{ad:?} x {bd:?} ({ta}, {tb})");
        }
    }

    #[test]
    fn batch_sums_fold_the_batch_into_k_when_they_can() {
        for (ad, bd, ta, tb, folded) in [
            (&[3, 5, 4][..], &[3, 5, 2][..], true, false, true),
            (&[3, 4, 5], &[3, 5, 2], false, false, false),
            (&[3, 4, 5], &[3, 2, 5], false, true, false),
            (&[2, 3, 1, 5], &[2, 3, 5, 2], false, false, true),
            (&[2, 5, 4], &[2, 2, 5], true, true, false),
        ] {
            let op = MatMulBatchSum { transpose_a: ta, transpose_b: tb };
            let l = layout(&Shape::from(ad), ta, &Shape::from(bd), tb).unwrap();
            let (a, b) = (array(ad, 3), array(bd, 4));
            let want = cpu(&op, &a, &b, &Shape::new(vec![l.m, l.n]));
            let (calls, zero) = batch_sum_calls(&l, ta, tb, 8).unwrap();
            assert_eq!(calls.len() == 1, folded, "{ad:?} x {bd:?}");
            let mut got = vec![f64::NAN; want.len()];
            evaluate(&calls, zero, &a.to_f64_vec(), &b.to_f64_vec(), &mut got);
            assert_eq!(got, want, "{ad:?} x {bd:?} ({ta}, {tb})");
        }
    }

    #[test]
    fn permuted_calls_reproduce_the_cpu_kernel_or_refuse() {
        // (a dims, b dims, a_axes, b_axes, out_axes, expressible)
        type Case<'a> = (&'a [usize], &'a [usize], &'a [usize], &'a [usize], &'a [usize], bool);
        let cases: &[Case] = &[
            // Attention's scores: q [b, t, h, d] read as [b, h, t, d], k read as [b, h, d, t].
            (&[2, 5, 3, 4], &[2, 5, 3, 4], &[0, 2, 1, 3], &[0, 2, 3, 1], &[0, 1, 2, 3], true),
            // ... and its output written back as [b, t, h, d].
            (&[2, 3, 5, 5], &[2, 5, 3, 4], &[0, 1, 2, 3], &[0, 2, 1, 3], &[0, 2, 1, 3], true),
            // Plain batched product, batch axes merged into one call.
            (&[2, 3, 4, 5], &[2, 3, 5, 6], &[0, 1, 2, 3], &[0, 1, 2, 3], &[0, 1, 2, 3], true),
            // A column-major output (its rows contiguous).
            (&[3, 4, 5], &[3, 5, 2], &[0, 1, 2], &[0, 1, 2], &[0, 2, 1], true),
            // Batch axis innermost in `a`: neither matrix stride of `a` is 1.
            (&[4, 5, 3], &[3, 5, 2], &[2, 0, 1], &[0, 1, 2], &[0, 1, 2], false),
        ];
        for &(ad, bd, aa, ba, oa, ok) in cases {
            let op = PermutedMatMul { a_axes: aa.to_vec(), b_axes: ba.to_vec(), out_axes: oa.to_vec() };
            let l = permuted_layout(&op, &Shape::from(ad), &Shape::from(bd)).unwrap();
            let result = permuted_calls(&l, 8);
            assert_eq!(result.is_ok(), ok, "{ad:?} {aa:?} x {bd:?} {ba:?}: {result:?}");
            let Ok((calls, zero)) = result else { continue };
            let (a, b) = (array(ad, 5), array(bd, 6));
            let want = cpu(&op, &a, &b, &Shape::from(l.out_dims.as_slice()));
            let mut got = vec![f64::NAN; want.len()];
            evaluate(&calls, zero, &a.to_f64_vec(), &b.to_f64_vec(), &mut got);
            assert_eq!(got, want, "{ad:?} {aa:?} x {bd:?} {ba:?} -> {oa:?}");
        }
    }

    #[test]
    fn attention_batches_loop_over_the_outer_axis() {
        // q [b=2, t=5, h=3, d=4] as [b, h, t, d]: b and h cannot merge (h's stride 4 is
        // not t·d·... of b's), so one call per b with h as cuBLAS's batch, or vice versa.
        let op = PermutedMatMul { a_axes: vec![0, 2, 1, 3], b_axes: vec![0, 2, 3, 1], out_axes: vec![0, 1, 2, 3] };
        let l = permuted_layout(&op, &Shape::from([2, 5, 3, 4]), &Shape::from([2, 5, 3, 4])).unwrap();
        let (calls, _) = permuted_calls(&l, 4).unwrap();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].gemm.batch, 3);
    }
}
