//! Training in the graph: `graph.minimize(loss, &optimizer)` appends the backward pass,
//! optional clipping by global norm, a learning-rate schedule and one update op per
//! variable, and returns the [`TrainStep`] that says which variable takes which new value.
//!
//! Updates follow PyTorch's definitions, so hand-computed values and other frameworks
//! agree: SGD with momentum (`v = μ·v + g + λ·p; p -= lr·v`), AdamW with decoupled weight
//! decay and bias correction. The step counter and optimizer state are non-trainable
//! variables; a runtime keeps them in registers with one slot, so step k+1 reads what
//! step k wrote.
//!
//! **Loss scaling** ([`LossScale`], on by default under f16 mixed precision) is PyTorch's
//! `GradScaler`, in the graph: the backward pass starts from `loss · scale`, so small
//! f16 gradients do not flush to zero. The global squared norm of the (scaled)
//! gradients, which clipping needs anyway, is the overflow check: it is not finite exactly
//! when some gradient element is infinite or NaN (or the norm itself passes f32's range,
//! where the step would be useless too). One scalar op, `unscale_factor`, turns it into
//! the factor the updates multiply each gradient element by as they read it
//! (`clip / scale`), or NaN for an overflowed step, which every update and the step
//! counter take as "skip": parameters, moments and the step stay as they were, as when
//! `GradScaler` skips `optimizer.step()`. `loss_scale_update` then halves the scale after
//! an overflow and doubles it after `interval` good steps. With data parallelism the norm
//! is summed over devices before the check, so every rank skips the same steps.

use crate::dsl::{Graph, Tensor};
use crate::ops::{GradCtx, InputGrads, OpDef};
use crate::plan::{DType, Init, Shape, TensorMeta};
use crate::{GraphError, Precision};
use regflow_plan::ops::{ClipFactor, LearningRate, LossScaleUpdate, NextStep, UnscaleFactor, Update};
pub use regflow_plan::ops::{OptimizerKind, Schedule};

/// An optimizer: an update rule, a learning-rate schedule and optional clipping.
#[derive(Debug, Clone, PartialEq)]
pub struct Optimizer {
    /// Update rule.
    pub kind: OptimizerKind,
    /// Learning rate per step.
    pub schedule: Schedule,
    /// Clip gradients so their global L2 norm is at most this.
    pub clip_norm: Option<f64>,
    /// Scale the loss (and so every gradient) by a dynamic factor and skip steps whose
    /// gradients overflow. `None` means none, except under [`Precision::F16`], where
    /// [`LossScale::dynamic`] is used.
    pub loss_scale: Option<LossScale>,
}

/// Dynamic loss scaling, as PyTorch's `torch.amp.GradScaler` (see the module docs): the
/// loss is multiplied by `init` at first; a step whose gradients overflow is skipped and
/// the scale multiplied by `backoff`; after `interval` steps in a row without overflow it
/// is multiplied by `growth`. The scale and the count of good steps are state variables
/// (`loss_scale.scale`, `loss_scale.good_steps`), saved with checkpoints.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScale {
    /// The first step's scale (> 0, at most f32's largest value).
    pub init: f64,
    /// Factor after `interval` good steps (>= 1; 1 never grows).
    pub growth: f64,
    /// Factor after an overflow (in (0, 1]; 1 never shrinks).
    pub backoff: f64,
    /// Good steps in a row before the scale grows (>= 1).
    pub interval: u64,
}

impl LossScale {
    /// PyTorch's defaults: 65536 at first, × 2 after 2000 good steps, × 0.5 after an
    /// overflow.
    pub fn dynamic() -> Self {
        Self { init: 65536.0, growth: 2.0, backoff: 0.5, interval: 2000 }
    }

    /// A scale that never changes; steps whose gradients overflow are still skipped.
    pub fn fixed(scale: f64) -> Self {
        Self { init: scale, growth: 1.0, backoff: 1.0, interval: 1 }
    }

    /// With the scale growing after `steps` good steps instead.
    pub fn with_interval(mut self, steps: u64) -> Self {
        self.interval = steps;
        self
    }

    /// Checks every option; the error names it and its value.
    pub fn check(&self) -> Result<(), GraphError> {
        positive("loss_scale.init", self.init, "the initial loss scale")?;
        if self.init > f64::from(f32::MAX) {
            let requirement = format!("the loss scale is kept in f32, whose largest value is {:e}", f32::MAX);
            return Err(option_error("loss_scale.init", self.init, requirement));
        }
        if !(self.growth.is_finite() && self.growth >= 1.0) {
            let requirement = "the growth factor must be a finite number >= 1 (1 never grows)".into();
            return Err(option_error("loss_scale.growth", self.growth, requirement));
        }
        if !(self.backoff > 0.0 && self.backoff <= 1.0) {
            let requirement = "the backoff factor must be in (0, 1] (1 never shrinks)".into();
            return Err(option_error("loss_scale.backoff", self.backoff, requirement));
        }
        if self.interval == 0 {
            let requirement = "the scale grows after at least 1 good step".into();
            return Err(option_error("loss_scale.interval", self.interval, requirement));
        }
        Ok(())
    }
}

impl Optimizer {
    /// SGD with momentum and weight decay, constant rate.
    pub fn sgd(lr: f64, momentum: f64, weight_decay: f64) -> Self {
        Self {
            kind: OptimizerKind::Sgd { momentum, weight_decay },
            schedule: Schedule::Constant(lr),
            clip_norm: None,
            loss_scale: None,
        }
    }

    /// AdamW with PyTorch's defaults (β = 0.9, 0.999; ε = 1e-8), constant rate.
    pub fn adamw(lr: f64, weight_decay: f64) -> Self {
        Self {
            kind: OptimizerKind::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay },
            schedule: Schedule::Constant(lr),
            clip_norm: None,
            loss_scale: None,
        }
    }

    /// With a learning-rate schedule.
    pub fn with_schedule(mut self, schedule: Schedule) -> Self {
        self.schedule = schedule;
        self
    }

    /// With gradient clipping by global norm.
    pub fn with_clip_norm(mut self, max_norm: f64) -> Self {
        self.clip_norm = Some(max_norm);
        self
    }

    /// With loss scaling (any precision; [`Precision::F16`] has [`LossScale::dynamic`]
    /// without asking).
    pub fn with_loss_scale(mut self, loss_scale: LossScale) -> Self {
        self.loss_scale = Some(loss_scale);
        self
    }

    /// Checks every option (run by [`Graph::minimize`] before it adds anything): learning
    /// rates finite and >= 0, momentum and Adam betas in [0, 1), eps finite and > 0,
    /// weight decay finite and >= 0, clip norm finite and > 0, a schedule with a total of
    /// at least one step and a warm-up no longer than it. The error names the option and
    /// its value.
    pub fn check(&self) -> Result<(), GraphError> {
        match self.kind {
            OptimizerKind::Sgd { momentum, weight_decay } => {
                unit_interval("momentum", momentum)?;
                non_negative("weight_decay", weight_decay, "weight decay")?;
            }
            OptimizerKind::AdamW { beta1, beta2, eps, weight_decay } => {
                unit_interval("beta1", beta1)?;
                unit_interval("beta2", beta2)?;
                positive("eps", eps, "Adam's eps")?;
                non_negative("weight_decay", weight_decay, "weight decay")?;
            }
        }
        match self.schedule {
            Schedule::Constant(lr) => non_negative("lr", lr, "the learning rate")?,
            Schedule::WarmupCosine { peak, warmup, total, min } => {
                non_negative("peak", peak, "the schedule's peak learning rate")?;
                non_negative("min", min, "the schedule's final learning rate")?;
                if total == 0 {
                    return Err(option_error("total", total, "the schedule needs at least 1 step".into()));
                }
                if warmup > total {
                    return Err(option_error(
                        "warmup",
                        warmup,
                        format!("the warm-up must not be longer than the schedule's total of {total} steps"),
                    ));
                }
            }
        }
        if let Some(max_norm) = self.clip_norm {
            positive("clip_norm", max_norm, "the clipping norm")?;
        }
        if let Some(loss_scale) = &self.loss_scale {
            loss_scale.check()?;
        }
        Ok(())
    }
}

fn option_error(option: &'static str, value: impl std::fmt::Display, requirement: String) -> GraphError {
    GraphError::OptimizerOption { option, value: value.to_string(), requirement }
}

/// `value` finite and >= 0.
fn non_negative(option: &'static str, value: f64, what: &str) -> Result<(), GraphError> {
    if value.is_finite() && value >= 0.0 {
        return Ok(());
    }
    Err(option_error(option, value, format!("{what} must be a finite number >= 0")))
}

/// `value` finite and > 0.
fn positive(option: &'static str, value: f64, what: &str) -> Result<(), GraphError> {
    if value.is_finite() && value > 0.0 {
        return Ok(());
    }
    Err(option_error(option, value, format!("{what} must be a finite number > 0")))
}

/// `value` in [0, 1).
fn unit_interval(option: &'static str, value: f64) -> Result<(), GraphError> {
    if (0.0..1.0).contains(&value) {
        return Ok(());
    }
    Err(option_error(option, value, format!("{option} must be in [0, 1)")))
}

/// What one training step computes: the loss and, for each variable, its next value.
#[derive(Debug, Clone)]
pub struct TrainStep<'g> {
    /// The loss.
    pub loss: Tensor<'g>,
    /// `(variable, its value after the step)`, parameters and optimizer state alike.
    pub updates: Vec<(Tensor<'g>, Tensor<'g>)>,
    /// Gradients of the parameters (after clipping, and unscaled with loss scaling; NaN on
    /// a step the loss scaler skips), in parameter order.
    pub grads: Vec<Tensor<'g>>,
    /// The learning rate used by this step.
    pub lr: Tensor<'g>,
    /// The gradients before clipping (times the loss scale, with loss scaling): where a
    /// micro-batch's part of the step ends.
    pub raw_grads: Vec<Tensor<'g>>,
    /// The trainable parameters, in the order of `grads` and `raw_grads`.
    pub params: Vec<Tensor<'g>>,
    /// `(optimizer state, its parameter)`: momentum and moment estimates, shaped like it.
    pub states: Vec<(Tensor<'g>, Tensor<'g>)>,
    /// With loss scaling: the scale this step's loss was multiplied by (`raw_grads` are
    /// scaled by it; `grads` are not).
    pub loss_scale: Option<Tensor<'g>>,
    /// The factor every update multiplies its raw gradient by: clipping's, and loss
    /// scaling's `1 / scale`, NaN on a step the loss scaler skips. `None` without either.
    pub grad_factor: Option<Tensor<'g>>,
}

impl TrainStep<'_> {
    /// Compile option for accumulating gradients over `micro_batches` pieces per step.
    pub fn accumulate(&self, micro_batches: u32) -> crate::Accumulate {
        crate::Accumulate { micro_batches, gradients: self.raw_grads.iter().map(|g| g.id()).collect() }
    }
}

impl OpDef for LearningRate {
    fn name(&self) -> &'static str {
        "learning_rate"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        match inputs {
            [step] if step.shape.numel() == 1 => Ok(vec![TensorMeta::new(Shape::scalar(), DType::F64)]),
            _ => Err("takes the scalar step counter".into()),
        }
    }

    fn grad<'g>(&self, _ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        Ok(vec![None])
    }
}

impl OpDef for ClipFactor {
    fn name(&self) -> &'static str {
        "clip_factor"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        match inputs {
            [norm] if norm.shape.numel() == 1 && norm.dtype.is_float() => Ok(vec![norm.clone()]),
            _ => Err("takes the scalar global norm".into()),
        }
    }

    fn grad<'g>(&self, _ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        Ok(vec![None])
    }
}

impl OpDef for Update {
    fn name(&self) -> &'static str {
        match self.0 {
            OptimizerKind::Sgd { .. } => "sgd_update",
            OptimizerKind::AdamW { .. } => "adamw_update",
        }
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let states = self.0.state_count();
        if inputs.len() != 4 + states && inputs.len() != 5 + states {
            return Err(format!(
                "takes param, grad, lr, step, {states} state tensor(s) and an optional gradient scale, got {} inputs",
                inputs.len()
            ));
        }
        let param = &inputs[0];
        for (i, t) in inputs.iter().enumerate().filter(|&(i, _)| i != 2 && i != 3) {
            if i == 4 + states {
                if t.shape.numel() != 1 || !t.dtype.is_float() {
                    return Err(format!("the gradient scale (input {i}) must be one float value, got {t}"));
                }
            } else if t != param {
                return Err(format!("input {i} is {t}, but the parameter is {param}"));
            }
        }
        Ok(vec![param.clone(); 1 + states])
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        Ok(vec![None; ctx.inputs.len()])
    }

    /// Elementwise over the parameter, its gradient and its state: any split of those
    /// (alike) splits every output, with the learning rate, step and gradient scale whole.
    fn sbp_signatures(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Vec<crate::sbp::SbpSignature> {
        use crate::sbp::{Sbp, SbpSignature};
        let rank = inputs.first().map_or(0, |param| param.shape.rank());
        let scale = 4 + self.0.state_count();
        (0..rank)
            .map(|d| {
                let whole = |i: usize| i == 2 || i == 3 || i == scale;
                let operands: Vec<Sbp> =
                    (0..inputs.len()).map(|i| if whole(i) { Sbp::Broadcast } else { Sbp::Split(d) }).collect();
                SbpSignature::new(operands, vec![Sbp::Split(d); outputs.len()])
            })
            .collect()
    }
}

impl OpDef for NextStep {
    fn name(&self) -> &'static str {
        "next_step"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        match inputs {
            [step] if step.shape.numel() == 1 => Ok(vec![step.clone()]),
            [step, factor] if step.shape.numel() == 1 && is_float_scalar(factor) => Ok(vec![step.clone()]),
            _ => Err("takes the scalar step counter, and optionally the step's scalar gradient factor".into()),
        }
    }

    fn grad<'g>(&self, _ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        Ok(vec![None])
    }
}

/// One float value.
fn is_float_scalar(t: &TensorMeta) -> bool {
    t.shape.numel() == 1 && t.dtype.is_float()
}

impl OpDef for UnscaleFactor {
    fn name(&self) -> &'static str {
        "unscale_factor"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        match inputs {
            [norm, scale] if is_float_scalar(norm) && is_float_scalar(scale) => {
                Ok(vec![TensorMeta::new(Shape::scalar(), norm.dtype)])
            }
            _ => Err("takes the scalar squared norm of the scaled gradients and the scalar loss scale".into()),
        }
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        Ok(vec![None; ctx.inputs.len()])
    }
}

impl OpDef for LossScaleUpdate {
    fn name(&self) -> &'static str {
        "loss_scale_update"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        match inputs {
            [scale, good, factor] if [scale, good, factor].iter().all(|t| is_float_scalar(t)) => {
                Ok(vec![scale.clone(), good.clone()])
            }
            _ => {
                Err("takes the scalar loss scale, the scalar count of good steps and the step's gradient factor".into())
            }
        }
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        Ok(vec![None; ctx.inputs.len()])
    }
}

/// The loss scaler's state variables.
struct Scaler<'g> {
    options: LossScale,
    scale: Tensor<'g>,
    good_steps: Tensor<'g>,
}

impl Graph {
    fn state(&self, name: &str, meta: &TensorMeta, init: Init) -> Result<Tensor<'_>, GraphError> {
        self.state_variable(name, meta.shape.clone(), meta.dtype, init)
    }

    /// Appends the backward pass and the updates of every trainable variable.
    /// Refuses, naming the option and its value, an optimizer whose options cannot train
    /// ([`Optimizer::check`]), and a loss no trainable variable reaches.
    pub fn minimize<'g>(&'g self, loss: Tensor<'g>, optimizer: &Optimizer) -> Result<TrainStep<'g>, GraphError> {
        optimizer.check()?;
        if !std::ptr::eq(loss.graph(), self) {
            return Err(GraphError::ForeignTensor { op: "minimize".into(), index: 0 });
        }
        // A loss that is not a scalar float is the first thing wrong with it.
        let loss_meta = loss.meta();
        if loss_meta.shape.numel() != 1 || !loss_meta.dtype.is_float() {
            return Err(GraphError::NonScalarLoss(loss_meta.to_string()));
        }
        let params = self.trainable_variables();
        let reached = crate::dsl::ancestors(&self.nodes(), self.tensor_count(), [loss.id()]);
        if !params.iter().any(|p| reached[p.id().0 as usize]) {
            return Err(GraphError::NothingToTrain { loss: loss.name() });
        }
        let loss_scale = optimizer.loss_scale.or((self.precision() == Precision::F16).then(LossScale::dynamic));
        let scaler = match loss_scale {
            Some(options) => {
                // Kept in f32 at least (a half-precision loss is widened first).
                let dtype = if loss_meta.dtype.is_half() { DType::F32 } else { loss_meta.dtype };
                let scalar = TensorMeta::new(Shape::scalar(), dtype);
                let scale = self.state("loss_scale.scale", &scalar, Init::Constant(options.init))?;
                let count = TensorMeta::new(Shape::scalar(), DType::F64);
                let good_steps = self.state("loss_scale.good_steps", &count, Init::Zeros)?;
                Some(Scaler { options, scale, good_steps })
            }
            None => None,
        };
        let seed = match &scaler {
            Some(s) => {
                let widened = if loss_meta.dtype.is_half() { loss.cast(DType::F32)? } else { loss };
                widened.mul(&self.alongside(s.scale, loss)?)?
            }
            None => loss,
        };
        let mut grads = self.grad(seed, &params)?;
        let raw_grads = grads.clone();
        // The factor (clipping's, loss scaling's) on each parameter's placement: the
        // updates multiply it in as they read the raw gradients (see `Update`), so the
        // clipped gradients below are made only if something fetches them.
        let squared_norm = match (&scaler, optimizer.clip_norm) {
            (None, None) => None,
            (Some(_), _) => self.squared_global_norm(&grads, "loss_scaling")?,
            (None, Some(_)) => self.squared_global_norm(&grads, "clip_by_global_norm")?,
        };
        let factor = match (&scaler, optimizer.clip_norm, squared_norm) {
            (Some(s), clip_norm, Some(total)) => {
                Some(self.apply1(UnscaleFactor { clip_norm }, &[total, self.alongside(s.scale, total)?])?)
            }
            (None, Some(max_norm), Some(total)) => Some(self.apply1(ClipFactor(max_norm), &[total.sqrt()?])?),
            _ => None,
        };
        let mut grad_scales = Vec::new();
        if let Some(factor) = factor {
            grad_scales = grads.iter().map(|g| self.alongside(factor, *g)).collect::<Result<_, _>>()?;
            grads = grads.iter().zip(&grad_scales).map(|(g, s)| g.mul(s)).collect::<Result<_, _>>()?;
        }
        let step = self.state("optimizer.step", &TensorMeta::new(Shape::scalar(), DType::F64), Init::Zeros)?;
        // A step the loss scaler skips does not count (AdamW's bias correction, the
        // schedule), so the counter reads the step's factor. That factor has the placement
        // of the gradients it was made from, so with parameters on several placements
        // (pipeline stages) each placement counts the step itself, from the same factor:
        // `counters` holds (placement, next step, learning rate), one entry without scaling.
        let skip_factor = factor.filter(|_| scaler.is_some());
        let place = |p: &Tensor<'g>| skip_factor.and_then(|_| self.placement(p.id()));
        let counter = |p: &Tensor<'g>| -> Result<(Tensor<'g>, Tensor<'g>), GraphError> {
            let next_step = match skip_factor {
                Some(factor) => self.apply1(NextStep, &[step, self.alongside(factor, *p)?])?,
                None => self.apply1(NextStep, &[step])?,
            };
            Ok((next_step, self.apply1(LearningRate(optimizer.schedule.clone()), &[next_step])?))
        };
        let mut counters = Vec::new();
        let mut updates = Vec::new();
        let mut all_states = Vec::new();
        for (i, (p, g)) in params.iter().zip(&raw_grads).enumerate() {
            let (next_step, lr) = match counters.iter().find(|(at, _, _)| *at == place(p)) {
                Some(&(_, next_step, lr)) => (next_step, lr),
                None => {
                    let (next_step, lr) = counter(p)?;
                    if counters.is_empty() {
                        updates.push((step, next_step));
                    }
                    counters.push((place(p), next_step, lr));
                    (next_step, lr)
                }
            };
            let meta = p.meta();
            let name = p.name();
            let states: Vec<Tensor<'g>> = match optimizer.kind {
                OptimizerKind::Sgd { .. } => vec![self.state(&format!("{name}.velocity"), &meta, Init::Zeros)?],
                OptimizerKind::AdamW { .. } => vec![
                    self.state(&format!("{name}.adam_m"), &meta, Init::Zeros)?,
                    self.state(&format!("{name}.adam_v"), &meta, Init::Zeros)?,
                ],
            };
            all_states.extend(states.iter().map(|s| (*s, *p)));
            let mut inputs = vec![*p, *g, lr, next_step];
            inputs.extend(&states);
            inputs.extend(grad_scales.get(i));
            let outputs = self.apply(Update(optimizer.kind.clone()), &inputs)?;
            updates.push((*p, outputs[0]));
            updates.extend(states.into_iter().zip(outputs[1..].iter().copied()));
        }
        if let (Some(s), Some(factor)) = (&scaler, factor) {
            let LossScale { growth, backoff, interval, .. } = s.options;
            let inputs = [s.scale, s.good_steps, self.alongside(factor, s.scale)?];
            let next = self.apply(LossScaleUpdate { growth, backoff, interval }, &inputs)?;
            updates.push((s.scale, next[0]));
            updates.push((s.good_steps, next[1]));
        }
        let loss_scale = scaler.map(|s| s.scale);
        // `minimize` refused a loss no parameter reaches, so the first one made a counter.
        let Some(&(_, _, lr)) = counters.first() else {
            return Err(GraphError::NothingToTrain { loss: loss.name() });
        };
        Ok(TrainStep {
            loss,
            updates,
            grads,
            lr,
            raw_grads,
            params,
            states: all_states,
            loss_scale,
            grad_factor: factor,
        })
    }

    /// The sum of every gradient's squared elements, on the first gradient's placement
    /// (`None` without gradients; `op` names the option that needs it in the error for
    /// gradients of mixed dtypes). The gradients of each placement (a pipeline stage) are
    /// summed there in their order, then each placement's total moves to the first and is
    /// added in order of first appearance: one scalar crosses per stage, and each stage's
    /// chain of `sum_squares` and adds is one the compiler fuses (`compile/fuse_norms.rs`).
    fn squared_global_norm<'g>(&'g self, grads: &[Tensor<'g>], op: &str) -> Result<Option<Tensor<'g>>, GraphError> {
        let mut totals: Vec<(Option<std::sync::Arc<crate::sbp::Mesh>>, Tensor<'g>)> = Vec::new();
        for g in grads {
            if let Some((_, t)) = totals.first() {
                if t.dtype() != g.dtype() {
                    return Err(GraphError::Op {
                        op: op.into(),
                        inputs: vec![t.meta().to_string(), g.meta().to_string()],
                        message: "gradients of different dtypes cannot share one global norm".into(),
                    });
                }
            }
            let squares = g.sum_squares()?;
            let placement = self.placement(g.id());
            match totals.iter_mut().find(|(p, _)| *p == placement) {
                Some((_, t)) => *t = t.add(&squares)?,
                None => totals.push((placement, squares)),
            }
        }
        let mut totals = totals.into_iter().map(|(_, t)| t);
        let Some(mut total) = totals.next() else { return Ok(None) };
        for t in totals {
            total = total.add(&self.alongside(t, total)?)?;
        }
        Ok(Some(total))
    }

    /// `t` on `like`'s placement: moved there (a stage edge) when both have placements and
    /// they differ, as the global norm of gradients spread over pipeline stages needs.
    fn alongside<'g>(&'g self, t: Tensor<'g>, like: Tensor<'g>) -> Result<Tensor<'g>, GraphError> {
        match (self.placement(t.id()), self.placement(like.id())) {
            (Some(from), Some(to)) if from != to => t.to_placement(&to),
            _ => Ok(t),
        }
    }

    /// A non-trainable variable (optimizer state, counters).
    pub fn state_variable(&self, name: &str, shape: Shape, dtype: DType, init: Init) -> Result<Tensor<'_>, GraphError> {
        let v = self.variable(name, shape, dtype, init)?;
        self.set_trainable(v, false);
        Ok(v)
    }
}
