//! The training step's scalar ops on CUDA (`learning_rate`, `clip_factor`, `next_step`,
//! and loss scaling's `unscale_factor` and `loss_scale_update`, in `optim.cu`): one thread
//! each, reading their input registers on the device. They are tiny, but run on the host
//! they would make their stream wait for its queued kernels every step.

use super::elementwise::{float_dtype, input_slots};
use super::fail;
use super::optim::scalar_code;
use super::{factory, function, op_conf, stream, Entry};
use crate::driver::{launch, Function, Grid};
use regflow_kernels::{Kernel, KernelError, KernelIo, KernelSpec};
use regflow_plan::ops::{ClipFactor, LearningRate, LossScaleUpdate, NextStep, Schedule, UnscaleFactor};
use regflow_plan::DType;

const FLOAT: &[DType] = &[DType::F32, DType::F64];

pub(super) const ENTRIES: &[Entry] = &[
    ("learning_rate", FLOAT, || factory(make_learning_rate)),
    ("clip_factor", FLOAT, || factory(make_clip_factor)),
    ("next_step", FLOAT, || factory(make_next_step)),
    ("unscale_factor", FLOAT, || factory(make_unscale_factor)),
    ("loss_scale_update", FLOAT, || factory(make_loss_scale_update)),
];

/// What the entry takes after `(input, input_code, out, out_code, n)`.
#[derive(Debug, Clone, Copy)]
enum Extra {
    /// `(factor, factor_code)`: the step's gradient factor (input 1), or a null pointer
    /// and 0 without one (`next_step`).
    Factor(Option<(usize, u64)>),
    /// `max_norm: f64`.
    Clip(f64),
    /// `(schedule: u64, peak: f64, warmup: u64, total: u64, min: f64)`.
    Rate(u64, f64, u64, u64, f64),
}

#[derive(Debug)]
struct ScalarKernel {
    function: Function,
    input: usize,
    input_code: u64,
    out_code: u64,
    n: u64,
    extra: Extra,
}

/// The kernel of a one-input scalar op whose entry is `entry`.
fn make(spec: &KernelSpec<'_>, entry: &str, extra: Extra) -> Result<ScalarKernel, KernelError> {
    let conf = op_conf(spec)?;
    let dtype = float_dtype(spec, conf)?;
    let inputs = match extra {
        Extra::Factor(Some(_)) => 2,
        _ => 1,
    };
    if conf.inputs.len() != inputs || conf.outputs.len() != 1 || conf.inputs.iter().any(|i| i.shape.numel() == 0) {
        return Err(fail(spec, conf, format!("takes {inputs} non-empty scalar input(s) and gives one output")));
    }
    let [input] = input_slots::<1>(conf);
    Ok(ScalarKernel {
        function: function(spec, entry)?,
        input,
        input_code: scalar_code(conf.inputs[0].dtype),
        out_code: scalar_code(dtype),
        n: conf.outputs[0].shape.numel() as u64,
        extra,
    })
}

fn make_learning_rate(spec: &KernelSpec<'_>) -> Result<ScalarKernel, KernelError> {
    let conf = op_conf(spec)?;
    let LearningRate(schedule) = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    let extra = match schedule {
        Schedule::Constant(rate) => Extra::Rate(0, rate, 0, 0, rate),
        Schedule::WarmupCosine { peak, warmup, total, min } => Extra::Rate(1, peak, warmup, total, min),
    };
    make(spec, "regflow_learning_rate", extra)
}

fn make_clip_factor(spec: &KernelSpec<'_>) -> Result<ScalarKernel, KernelError> {
    let conf = op_conf(spec)?;
    let ClipFactor(max_norm) = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    make(spec, "regflow_clip_factor", Extra::Clip(max_norm))
}

fn make_next_step(spec: &KernelSpec<'_>) -> Result<ScalarKernel, KernelError> {
    let conf = op_conf(spec)?;
    let _: NextStep = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    // With loss scaling, the step's gradient factor as a second input.
    let factor = match &conf.inputs[..] {
        [_, factor] => Some((input_slots::<2>(conf)[1], scalar_code(factor.dtype))),
        _ => None,
    };
    make(spec, "regflow_next_step", Extra::Factor(factor))
}

/// `unscale_factor`: `(squared_norm, norm_code, scale, scale_code, out, out_code, n, clips,
/// max_norm)`.
#[derive(Debug)]
struct UnscaleFactorKernel {
    function: Function,
    inputs: [usize; 2],
    codes: [u64; 3],
    clip: Option<f64>,
}

fn make_unscale_factor(spec: &KernelSpec<'_>) -> Result<UnscaleFactorKernel, KernelError> {
    let conf = op_conf(spec)?;
    let op: UnscaleFactor = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    let dtype = float_dtype(spec, conf)?;
    match (&conf.inputs[..], &conf.outputs[..]) {
        ([norm, scale], [out]) if norm.shape.numel() == 1 && scale.shape.numel() == 1 && out.shape.numel() == 1 => {}
        _ => return Err(fail(spec, conf, "takes the scalar squared norm and the scalar scale, gives one scalar")),
    }
    Ok(UnscaleFactorKernel {
        function: function(spec, "regflow_unscale_factor")?,
        inputs: input_slots::<2>(conf),
        codes: [scalar_code(conf.inputs[0].dtype), scalar_code(conf.inputs[1].dtype), scalar_code(dtype)],
        clip: op.clip_norm,
    })
}

impl Kernel for UnscaleFactorKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let [norm, scale] = self.inputs.map(|i| io.input_addr(i));
        let [norm_code, scale_code, out_code] = self.codes;
        let (out, n, clips, max_norm) =
            (io.output_addr(0), 1u64, u64::from(self.clip.is_some()), self.clip.unwrap_or(0.0));
        // SAFETY: each input holds one element of its code's dtype and the output one of its
        // own (checked when made); the argument list is the entry's.
        unsafe {
            launch(
                stream(io),
                self.function,
                Grid::linear(1),
                &mut args![norm, norm_code, scale, scale_code, out, out_code, n, clips, max_norm],
            )
        }?;
        Ok(())
    }
}

/// `loss_scale_update`: `(scale, scale_code, good, good_code, factor, factor_code,
/// scale_out, good_out, growth, backoff, interval, max)`.
#[derive(Debug)]
struct LossScaleUpdateKernel {
    function: Function,
    inputs: [usize; 3],
    codes: [u64; 3],
    op: LossScaleUpdate,
    /// The largest finite value of the scale's dtype.
    max: f64,
}

fn make_loss_scale_update(spec: &KernelSpec<'_>) -> Result<LossScaleUpdateKernel, KernelError> {
    let conf = op_conf(spec)?;
    let op: LossScaleUpdate = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    let scalar = |m: &regflow_plan::TensorMeta| m.shape.numel() == 1 && FLOAT.contains(&m.dtype);
    let (scale, good) = match (&conf.inputs[..], &conf.outputs[..]) {
        ([scale, good, factor], [scale_out, good_out])
            if [scale, good, factor].into_iter().all(scalar) && scale_out == scale && good_out == good =>
        {
            (scale.dtype, good.dtype)
        }
        _ => {
            let message =
                "takes the scalar scale, count and gradient factor (f32 or f64) and gives the scale and count";
            return Err(fail(spec, conf, message));
        }
    };
    Ok(LossScaleUpdateKernel {
        function: function(spec, "regflow_loss_scale_update")?,
        inputs: input_slots::<3>(conf),
        codes: [scalar_code(scale), scalar_code(good), scalar_code(conf.inputs[2].dtype)],
        max: scale.max_finite(),
        op,
    })
}

impl Kernel for LossScaleUpdateKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let [scale, good, factor] = self.inputs.map(|i| io.input_addr(i));
        let [scale_code, good_code, factor_code] = self.codes;
        let (scale_out, good_out) = (io.output_addr(0), io.output_addr(1));
        let LossScaleUpdate { growth, backoff, interval } = self.op;
        let max = self.max;
        // SAFETY: every input and output holds one element of its code's dtype (checked
        // when made); the argument list is the entry's.
        unsafe {
            launch(
                stream(io),
                self.function,
                Grid::linear(1),
                &mut args![
                    scale,
                    scale_code,
                    good,
                    good_code,
                    factor,
                    factor_code,
                    scale_out,
                    good_out,
                    growth,
                    backoff,
                    interval,
                    max
                ],
            )
        }?;
        Ok(())
    }
}

impl Kernel for ScalarKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let (x, x_code, out, out_code, n) =
            (io.input_addr(self.input), self.input_code, io.output_addr(0), self.out_code, self.n);
        let (s, f, grid) = (stream(io), self.function, Grid::linear(1));
        // SAFETY: the input holds at least one element of its code's dtype and the output
        // `n` of its own (checked when made); the argument lists are the entries'.
        unsafe {
            match self.extra {
                Extra::Factor(factor) => {
                    let (at, code) = factor.map_or((0u64, 0u64), |(i, code)| (io.input_addr(i), code));
                    launch(s, f, grid, &mut args![x, x_code, out, out_code, n, at, code])
                }
                Extra::Clip(max_norm) => launch(s, f, grid, &mut args![x, x_code, out, out_code, n, max_norm]),
                Extra::Rate(schedule, peak, warmup, total, min) => {
                    launch(s, f, grid, &mut args![x, x_code, out, out_code, n, schedule, peak, warmup, total, min])
                }
            }
        }?;
        Ok(())
    }
}
