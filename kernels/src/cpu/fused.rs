//! CPU kernels of fused elementwise ops (`bias_gelu`, `bias_gelu_grad`), rows shared over the
//! device's threads when large.

use crate::cpu::fast_math;
use crate::cpu::shares::rows_in_shares;
use crate::cpu::unary::{gelu, gelu_derivative};
use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::*;
use regflow_plan::{HostTensor, HostTensorMut, TensorMeta};

impl HostCompute for BiasGelu {
    fn compute(
        &self,
        context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        by_float!(outputs[0].dtype(), "integer GELU is not supported", T => {
            let (x, bias) = (inputs[0].as_slice::<T>()?, inputs[1].as_slice::<T>()?);
            let width = bias.len().max(1);
            rows_in_shares(context.threads, outputs[0].as_mut_slice::<T>()?, width, |rows, y| {
                fast_math::vectorized(
                    #[inline(always)]
                    || {
                        let x = &x[rows.start * width..rows.end * width];
                        for (x_row, y_row) in x.chunks_exact(width).zip(y.chunks_exact_mut(width)) {
                            for ((o, &v), &b) in y_row.iter_mut().zip(x_row).zip(bias) {
                                *o = gelu::<T>(v + b);
                            }
                        }
                    },
                )
            });
            Ok(())
        })
    }

    fn check(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Result<(), String> {
        let ([x, bias], [out]) = (inputs, outputs) else {
            return Err(crate::cpu::not_n_to_one(2, (inputs, outputs)));
        };
        check_bias(x, bias)?;
        if out != x {
            return Err(format!("the output must match the input {x}, got {out}"));
        }
        Ok(())
    }
}

impl HostCompute for BiasGeluGrad {
    fn compute(
        &self,
        context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        by_float!(outputs[0].dtype(), "integer GELU is not supported", T => {
            let (x, bias, dy) = (inputs[0].as_slice::<T>()?, inputs[1].as_slice::<T>()?, inputs[2].as_slice::<T>()?);
            let width = bias.len().max(1);
            rows_in_shares(context.threads, outputs[0].as_mut_slice::<T>()?, width, |rows, dx| {
                fast_math::vectorized(
                    #[inline(always)]
                    || {
                        let span = rows.start * width..rows.end * width;
                        let (x, dy) = (&x[span.clone()], &dy[span]);
                        for ((x_row, dy_row), dx_row) in x.chunks_exact(width).zip(dy.chunks_exact(width)).zip(dx.chunks_exact_mut(width)) {
                            for (((d, &v), &g), &b) in dx_row.iter_mut().zip(x_row).zip(dy_row).zip(bias) {
                                *d = g * gelu_derivative::<T>(v + b);
                            }
                        }
                    },
                )
            });
            Ok(())
        })
    }

    fn check(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Result<(), String> {
        let ([x, bias, dy], [dx]) = (inputs, outputs) else {
            return Err(crate::cpu::not_n_to_one(3, (inputs, outputs)));
        };
        check_bias(x, bias)?;
        if dy != x || dx != x {
            return Err(format!("dy and dx must match x {x}, got {dy} and {dx}"));
        }
        Ok(())
    }
}

/// Whether `bias` fits `x` (`[N]` for `[..., N]`, one float dtype); shared by the graph's
/// shape rule.
pub fn check_bias(x: &TensorMeta, bias: &TensorMeta) -> Result<(), String> {
    float_pair(("input", x), ("bias", bias), "a float input")?;
    match x.shape.dims().last() {
        None => Err("the input must have rank >= 1, got a scalar".into()),
        Some(&n) if bias.shape.dims() != [n] => {
            Err(format!("the bias must have shape [{n}] for an input {}, got {}", x.shape, bias.shape))
        }
        Some(_) => Ok(()),
    }
}

/// `x` and its companion `other` (a bias, a mask) share one float dtype; errors name them
/// as `x_name` and `other_name`, and say the kernel `needs` (for example "a float input").
pub(crate) fn float_pair(
    (x_name, x): (&str, &TensorMeta),
    (other_name, other): (&str, &TensorMeta),
    needs: &str,
) -> Result<(), String> {
    if x.dtype != other.dtype {
        return Err(format!("the {x_name} {x} and the {other_name} {other} must have one dtype"));
    }
    if !x.dtype.is_float() {
        return Err(format!("needs {needs}, got {}", x.dtype));
    }
    Ok(())
}
