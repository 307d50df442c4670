//! The optimizer updates' element loop, shared by one parameter's `update` and a device's
//! fused `update_group`: each parameter is a [`Part`] (the addresses of its gradient, its
//! old value and state and their outputs), and all parts' elements together are cut into
//! contiguous shares over the kernel's threads. An element's update reads only its own
//! entries, so neither the grouping nor the split changes a bit of the result.

use crate::{Kernel, KernelError, KernelFactory, KernelIo};
use regflow_plan::ops::{skips_step, OptimizerKind, Update, UpdateGroup};
use regflow_plan::{OpConf, Real, TensorMeta};
use std::marker::PhantomData;
use std::sync::Arc;

/// Updates of at least this many elements (one parameter's, or a group's in all) run on
/// `cpu_threads` threads, each a contiguous share; smaller ones on one thread, where waking
/// the pool costs more.
pub const PARALLEL_MIN_ELEMENTS: usize = 1 << 16;

/// Elements per block: the tensors not given in place are copied to their outputs a block
/// at a time (while the block is in L1), then the whole block is updated in place, in one
/// loop that vectorizes.
const BLOCK: usize = 2048;

/// One parameter's update, as addresses of elements of the update's type: the gradient,
/// the old parameter and states (`sources`, in the rule's order), and where their new
/// values go (`targets`). A source `given` in place is not read: its old value is already
/// in its target, which the update reads there.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Part {
    /// The gradient's first element.
    pub(crate) grad: usize,
    /// The old parameter, then each state; only the first `1 + states` are used.
    pub(crate) sources: [usize; 3],
    /// The new parameter, then each state, as `sources`.
    pub(crate) targets: [usize; 3],
    /// Whether each source is given in place (its target holds it).
    pub(crate) given: [bool; 3],
    /// Elements of every tensor of the part.
    pub(crate) len: usize,
}

/// An update rule with its per-step constants computed once, in the parameter's type (as
/// PyTorch hoists them): the learning rate, the bias corrections and the gradient scale
/// (clipping's factor, or 1).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Rule<T> {
    /// `v' = μ·v + (s·g + λ·p); p' = p − lr·v'`.
    Sgd { lr: T, momentum: T, weight_decay: T, scale: T },
    /// AdamW with bias correction and decoupled decay.
    AdamW { b1: T, b2: T, one_b1: T, one_b2: T, c1: T, c2: T, lr: T, eps: T, decay: T, scale: T },
}

impl<T: Real> Rule<T> {
    /// `kind` at learning rate `lr`, step `step` (from 1) and gradient scale `scale`.
    pub(crate) fn new(kind: &OptimizerKind, lr: f64, step: f64, scale: f64) -> Self {
        let c = T::from_f64;
        match *kind {
            OptimizerKind::Sgd { momentum, weight_decay } => {
                Rule::Sgd { lr: c(lr), momentum: c(momentum), weight_decay: c(weight_decay), scale: c(scale) }
            }
            OptimizerKind::AdamW { beta1, beta2, eps, weight_decay } => Rule::AdamW {
                b1: c(beta1),
                b2: c(beta2),
                one_b1: c(1.0 - beta1),
                one_b2: c(1.0 - beta2),
                c1: c(1.0 - beta1.powf(step)),
                c2: c(1.0 - beta2.powf(step)),
                lr: c(lr),
                eps: c(eps),
                decay: c(1.0 - lr * weight_decay),
                scale: c(scale),
            },
        }
    }

    /// The state tensors per parameter.
    fn states(&self) -> usize {
        match self {
            Rule::Sgd { .. } => 1,
            Rule::AdamW { .. } => 2,
        }
    }
}

/// Updates every element of every part: their elements in order, cut into contiguous
/// shares over `threads` (one thread under [`PARALLEL_MIN_ELEMENTS`] in all), each share's
/// loop at AVX2 width where the CPU has it ([`vectorized`](super::fast_math::vectorized)):
/// the update divides twice and takes a square root per element, so on SSE2's 4 lanes it
/// waited on the divider. Lane width does not change an element's rounding.
///
/// # Safety
/// Each part's addresses hold `len` elements of `T` for the call; no target overlaps
/// another target or any gradient or source, but a source given in place (not read).
pub(crate) unsafe fn update_parts<T: Real>(rule: &Rule<T>, threads: usize, parts: &[Part]) {
    let total: usize = parts.iter().map(|p| p.len).sum();
    let threads = if total < PARALLEL_MIN_ELEMENTS { 1 } else { threads };
    super::shares::in_shares(threads, total, |share| {
        super::fast_math::vectorized(
            #[inline(always)]
            || {
                // The parts this share overlaps, each from its first element in the share.
                let mut first = 0;
                for part in parts {
                    let (start, end) = (share.start.max(first), share.end.min(first + part.len));
                    if start < end {
                        // SAFETY: the caller's contract; shares are disjoint ranges.
                        unsafe { update_range(rule, part, start - first, end - first) };
                    }
                    first += part.len;
                    if first >= share.end {
                        break;
                    }
                }
            },
        )
    });
}

/// Elements `start..end` of one part.
///
/// # Safety
/// As [`update_parts`], and no other thread touches these elements meanwhile.
#[inline(always)]
unsafe fn update_range<T: Real>(rule: &Rule<T>, part: &Part, start: usize, end: usize) {
    let n = end - start;
    // SAFETY (all four): in bounds and unaliased by the caller's contract.
    let grad = unsafe { std::slice::from_raw_parts((part.grad as *const T).add(start), n) };
    let target = |k: usize| unsafe { std::slice::from_raw_parts_mut((part.targets[k] as *mut T).add(start), n) };
    let source: [&[T]; 3] = std::array::from_fn(|k| match k <= rule.states() && !part.given[k] {
        true => unsafe { std::slice::from_raw_parts((part.sources[k] as *const T).add(start), n) },
        false => &[],
    });
    let given = part.given;
    match *rule {
        Rule::Sgd { lr, momentum, weight_decay, scale } => {
            let (p_out, v_out) = (target(0), target(1));
            let sgd = |p: T, g: T, v: T| {
                let velocity = momentum * v + (g * scale + weight_decay * p);
                (p - lr * velocity, velocity)
            };
            // A block at a time: what is not given in place is copied to its output while
            // the block is in L1, then the block is updated in place, in one loop over
            // slices that do not alias (so it vectorizes).
            for block in (0..n).step_by(BLOCK) {
                let b = block..(block + BLOCK).min(n);
                copy_unless_given(given[0], source[0], block, &mut p_out[b.clone()]);
                copy_unless_given(given[1], source[1], block, &mut v_out[b.clone()]);
                let (g, p_out, v_out) = (&grad[b.clone()], &mut p_out[b.clone()], &mut v_out[b]);
                for i in 0..g.len() {
                    (p_out[i], v_out[i]) = sgd(p_out[i], g[i], v_out[i]);
                }
            }
        }
        Rule::AdamW { b1, b2, one_b1, one_b2, c1, c2, lr, eps, decay, scale } => {
            let (p_out, m_out, v_out) = (target(0), target(1), target(2));
            let adamw = |p: T, g: T, m: T, v: T| {
                let grad = g * scale;
                let m1 = b1 * m + one_b1 * grad;
                let v1 = b2 * v + one_b2 * grad * grad;
                (p * decay - lr * (m1 / c1) / ((v1 / c2).sqrt() + eps), m1, v1)
            };
            for block in (0..n).step_by(BLOCK) {
                let b = block..(block + BLOCK).min(n);
                copy_unless_given(given[0], source[0], block, &mut p_out[b.clone()]);
                copy_unless_given(given[1], source[1], block, &mut m_out[b.clone()]);
                copy_unless_given(given[2], source[2], block, &mut v_out[b.clone()]);
                let (g, p_out) = (&grad[b.clone()], &mut p_out[b.clone()]);
                let (m_out, v_out) = (&mut m_out[b.clone()], &mut v_out[b]);
                for i in 0..g.len() {
                    (p_out[i], m_out[i], v_out[i]) = adamw(p_out[i], g[i], m_out[i], v_out[i]);
                }
            }
        }
    }
}

/// Copies `source[from..from + out.len()]` into `out`, unless the tensor is `given` in
/// place (its old value is in `out` already).
#[inline(always)]
fn copy_unless_given<T: Copy>(given: bool, source: &[T], from: usize, out: &mut [T]) {
    if !given {
        out.copy_from_slice(&source[from..from + out.len()]);
    }
}

/// A skipped step (a gradient scale that is not finite): every part's parameter and
/// `states` states come out as they went in (those given in place are left as they are).
///
/// # Safety
/// As [`update_parts`].
pub(crate) unsafe fn keep_parts<T: Real>(parts: &[Part], states: usize) {
    for part in parts {
        for k in (0..=states).filter(|&k| !part.given[k]) {
            // SAFETY: the caller's contract: `len` elements each, not overlapping.
            unsafe {
                std::ptr::copy_nonoverlapping(part.sources[k] as *const T, part.targets[k] as *mut T, part.len);
            }
        }
    }
}

/// The CPU kernel of `update_group`: each member a [`Part`] of one pass over all their
/// elements, split over the device's threads as one tensor would be.
pub(crate) struct UpdateGroupKernel<T> {
    op: UpdateGroup,
    /// For each op input, the actor input that holds it.
    input_map: Vec<usize>,
    /// The learning rate's, the step's and (when scaled) the gradient scale's metas, as
    /// every member reads them (the first member's).
    scalars: Vec<TensorMeta>,
    /// Elements of each member's tensors.
    lens: Vec<usize>,
    /// This firing's parts, one per member (capacity for all from the start: a firing
    /// allocates nothing).
    parts: Vec<Part>,
    element: PhantomData<fn() -> T>,
}

impl<T: Real> UpdateGroupKernel<T> {
    /// The kernel of `conf`, whose metas are checked against `op` (the same rules as one
    /// `update`'s, per member, and one learning rate, step and scale for all).
    pub(crate) fn new(op: UpdateGroup, conf: &OpConf) -> Result<Self, String> {
        let (inputs, outputs) = (op.member_inputs(), op.member_outputs());
        let params = op.params as usize;
        if params == 0 {
            return Err("updates no parameter (params is 0)".into());
        }
        if conf.inputs.len() != params * inputs
            || conf.input_map.len() != conf.inputs.len()
            || conf.outputs.len() != params * outputs
        {
            return Err(format!(
                "has {params} member(s) of {inputs} inputs and {outputs} outputs each, so {} inputs and {} outputs, \
                 but its conf has {} inputs ({} mapped) and {} outputs",
                params * inputs,
                params * outputs,
                conf.inputs.len(),
                conf.input_map.len(),
                conf.outputs.len()
            ));
        }
        let states = op.kind.state_count();
        // The scalars: lr (2), step (3), scale (last), at the same actor inputs for all.
        let scalar_inputs: Vec<usize> = [2, 3].into_iter().chain(op.scaled.then_some(inputs - 1)).collect();
        let mut lens = Vec::with_capacity(params);
        for m in 0..params {
            let member = &conf.inputs[m * inputs..(m + 1) * inputs];
            let param = &member[0];
            if param.dtype != T::DTYPE {
                return Err(format!("member {m}'s parameter is {param}, but the kernel updates {}", T::DTYPE));
            }
            let dense = std::iter::once(&member[1])
                .chain(&member[4..4 + states])
                .chain(&conf.outputs[m * outputs..(m + 1) * outputs]);
            if let Some(other) = dense.into_iter().find(|meta| *meta != param) {
                return Err(format!(
                    "member {m}'s gradient, states and outputs must match its parameter {param}, got {other}"
                ));
            }
            for &i in &scalar_inputs {
                if conf.input_map[m * inputs + i] != conf.input_map[i] {
                    return Err(format!(
                        "member {m} reads input {i} (learning rate, step or gradient scale) from actor input {}, \
                         member 0 from {}: a group shares them",
                        conf.input_map[m * inputs + i],
                        conf.input_map[i]
                    ));
                }
            }
            lens.push(param.shape.numel());
        }
        let scalars: Vec<TensorMeta> = scalar_inputs.iter().map(|&i| conf.inputs[i].clone()).collect();
        if let Some(empty) = scalars.iter().find(|meta| meta.shape.numel() == 0) {
            return Err(format!("the learning rate, step and gradient scale hold a value each, got {empty}"));
        }
        if let Some(scale) = scalars.get(2).filter(|meta| !meta.dtype.is_float()) {
            return Err(format!("the gradient scale must be a float, got {scale}"));
        }
        Ok(Self {
            op,
            input_map: conf.input_map.clone(),
            scalars,
            lens,
            parts: Vec::with_capacity(params),
            element: PhantomData,
        })
    }

    /// Scalar `k` of [`Self::scalars`] (lr, step, scale), read from its register.
    fn scalar(&self, io: &KernelIo<'_>, k: usize, op_input: usize) -> Result<f64, String> {
        let tensor = crate::io::view(&self.scalars[k], io.input(self.input_map[op_input]))?;
        super::optim::scalar_input(&[tensor], 0)
    }

    /// This firing's parts, each tensor's register checked to hold its elements.
    fn fill_parts(&mut self, io: &mut KernelIo<'_>) -> Result<(), String> {
        let (inputs, outputs, states) = (self.op.member_inputs(), self.op.member_outputs(), self.op.kind.state_count());
        let size = std::mem::size_of::<T>();
        self.parts.clear();
        for (m, &len) in self.lens.iter().enumerate() {
            let bytes = len * size;
            let input = |k: usize| self.input_map[m * inputs + k];
            // Which tensor (`None`: the gradient; `Some(k)`: the parameter or state `k`, old
            // or new) is named only on error: a firing allocates nothing.
            let fits = |tensor: Option<usize>, new: bool, got: usize, addr: u64| {
                if got == bytes && (addr as usize).is_multiple_of(std::mem::align_of::<T>()) {
                    return Ok(());
                }
                let what = match tensor {
                    None => "gradient".to_string(),
                    Some(0) => "parameter".to_string(),
                    Some(k) => format!("state {k}"),
                };
                Err(format!(
                    "member {m}'s {}{what} register has {got} bytes at address {addr:#x}, not {bytes} aligned bytes \
                     ({len} elements of {})",
                    if new { "new " } else { "" },
                    T::DTYPE
                ))
            };
            let grad = input(1);
            fits(None, false, io.input_len(grad), io.input_addr(grad))?;
            let mut part = Part { grad: io.input(grad).as_ptr() as usize, len, ..Part::default() };
            for k in 0..=states {
                let (source, target) = (input(Update::old_value_input(k)), m * outputs + k);
                fits(Some(k), true, io.output_len(target), io.output_addr(target))?;
                // Given in place: the output is the input's very bytes (aliased slots).
                part.given[k] = io.input_addr(source) == io.output_addr(target) && bytes > 0;
                if !part.given[k] {
                    fits(Some(k), false, io.input_len(source), io.input_addr(source))?;
                    part.sources[k] = io.input(source).as_ptr() as usize;
                }
                part.targets[k] = io.output_detached(target).as_mut_ptr() as usize;
            }
            self.parts.push(part);
        }
        Ok(())
    }
}

impl<T: Real> Kernel for UpdateGroupKernel<T> {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let fail = |m: String| KernelError(format!("update_group: {m}"));
        let (lr, step) = (self.scalar(io, 0, 2).map_err(fail)?, self.scalar(io, 1, 3).map_err(fail)?);
        let scale = match self.op.scaled {
            true => self.scalar(io, 2, self.op.member_inputs() - 1).map_err(fail)?,
            false => 1.0,
        };
        self.fill_parts(io).map_err(fail)?;
        // SAFETY: each part's registers hold `len` aligned elements (checked above) for the
        // firing; outputs are distinct registers, and a source given in place is its
        // target (not read as a source).
        unsafe {
            if skips_step(scale) {
                keep_parts::<T>(&self.parts, self.op.kind.state_count());
            } else {
                update_parts(&Rule::<T>::new(&self.op.kind, lr, step, scale), io.context().threads, &self.parts);
            }
        }
        Ok(())
    }
}

/// The factory of `update_group`'s CPU kernel for elements of `T`.
pub(crate) fn update_group_factory<T: Real>() -> KernelFactory {
    Arc::new(|spec| {
        let conf = spec.op.ok_or_else(|| {
            KernelError(format!("actor '{}' runs an op kernel without an op (broken invariant)", spec.actor))
        })?;
        let op: UpdateGroup = conf.parse_attrs().map_err(KernelError)?;
        let kernel =
            UpdateGroupKernel::<T>::new(op, conf).map_err(|m| KernelError(format!("op 'update_group': {m}")))?;
        Ok(Box::new(kernel))
    })
}
