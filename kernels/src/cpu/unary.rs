//! CPU kernels of `unary` ops.

use crate::cpu::fast_math::{self, FastMath};
use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::*;
use regflow_plan::{HostTensor, HostTensorMut, TensorMeta};

impl HostCompute for Unary {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        fast_math::vectorized(
            || by_float!(outputs[0].dtype(), "integer math is not supported", T => compute_typed::<T>(self.0, &inputs[0], &mut outputs[0])),
        )
    }

    fn check(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Result<(), String> {
        match (inputs, outputs) {
            ([input], [out]) if input == out => Ok(()),
            ([input], [out]) => Err(format!("maps {input} elementwise, but the output is {out}")),
            _ => Err(format!("takes 1 input and gives 1 output, but has {} and {}", inputs.len(), outputs.len())),
        }
    }
}

#[inline(always)]
fn compute_typed<T: FastMath>(
    kind: UnaryKind,
    input: &HostTensor<'_>,
    out: &mut HostTensorMut<'_>,
) -> Result<(), String> {
    let x = input.as_slice::<T>()?;
    let out = out.as_mut_slice::<T>()?;
    // One tight loop per kind (the match outside), so the simple ones vectorize.
    macro_rules! map {
        ($f:expr) => {
            for (o, &v) in out.iter_mut().zip(x) {
                *o = $f(v);
            }
        };
    }
    let zero = T::zero();
    match kind {
        UnaryKind::Neg => map!(|v: T| -v),
        UnaryKind::Relu => map!(|v: T| if v > zero { v } else { zero }),
        UnaryKind::Step => map!(|v: T| if v > zero { T::one() } else { zero }),
        UnaryKind::AddScalar(c) => {
            let c = T::from_f64(c);
            map!(|v: T| v + c)
        }
        UnaryKind::MulScalar(c) => {
            let c = T::from_f64(c);
            map!(|v: T| v * c)
        }
        UnaryKind::Gelu => map!(gelu::<T>),
        UnaryKind::GeluDerivative => map!(gelu_derivative::<T>),
        other => map!(|v: T| apply(other, v)),
    }
    Ok(())
}

fn apply<T: FastMath>(kind: UnaryKind, x: T) -> T {
    let c = |v: f64| T::from_f64(v);
    match kind {
        UnaryKind::Neg => -x,
        UnaryKind::Relu => {
            if x > T::zero() {
                x
            } else {
                T::zero()
            }
        }
        UnaryKind::Step => {
            if x > T::zero() {
                T::one()
            } else {
                T::zero()
            }
        }
        UnaryKind::Exp => x.exp(),
        UnaryKind::Log => x.ln(),
        UnaryKind::Sqrt => x.sqrt(),
        UnaryKind::Tanh => x.tanh(),
        UnaryKind::Sigmoid => {
            // Stable on both sides: never exponentiates a large positive number.
            if x >= T::zero() {
                T::one() / (T::one() + (-x).exp())
            } else {
                let e = x.exp();
                e / (T::one() + e)
            }
        }
        UnaryKind::Gelu => gelu(x),
        UnaryKind::GeluDerivative => gelu_derivative(x),
        UnaryKind::AddScalar(v) => x + c(v),
        UnaryKind::MulScalar(v) => x * c(v),
        UnaryKind::PowScalar(p) => T::from_f64(x.to_f64().powf(p)),
    }
}

/// GELU with the tanh approximation: `x/2 · (1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
#[inline(always)]
pub fn gelu<T: FastMath>(x: T) -> T {
    let c = |v: f64| T::from_f64(v);
    let inner = c(GELU_C) * (x + c(GELU_A) * x * x * x);
    c(0.5) * x * (T::one() + inner.fast_tanh())
}

/// The derivative of [`gelu`].
#[inline(always)]
pub fn gelu_derivative<T: FastMath>(x: T) -> T {
    let c = |v: f64| T::from_f64(v);
    let inner = c(GELU_C) * (x + c(GELU_A) * x * x * x);
    let t = inner.fast_tanh();
    let dinner = c(GELU_C) * (T::one() + c(3.0 * GELU_A) * x * x);
    c(0.5) * (T::one() + t) + c(0.5) * x * (T::one() - t * t) * dinner
}

const GELU_C: f64 = 0.797_884_560_802_865_4;
const GELU_A: f64 = 0.044_715;
