//! CPU kernels of `softmax` ops.

use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::*;
use regflow_plan::{HostTensor, HostTensorMut, Real, Shape};

impl HostCompute for Softmax {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        forward(self.axis, false, inputs, outputs)
    }
}

impl HostCompute for LogSoftmax {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        forward(self.axis, true, inputs, outputs)
    }
}

impl HostCompute for SoftmaxGrad {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        by_float!(outputs[0].dtype(), "integer softmax is not supported", T => backward_typed::<T>(self.axis, self.log, inputs, &mut outputs[0]))
    }
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

fn forward(axis: isize, log: bool, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
    by_float!(outputs[0].dtype(), "integer softmax is not supported", T => forward_typed::<T>(axis, log, &inputs[0], &mut outputs[0]))
}

/// A tensor seen as `[outer, len, inner]` around one axis.
#[derive(Debug, Clone, Copy)]
pub struct Lanes {
    outer: usize,
    len: usize,
    inner: usize,
}

impl Lanes {
    /// The lanes of a tensor of `shape` along `axis`, or why the axis does not exist.
    pub fn new(shape: &Shape, axis: isize) -> Result<Self, String> {
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
