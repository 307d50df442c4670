//! CPU kernels of `optim` ops.

use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::*;
use regflow_plan::{HostSlice, HostSliceMut, HostTensor, HostTensorMut, Real};

impl HostCompute for LearningRate {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        write_scalar(&mut outputs[0], self.0.at(scalar_input(inputs, 0)?))
    }
}

impl HostCompute for ClipFactor {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        let norm = scalar_input(inputs, 0)?;
        write_scalar(&mut outputs[0], (self.0 / (norm + 1e-6)).min(1.0))
    }
}

impl HostCompute for Update {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        by_float!(inputs[0].dtype(), "cannot optimize an integer variable", T => update_typed::<T>(&self.0, inputs, outputs))
    }
}

impl HostCompute for NextStep {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        write_scalar(&mut outputs[0], scalar_input(inputs, 0)? + 1.0)
    }
}

fn scalar_input(inputs: &[HostTensor<'_>], i: usize) -> Result<f64, String> {
    match inputs[i].data {
        HostSlice::F64(v) => v.first().copied(),
        HostSlice::F32(v) => v.first().map(|&x| f64::from(x)),
        HostSlice::I64(v) => v.first().map(|&x| x as f64),
    }
    .ok_or_else(|| format!("input {i} is empty"))
}

fn update_typed<T: Real>(
    kind: &OptimizerKind,
    inputs: &[HostTensor<'_>],
    outputs: &mut [HostTensorMut<'_>],
) -> Result<(), String> {
    let (lr, step) = (scalar_input(inputs, 2)?, scalar_input(inputs, 3)?);
    let (p, g) = (inputs[0].as_slice::<T>()?, inputs[1].as_slice::<T>()?);
    let [p_out, rest @ ..] = outputs else { return Err("missing outputs".into()) };
    let p_out = p_out.as_mut_slice::<T>()?;
    // Element math in the parameter's own type, constants hoisted (as PyTorch does).
    let c = T::from_f64;
    match *kind {
        OptimizerKind::Sgd { momentum, weight_decay } => {
            let v = inputs[4].as_slice::<T>()?;
            let v_out = rest[0].as_mut_slice::<T>()?;
            let (lr, momentum, weight_decay) = (c(lr), c(momentum), c(weight_decay));
            for i in 0..p.len() {
                let velocity = momentum * v[i] + (g[i] + weight_decay * p[i]);
                v_out[i] = velocity;
                p_out[i] = p[i] - lr * velocity;
            }
        }
        OptimizerKind::AdamW { beta1, beta2, eps, weight_decay } => {
            let (m, v) = (inputs[4].as_slice::<T>()?, inputs[5].as_slice::<T>()?);
            let [m_out, v_out] = rest else { return Err("missing moment outputs".into()) };
            let (m_out, v_out) = (m_out.as_mut_slice::<T>()?, v_out.as_mut_slice::<T>()?);
            let (b1, b2, one_b1, one_b2) = (c(beta1), c(beta2), c(1.0 - beta1), c(1.0 - beta2));
            let (c1, c2) = (c(1.0 - beta1.powf(step)), c(1.0 - beta2.powf(step)));
            let (lr_t, eps, decay) = (c(lr), c(eps), c(1.0 - lr * weight_decay));
            for i in 0..p.len() {
                let grad = g[i];
                let m1 = b1 * m[i] + one_b1 * grad;
                let v1 = b2 * v[i] + one_b2 * grad * grad;
                m_out[i] = m1;
                v_out[i] = v1;
                p_out[i] = p[i] * decay - lr_t * (m1 / c1) / ((v1 / c2).sqrt() + eps);
            }
        }
    }
    Ok(())
}

fn write_scalar(out: &mut HostTensorMut<'_>, value: f64) -> Result<(), String> {
    match &mut out.data {
        HostSliceMut::F64(v) => v.iter_mut().for_each(|x| *x = value),
        HostSliceMut::F32(v) => v.iter_mut().for_each(|x| *x = value as f32),
        HostSliceMut::I64(_) => return Err("the output must be a float".into()),
    }
    Ok(())
}
