//! Host computation of an op on typed tensors, and the kernel that runs it on registers.

use crate::io::{view, view_mut};
use crate::{Kernel, KernelError, KernelIo};
use regflow_plan::{HostTensor, HostTensorMut, OpConf, TensorMeta};
use smallvec::SmallVec;

/// What a host computation may use besides its tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostContext {
    /// Threads one computation may use (matrix products split their output tiles over
    /// them; every output element is still computed by one thread in a fixed order, so
    /// results are bitwise the same for any count).
    pub threads: usize,
}

impl Default for HostContext {
    fn default() -> Self {
        Self { threads: 1 }
    }
}

/// An op's computation on the host: plain arithmetic on slices, no device. The CPU
/// kernels and the graph's reference evaluator both run it.
pub trait HostCompute: Send + Sync {
    /// Computes the outputs from the inputs. Inputs have the shapes the op's shape rule
    /// accepted and outputs the shapes it gave.
    fn compute(
        &self,
        context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String>;

    /// Checks, at job build, that local metas fit the op's attributes beyond what the
    /// register sizes already say (a plan file may contradict itself). The default accepts.
    fn check(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Result<(), String> {
        let _ = (inputs, outputs);
        Ok(())
    }
}

/// Runs one op on its actor's registers viewed as tensors of the plan's local metas.
/// Views are built on the stack (ops with up to 8 inputs or outputs), so a firing
/// allocates nothing.
#[derive(Debug)]
pub struct HostOpKernel<T> {
    op: T,
    op_type: String,
    inputs: Vec<TensorMeta>,
    input_map: Vec<usize>,
    outputs: Vec<TensorMeta>,
}

impl<T: HostCompute> HostOpKernel<T> {
    /// The kernel of `op` configured by `conf` (its metas and input map).
    pub fn new(op: T, conf: &OpConf) -> Self {
        Self {
            op,
            op_type: conf.op_type.clone(),
            inputs: conf.inputs.clone(),
            input_map: conf.input_map.clone(),
            outputs: conf.outputs.clone(),
        }
    }
}

impl<T: HostCompute> Kernel for HostOpKernel<T> {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let fail = |m: String| KernelError(format!("{}: {m}", self.op_type));
        let context = HostContext { threads: io.context().threads };
        // A tick input (constants) comes after the real ones and is not passed on.
        let mut inputs: SmallVec<[HostTensor<'_>; 8]> = SmallVec::new();
        for (meta, &i) in self.inputs.iter().zip(&self.input_map) {
            inputs.push(view(meta, io.input(i)).map_err(fail)?);
        }
        // Outputs are distinct registers: split the borrows one by one.
        let mut outputs: SmallVec<[HostTensorMut<'_>; 8]> = SmallVec::new();
        for (o, meta) in self.outputs.iter().enumerate() {
            outputs.push(view_mut(meta, io.output_detached(o)).map_err(fail)?);
        }
        self.op.compute(&context, &inputs, &mut outputs).map_err(fail)
    }
}
