//! The kernels of one job: the device kernels of `regflow-kernels` (op kernels by op type,
//! device kind and dtype, plus the kernels a program registers by name), and the job's
//! collective groups, which make the collective kernels.

use crate::collective::CollectiveGroups;
use regflow_kernels::KernelRegistry;
use regflow_plan::{DeviceKind, KernelConf};
use std::sync::Arc;

pub use regflow_kernels::{Kernel, KernelError, KernelFactory, KernelIo, KernelSpec, StreamContext};

/// Kernel factories of one job, and the collective groups of the kernels made so far.
#[derive(Debug, Clone)]
pub(crate) struct JobKernels {
    pub(crate) registry: KernelRegistry,
    /// One table per job (a builder builds one job): collective kernels find their
    /// group's rendezvous here, and the job keeps it to wake them on abort.
    collectives: Arc<CollectiveGroups>,
}

impl Default for JobKernels {
    fn default() -> Self {
        let mut registry = KernelRegistry::new();
        for kind in crate::device::KINDS {
            crate::device::register_kernels(&mut registry, kind);
        }
        Self { registry, collectives: Arc::default() }
    }
}

impl JobKernels {
    /// The collective groups of the kernels made so far.
    pub(crate) fn collectives(&self) -> Arc<CollectiveGroups> {
        self.collectives.clone()
    }

    /// Builds the kernel a plan names for the actor `spec` describes (on its device kind).
    pub(crate) fn make(&self, conf: &KernelConf, spec: &KernelSpec<'_>) -> Result<Box<dyn Kernel>, KernelError> {
        match conf {
            KernelConf::Collective(conf) => self.collectives.make_kernel(conf, spec),
            other => self.registry.make(other, spec),
        }
    }
}

/// Whether kernels for `device` can run in this build (a plan naming another kind is
/// refused when the job is built).
pub(crate) fn device_supported(device: DeviceKind) -> bool {
    crate::device::KINDS.contains(&device)
}
