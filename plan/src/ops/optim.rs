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
/// applied as the update reads each element: the same bits as a separate `g · factor`,
/// without writing and re-reading a clipped copy of every gradient); outputs
/// `(param', state'...)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Update(pub OptimizerKind);

impl OptimizerKind {
    /// The state tensors the rule keeps per parameter: SGD's velocity, AdamW's two moments.
    pub fn state_count(&self) -> usize {
        match self {
            OptimizerKind::Sgd { .. } => 1,
            OptimizerKind::AdamW { .. } => 2,
        }
    }
}

/// Increments the step counter: `step + 1`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NextStep;

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
