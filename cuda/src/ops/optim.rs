//! Optimizer updates on CUDA (`optim.cu`): `update` as one fused elementwise launch per
//! optimizer (SGD with momentum, AdamW), `update_group` as one multi-tensor launch per 32
//! members ([`group`]), the global gradient norm's `sum_squares_group` as a launch pair per
//! 64 tensors ([`norm`]), and the mean over a gradient-accumulation group (`accumulate_mean`).
//!
//! The learning rate and step counter are registers other actors write (on the device or
//! the host, in managed memory), not attributes: the kernels read them on the device, so a
//! firing never waits for the stream to drain. So is gradient clipping's factor, the
//! update's optional last input: the kernels multiply each gradient element by it as they
//! read it (a null address stands for 1).

mod group;
mod norm;

use super::elementwise::{float_dtype, input_slots};
use super::fail;
use super::{factory, function, op_conf, stream, suffix, Entry};
use crate::driver::{launch, Function, Grid};
use group::make_update_group;
use norm::make_sum_squares_group;
use regflow_kernels::{Kernel, KernelError, KernelIo, KernelSpec};
use regflow_plan::ops::{OptimizerKind, Update, ACCUMULATE_MEAN};
use regflow_plan::{DType, OpConf};

const FLOAT: &[DType] = &[DType::F32, DType::F64];

pub(super) const ENTRIES: &[Entry] = &[
    ("update", FLOAT, || factory(make_update)),
    ("update_group", FLOAT, || factory(make_update_group)),
    ("sum_squares_group", FLOAT, || factory(make_sum_squares_group)),
    (ACCUMULATE_MEAN, FLOAT, || factory(make_accumulate_mean)),
];

/// The code `optim.cu` reads a scalar register of `dtype` by (`SCALAR_F32`, `SCALAR_F64`,
/// `SCALAR_I64`, `SCALAR_BF16`, `SCALAR_F16`).
pub(crate) fn scalar_code(dtype: DType) -> u64 {
    match dtype {
        DType::F32 => 0,
        DType::F64 => 1,
        DType::I64 => 2,
        DType::Bf16 => 3,
        DType::F16 => 4,
    }
}

/// The hyperparameters of one update, as the entry takes them after the addresses (the
/// group entries: after `(table, lr, lr_code, [step, step_code,] scale, scale_code)`).
#[derive(Debug, Clone, Copy)]
enum Rule {
    /// `(momentum: T, weight_decay: T)` after `(p, g, lr, lr_code, scale, scale_code, v,
    /// p_out, v_out)`, then `n`.
    Sgd { momentum: f64, weight_decay: f64 },
    /// `(b1, b2, 1-b1, 1-b2, eps: T, beta1, beta2, weight_decay: f64)` after `(p, g, lr,
    /// lr_code, step, step_code, scale, scale_code, m, v, p_out, m_out, v_out)`, then `n`.
    AdamW { beta1: f64, beta2: f64, eps: f64, weight_decay: f64 },
}

impl Rule {
    /// The rule of `kind`, its state count and its entries' stem (`regflow_update_{stem}_f32`,
    /// `regflow_update_group_{stem}_f32`).
    fn of(kind: &OptimizerKind) -> (Rule, usize, &'static str) {
        let rule = match *kind {
            OptimizerKind::Sgd { momentum, weight_decay } => Rule::Sgd { momentum, weight_decay },
            OptimizerKind::AdamW { beta1, beta2, eps, weight_decay } => Rule::AdamW { beta1, beta2, eps, weight_decay },
        };
        let stem = match rule {
            Rule::Sgd { .. } => "sgd",
            Rule::AdamW { .. } => "adamw",
        };
        (rule, rule.states(), stem)
    }

    /// The state tensors the rule keeps per parameter (momentum; or the two moments).
    fn states(&self) -> usize {
        match self {
            Rule::Sgd { .. } => 1,
            Rule::AdamW { .. } => 2,
        }
    }
}

/// An update kernel that queues its launches for one element type.
trait QueueTyped {
    /// The kernel's element type (f32, else f64).
    fn dtype(&self) -> DType;

    /// Queues the launches with the element type `T`, hyperparameters rounded by `round`.
    ///
    /// # Safety
    ///
    /// `T` is the type of [`QueueTyped::dtype`]; the rest as each implementation says.
    unsafe fn queue<T: Copy>(&self, io: &KernelIo<'_>, round: fn(f64) -> T) -> Result<(), crate::CudaError>;
}

/// Runs `kernel` in its element type: f32, or f64 (the only two it is made for).
fn run_typed(kernel: &impl QueueTyped, io: &KernelIo<'_>) -> Result<(), KernelError> {
    // SAFETY: the type matches the dtype the kernel was made for.
    unsafe {
        match kernel.dtype() {
            DType::F32 => kernel.queue::<f32>(io, |v| v as f32),
            _ => kernel.queue::<f64>(io, |v| v),
        }
    }?;
    Ok(())
}

fn make_update(spec: &KernelSpec<'_>) -> Result<UpdateKernel, KernelError> {
    let conf = op_conf(spec)?;
    let op: Update = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    update_kernel(spec, conf, op)
}

/// The kernel of one update described by `conf`.
fn update_kernel(spec: &KernelSpec<'_>, conf: &OpConf, op: Update) -> Result<UpdateKernel, KernelError> {
    let dtype = float_dtype(spec, conf)?;
    let (rule, states, stem) = Rule::of(&op.0);
    check_update(conf, states).map_err(|e| fail(spec, conf, e))?;
    let scale = conf.inputs.get(4 + states).map(|meta| scalar_code(meta.dtype));
    Ok(UpdateKernel {
        function: function(spec, &format!("regflow_update_{stem}_{}", suffix(dtype)))?,
        inputs: input_slots(conf),
        lr_code: scalar_code(conf.inputs[2].dtype),
        step_code: scalar_code(conf.inputs[3].dtype),
        scale_code: scale,
        rule,
        dtype,
        n: conf.inputs[0].shape.numel() as u64,
    })
}

/// Inputs `(param, grad, lr, step, states..., [grad scale])` and outputs `(param',
/// states'...)`: every tensor but lr, step and the scale has the parameter's meta, and
/// those hold a value (the scale a float one).
fn check_update(conf: &OpConf, states: usize) -> Result<(), String> {
    let (inputs, outputs) = (&conf.inputs, &conf.outputs);
    let counts_fit = inputs.len() == 4 + states || inputs.len() == 5 + states;
    if !counts_fit || conf.input_map.len() != inputs.len() || outputs.len() != 1 + states {
        return Err(format!(
            "takes param, grad, lr, step, {states} state tensor(s) and an optional gradient scale, and gives {} \
             outputs, but has {} inputs and {} outputs",
            1 + states,
            inputs.len(),
            outputs.len()
        ));
    }
    let param = &inputs[0];
    let dense = std::iter::once(&inputs[1]).chain(&inputs[4..4 + states]).chain(outputs);
    if let Some(other) = dense.into_iter().find(|m| *m != param) {
        return Err(format!("the gradient, states and outputs must match the parameter {param}, got {other}"));
    }
    let scale = inputs.get(4 + states).map(|meta| ("gradient scale", meta));
    for (name, meta) in [("learning rate", &inputs[2]), ("step", &inputs[3])].into_iter().chain(scale) {
        if meta.shape.numel() == 0 {
            return Err(format!("the {name} input {meta} is empty"));
        }
    }
    if let Some((_, meta)) = scale.filter(|(_, meta)| !meta.dtype.is_float()) {
        return Err(format!("the gradient scale must be a float, got {meta}"));
    }
    Ok(())
}

#[derive(Debug)]
struct UpdateKernel {
    function: Function,
    /// Registers of param, grad, lr, step, up to two states and the gradient scale (only
    /// the first 4 + states, and the scale if there is one, are used).
    inputs: [usize; 7],
    lr_code: u64,
    step_code: u64,
    /// The gradient scale's dtype code, if the update has one (input 4 + states).
    scale_code: Option<u64>,
    rule: Rule,
    dtype: DType,
    n: u64,
}

impl QueueTyped for UpdateKernel {
    fn dtype(&self) -> DType {
        self.dtype
    }

    /// Queues the update with the element type `T`: hyperparameters the entry takes as `T`
    /// are rounded by `round`, as the CPU rounds them; the rest stay f64.
    ///
    /// # Safety
    ///
    /// Every dense operand holds `n` elements of `T` and lr, step and the scale at least one
    /// of theirs (checked when made); the argument lists are the entries' (see `Rule`).
    unsafe fn queue<T: Copy>(&self, io: &KernelIo<'_>, round: fn(f64) -> T) -> Result<(), crate::CudaError> {
        let at = |k: usize| io.input_addr(self.inputs[k]);
        let (p, g, lr, step, lr_code, step_code) = (at(0), at(1), at(2), at(3), self.lr_code, self.step_code);
        let (s, f, n, grid) = (stream(io), self.function, self.n, Grid::linear(self.n));
        let out = |k: usize| io.output_addr(k);
        let p_out = out(0);
        // No scale: a null address, which the kernels read as 1.
        let (scale, scale_code) = self.scale_code.map_or((0, 0), |code| (at(4 + self.rule.states()), code));
        // SAFETY: forwarded to the caller.
        unsafe {
            match self.rule {
                Rule::Sgd { momentum, weight_decay } => {
                    let (v, v_out, mu, wd) = (at(4), out(1), round(momentum), round(weight_decay));
                    launch(s, f, grid, &mut args![p, g, lr, lr_code, scale, scale_code, v, p_out, v_out, mu, wd, n])
                }
                Rule::AdamW { beta1, beta2, eps, weight_decay } => {
                    let (m, v, m_out, v_out) = (at(4), at(5), out(1), out(2));
                    let (b1, b2, one_b1, one_b2) = (round(beta1), round(beta2), round(1.0 - beta1), round(1.0 - beta2));
                    let eps = round(eps);
                    launch(
                        s,
                        f,
                        grid,
                        &mut args![
                            p,
                            g,
                            lr,
                            lr_code,
                            step,
                            step_code,
                            scale,
                            scale_code,
                            m,
                            v,
                            p_out,
                            m_out,
                            v_out,
                            b1,
                            b2,
                            one_b1,
                            one_b2,
                            eps,
                            beta1,
                            beta2,
                            weight_decay,
                            n
                        ],
                    )
                }
            }
        }
    }
}

impl Kernel for UpdateKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        run_typed(self, io)
    }
}

// ---- accumulate_mean ------------------------------------------------------------------

fn make_accumulate_mean(spec: &KernelSpec<'_>) -> Result<AccumulateMeanKernel, KernelError> {
    let conf = op_conf(spec)?;
    let dtype = float_dtype(spec, conf)?;
    Ok(AccumulateMeanKernel {
        function: function(spec, &format!("regflow_accumulate_mean_{}", suffix(dtype)))?,
        input: input_slots::<1>(conf)[0],
        dtype,
    })
}

/// The CPU's `AccumulateMean`: the first piece of a group copied, the others added, the sum
/// scaled by 1/count on the last.
#[derive(Debug)]
struct AccumulateMeanKernel {
    function: Function,
    input: usize,
    dtype: DType,
}

impl Kernel for AccumulateMeanKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let group = io.group();
        // Over the shorter register, as the CPU kernel zips them.
        let n = (io.input_len(self.input).min(io.output_len(0)) / self.dtype.size()) as u64;
        let (x, out) = (io.input_addr(self.input), io.output_addr(0));
        let (first, last) = (u64::from(group.index == 0), u64::from(group.index + 1 == group.count));
        let scale = 1.0 / f64::from(group.count);
        let (s, f, grid) = (stream(io), self.function, Grid::linear(n));
        // SAFETY: both registers hold at least n elements of the dtype; the entry takes
        // (x, out, n, first, last, scale: T).
        unsafe {
            match self.dtype {
                DType::F32 => launch(s, f, grid, &mut args![x, out, n, first, last, scale as f32]),
                _ => launch(s, f, grid, &mut args![x, out, n, first, last, scale]),
            }
        }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use regflow_plan::TensorMeta;

    #[test]
    fn scalar_codes_match_the_source() {
        let code = crate::sources::SOURCES.iter().find(|s| s.name == "optim").expect("optim.cu").code;
        for (dtype, name) in [
            (DType::F32, "SCALAR_F32"),
            (DType::F64, "SCALAR_F64"),
            (DType::I64, "SCALAR_I64"),
            (DType::Bf16, "SCALAR_BF16"),
            (DType::F16, "SCALAR_F16"),
        ] {
            assert!(code.contains(&format!("#define {name} {}ull", scalar_code(dtype))), "{name}");
        }
    }

    #[test]
    fn update_metas_are_checked() {
        let p = TensorMeta::new([7], DType::F32);
        let scalar = TensorMeta::new([1], DType::F64);
        let sgd = Update(OptimizerKind::Sgd { momentum: 0.9, weight_decay: 0.0 });
        let ok = OpConf::new(
            &sgd,
            vec![p.clone(), p.clone(), scalar.clone(), scalar.clone(), p.clone()],
            (0..5).collect(),
            vec![p.clone(); 2],
        );
        assert_eq!(check_update(&ok, 1), Ok(()));
        let mut scaled = ok.clone();
        scaled.inputs.push(TensorMeta::new([1], DType::F32));
        scaled.input_map.push(5);
        assert_eq!(check_update(&scaled, 1), Ok(()));
        scaled.inputs[5] = TensorMeta::new([1], DType::I64);
        assert!(check_update(&scaled, 1).unwrap_err().contains("gradient scale must be a float"));
        let mut bad = ok.clone();
        bad.inputs[1] = TensorMeta::new([8], DType::F32);
        assert!(check_update(&bad, 1).unwrap_err().contains("must match the parameter"));
        assert!(check_update(&ok, 2).unwrap_err().contains("2 state tensor(s)"));
    }
}
