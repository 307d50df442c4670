//! CPU kernels of `reduce_to` ops.

use crate::cpu::fast_math;
use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::*;
use regflow_plan::{DType, HostTensor, HostTensorMut, Real, TensorMeta};

impl HostCompute for SumTo {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        fast_math::vectorized(
            #[inline(always)]
            || by_float!(outputs[0].dtype(), "integer sums are not supported", T => sum_to_typed::<T>(&inputs[0], &mut outputs[0])),
        )
    }
}

impl HostCompute for SumSquares {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        fast_math::vectorized(
            #[inline(always)]
            || by_float!(outputs[0].dtype(), "integer sums are not supported", T => sum_squares_typed::<T>(&inputs[0], &mut outputs[0])),
        )
    }
}

impl HostCompute for BroadcastTo {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        match outputs[0].dtype() {
            DType::F32 => broadcast_typed::<f32>(&inputs[0], &mut outputs[0]),
            DType::F64 => broadcast_typed::<f64>(&inputs[0], &mut outputs[0]),
            DType::I64 => broadcast_elements::<i64>(&inputs[0], &mut outputs[0]),
            DType::Bf16 => broadcast_elements::<regflow_plan::bf16>(&inputs[0], &mut outputs[0]),
            DType::F16 => broadcast_elements::<regflow_plan::f16>(&inputs[0], &mut outputs[0]),
        }
    }

    fn half_native(&self) -> bool {
        true
    }
}

fn broadcast_typed<T: Real>(input: &HostTensor<'_>, out: &mut HostTensorMut<'_>) -> Result<(), String> {
    let x = input.as_slice::<T>()?;
    let shape = out.shape;
    let o = out.as_mut_slice::<T>()?;
    crate::cpu::binary::for_each_broadcast(shape.dims(), input.shape.dims(), shape.dims(), |i, ix, _| o[i] = x[ix]);
    Ok(())
}

fn broadcast_elements<T: regflow_plan::Element>(
    input: &HostTensor<'_>,
    out: &mut HostTensorMut<'_>,
) -> Result<(), String> {
    let x = input.as_slice::<T>()?;
    let shape = out.shape;
    let o = out.as_mut_slice::<T>()?;
    crate::cpu::binary::for_each_broadcast(shape.dims(), input.shape.dims(), shape.dims(), |i, ix, _| o[i] = x[ix]);
    Ok(())
}

#[inline(always)]
fn sum_to_typed<T: Real>(input: &HostTensor<'_>, out: &mut HostTensorMut<'_>) -> Result<(), String> {
    let x = input.as_slice::<T>()?;
    let shape = out.shape;
    let o = out.as_mut_slice::<T>()?;
    o.fill(T::zero());
    // Walk the input; the output is the operand read "broadcast" to the input's shape.
    let dims = input.shape.dims();
    crate::cpu::binary::for_each_broadcast_run(
        dims,
        dims,
        shape.dims(),
        #[inline(always)]
        |run| {
            let xs = &x[run.out..run.out + run.len];
            if run.b_step == 0 {
                o[run.b] += xs.iter().copied().sum::<T>();
            } else if run.b_step == 1 {
                for (acc, &v) in o[run.b..run.b + run.len].iter_mut().zip(xs) {
                    *acc += v;
                }
            } else {
                for (k, &v) in xs.iter().enumerate() {
                    o[run.b + k * run.b_step] += v;
                }
            }
        },
    );
    Ok(())
}

/// `Σ x²` in the runs and order `sum_to_typed` sums a tensor to a scalar, each square
/// rounded to `T` first: the bits of `x · x` summed to `[]`.
#[inline(always)]
fn sum_squares_typed<T: Real>(input: &HostTensor<'_>, out: &mut HostTensorMut<'_>) -> Result<(), String> {
    let [total] = out.as_mut_slice::<T>()? else { return Err("the output must be a scalar".into()) };
    *total = squares_of::<T>(input)?;
    Ok(())
}

/// `Σ x²` of one tensor, in the order `sum_squares` sums (every fused chain member too).
#[inline(always)]
fn squares_of<T: Real>(input: &HostTensor<'_>) -> Result<T, String> {
    let x = input.as_slice::<T>()?;
    let mut total = T::zero();
    let dims = input.shape.dims();
    crate::cpu::binary::for_each_broadcast_run(
        dims,
        dims,
        &[],
        #[inline(always)]
        |run| total += x[run.out..run.out + run.len].iter().map(|&v| v * v).sum::<T>(),
    );
    Ok(total)
}

/// `sum_squares_group`: the chain it replaces, the carry (or the first tensor's squares),
/// then each tensor's squares added in turn, each sum rounded to the dtype as the scalar
/// `add` rounds it.
impl HostCompute for SumSquaresGroup {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        fast_math::vectorized(
            #[inline(always)]
            || by_float!(outputs[0].dtype(), "integer sums are not supported", T => squares_chain::<T>(self.carried, inputs, &mut outputs[0])),
        )
    }

    fn check(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Result<(), String> {
        self.check_metas(inputs, outputs)
    }
}

/// The chain of a [`SumSquaresGroup`] (`carried`: its first input is a carried total) in
/// the element type `T`.
#[inline(always)]
fn squares_chain<T: Real>(carried: bool, inputs: &[HostTensor<'_>], out: &mut HostTensorMut<'_>) -> Result<(), String> {
    let mut total: Option<T> = None;
    for (k, tensor) in inputs.iter().enumerate() {
        let value = if k == 0 && carried {
            *tensor.as_slice::<T>()?.first().ok_or("the carried total is empty")?
        } else {
            squares_of::<T>(tensor)?
        };
        total = Some(match total {
            Some(sum) => sum + value,
            None => value,
        });
    }
    let [slot] = out.as_mut_slice::<T>()? else { return Err("the output must be a scalar".into()) };
    *slot = total.ok_or("sums the squares of at least one tensor, got none")?;
    Ok(())
}
