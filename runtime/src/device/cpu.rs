//! The `cpu` device: kernels run synchronously on the stream thread.

use super::{DeviceStream, Launched, SliceTag};
use crate::kernel::{Kernel, KernelError, KernelIo};
use regflow_actors::{ActorId, Completion};
use std::time::{Duration, Instant};

/// A cpu stream: nothing to queue, nothing to poll.
#[derive(Debug, Default)]
pub(crate) struct CpuStream;

impl DeviceStream for CpuStream {
    fn launch(
        &mut self,
        _actor: ActorId,
        kernel: &mut dyn Kernel,
        io: &mut KernelIo<'_>,
        _modeled: Duration,
        timed: Option<SliceTag>,
        _completion_wanted: bool,
    ) -> Result<Launched, KernelError> {
        if timed.is_none() {
            kernel.run(io)?;
            return Ok(Launched { completion: Completion::Done, span: None });
        }
        let start = Instant::now();
        kernel.run(io)?;
        Ok(Launched { completion: Completion::Done, span: Some((start, Instant::now())) })
    }

    fn runs_at_launch(&self) -> bool {
        true
    }
}
