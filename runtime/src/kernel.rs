//! The kernels of one job: the device kernels of `regflow-kernels` (op kernels by op type,
//! device kind and dtype, plus the kernels a program registers by name), and the job's
//! collective groups, which make the collective kernels.

use crate::collective::CollectiveGroups;
use crate::finite::{FiniteCheck, FiniteSite};
use regflow_kernels::KernelRegistry;
use regflow_plan::{ActorIndex, DeviceKind, KernelConf, PlanIndex};
use std::sync::{Arc, OnceLock};

pub use regflow_kernels::{Kernel, KernelError, KernelFactory, KernelIo, KernelSpec, StreamContext};

/// Kernel factories of one job, and the collective groups of the kernels made so far.
#[derive(Debug, Clone)]
pub(crate) struct JobKernels {
    pub(crate) registry: KernelRegistry,
    /// One table per job (a builder builds one job): collective kernels find their
    /// group's rendezvous here, and the job keeps it to wake them on abort.
    collectives: Arc<CollectiveGroups>,
    /// Firings per step of every actor, computed on first use by plans that check finite
    /// values (to say which step a piece belongs to).
    per_step: OnceLock<Vec<u64>>,
}

impl Default for JobKernels {
    fn default() -> Self {
        let mut registry = KernelRegistry::new();
        for kind in crate::device::KINDS {
            crate::device::register_kernels(&mut registry, kind);
        }
        Self { registry, collectives: Arc::default(), per_step: OnceLock::new() }
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

    /// Builds the kernel of actor `index` of the indexed plan, as [`JobKernels::make`]
    /// does; under `Plan::check_finite` an op kernel also scans its outputs.
    pub(crate) fn make_for(
        &self,
        conf: &KernelConf,
        spec: &KernelSpec<'_>,
        indexed: &PlanIndex<'_>,
        index: ActorIndex,
    ) -> Result<Box<dyn Kernel>, KernelError> {
        let kernel = self.make(conf, spec)?;
        let plan = indexed.plan();
        match conf {
            KernelConf::Op(op) if plan.check_finite => {
                // A plan whose rates do not balance has no steps; count pieces then.
                let per_step =
                    self.per_step.get_or_init(|| regflow_actors::firings_per_step(indexed).unwrap_or_default());
                let site = FiniteSite {
                    actor: spec.actor.to_string(),
                    device: plan.devices[plan.device_of(index).index()].label(),
                    per_step: per_step.get(index.index()).copied().unwrap_or(1),
                };
                Ok(FiniteCheck::wrap(kernel, op, site))
            }
            _ => Ok(kernel),
        }
    }
}

/// Whether kernels for `device` can run in this build (a plan naming another kind is
/// refused when the job is built).
pub(crate) fn device_supported(device: DeviceKind) -> bool {
    crate::device::KINDS.contains(&device)
}
