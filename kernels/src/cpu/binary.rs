//! CPU kernels of `binary` ops.

use crate::cpu::axes::{self, AxisVec};
use crate::cpu::fast_math;
use crate::cpu::shares::{row_shares, rows_in_shares};
use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::*;
use regflow_plan::{DType, HostTensor, HostTensorMut, Real, Shape, TensorMeta};

impl HostCompute for Binary {
    fn compute(
        &self,
        context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        let (first, narrow) = outputs.split_at_mut(1);
        by_float!(first[0].dtype(), "integer arithmetic is not supported", T => compute_typed::<T>(self.0, context.threads, inputs, &mut first[0]))?;
        // A second output is the first one narrowed: a cast folded into the op. It reaches
        // here as its f32 buffer, which the register kernel rounds as a cast rounds
        // (`host.rs`), so the bits are the cast's of the f32 result.
        if let [narrow] = narrow {
            let result: &[f32] = first[0].as_mut_slice::<f32>()?;
            narrow.as_mut_slice::<f32>()?.copy_from_slice(result);
        }
        Ok(())
    }

    fn check(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Result<(), String> {
        let (out, narrow) = match outputs {
            [out] => (out, None),
            [out, narrow] => (out, Some(narrow)),
            _ => {
                return Err(format!(
                    "takes 2 inputs and gives 1 output (or 2: the result and its 16-bit copy), but has {} and {}",
                    inputs.len(),
                    outputs.len()
                ))
            }
        };
        let [a, b] = inputs else {
            return Err(crate::cpu::not_n_to_one(2, (inputs, outputs)));
        };
        // A second output is the result narrowed to bf16 or f16, as a `cast` of it narrows
        // (a cast the compiler folded into the op), from an f32 op of f32 operands.
        if let Some(narrow) = narrow {
            let all_f32 = [a, b, out].iter().all(|m| m.dtype == DType::F32);
            if !(all_f32 && narrow.dtype.is_half() && narrow.shape == out.shape) {
                return Err(format!(
                    "operands {a} and {b} give {out} and {narrow}: a second output must be the bf16 or f16 copy of \
                     an f32 result of f32 operands"
                ));
            }
        }
        // One operand may be a 16-bit float read widened (exactly) to the f32 of the other
        // and of the output: a cast folded into the op by the compiler, the same values as
        // `cast` then the op, without the f32 copy stored between them.
        let dtypes_fit = if a.dtype == b.dtype {
            out.dtype == a.dtype
        } else {
            let (narrow, wide) = if a.dtype.is_half() { (a, b) } else { (b, a) };
            narrow.dtype.is_half() && wide.dtype == DType::F32 && out.dtype == DType::F32
        };
        if !dtypes_fit {
            return Err(format!(
                "operands {a} and {b} give {out}: all three must have one dtype, or one operand be bf16 or f16 \
                 and the other and the output f32"
            ));
        }
        match Shape::broadcast(&a.shape, &b.shape) {
            None => Err(format!("shapes {} and {} do not broadcast", a.shape, b.shape)),
            Some(shape) if shape != out.shape => {
                Err(format!("shapes {} and {} broadcast to {shape}, but the output is {}", a.shape, b.shape, out.shape))
            }
            Some(_) => Ok(()),
        }
    }
}

/// `out = kind(a, b)`, in shares of the output's leading dimension over `threads` where the
/// output is large enough ([`row_shares`]): an operand with that leading dimension is read
/// by the share's rows, one broadcast along it whole. Each element is computed as on one
/// thread.
fn compute_typed<T: Real>(
    kind: BinaryKind,
    threads: usize,
    inputs: &[HostTensor<'_>],
    out: &mut HostTensorMut<'_>,
) -> Result<(), String> {
    let (a, b) = (inputs[0].as_slice::<T>()?, inputs[1].as_slice::<T>()?);
    let (out_dims, a_dims, b_dims) = (out.shape.dims(), inputs[0].shape.dims(), inputs[1].shape.dims());
    let o = out.as_mut_slice::<T>()?;
    let leading = out_dims.first().copied().unwrap_or(1);
    let row_len = o.len().checked_div(leading).unwrap_or(0);
    if leading < 2 || row_shares(threads, o.len(), row_len) <= 1 {
        fast_math::vectorized(
            #[inline(always)]
            || by_kind(kind, (out_dims, a_dims, b_dims), a, b, o),
        );
        return Ok(());
    }
    // An operand of the output's rank and leading dimension is cut by rows; any other (of
    // lower rank, or leading dimension 1) is broadcast along the rows, so read whole.
    let by_rows = |dims: &[usize]| dims.len() == out_dims.len() && dims[0] == leading;
    rows_in_shares(threads, o, row_len, |rows, part| {
        let count = rows.end - rows.start;
        let part_dims = |dims: &[usize]| -> AxisVec<usize> {
            let mut dims: AxisVec<usize> = dims.iter().copied().collect();
            dims[0] = count;
            dims
        };
        let o_dims = part_dims(out_dims);
        let (a_part, a_part_dims): (&[T], AxisVec<usize>) = if by_rows(a_dims) {
            let len = a.len() / leading;
            (&a[rows.start * len..rows.end * len], part_dims(a_dims))
        } else {
            (a, a_dims.iter().copied().collect())
        };
        let (b_part, b_part_dims): (&[T], AxisVec<usize>) = if by_rows(b_dims) {
            let len = b.len() / leading;
            (&b[rows.start * len..rows.end * len], part_dims(b_dims))
        } else {
            (b, b_dims.iter().copied().collect())
        };
        fast_math::vectorized(
            #[inline(always)]
            || by_kind(kind, (&o_dims, &a_part_dims, &b_part_dims), a_part, b_part, part),
        );
    });
    Ok(())
}

/// One loop per kind (the match outside), so that each vectorizes.
#[inline(always)]
fn by_kind<T: Real>(kind: BinaryKind, dims: (&[usize], &[usize], &[usize]), a: &[T], b: &[T], o: &mut [T]) {
    match kind {
        BinaryKind::Add => elementwise(dims, a, b, o, |x, y| x + y),
        BinaryKind::Sub => elementwise(dims, a, b, o, |x, y| x - y),
        BinaryKind::Mul => elementwise(dims, a, b, o, |x, y| x * y),
        BinaryKind::Div => elementwise(dims, a, b, o, |x, y| x / y),
        BinaryKind::ReluGrad => elementwise(dims, a, b, o, |d, y| if y > T::zero() { d } else { T::zero() }),
    }
}

/// `o = op(a, b)` with `a` and `b` read broadcast to `o`'s dimensions (`dims`: output, `a`,
/// `b`), in runs along the innermost dimension: plain slices where an operand is
/// contiguous, a repeated value where it is broadcast.
#[inline(always)]
fn elementwise<T: Real>(
    (out, a_dims, b_dims): (&[usize], &[usize], &[usize]),
    a: &[T],
    b: &[T],
    o: &mut [T],
    op: impl Fn(T, T) -> T,
) {
    for_each_broadcast_run(
        out,
        a_dims,
        b_dims,
        #[inline(always)]
        |run| {
            let dst = &mut o[run.out..run.out + run.len];
            match (run.a_step, run.b_step) {
                (1, 1) => {
                    for ((d, &x), &y) in dst.iter_mut().zip(&a[run.a..run.a + run.len]).zip(&b[run.b..run.b + run.len])
                    {
                        *d = op(x, y);
                    }
                }
                (1, 0) => {
                    let y = b[run.b];
                    for (d, &x) in dst.iter_mut().zip(&a[run.a..run.a + run.len]) {
                        *d = op(x, y);
                    }
                }
                (0, 1) => {
                    let x = a[run.a];
                    for (d, &y) in dst.iter_mut().zip(&b[run.b..run.b + run.len]) {
                        *d = op(x, y);
                    }
                }
                (step_a, step_b) => {
                    for (k, d) in dst.iter_mut().enumerate() {
                        *d = op(a[run.a + k * step_a], b[run.b + k * step_b]);
                    }
                }
            }
        },
    );
}

/// A run of output elements along the innermost dimension and where its operands are read:
/// output `out..out + len`, operand elements `a + k·a_step` and `b + k·b_step`.
#[derive(Debug, Clone, Copy)]
pub struct BroadcastRun {
    /// First output element.
    pub out: usize,
    /// First element of `a` read.
    pub a: usize,
    /// Elements of `a` between consecutive outputs (0: broadcast).
    pub a_step: usize,
    /// First element of `b` read.
    pub b: usize,
    /// Elements of `b` between consecutive outputs (0: broadcast).
    pub b_step: usize,
    /// Output elements in the run.
    pub len: usize,
}

/// Calls `f(out_index, a_index, b_index)` for every element of an output of dimensions
/// `out`, where operands of dimensions `a` and `b` are read broadcast to `out`. Allocates
/// nothing up to rank [`INLINE_RANK`](crate::cpu::axes::INLINE_RANK).
pub fn for_each_broadcast(out: &[usize], a: &[usize], b: &[usize], mut f: impl FnMut(usize, usize, usize)) {
    for_each_broadcast_run(out, a, b, |run| {
        for k in 0..run.len {
            f(run.out + k, run.a + k * run.a_step, run.b + k * run.b_step);
        }
    });
}

/// Calls `f` for every run of an output of dimensions `out` along its innermost dimension
/// (one run for the whole output when both operands have its dimensions), where operands
/// of dimensions `a` and `b` are read broadcast to `out`. Allocates nothing up to rank
/// [`INLINE_RANK`](crate::cpu::axes::INLINE_RANK).
#[inline(always)]
pub fn for_each_broadcast_run(out: &[usize], a: &[usize], b: &[usize], mut f: impl FnMut(BroadcastRun)) {
    let n: usize = out.iter().product();
    if a == out && b == out {
        if n > 0 {
            f(BroadcastRun { out: 0, a: 0, a_step: 1, b: 0, b_step: 1, len: n });
        }
        return;
    }
    let (sa, sb) = (axes::broadcast_strides(a, out), axes::broadcast_strides(b, out));
    let dims = out;
    let Some((&inner, outer_dims)) = dims.split_last() else {
        f(BroadcastRun { out: 0, a: 0, a_step: 0, b: 0, b_step: 0, len: 1 });
        return;
    };
    if inner == 0 {
        return;
    }
    // The innermost dimension in one run (a bias row, a broadcast column), the outer ones
    // by an odometer that updates the two read offsets incrementally.
    let rank = dims.len();
    let (a_step, b_step) = (sa[rank - 1], sb[rank - 1]);
    let mut index: axes::AxisVec<usize> = smallvec::smallvec![0; outer_dims.len()];
    let (mut ia, mut ib) = (0usize, 0usize);
    for block in 0..n / inner {
        f(BroadcastRun { out: block * inner, a: ia, a_step, b: ib, b_step, len: inner });
        for d in (0..outer_dims.len()).rev() {
            index[d] += 1;
            ia += sa[d];
            ib += sb[d];
            if index[d] < outer_dims[d] {
                break;
            }
            ia -= sa[d] * outer_dims[d];
            ib -= sb[d] * outer_dims[d];
            index[d] = 0;
        }
    }
}
