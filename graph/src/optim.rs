//! Training in the graph: `graph.minimize(loss, &optimizer)` appends the backward pass,
//! optional clipping by global norm, a learning-rate schedule and one update op per
//! variable, and returns the [`TrainStep`] that says which variable takes which new value.
//!
//! Updates follow PyTorch's definitions, so hand-computed values and other frameworks
//! agree: SGD with momentum (`v = μ·v + g + λ·p; p -= lr·v`), AdamW with decoupled weight
//! decay and bias correction. The step counter and optimizer state are non-trainable
//! variables; a runtime keeps them in registers with one slot, so step k+1 reads what
//! step k wrote.

use crate::dsl::{Graph, Tensor};
use crate::ops::{GradCtx, InputGrads, OpDef};
use crate::plan::{DType, Init, Shape, TensorMeta};
use crate::GraphError;
use regflow_plan::ops::{ClipFactor, LearningRate, NextStep, Update};
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
}

impl Optimizer {
    /// SGD with momentum and weight decay, constant rate.
    pub fn sgd(lr: f64, momentum: f64, weight_decay: f64) -> Self {
        Self { kind: OptimizerKind::Sgd { momentum, weight_decay }, schedule: Schedule::Constant(lr), clip_norm: None }
    }

    /// AdamW with PyTorch's defaults (β = 0.9, 0.999; ε = 1e-8), constant rate.
    pub fn adamw(lr: f64, weight_decay: f64) -> Self {
        Self {
            kind: OptimizerKind::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay },
            schedule: Schedule::Constant(lr),
            clip_norm: None,
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
    /// Gradients of the parameters (after clipping), in parameter order.
    pub grads: Vec<Tensor<'g>>,
    /// The learning rate used by this step.
    pub lr: Tensor<'g>,
    /// The gradients before clipping: where a micro-batch's part of the step ends.
    pub raw_grads: Vec<Tensor<'g>>,
    /// The trainable parameters, in the order of `grads` and `raw_grads`.
    pub params: Vec<Tensor<'g>>,
    /// `(optimizer state, its parameter)`: momentum and moment estimates, shaped like it.
    pub states: Vec<(Tensor<'g>, Tensor<'g>)>,
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
            _ => Err("takes the scalar step counter".into()),
        }
    }

    fn grad<'g>(&self, _ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        Ok(vec![None])
    }
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
        let mut grads = self.grad(loss, &params)?;
        let raw_grads = grads.clone();
        // The clip factor on each parameter's placement: the updates multiply it in as
        // they read the raw gradients (see `Update`), so the clipped gradients below are
        // made only if something fetches them.
        let mut grad_scales = Vec::new();
        if let Some(max_norm) = optimizer.clip_norm {
            let mut total: Option<Tensor<'g>> = None;
            for g in &grads {
                if let Some(t) = total {
                    if t.dtype() != g.dtype() {
                        return Err(GraphError::Op {
                            op: "clip_by_global_norm".into(),
                            inputs: vec![t.meta().to_string(), g.meta().to_string()],
                            message: "gradients of different dtypes cannot share one global norm".into(),
                        });
                    }
                }
                let squares = g.sum_squares()?;
                total = Some(match total {
                    Some(t) => t.add(&self.alongside(squares, t)?)?,
                    None => squares,
                });
            }
            if let Some(total) = total {
                let factor = self.apply1(ClipFactor(max_norm), &[total.sqrt()?])?;
                grad_scales = grads.iter().map(|g| self.alongside(factor, *g)).collect::<Result<_, _>>()?;
                grads = grads.iter().zip(&grad_scales).map(|(g, s)| g.mul(s)).collect::<Result<_, _>>()?;
            }
        }
        let step = self.state("optimizer.step", &TensorMeta::new(Shape::scalar(), DType::F64), Init::Zeros)?;
        let next_step = self.apply1(NextStep, &[step])?;
        let lr = self.apply1(LearningRate(optimizer.schedule.clone()), &[next_step])?;
        let mut updates = vec![(step, next_step)];
        let mut all_states = Vec::new();
        for (i, (p, g)) in params.iter().zip(&raw_grads).enumerate() {
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
        Ok(TrainStep { loss, updates, grads, lr, raw_grads, params, states: all_states })
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
