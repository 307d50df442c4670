//! The training step's scalar ops on CUDA (`learning_rate`, `clip_factor`, `next_step`,
//! in `optim.cu`): one thread each, reading their input register on the device. They are
//! tiny, but run on the host they would make their stream wait for its queued kernels
//! every step.

use super::elementwise::{float_dtype, input_slots, refuse};
use super::optim::scalar_code;
use super::{factory, function, op_conf, stream, Entry};
use crate::driver::{launch, Function, Grid};
use regflow_kernels::{Kernel, KernelError, KernelIo, KernelSpec};
use regflow_plan::ops::{ClipFactor, LearningRate, NextStep, Schedule};
use regflow_plan::DType;

const FLOAT: &[DType] = &[DType::F32, DType::F64];

pub(super) const ENTRIES: &[Entry] = &[
    ("learning_rate", FLOAT, || factory(make_learning_rate)),
    ("clip_factor", FLOAT, || factory(make_clip_factor)),
    ("next_step", FLOAT, || factory(make_next_step)),
];

/// What the entry takes after `(input, input_code, out, out_code, n)`.
#[derive(Debug, Clone, Copy)]
enum Extra {
    None,
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
    match (&conf.inputs[..], &conf.outputs[..]) {
        ([input], [_]) if input.shape.numel() > 0 => {}
        _ => return Err(refuse(spec, conf, "takes one non-empty scalar input and gives one output")),
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
    let LearningRate(schedule) = conf.parse_attrs().map_err(|e| refuse(spec, conf, e))?;
    let extra = match schedule {
        Schedule::Constant(rate) => Extra::Rate(0, rate, 0, 0, rate),
        Schedule::WarmupCosine { peak, warmup, total, min } => Extra::Rate(1, peak, warmup, total, min),
    };
    make(spec, "regflow_learning_rate", extra)
}

fn make_clip_factor(spec: &KernelSpec<'_>) -> Result<ScalarKernel, KernelError> {
    let conf = op_conf(spec)?;
    let ClipFactor(max_norm) = conf.parse_attrs().map_err(|e| refuse(spec, conf, e))?;
    make(spec, "regflow_clip_factor", Extra::Clip(max_norm))
}

fn make_next_step(spec: &KernelSpec<'_>) -> Result<ScalarKernel, KernelError> {
    let conf = op_conf(spec)?;
    let _: NextStep = conf.parse_attrs().map_err(|e| refuse(spec, conf, e))?;
    make(spec, "regflow_next_step", Extra::None)
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
                Extra::None => launch(s, f, grid, &mut args![x, x_code, out, out_code, n]),
                Extra::Clip(max_norm) => launch(s, f, grid, &mut args![x, x_code, out, out_code, n, max_norm]),
                Extra::Rate(schedule, peak, warmup, total, min) => {
                    launch(s, f, grid, &mut args![x, x_code, out, out_code, n, schedule, peak, warmup, total, min])
                }
            }
        }?;
        Ok(())
    }
}
