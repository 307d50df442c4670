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
use crate::init::Init;
use crate::ops::{GradCtx, InputGrads, OpDef};
use crate::tensor::{DType, HostTensor, HostTensorMut, Real, Shape, TensorMeta};
use crate::GraphError;

/// A learning-rate schedule, evaluated from the step counter (starting at 1).
#[derive(Debug, Clone, PartialEq)]
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
                    let progress = (step - warmup as f64) / (total - warmup).max(1) as f64;
                    min + 0.5 * (peak - min) * (1.0 + (std::f64::consts::PI * progress).cos())
                }
            }
        }
    }
}

/// Which update rule.
#[derive(Debug, Clone, PartialEq)]
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

/// Computes the learning rate of a step from the step counter.
#[derive(Debug, Clone, PartialEq)]
struct LearningRate(Schedule);

/// `min(1, max_norm / (norm + 1e-6))`: the factor that clips a global norm.
#[derive(Debug, Clone, PartialEq)]
struct ClipFactor(f64);

/// One optimizer update: inputs `(param, grad, lr, step, state...)`, outputs
/// `(param', state'...)`.
#[derive(Debug, Clone, PartialEq)]
struct Update(OptimizerKind);

fn scalar_input(inputs: &[HostTensor<'_>], i: usize) -> Result<f64, String> {
    match inputs[i].data {
        crate::HostSlice::F64(v) => v.first().copied(),
        crate::HostSlice::F32(v) => v.first().map(|&x| f64::from(x)),
        crate::HostSlice::I64(v) => v.first().map(|&x| x as f64),
    }
    .ok_or_else(|| format!("input {i} is empty"))
}

fn write_scalar(out: &mut HostTensorMut<'_>, value: f64) -> Result<(), String> {
    match &mut out.data {
        crate::HostSliceMut::F64(v) => v.iter_mut().for_each(|x| *x = value),
        crate::HostSliceMut::F32(v) => v.iter_mut().for_each(|x| *x = value as f32),
        crate::HostSliceMut::I64(_) => return Err("the output must be a float".into()),
    }
    Ok(())
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

    fn compute(&self, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
        write_scalar(&mut outputs[0], self.0.at(scalar_input(inputs, 0)?))
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

    fn compute(&self, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
        let norm = scalar_input(inputs, 0)?;
        write_scalar(&mut outputs[0], (self.0 / (norm + 1e-6)).min(1.0))
    }
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

impl OpDef for Update {
    fn name(&self) -> &'static str {
        match self.0 {
            OptimizerKind::Sgd { .. } => "sgd_update",
            OptimizerKind::AdamW { .. } => "adamw_update",
        }
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let states = match self.0 {
            OptimizerKind::Sgd { .. } => 1,
            OptimizerKind::AdamW { .. } => 2,
        };
        if inputs.len() != 4 + states {
            return Err(format!(
                "takes param, grad, lr, step and {states} state tensor(s), got {} inputs",
                inputs.len()
            ));
        }
        let param = &inputs[0];
        for (i, t) in inputs.iter().enumerate().filter(|&(i, _)| i != 2 && i != 3) {
            if t != param {
                return Err(format!("input {i} is {t}, but the parameter is {param}"));
            }
        }
        Ok(vec![param.clone(); 1 + states])
    }

    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        Ok(vec![None; ctx.inputs.len()])
    }

    fn compute(&self, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
        match inputs[0].dtype() {
            DType::F32 => update_typed::<f32>(&self.0, inputs, outputs),
            DType::F64 => update_typed::<f64>(&self.0, inputs, outputs),
            DType::I64 => Err("cannot optimize an integer variable".into()),
        }
    }

    /// Elementwise over the parameter, its gradient and its state: any split of those
    /// (alike) splits every output, with the learning rate and step whole.
    fn sbp_signatures(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Vec<crate::sbp::SbpSignature> {
        use crate::sbp::{Sbp, SbpSignature};
        let rank = inputs.first().map_or(0, |param| param.shape.rank());
        (0..rank)
            .map(|d| {
                let operands: Vec<Sbp> =
                    (0..inputs.len()).map(|i| if i == 2 || i == 3 { Sbp::Broadcast } else { Sbp::Split(d) }).collect();
                SbpSignature::new(operands, vec![Sbp::Split(d); outputs.len()])
            })
            .collect()
    }
}

/// Increments the step counter: `step + 1`.
#[derive(Debug, Clone, PartialEq)]
struct NextStep;

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

    fn compute(&self, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
        write_scalar(&mut outputs[0], scalar_input(inputs, 0)? + 1.0)
    }
}

impl Graph {
    fn state(&self, name: &str, meta: &TensorMeta, init: Init) -> Result<Tensor<'_>, GraphError> {
        self.state_variable(name, meta.shape.clone(), meta.dtype, init)
    }

    /// Appends the backward pass and the updates of every trainable variable.
    pub fn minimize<'g>(&'g self, loss: Tensor<'g>, optimizer: &Optimizer) -> Result<TrainStep<'g>, GraphError> {
        let params = self.trainable_variables();
        let mut grads = self.grad(loss, &params)?;
        let raw_grads = grads.clone();
        if let Some(max_norm) = optimizer.clip_norm {
            if max_norm.is_nan() || max_norm <= 0.0 {
                return Err(GraphError::Op {
                    op: "clip_by_global_norm".into(),
                    inputs: vec![],
                    message: format!("max norm must be > 0, got {max_norm}"),
                });
            }
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
                let squares = g.mul(g)?.sum_to(&Shape::scalar())?;
                total = Some(match total {
                    Some(t) => t.add(&self.alongside(squares, t)?)?,
                    None => squares,
                });
            }
            if let Some(total) = total {
                let factor = self.apply1(ClipFactor(max_norm), &[total.sqrt()?])?;
                grads = grads.iter().map(|g| g.mul(&self.alongside(factor, *g)?)).collect::<Result<_, _>>()?;
            }
        }
        let step = self.state("optimizer.step", &TensorMeta::new(Shape::scalar(), DType::F64), Init::Zeros)?;
        let next_step = self.apply1(NextStep, &[step])?;
        let lr = self.apply1(LearningRate(optimizer.schedule.clone()), &[next_step])?;
        let mut updates = vec![(step, next_step)];
        let mut all_states = Vec::new();
        for (p, g) in params.iter().zip(&grads) {
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
