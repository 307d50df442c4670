//! Attributes of `optim` ops.

use serde::{Deserialize, Serialize};

/// A learning-rate schedule, evaluated from the step counter (starting at 1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Schedule {
    /// The same rate every step.
    Constant(f64),
    /// Linear warm-up from 0 to `peak` over `warmup` steps, then cosine decay to `min`
    /// at step `total` (and `min` after it).
    WarmupCosine {
        /// Rate at the end of warm-up.
        peak: f64,
        /// Warm-up steps.
        warmup: u64,
        /// Step at which the decay reaches `min`.
        total: u64,
        /// Final rate.
        min: f64,
    },
}

/// Which update rule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum OptimizerKind {
    /// SGD with optional momentum and L2 weight decay (PyTorch `torch.optim.SGD`).
    Sgd {
        /// Momentum μ (0 for plain SGD).
        momentum: f64,
        /// L2 weight decay λ, added to the gradient.
        weight_decay: f64,
    },
    /// AdamW (PyTorch `torch.optim.AdamW`): decoupled weight decay, bias-corrected moments.
    AdamW {
        /// β₁.
        beta1: f64,
        /// β₂.
        beta2: f64,
        /// ε.
        eps: f64,
        /// Decoupled weight decay λ.
        weight_decay: f64,
    },
}

/// Computes the learning rate of a step from the step counter.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LearningRate(pub Schedule);

/// `min(1, max_norm / (norm + 1e-6))`: the factor that clips a global norm.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClipFactor(pub f64);

/// One optimizer update: inputs `(param, grad, lr, step, state...)` and optionally a last
/// scalar `grad_scale` the gradient is multiplied by first (gradient clipping's factor,
/// or loss scaling's `1 / scale` with it: applied as the update reads each element, the
/// same bits as a separate `g · factor`, without writing and re-reading a clipped copy of
/// every gradient); outputs `(param', state'...)`.
///
/// A `grad_scale` that is not finite skips the step ([`skips_step`]): every output is its
/// input unchanged. Loss scaling makes it NaN when the step's gradients overflowed
/// ([`UnscaleFactor`]), as PyTorch's `GradScaler` skips `optimizer.step()`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Update(pub OptimizerKind);

impl Update {
    /// The (input, output) pairs it can take in place: the parameter (input 0, output 0)
    /// and each state (input 4 + j, output 1 + j). Every element of an output is computed
    /// from the same element of the inputs, read before it is written.
    pub fn in_place_pairs(&self) -> Vec<(usize, usize)> {
        (0..=self.0.state_count()).map(|k| (Self::old_value_input(k), k)).collect()
    }

    /// The input holding the old value of output `k`: the parameter (input 0) for the new
    /// parameter (output 0), state `j` (input 4 + j) for its new value (output 1 + j).
    pub fn old_value_input(k: usize) -> usize {
        if k == 0 {
            0
        } else {
            3 + k
        }
    }
}

/// Several [`Update`]s of one rule in one firing, as the compiler fuses a device's
/// updates (`compile/fuse_updates.rs` in `regflow-graph`): PyTorch's `fused=True`
/// optimizers. `params` members, each reading `(param, grad, lr, step, state...)` and, when
/// `scaled`, a last `grad_scale`; the op's inputs are the members' inputs one member after
/// the other, its outputs the members' `(param', state'...)` likewise. Every member reads
/// the same learning rate, step and scale (the compiler fuses only such updates), and
/// every element is computed as [`Update`] computes it: the same bits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UpdateGroup {
    /// The members' rule.
    pub kind: OptimizerKind,
    /// How many parameters it updates (at least 1).
    pub params: u32,
    /// Whether each member reads a gradient scale (its last input).
    pub scaled: bool,
}

impl UpdateGroup {
    /// Inputs per member: `(param, grad, lr, step, state...)` and the scale if `scaled`.
    pub fn member_inputs(&self) -> usize {
        4 + self.kind.state_count() + usize::from(self.scaled)
    }

    /// Outputs per member: `(param', state'...)`.
    pub fn member_outputs(&self) -> usize {
        1 + self.kind.state_count()
    }

    /// Each member's [`Update::in_place_pairs`], at its place among the op's inputs and
    /// outputs.
    pub fn in_place_pairs(&self) -> Vec<(usize, usize)> {
        let single = Update(self.kind.clone()).in_place_pairs();
        let (inputs, outputs) = (self.member_inputs(), self.member_outputs());
        (0..self.params as usize)
            .flat_map(|m| single.iter().map(move |&(i, o)| (m * inputs + i, m * outputs + o)))
            .collect()
    }
}

impl OptimizerKind {
    /// The state tensors the rule keeps per parameter: SGD's velocity, AdamW's two moments.
    pub fn state_count(&self) -> usize {
        match self {
            OptimizerKind::Sgd { .. } => 1,
            OptimizerKind::AdamW { .. } => 2,
        }
    }
}

/// Increments the step counter: `step + 1`. With a second input, the step's gradient
/// scale, a skipped step ([`skips_step`]) leaves the counter as it is, so a step the loss
/// scaler skipped advances neither AdamW's bias correction nor the schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NextStep;

/// Whether an update whose gradient scale is `grad_scale` is skipped: the scale is not
/// finite (loss scaling found an infinity or NaN among the step's gradients).
pub fn skips_step(grad_scale: f64) -> bool {
    !grad_scale.is_finite()
}

/// The factor loss-scaled gradients are multiplied by as the updates read them: inputs
/// `(squared_norm, scale)`, the squared global norm of the scaled gradients and the loss
/// scale they were made with; output one value in the scale's dtype:
/// `clip / scale`, with `clip = min(1, max_norm / (norm + 1e-6))` of the unscaled norm
/// `sqrt(squared_norm) / scale` when `clip_norm` is set, else 1. NaN when `squared_norm`
/// is not finite: some gradient element overflowed (or was NaN), and the step is skipped.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UnscaleFactor {
    /// Gradient clipping's largest global norm, of the unscaled gradients.
    pub clip_norm: Option<f64>,
}

impl UnscaleFactor {
    /// The factor for `squared_norm`, of dtype `dtype`, and `scale` (see the type's docs),
    /// in f64. The norm is its square root taken in `dtype` (f32 for f32 gradients), as
    /// clipping's `sqrt` op takes it: with a power-of-two scale and no overflow,
    /// `norm / scale` is then exactly the unscaled norm clipping alone computes, so the
    /// updates get the bits they would get without loss scaling.
    pub fn at(&self, squared_norm: f64, dtype: crate::DType, scale: f64) -> f64 {
        let norm = match dtype {
            crate::DType::F64 => squared_norm.sqrt(),
            _ => f64::from((squared_norm as f32).sqrt()),
        };
        if !norm.is_finite() {
            return f64::NAN;
        }
        let clip = match self.clip_norm {
            Some(max_norm) => (max_norm / (norm / scale + 1e-6)).min(1.0),
            None => 1.0,
        };
        clip / scale
    }
}

/// Dynamic loss scaling's bookkeeping after a step, PyTorch's `GradScaler.update()`:
/// inputs `(scale, good_steps, grad_scale)`, outputs `(scale', good_steps')`. A skipped
/// step ([`skips_step`] of `grad_scale`) multiplies the scale by `backoff` and restarts
/// the count; otherwise the count grows by one, and at `interval` the scale is multiplied
/// by `growth` (kept when that would overflow to infinity) and the count restarts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LossScaleUpdate {
    /// Factor after `interval` steps in a row without overflow (> 1 to grow; 1 keeps it).
    pub growth: f64,
    /// Factor after a step that overflowed (in (0, 1]).
    pub backoff: f64,
    /// Steps without overflow before the scale grows (>= 1).
    pub interval: u64,
}

impl LossScaleUpdate {
    /// `(scale', good_steps')` after a step with `grad_scale`, the scale being of `dtype`
    /// (growth stops short of its largest finite value).
    pub fn at(&self, scale: f64, good_steps: f64, grad_scale: f64, dtype: crate::DType) -> (f64, f64) {
        if skips_step(grad_scale) {
            return (scale * self.backoff, 0.0);
        }
        let good = good_steps + 1.0;
        if good < self.interval as f64 {
            return (scale, good);
        }
        let grown = scale * self.growth;
        (if grown <= dtype.max_finite() { grown } else { scale }, 0.0)
    }
}

impl Schedule {
    /// The rate at `step` (1-based).
    pub fn at(&self, step: f64) -> f64 {
        match *self {
            Schedule::Constant(lr) => lr,
            Schedule::WarmupCosine { peak, warmup, total, min } => {
                if step <= warmup as f64 {
                    peak * step / warmup.max(1) as f64
                } else if step >= total as f64 {
                    min
                } else {
                    let progress = (step - warmup as f64) / total.saturating_sub(warmup).max(1) as f64;
                    min + 0.5 * (peak - min) * (1.0 + (std::f64::consts::PI * progress).cos())
                }
            }
        }
    }
}
