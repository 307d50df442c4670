//! CPU kernels of `optim` ops.

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

/// Parameters of at least this many elements are updated on `cpu_threads` threads, each a
/// contiguous share (an element's update reads only its own entries, so the result does not
/// depend on the split); smaller ones on one thread, where waking the pool costs more.
pub const PARALLEL_MIN_ELEMENTS: usize = 1 << 16;

/// Runs `update(start, end)` over `0..len` in contiguous shares over `threads`, or on this
/// thread for a parameter under [`PARALLEL_MIN_ELEMENTS`].
///
/// Each share's loop runs at AVX2 width where the CPU has it
/// ([`vectorized`](super::fast_math::vectorized)): the update divides twice and takes a
/// square root per element, so on SSE2's 4 lanes it waited on the divider (9.5 % of the
/// MLP's step at one thread). Lane width does not change an element's rounding: the bits
/// are those of the baseline build.
fn in_shares(threads: usize, len: usize, update: impl Fn(usize, usize) + Sync) {
    let threads = if len < PARALLEL_MIN_ELEMENTS { 1 } else { threads };
    super::shares::in_shares(threads, len, |share| {
        super::fast_math::vectorized(
            #[inline(always)]
            || update(share.start, share.end),
        )
    });
}

/// A mutable slice that threads write in disjoint ranges.
#[derive(Clone, Copy)]
struct Shared<T>(*mut T);

// SAFETY: only `in_shares` hands it out, and its shares are disjoint ranges of a slice that
// outlives the scope.
unsafe impl<T> Send for Shared<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Shared<T> {}

impl<T> Shared<T> {
    /// Elements `start..end`.
    ///
    /// # Safety
    /// Within the slice this was made from, and no other thread touches those elements.
    #[allow(clippy::mut_from_ref)]
    unsafe fn range(&self, start: usize, end: usize) -> &mut [T] {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), end - start) }
    }
}

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

fn scalar_input(inputs: &[HostTensor<'_>], i: usize) -> Result<f64, String> {
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
    let scale = T::from_f64(scale);
    let g = inputs[1].as_slice::<T>()?;
    let len = g.len();
    // The old parameter and state: the inputs, empty where given in place (the outputs
    // hold those). On the stack (at most the parameter and two moments): a firing
    // allocates nothing.
    let sources: SmallVec<[&[T]; 3]> =
        std::iter::once(0).chain(4..4 + states).map(|i| inputs[i].as_slice::<T>()).collect::<Result<_, _>>()?;
    let mut targets: SmallVec<[Shared<T>; 3]> = SmallVec::new();
    for (k, out) in outputs.iter_mut().enumerate() {
        let out = out.as_mut_slice::<T>()?;
        let source = if given[k] { len } else { sources[k].len() };
        if out.len() != len || source != len {
            return Err(format!(
                "the gradient has {len} elements, but {} has {source} and its output {}",
                if k == 0 { "the parameter".to_string() } else { format!("state {k}") },
                out.len()
            ));
        }
        targets.push(Shared(out.as_mut_ptr()));
    }
    // Element math in the parameter's own type, constants hoisted (as PyTorch does).
    let c = T::from_f64;
    match *kind {
        OptimizerKind::Sgd { momentum, weight_decay } => {
            let (lr, momentum, weight_decay) = (c(lr), c(momentum), c(weight_decay));
            let (p_out, v_out) = (targets[0], targets[1]);
            in_shares(
                threads,
                len,
                #[inline(always)]
                |start, end| {
                    // SAFETY: `in_shares` gives disjoint ranges of `0..len`; every slice has `len`.
                    let (p_out, v_out) = unsafe { (p_out.range(start, end), v_out.range(start, end)) };
                    let n = end - start;
                    // Equal lengths (no bounds checks) and the constants as locals: read
                    // through the closure's captures, they were reloaded every element,
                    // which kept the loop from vectorizing.
                    let (g, p_out, v_out) = (&g[start..end], &mut p_out[..n], &mut v_out[..n]);
                    let (scale, lr, momentum, weight_decay) = (scale, lr, momentum, weight_decay);
                    let sgd = |p: T, g: T, v: T| {
                        let velocity = momentum * v + (g * scale + weight_decay * p);
                        (p - lr * velocity, velocity)
                    };
                    // A block at a time: what is not given in place is copied to its output
                    // while the block is in L1, then the block is updated in place, in one
                    // loop over slices that do not alias (so it vectorizes).
                    for block in (0..n).step_by(BLOCK) {
                        let b = block..(block + BLOCK).min(n);
                        copy_unless_given(given[0], sources[0], start + block, &mut p_out[b.clone()]);
                        copy_unless_given(given[1], sources[1], start + block, &mut v_out[b.clone()]);
                        for i in b {
                            (p_out[i], v_out[i]) = sgd(p_out[i], g[i], v_out[i]);
                        }
                    }
                },
            );
        }
        OptimizerKind::AdamW { beta1, beta2, eps, weight_decay } => {
            let (p_out, m_out, v_out) = (targets[0], targets[1], targets[2]);
            let (b1, b2, one_b1, one_b2) = (c(beta1), c(beta2), c(1.0 - beta1), c(1.0 - beta2));
            let (c1, c2) = (c(1.0 - beta1.powf(step)), c(1.0 - beta2.powf(step)));
            let (lr_t, eps, decay) = (c(lr), c(eps), c(1.0 - lr * weight_decay));
            in_shares(
                threads,
                len,
                #[inline(always)]
                |start, end| {
                    // SAFETY: `in_shares` gives disjoint ranges of `0..len`; every slice has `len`.
                    let (p_out, m_out, v_out) =
                        unsafe { (p_out.range(start, end), m_out.range(start, end), v_out.range(start, end)) };
                    let n = end - start;
                    // As for SGD above: equal lengths, constants as locals.
                    let (g, p_out, m_out, v_out) = (&g[start..end], &mut p_out[..n], &mut m_out[..n], &mut v_out[..n]);
                    let (scale, b1, b2, one_b1, one_b2) = (scale, b1, b2, one_b1, one_b2);
                    let (c1, c2, lr_t, eps, decay) = (c1, c2, lr_t, eps, decay);
                    let adamw = |p: T, g: T, m: T, v: T| {
                        let grad = g * scale;
                        let m1 = b1 * m + one_b1 * grad;
                        let v1 = b2 * v + one_b2 * grad * grad;
                        (p * decay - lr_t * (m1 / c1) / ((v1 / c2).sqrt() + eps), m1, v1)
                    };
                    // As for SGD above: a block at a time, in place.
                    for block in (0..n).step_by(BLOCK) {
                        let b = block..(block + BLOCK).min(n);
                        copy_unless_given(given[0], sources[0], start + block, &mut p_out[b.clone()]);
                        copy_unless_given(given[1], sources[1], start + block, &mut m_out[b.clone()]);
                        copy_unless_given(given[2], sources[2], start + block, &mut v_out[b.clone()]);
                        for i in b {
                            (p_out[i], m_out[i], v_out[i]) = adamw(p_out[i], g[i], m_out[i], v_out[i]);
                        }
                    }
                },
            );
        }
    }
    Ok(())
}

/// Elements per block of an update: the tensors not given in place are copied to their
/// outputs a block at a time (while the block is in L1), then the whole block is updated
/// in place, in one loop that vectorizes.
const BLOCK: usize = 2048;

/// Copies `source[from..from + out.len()]` into `out`, unless the tensor is `given` in
/// place (its old value is in `out` already).
#[inline(always)]
fn copy_unless_given<T: Copy>(given: bool, source: &[T], from: usize, out: &mut [T]) {
    if !given {
        out.copy_from_slice(&source[from..from + out.len()]);
    }
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
