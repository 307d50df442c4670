//! Anomaly checking (`Plan::check_finite`): op kernels wrapped to scan their floating-point
//! outputs after every firing and stop the job at the first NaN or infinity, naming the op,
//! the step, the micro-batch and the device (PyTorch's anomaly mode, at the cost of one
//! read of each output).

use crate::kernel::{Kernel, KernelError, KernelIo};
use regflow_plan::{DType, OpConf, TensorMeta};

/// Where a wrapped kernel runs, for the message.
#[derive(Debug, Clone)]
pub(crate) struct FiniteSite {
    /// Actor name.
    pub(crate) actor: String,
    /// Device label (`cpu:1`).
    pub(crate) device: String,
    /// Firings of the actor per step (its micro-batches), to turn a piece into a step.
    pub(crate) per_step: u64,
}

/// An op kernel followed by a scan of its float outputs.
pub(crate) struct FiniteCheck {
    inner: Box<dyn Kernel>,
    site: FiniteSite,
    op: OpConf,
}

impl std::fmt::Debug for FiniteCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FiniteCheck").field("site", &self.site).field("op", &self.op.op_type).finish()
    }
}

impl FiniteCheck {
    /// Wraps `inner`, the kernel of `op`, when the op writes a float; otherwise returns it.
    pub(crate) fn wrap(inner: Box<dyn Kernel>, op: &OpConf, site: FiniteSite) -> Box<dyn Kernel> {
        if op.outputs.iter().any(|m| m.dtype.is_float()) {
            Box::new(Self { inner, site, op: op.clone() })
        } else {
            inner
        }
    }

    fn describe(&self, piece: u64, what: String, inputs: String) -> KernelError {
        let per_step = self.site.per_step.max(1);
        let (step, micro) = (piece / per_step, piece % per_step);
        let when = if per_step > 1 {
            format!("step {step}, micro-batch {micro} of {per_step} (piece {piece})")
        } else {
            format!("step {step}")
        };
        KernelError(format!(
            "check_finite: op '{}' (actor '{}') on device {} produced {what} in {when}; {inputs}",
            self.op.op_type, self.site.actor, self.site.device
        ))
    }
}

/// The first non-finite element of `bytes` read as `meta`: its index and value.
fn first_non_finite(bytes: &[u8], meta: &TensorMeta) -> Option<(usize, f64)> {
    let count = meta.shape.dims().iter().try_fold(1usize, |n, &d| n.checked_mul(d)).unwrap_or(usize::MAX);
    match meta.dtype {
        DType::F32 => bytes.chunks_exact(4).take(count).enumerate().find_map(|(i, c)| {
            let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            (!v.is_finite()).then_some((i, f64::from(v)))
        }),
        DType::F64 => bytes.chunks_exact(8).take(count).enumerate().find_map(|(i, c)| {
            let v = f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
            (!v.is_finite()).then_some((i, v))
        }),
        DType::Bf16 => bytes.chunks_exact(2).take(count).enumerate().find_map(|(i, c)| {
            let v = regflow_plan::bf16::from_le_bytes([c[0], c[1]]);
            (!v.is_finite()).then_some((i, v.to_f64()))
        }),
        DType::F16 => bytes.chunks_exact(2).take(count).enumerate().find_map(|(i, c)| {
            let v = regflow_plan::f16::from_le_bytes([c[0], c[1]]);
            (!v.is_finite()).then_some((i, v.to_f64()))
        }),
        DType::I64 => None,
    }
}

fn name(value: f64) -> &'static str {
    if value.is_nan() {
        "NaN"
    } else if value > 0.0 {
        "+inf"
    } else {
        "-inf"
    }
}

impl Kernel for FiniteCheck {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        self.inner.run(io)?;
        if self.inner.execution() == regflow_kernels::Execution::Queued {
            // The outputs are read here, on the host: let the device finish them.
            regflow_cuda::synchronize(regflow_cuda::StreamHandle(io.context().native))?;
        }
        for (o, meta) in self.op.outputs.iter().enumerate() {
            let Some((element, value)) = first_non_finite(io.output(o), meta) else { continue };
            let what = format!("{} at element {element} of its output {o} ({meta})", name(value));
            // Say whether it came in: an op can only be blamed for what it made.
            let came_in = self
                .op
                .inputs
                .iter()
                .zip(&self.op.input_map)
                .enumerate()
                .find_map(|(i, (m, &at))| first_non_finite(io.input(at), m).map(|(e, v)| (i, e, v)));
            let inputs = match came_in {
                Some((i, e, v)) => format!("its input {i} already held {} at element {e}", name(v)),
                None => "its inputs were all finite".to_string(),
            };
            return Err(self.describe(io.piece(), what, inputs));
        }
        Ok(())
    }

    fn scratch_bytes(&self) -> u64 {
        self.inner.scratch_bytes()
    }
}
