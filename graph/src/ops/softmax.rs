//! `softmax` and `log_softmax` along one axis, numerically stable (the maximum is
//! subtracted before exponentiating), and the ops that compute their gradients.

use super::{GradCtx, InputGrads, OpDef};
use crate::sbp::{Sbp, SbpSignature};
use crate::tensor::{HostTensor, HostTensorMut, Real, Shape, TensorMeta};
use crate::{DType, GraphError, Tensor};

/// `e^x / Σ e^x` along `axis` (negative: from the end).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Softmax {
    /// The axis normalized over.
    pub axis: isize,
}

/// `x - ln Σ e^x` along `axis` (negative: from the end).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogSoftmax {
    /// The axis normalized over.
    pub axis: isize,
}

/// The input gradient of [`Softmax`] or [`LogSoftmax`] from its output `y` and output
/// gradient `dy`: `y·(dy - Σ dy·y)` for softmax, `dy - e^y·Σ dy` for log-softmax (whose
/// `e^y` is the softmax), sums along `axis`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SoftmaxGrad {
    /// The axis normalized over.
    pub axis: isize,
    /// Whether the forward op was [`LogSoftmax`].
    pub log: bool,
}

/// A tensor seen as `[outer, len, inner]` around one axis.
#[derive(Debug, Clone, Copy)]
struct Lanes {
    outer: usize,
    len: usize,
    inner: usize,
}

impl Lanes {
    fn new(shape: &Shape, axis: isize) -> Result<Self, String> {
        let a = shape.axis(axis).ok_or_else(|| format!("axis {axis} is out of range for rank {}", shape.rank()))?;
        let dims = shape.dims();
        Ok(Self { outer: dims[..a].iter().product(), len: dims[a], inner: dims[a + 1..].iter().product() })
    }

    /// Element indices of every lane along the axis, one iterator per lane.
    fn lanes(self) -> impl Iterator<Item = impl Iterator<Item = usize> + Clone> {
        (0..self.outer).flat_map(move |o| {
            (0..self.inner).map(move |i| {
                let start = o * self.len * self.inner + i;
                (0..self.len).map(move |j| start + j * self.inner)
            })
        })
    }
}

fn check_float(inputs: &[TensorMeta], count: usize, axis: isize) -> Result<TensorMeta, String> {
    if inputs.len() != count {
        return Err(format!("takes {count} input(s), got {}", inputs.len()));
    }
    let x = &inputs[0];
    if let Some(other) = inputs.iter().find(|m| m.dtype != x.dtype || m.shape != x.shape) {
        return Err(format!("input mismatch: {x} vs {other}"));
    }
    if !x.dtype.is_float() {
        return Err(format!("needs a float input, got {}", x.dtype));
    }
    Lanes::new(&x.shape, axis)?;
    Ok(x.clone())
}

fn forward_typed<T: Real>(
    axis: isize,
    log: bool,
    input: &HostTensor<'_>,
    out: &mut HostTensorMut<'_>,
) -> Result<(), String> {
    let lanes = Lanes::new(input.shape, axis)?;
    let x = input.as_slice::<T>()?;
    let y = out.as_mut_slice::<T>()?;
    for lane in lanes.lanes() {
        let Some(first) = lane.clone().next() else { continue };
        let max = lane.clone().fold(x[first], |m, i| m.max(x[i]));
        let sum: T = lane.clone().map(|i| (x[i] - max).exp()).sum();
        if log {
            let log_sum = sum.ln();
            for i in lane {
                y[i] = x[i] - max - log_sum;
            }
        } else {
            for i in lane {
                y[i] = (x[i] - max).exp() / sum;
            }
        }
    }
    Ok(())
}

fn backward_typed<T: Real>(
    axis: isize,
    log: bool,
    inputs: &[HostTensor<'_>],
    out: &mut HostTensorMut<'_>,
) -> Result<(), String> {
    let lanes = Lanes::new(inputs[0].shape, axis)?;
    let (y, dy) = (inputs[0].as_slice::<T>()?, inputs[1].as_slice::<T>()?);
    let dx = out.as_mut_slice::<T>()?;
    for lane in lanes.lanes() {
        if log {
            let sum: T = lane.clone().map(|i| dy[i]).sum();
            for i in lane {
                dx[i] = dy[i] - y[i].exp() * sum;
            }
        } else {
            let sum: T = lane.clone().map(|i| dy[i] * y[i]).sum();
            for i in lane {
                dx[i] = y[i] * (dy[i] - sum);
            }
        }
    }
    Ok(())
}

/// Splits of every dimension but the normalized one, on all `inputs` and the output.
fn lane_splits(axis: isize, inputs: &[TensorMeta]) -> Vec<SbpSignature> {
    let Some(x) = inputs.first() else { return Vec::new() };
    let Some(axis) = x.shape.axis(axis) else { return Vec::new() };
    (0..x.shape.rank())
        .filter(|&d| d != axis)
        .map(|d| SbpSignature::new(vec![Sbp::Split(d); inputs.len()], [Sbp::Split(d)]))
        .collect()
}

fn forward(axis: isize, log: bool, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
    match outputs[0].dtype() {
        DType::F32 => forward_typed::<f32>(axis, log, &inputs[0], &mut outputs[0]),
        DType::F64 => forward_typed::<f64>(axis, log, &inputs[0], &mut outputs[0]),
        DType::I64 => Err("integer softmax is not supported".into()),
    }
}

impl OpDef for Softmax {
    fn name(&self) -> &'static str {
        "softmax"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        Ok(vec![check_float(inputs, 1, self.axis)?])
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        let (y, dy) = (ctx.outputs[0], ctx.grad()?);
        Ok(vec![Some(y.graph().apply1(SoftmaxGrad { axis: self.axis, log: false }, &[y, dy])?)])
    }

    fn compute(&self, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
        forward(self.axis, false, inputs, outputs)
    }

    /// Lanes are independent: any dimension but the normalized one may be split.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        lane_splits(self.axis, inputs)
    }
}

impl OpDef for LogSoftmax {
    fn name(&self) -> &'static str {
        "log_softmax"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        Ok(vec![check_float(inputs, 1, self.axis)?])
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        let (y, dy) = (ctx.outputs[0], ctx.grad()?);
        Ok(vec![Some(y.graph().apply1(SoftmaxGrad { axis: self.axis, log: true }, &[y, dy])?)])
    }

    fn compute(&self, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
        forward(self.axis, true, inputs, outputs)
    }

    /// Lanes are independent: any dimension but the normalized one may be split.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        lane_splits(self.axis, inputs)
    }
}

impl OpDef for SoftmaxGrad {
    fn name(&self) -> &'static str {
        if self.log {
            "log_softmax_grad"
        } else {
            "softmax_grad"
        }
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        Ok(vec![check_float(inputs, 2, self.axis)?])
    }

    fn grad<'g>(&self, _ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        // Second derivatives of softmax are not needed by any optimizer here.
        Err(GraphError::NoGradient { op: self.name().into(), index: 0 })
    }

    fn compute(&self, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
        match outputs[0].dtype() {
            DType::F32 => backward_typed::<f32>(self.axis, self.log, inputs, &mut outputs[0]),
            DType::F64 => backward_typed::<f64>(self.axis, self.log, inputs, &mut outputs[0]),
            DType::I64 => Err("integer softmax is not supported".into()),
        }
    }

    /// Lanes are independent: any dimension but the normalized one may be split. With `y`
    /// whole, the gradient is linear in `dy`, so summands of `dy` give summands.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        let mut signatures = lane_splits(self.axis, inputs);
        signatures.push(SbpSignature::new([Sbp::Broadcast, Sbp::Partial], [Sbp::Partial]));
        signatures
    }
}

impl<'g> Tensor<'g> {
    /// Softmax along `axis` (negative: from the end): `e^x / Σ e^x`, computed as
    /// `e^(x - max) / Σ e^(x - max)` so large logits do not overflow.
    pub fn softmax(&self, axis: isize) -> Result<Tensor<'g>, GraphError> {
        self.graph().apply1(Softmax { axis }, &[*self])
    }

    /// Log-softmax along `axis` (negative: from the end): `x - max - ln Σ e^(x - max)`.
    pub fn log_softmax(&self, axis: isize) -> Result<Tensor<'g>, GraphError> {
        self.graph().apply1(LogSoftmax { axis }, &[*self])
    }
}
