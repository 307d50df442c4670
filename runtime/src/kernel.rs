//! The kernels of one job: the device kernels of `regflow-kernels` (op kernels by op type,
//! device kind and dtype, plus the kernels a program registers by name), and the job's
//! collective groups, which make the collective kernels.

use crate::collective::CollectiveGroups;
use crate::finite::{FiniteCheck, FiniteSite};
use regflow_kernels::KernelRegistry;
use regflow_plan::{ActorIndex, KernelConf, PlanIndex};
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

    /// Builds the kernel of actor `index` of the indexed plan, as [`JobKernels::make`]
    /// does; under `Plan::check_finite` an op kernel also scans its outputs (and names the
    /// step of a piece from the actor's `per_step` firings).
    pub(crate) fn make_for(
        &self,
        conf: &KernelConf,
        spec: &KernelSpec<'_>,
        indexed: &PlanIndex<'_>,
        index: ActorIndex,
        per_step: u64,
    ) -> Result<Box<dyn Kernel>, KernelError> {
        let kernel = self.make(conf, spec)?;
        let plan = indexed.plan();
        match conf {
            KernelConf::Op(op) if plan.check_finite => {
                let site = FiniteSite {
                    actor: spec.actor.to_string(),
                    device: plan.devices[plan.device_of(index).index()].label(),
                    per_step,
                };
                Ok(FiniteCheck::wrap(kernel, op, site))
            }
            _ => Ok(kernel),
        }
    }
}
