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

impl HostCompute for SumSquaresGroup {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        fast_math::vectorized(
            || by_float!(outputs[0].dtype(), "integer sums are not supported", T => squares_chain::<T>(self.carried, inputs, &mut outputs[0])),
        )
    }

    fn check(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Result<(), String> {
        let summed = inputs.len() - usize::from(self.carried).min(inputs.len());
        let scalar = |m: &TensorMeta| m.shape.numel() == 1;
        match outputs {
            [out] if summed >= 1 && scalar(out) && inputs.iter().all(|m| m.dtype == out.dtype) => {}
            _ => {
                return Err(format!(
                    "sums the squares of at least one tensor{} into one scalar of their dtype, got {} inputs and {} \
                     outputs",
                    if self.carried { " after a carried scalar" } else { "" },
                    inputs.len(),
                    outputs.len()
                ))
            }
        }
        match inputs.first() {
            Some(carry) if self.carried && !scalar(carry) => {
                Err(format!("the carried total must be a scalar, got {carry}"))
            }
            _ => Ok(()),
        }
    }
}

/// `sum_squares_group`: the chain it replaces, the carry (or the first tensor's squares),
/// then each tensor's squares added in turn, each sum rounded to `T` as the scalar `add`
/// rounds it.
#[inline(always)]
fn squares_chain<T: Real>(carried: bool, inputs: &[HostTensor<'_>], out: &mut HostTensorMut<'_>) -> Result<(), String> {
    let (mut total, rest) = match (carried, inputs) {
        (true, [carry, rest @ ..]) => (*carry.as_slice::<T>()?.first().ok_or("the carried total is empty")?, rest),
        (false, [first, rest @ ..]) => (squares_of::<T>(first)?, rest),
        _ => return Err("sums the squares of at least one tensor, got none".into()),
    };
    for x in rest {
        total += squares_of::<T>(x)?;
    }
    let [slot] = out.as_mut_slice::<T>()? else { return Err("the output must be a scalar".into()) };
    *slot = total;
    Ok(())
}
