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
    if skips_step(scale) {
        return skip_update::<T>(inputs, outputs, states);
    }
    let scale = T::from_f64(scale);
    let (p, g) = (inputs[0].as_slice::<T>()?, inputs[1].as_slice::<T>()?);
    let [p_out, rest @ ..] = outputs else { return Err("missing outputs".into()) };
    let p_out = p_out.as_mut_slice::<T>()?;
    let len = p.len();
    if g.len() != len || p_out.len() != len {
        return Err(format!("parameter, gradient and output have {len}, {} and {} elements", g.len(), p_out.len()));
    }
    let p_out = Shared(p_out.as_mut_ptr());
    // Element math in the parameter's own type, constants hoisted (as PyTorch does).
    let c = T::from_f64;
    match *kind {
        OptimizerKind::Sgd { momentum, weight_decay } => {
            let v = inputs[4].as_slice::<T>()?;
            let v_out = rest[0].as_mut_slice::<T>()?;
            if v.len() != len || v_out.len() != len {
                return Err(format!("the velocity has {} elements and its output {}, not {len}", v.len(), v_out.len()));
            }
            let v_out = Shared(v_out.as_mut_ptr());
            let (lr, momentum, weight_decay) = (c(lr), c(momentum), c(weight_decay));
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
                    let (p, g, v, p_out) = (&p[start..end], &g[start..end], &v[start..end], &mut p_out[..n]);
                    let (scale, lr, momentum, weight_decay) = (scale, lr, momentum, weight_decay);
                    for i in 0..n {
                        let velocity = momentum * v[i] + (g[i] * scale + weight_decay * p[i]);
                        v_out[i] = velocity;
                        p_out[i] = p[i] - lr * velocity;
                    }
                },
            );
        }
        OptimizerKind::AdamW { beta1, beta2, eps, weight_decay } => {
            let (m, v) = (inputs[4].as_slice::<T>()?, inputs[5].as_slice::<T>()?);
            let [m_out, v_out] = rest else { return Err("missing moment outputs".into()) };
            let (m_out, v_out) = (m_out.as_mut_slice::<T>()?, v_out.as_mut_slice::<T>()?);
            if [m.len(), v.len(), m_out.len(), v_out.len()].iter().any(|&n| n != len) {
                return Err(format!("the moments and their outputs must have {len} elements"));
            }
            let (m_out, v_out) = (Shared(m_out.as_mut_ptr()), Shared(v_out.as_mut_ptr()));
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
                    let (p, g, m, v) = (&p[start..end], &g[start..end], &m[start..end], &v[start..end]);
                    let (p_out, m_out, v_out) = (&mut p_out[..n], &mut m_out[..n], &mut v_out[..n]);
                    let (scale, b1, b2, one_b1, one_b2) = (scale, b1, b2, one_b1, one_b2);
                    let (c1, c2, lr_t, eps, decay) = (c1, c2, lr_t, eps, decay);
                    for i in 0..n {
                        let grad = g[i] * scale;
                        let m1 = b1 * m[i] + one_b1 * grad;
                        let v1 = b2 * v[i] + one_b2 * grad * grad;
                        m_out[i] = m1;
                        v_out[i] = v1;
                        p_out[i] = p[i] * decay - lr_t * (m1 / c1) / ((v1 / c2).sqrt() + eps);
                    }
                },
            );
        }
    }
    Ok(())
}

/// A skipped step: the parameter and its state come out as they went in.
fn skip_update<T: Real>(
    inputs: &[HostTensor<'_>],
    outputs: &mut [HostTensorMut<'_>],
    states: usize,
) -> Result<(), String> {
    // Outputs are (param', state'...), inputs (param, grad, lr, step, state...).
    let sources = std::iter::once(0).chain(4..4 + states);
    if outputs.len() != 1 + states {
        return Err(format!("gives the parameter and {states} state(s), not {} outputs", outputs.len()));
    }
    for (out, i) in outputs.iter_mut().zip(sources) {
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
