//! CPU kernels of `optim` ops.

use super::update::{keep_parts, update_parts, Part, Rule};
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
        context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        by_float!(inputs[0].dtype(), "cannot optimize an integer variable", T => update_typed::<T>(&self.0, context.threads, inputs, outputs))
    }
}

/// Updates of at least this many elements run on several threads (see
/// `cpu/update.rs`).
pub use super::update::PARALLEL_MIN_ELEMENTS;

impl HostCompute for NextStep {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        let step = scalar_input(inputs, 0)?;
        let skipped = match inputs.len() {
            1 => false,
            _ => skips_step(scalar_input(inputs, 1)?),
        };
        write_scalar(&mut outputs[0], if skipped { step } else { step + 1.0 })
    }
}

impl HostCompute for UnscaleFactor {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        let (squared_norm, scale) = (scalar_input(inputs, 0)?, scalar_input(inputs, 1)?);
        write_scalar(&mut outputs[0], self.at(squared_norm, inputs[0].dtype(), scale))
    }
}

impl HostCompute for LossScaleUpdate {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        let (scale, good_steps, grad_scale) =
            (scalar_input(inputs, 0)?, scalar_input(inputs, 1)?, scalar_input(inputs, 2)?);
        let (scale, good_steps) = self.at(scale, good_steps, grad_scale, outputs[0].dtype());
        let [scale_out, good_out] = outputs else {
            return Err(format!("gives the scale and the count of good steps, not {} outputs", outputs.len()));
        };
        write_scalar(scale_out, scale)?;
        write_scalar(good_out, good_steps)
    }
}

pub(super) fn scalar_input(inputs: &[HostTensor<'_>], i: usize) -> Result<f64, String> {
    match inputs[i].data {
        HostSlice::F64(v) => v.first().copied(),
        HostSlice::F32(v) => v.first().map(|&x| f64::from(x)),
        HostSlice::I64(v) => v.first().map(|&x| x as f64),
        HostSlice::Bf16(v) => v.first().map(|&x| x.to_f64()),
        HostSlice::F16(v) => v.first().map(|&x| x.to_f64()),
    }
    .ok_or_else(|| format!("input {i} is empty"))
}

fn update_typed<T: Real>(
    kind: &OptimizerKind,
    threads: usize,
    inputs: &[HostTensor<'_>],
    outputs: &mut [HostTensorMut<'_>],
) -> Result<(), String> {
    let (lr, step) = (scalar_input(inputs, 2)?, scalar_input(inputs, 3)?);
    // The clip factor (and loss scaling's 1 / scale), multiplied in as each gradient
    // element is read (× 1 is exact).
    let states = kind.state_count();
    let scale = match inputs.len().checked_sub(4 + states) {
        Some(0) => 1.0,
        Some(1) => scalar_input(inputs, 4 + states)?,
        _ => {
            return Err(format!(
                "takes param, grad, lr, step, {states} state(s) and an optional gradient scale, got {} inputs",
                inputs.len()
            ))
        }
    };
    if outputs.len() != 1 + states {
        return Err(format!("gives the parameter and {states} state(s), not {} outputs", outputs.len()));
    }
    let g = inputs[1].as_slice::<T>()?;
    let len = g.len();
    let mut part = Part { grad: g.as_ptr() as usize, len, ..Part::default() };
    // Outputs are (param', state'...), inputs (param, grad, lr, step, state...).
    for (k, out) in outputs.iter_mut().enumerate() {
        let input = &inputs[Update::old_value_input(k)];
        let out = out.as_mut_slice::<T>()?;
        // Given in place: the input arrives with no elements though its shape has some,
        // and its old value is in the output (see `HostCompute::compute`).
        let given = input.is_empty() && input.shape.numel() > 0 && !out.is_empty();
        let source = input.as_slice::<T>()?;
        let source_len = if given { len } else { source.len() };
        if out.len() != len || source_len != len {
            return Err(format!(
                "the gradient has {len} elements, but {} has {source_len} and its output {}",
                if k == 0 { "the parameter".to_string() } else { format!("state {k}") },
                out.len()
            ));
        }
        (part.sources[k], part.given[k], part.targets[k]) =
            (source.as_ptr() as usize, given, out.as_mut_ptr() as usize);
    }
    // SAFETY: every slice has `len` elements and lives through the call; outputs are
    // distinct registers, and an input given in place is empty (not read).
    unsafe {
        if skips_step(scale) {
            keep_parts::<T>(&[part], states);
        } else {
            update_parts(&Rule::<T>::new(kind, lr, step, scale), threads, &[part]);
        }
    }
    Ok(())
}

fn write_scalar(out: &mut HostTensorMut<'_>, value: f64) -> Result<(), String> {
    match &mut out.data {
        HostSliceMut::F64(v) => v.iter_mut().for_each(|x| *x = value),
        HostSliceMut::F32(v) => v.iter_mut().for_each(|x| *x = value as f32),
        HostSliceMut::Bf16(v) => v.iter_mut().for_each(|x| *x = regflow_plan::bf16_from_f64(value)),
        HostSliceMut::F16(v) => v.iter_mut().for_each(|x| *x = regflow_plan::f16_from_f64(value)),
        HostSliceMut::I64(_) => return Err("the output must be a float".into()),
    }
    Ok(())
}
