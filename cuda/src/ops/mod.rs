//! The CUDA kernels of the DSL's ops: each parses its op's attributes and metas once, when
//! its actor is made, looks up its compiled entry points on the actor's device, and at
//! every firing only queues launches on the stream its [`StreamContext`] names (no
//! allocation, no synchronization).
//!
//! [`register`] first adds every op's CPU kernel for `cuda` devices, then replaces those
//! that have a CUDA kernel. A CPU kernel on a `cuda` stream runs on the host over the same
//! managed registers, after its stream has drained (see `Execution::Host`): every plan
//! runs, and the op families without a CUDA kernel yet are listed by [`queued_ops`]'s
//! complement.
//!
//! [`StreamContext`]: regflow_kernels::StreamContext

use crate::driver::{Device, Function, StreamHandle};
use regflow_kernels::{Execution, Kernel, KernelError, KernelFactory, KernelIo, KernelKey, KernelRegistry, KernelSpec};
use regflow_plan::{DType, DeviceKind, OpConf};
use std::sync::Arc;

mod attention;
mod cast;
mod chunks;
mod elementwise;
mod fill;
mod layout;
mod matmul;
mod movement;
mod optim;
mod reduce;
mod rows;
mod scalars;

/// The op conf of an op actor.
pub(crate) fn op_conf<'a>(spec: &KernelSpec<'a>) -> Result<&'a OpConf, KernelError> {
    spec.op.ok_or_else(|| {
        KernelError(format!("actor '{}' runs an op kernel without an op (broken invariant)", spec.actor))
    })
}

/// An error of the actor's op, naming the actor and the op type.
pub(crate) fn fail(spec: &KernelSpec<'_>, conf: &OpConf, message: impl std::fmt::Display) -> KernelError {
    KernelError(format!("actor '{}': op '{}' on CUDA: {message}", spec.actor, conf.op_type))
}

/// Entry point `entry` compiled for the actor's device.
pub(crate) fn function(spec: &KernelSpec<'_>, entry: &str) -> Result<Function, KernelError> {
    let device = Device::open(usize::from(spec.device_index))?;
    device.function(entry).map_err(|e| KernelError(format!("actor '{}': {e}", spec.actor)))
}

/// The suffix of a dtype in entry point names (`regflow_fill_f32`).
pub(crate) fn suffix(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::I64 => "i64",
        DType::Bf16 => "bf16",
        DType::F16 => "f16",
    }
}

/// The stream a firing's launches go to.
pub(crate) fn stream(io: &KernelIo<'_>) -> StreamHandle {
    StreamHandle(io.context().native)
}

/// The entries [`register`] adds, so [`queued_ops`] lists exactly what is registered.
type Entry = (&'static str, &'static [DType], fn() -> KernelFactory);

/// Every op with a CUDA kernel, family by family.
fn entries() -> Vec<Entry> {
    let mut all = Vec::new();
    all.extend_from_slice(fill::ENTRIES);
    all.extend_from_slice(cast::ENTRIES);
    all.extend_from_slice(elementwise::ENTRIES);
    all.extend_from_slice(matmul::ENTRIES);
    all.extend_from_slice(movement::ENTRIES);
    all.extend_from_slice(optim::ENTRIES);
    all.extend_from_slice(reduce::ENTRIES);
    all.extend_from_slice(rows::ENTRIES);
    all.extend_from_slice(attention::ENTRIES);
    all.extend_from_slice(scalars::ENTRIES);
    all
}

/// Adds the kernels of `cuda` devices to `registry`: the CPU kernel of every op (run on
/// the host), replaced by a CUDA kernel where one exists.
pub fn register(registry: &mut KernelRegistry) {
    regflow_kernels::cpu::register(registry, DeviceKind::Cuda);
    for (op_type, dtypes, factory) in entries() {
        for &dtype in dtypes {
            registry.register_op(op_type, DeviceKind::Cuda, dtype, factory());
        }
    }
    registry.register_copy(DeviceKind::Cuda, factory(|_| Ok(DeviceCopy)));
}

/// `KernelConf::Copy` on a cuda device (a variable's per-step assign, say): the input
/// register copied into each output on the stream, as far as both reach. A host copy would
/// first wait for the stream to drain (a host kernel reads what queued kernels wrote), and
/// the GPU would then idle at every step's end until the next step's first launches.
#[derive(Debug)]
struct DeviceCopy;

impl Kernel for DeviceCopy {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let (src, len) = (io.input_addr(0), io.input_len(0));
        for o in 0..io.output_count() {
            let (dst, bytes) = (io.output_addr(o), io.output_len(o).min(len));
            if bytes == 0 || dst == src {
                continue;
            }
            // SAFETY: both are registers of this firing, valid for their lengths while the
            // stream runs the copy (the protocol frees neither before the firing completes),
            // and distinct registers live at once never share bytes.
            unsafe { crate::driver::copy_on_device(stream(io), dst, src, bytes) }?;
        }
        Ok(())
    }
}

/// The (op type, dtype) pairs that run as CUDA kernels; every other op runs its CPU kernel
/// on the host.
pub fn queued_ops() -> Vec<KernelKey> {
    entries()
        .into_iter()
        .flat_map(|(op_type, dtypes, _)| {
            dtypes.iter().map(move |&dtype| KernelKey { op_type: op_type.to_string(), device: DeviceKind::Cuda, dtype })
        })
        .collect()
}

/// A CUDA op kernel as the stream sees it: its `run` only queues launches on the firing's
/// stream, so the firing completes when the stream reaches it (`Execution::Queued`). Every
/// device kernel of this module is made through [`queued`] (or [`factory`]), so none can
/// forget to say so and be taken for a host kernel, whose outputs count as written when
/// `run` returns.
#[derive(Debug)]
struct Queued<K>(K);

impl<K: Kernel> Kernel for Queued<K> {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        self.0.run(io)
    }

    fn execution(&self) -> Execution {
        Execution::Queued
    }

    fn scratch_bytes(&self) -> u64 {
        self.0.scratch_bytes()
    }
}

/// `kernel`, a device kernel that only queues launches, as the registry hands it out.
pub(crate) fn queued<K: Kernel + 'static>(kernel: K) -> Box<dyn Kernel> {
    Box::new(Queued(kernel))
}

/// A factory from a function of the spec making a device kernel: the common shape of the
/// CUDA op factories without a host fallback.
pub(crate) fn factory<K, F>(make: F) -> KernelFactory
where
    K: Kernel + 'static,
    F: Fn(&KernelSpec<'_>) -> Result<K, KernelError> + Send + Sync + 'static,
{
    Arc::new(move |spec| Ok(queued(make(spec)?)))
}
