//! CPU kernels of `optim` ops.

use super::update::{update_parts, Part, Rule};
use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::*;
use regflow_plan::{HostSlice, HostSliceMut, HostTensor, HostTensorMut, Real};
use smallvec::SmallVec;

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
/// [`update`](super::update)).
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
    // Which of the parameter and its state are given in place: their inputs arrive with
    // no elements though their shapes have some, and their old values are in the outputs
    // (see `HostCompute::compute`).
    let given: SmallVec<[bool; 3]> = std::iter::once(0)
        .chain(4..4 + states)
        .zip(&*outputs)
        .map(|(i, out)| inputs[i].is_empty() && inputs[i].shape.numel() > 0 && !out.is_empty())
        .collect();
    if skips_step(scale) {
        return skip_update::<T>(inputs, outputs, states, &given);
    }
    let g = inputs[1].as_slice::<T>()?;
    let len = g.len();
    // The old parameter and state: the inputs, empty where given in place (the outputs
    // hold those).
    let mut part = Part { grad: g.as_ptr() as usize, len, given: [false; 3], ..Part::default() };
    for (k, i) in std::iter::once(0).chain(4..4 + states).enumerate() {
        part.sources[k] = inputs[i].as_slice::<T>()?.as_ptr() as usize;
        part.given[k] = given[k];
    }
    for (k, out) in outputs.iter_mut().enumerate() {
        let out = out.as_mut_slice::<T>()?;
        let source = if given[k] { len } else { inputs[if k == 0 { 0 } else { 3 + k }].len() };
        if out.len() != len || source != len {
            return Err(format!(
                "the gradient has {len} elements, but {} has {source} and its output {}",
                if k == 0 { "the parameter".to_string() } else { format!("state {k}") },
                out.len()
            ));
        }
        part.targets[k] = out.as_mut_ptr() as usize;
    }
    let rule = Rule::<T>::new(kind, lr, step, scale);
    // SAFETY: every slice has `len` elements and lives through the call; outputs are
    // distinct registers, and an input given in place is empty (not read).
    unsafe { update_parts(&rule, threads, &[part]) };
    Ok(())
}

/// A skipped step: the parameter and its state come out as they went in (those `given` in
/// place are left as they are).
fn skip_update<T: Real>(
    inputs: &[HostTensor<'_>],
    outputs: &mut [HostTensorMut<'_>],
    states: usize,
    given: &[bool],
) -> Result<(), String> {
    // Outputs are (param', state'...), inputs (param, grad, lr, step, state...).
    let sources = std::iter::once(0).chain(4..4 + states);
    for ((out, i), _) in outputs.iter_mut().zip(sources).zip(given).filter(|(_, &given)| !given) {
        let (from, to) = (inputs[i].as_slice::<T>()?, out.as_mut_slice::<T>()?);
        if from.len() != to.len() {
            return Err(format!("input {i} has {} elements and its output {}", from.len(), to.len()));
        }
        to.copy_from_slice(from);
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
