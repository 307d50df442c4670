//! NCCL for groups whose members are all `cuda` devices of this job on distinct GPUs: the
//! collective is queued on each member's comm stream as one NCCL group per firing and
//! completes with the stream, like any queued kernel. Everything else (two devices on one
//! GPU, which NCCL refuses; members on other nodes; a layout NCCL's contiguous rank order
//! cannot express; no libnccl) runs the host rendezvous over the same managed registers.
//!
//! The choice is made per group once every member's kernel is made
//! ([`NcclGroup::decide`], from `CollectiveGroups::check`), before anything fires, so all
//! members agree. An abort of the job aborts the communicators, so members blocked in NCCL
//! fail rather than wait.

use crate::kernel::{Kernel, KernelError, KernelIo};
use crate::sync::{lock, Mutex};
use regflow_cuda::nccl::{Call, Communicator, Element};
use regflow_cuda::StreamHandle;
use regflow_kernels::Execution;
use regflow_plan::{CollectiveConf, CollectiveOp};
use std::sync::{Arc, OnceLock};

/// What one member queues per firing, in elements.
#[derive(Debug, Clone)]
pub(super) enum Shape {
    /// An all-reduce of input 0 into output 0.
    AllReduce(usize),
    /// A bucket: part `i` (input and output `i`) all-reduced, all in one NCCL group.
    Bucket(Vec<usize>),
    /// A reduce-scatter bucket: rank r gets block r of the sum of part `i` (`counts[i]`
    /// elements of output `i`), all in one NCCL group.
    ReduceScatterBucket(Vec<usize>),
    /// An all-gather bucket: every rank gets every block of part `i` (`counts[i]` elements
    /// of input `i` from each), all in one NCCL group.
    AllGatherBucket(Vec<usize>),
    /// Rank r gets part r (contiguous, equal parts) of the sum.
    ReduceScatter(usize),
    /// Every rank gets all parts, rank after rank.
    AllGather(usize),
}

/// How NCCL would run `conf` with data registers of `input_bytes` and `output_bytes`, or
/// `None` where it cannot:
/// a dtype it has no element for, an all-to-all, or parts along a dimension that are not
/// contiguous equal blocks of the flat tensor (NCCL's reduce-scatter and all-gather order
/// ranks along the flat buffer).
pub(super) fn shape_of(conf: &CollectiveConf, input_bytes: &[u64], output_bytes: &[u64]) -> Option<(Shape, Element)> {
    let element = Element::of(conf.dtype)?;
    let size = conf.dtype.size() as u64;
    let counts = |bytes: &[u64]| bytes.iter().map(|&b| usize::try_from(b / size).unwrap_or(usize::MAX)).collect();
    let numel: usize = conf.shape.iter().product();
    let blocks = |dim: usize| {
        let outer_is_one = conf.shape.get(..dim).is_some_and(|outer| outer.iter().all(|&d| d == 1));
        let members = conf.size as usize;
        (outer_is_one && members > 0 && conf.shape.get(dim).is_some_and(|&d| d % members == 0)).then(|| numel / members)
    };
    let shape = match conf.op {
        CollectiveOp::AllReduce => Shape::AllReduce(numel),
        CollectiveOp::AllReduceBucket { .. } => Shape::Bucket(counts(input_bytes)),
        CollectiveOp::ReduceScatterBucket { .. } => Shape::ReduceScatterBucket(counts(output_bytes)),
        CollectiveOp::AllGatherBucket { .. } => Shape::AllGatherBucket(counts(input_bytes)),
        CollectiveOp::ReduceScatter { dim } => Shape::ReduceScatter(blocks(dim)?),
        CollectiveOp::AllGather { dim } => Shape::AllGather(blocks(dim)?),
        CollectiveOp::AllToAll { .. } => return None,
    };
    Some((shape, element))
}

/// A group that may run on NCCL: the GPU of each rank as its kernels were made, then the
/// decision.
#[derive(Debug)]
pub(super) struct NcclGroup {
    name: String,
    /// GPU ordinal per rank; `None` until that rank's kernel is made.
    ordinals: Mutex<Vec<Option<usize>>>,
    /// `Some(communicators)` once decided for NCCL, `None` once decided for the host.
    decided: OnceLock<Option<Vec<Communicator>>>,
}

impl NcclGroup {
    pub(super) fn new(name: &str, size: usize) -> Self {
        Self { name: name.to_string(), ordinals: Mutex::new(vec![None; size]), decided: OnceLock::new() }
    }

    /// Records that rank `rank` runs on GPU `ordinal`.
    pub(super) fn join(&self, rank: usize, ordinal: usize) {
        if let Some(slot) = lock(&self.ordinals).get_mut(rank) {
            *slot = Some(ordinal);
        }
    }

    /// Decides, once every member's kernel is made: NCCL when every rank is here on its
    /// own GPU and NCCL loads; the host rendezvous otherwise (saying why in the log). A
    /// failure of NCCL itself to make the communicators is an error.
    pub(super) fn decide(&self) -> Result<(), String> {
        let ordinals = lock(&self.ordinals).clone();
        let host = |why: String| {
            tracing::info!(group = %self.name, "collective runs on the host rendezvous: {why}");
            let _ = self.decided.set(None);
            Ok(())
        };
        let Some(ordinals) = ordinals.into_iter().collect::<Option<Vec<usize>>>() else {
            return host("not every member is a cuda device of this job".into());
        };
        let mut distinct = ordinals.clone();
        distinct.sort_unstable();
        distinct.dedup();
        if distinct.len() != ordinals.len() {
            return host(format!("members share a GPU (GPUs {ordinals:?}), which NCCL refuses"));
        }
        if let Err(e) = regflow_cuda::nccl::available() {
            return host(e.to_string());
        }
        let comms = Communicator::for_devices(&ordinals).map_err(|e| format!("collective '{}': {e}", self.name))?;
        let _ = self.decided.set(Some(comms));
        Ok(())
    }

    fn communicators(&self) -> Option<&[Communicator]> {
        self.decided.get().and_then(|d| d.as_deref())
    }

    /// Aborts the communicators (the job is aborting).
    pub(super) fn abort(&self) {
        for comm in self.communicators().unwrap_or_default() {
            comm.abort();
        }
    }
}

/// A member of a group that may run on NCCL: queues its calls on the stream when the group
/// decided for NCCL, else runs `host` (the rendezvous kernel).
pub(super) struct NcclKernel {
    host: Box<dyn Kernel>,
    group: Arc<NcclGroup>,
    rank: usize,
    shape: Shape,
    element: Element,
    /// The calls of one firing, refilled in place (capacity fixed when made).
    calls: Vec<Call>,
}

impl std::fmt::Debug for NcclKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclKernel").field("group", &self.group.name).field("rank", &self.rank).finish_non_exhaustive()
    }
}

impl NcclKernel {
    pub(super) fn new(
        host: Box<dyn Kernel>,
        group: Arc<NcclGroup>,
        rank: usize,
        shape: Shape,
        element: Element,
    ) -> Self {
        let calls = Vec::with_capacity(match &shape {
            Shape::Bucket(parts) | Shape::ReduceScatterBucket(parts) | Shape::AllGatherBucket(parts) => parts.len(),
            _ => 1,
        });
        Self { host, group, rank, shape, element, calls }
    }
}

impl Kernel for NcclKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let Some(comms) = self.group.communicators() else { return self.host.run(io) };
        let fail = |e: regflow_cuda::CudaError| {
            KernelError(format!("collective '{}' (rank {} on NCCL): {e}", self.group.name, self.rank))
        };
        let comm = &comms[self.rank];
        comm.async_error().map_err(fail)?;
        self.calls.clear();
        let (input, output) = (io.input_addr(0), io.output_addr(0));
        match &self.shape {
            Shape::AllReduce(count) => self.calls.push(Call::AllReduce { input, output, count: *count }),
            Shape::ReduceScatter(count) => self.calls.push(Call::ReduceScatter { input, output, count: *count }),
            Shape::AllGather(count) => self.calls.push(Call::AllGather { input, output, count: *count }),
            Shape::Bucket(parts) => {
                per_part(&mut self.calls, io, parts, |input, output, count| Call::AllReduce { input, output, count })
            }
            Shape::ReduceScatterBucket(parts) => per_part(&mut self.calls, io, parts, |input, output, count| {
                Call::ReduceScatter { input, output, count }
            }),
            Shape::AllGatherBucket(parts) => {
                per_part(&mut self.calls, io, parts, |input, output, count| Call::AllGather { input, output, count })
            }
        }
        comm.queue(&self.calls, self.element, StreamHandle(io.context().native)).map_err(fail)
    }

    fn execution(&self) -> Execution {
        match self.group.communicators() {
            Some(_) => Execution::Queued,
            None => self.host.execution(),
        }
    }
}

/// Appends one call per part of a bucket: part `i` from input `i` to output `i`, `counts[i]`
/// elements.
fn per_part(calls: &mut Vec<Call>, io: &KernelIo<'_>, counts: &[usize], call: impl Fn(u64, u64, usize) -> Call) {
    calls.extend(counts.iter().enumerate().map(|(i, &count)| call(io.input_addr(i), io.output_addr(i), count)));
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use regflow_plan::DType;

    fn conf(op: CollectiveOp, shape: &[usize], size: u32) -> CollectiveConf {
        CollectiveConf { group: "g".into(), rank: 0, size, op, dtype: DType::F32, shape: shape.to_vec() }
    }

    #[test]
    fn nccl_takes_the_layouts_its_rank_order_expresses() {
        let count = |c: &CollectiveConf, parts: &[u64]| shape_of(c, parts, parts).map(|(s, _)| format!("{s:?}"));
        assert_eq!(count(&conf(CollectiveOp::AllReduce, &[3, 5], 2), &[60]).as_deref(), Some("AllReduce(15)"));
        // Rows split over 2 ranks: contiguous equal blocks.
        let rs = conf(CollectiveOp::ReduceScatter { dim: 0 }, &[4, 5], 2);
        assert_eq!(count(&rs, &[80]).as_deref(), Some("ReduceScatter(10)"));
        // Columns (or uneven rows) are not contiguous equal blocks: the host keeps them.
        assert_eq!(count(&conf(CollectiveOp::ReduceScatter { dim: 1 }, &[4, 6], 2), &[96]), None);
        assert_eq!(count(&conf(CollectiveOp::AllGather { dim: 0 }, &[5, 2], 2), &[20]), None);
        // Leading dimensions of one element do not break contiguity.
        let ag = conf(CollectiveOp::AllGather { dim: 1 }, &[1, 6, 2], 3);
        assert_eq!(count(&ag, &[16]).as_deref(), Some("AllGather(4)"));
        assert_eq!(count(&conf(CollectiveOp::AllToAll { from: 0, to: 1 }, &[4, 4], 2), &[64]), None);
        let bucket = conf(CollectiveOp::AllReduceBucket { parts: 2 }, &[7], 2);
        assert_eq!(count(&bucket, &[12, 16]).as_deref(), Some("Bucket([3, 4])"));
        // ZeRO buckets: per part, the elements of one member's block (output of a
        // reduce-scatter, input of an all-gather).
        let rs = conf(CollectiveOp::ReduceScatterBucket { parts: 2 }, &[14], 2);
        let blocks = shape_of(&rs, &[24, 32], &[12, 16]).map(|(s, _)| format!("{s:?}"));
        assert_eq!(blocks.as_deref(), Some("ReduceScatterBucket([3, 4])"));
        let ag = conf(CollectiveOp::AllGatherBucket { parts: 2 }, &[14], 2);
        assert_eq!(count(&ag, &[12, 16]).as_deref(), Some("AllGatherBucket([3, 4])"));
    }

    #[test]
    fn a_group_on_one_gpu_or_off_gpus_stays_on_the_host() {
        let shared = NcclGroup::new("shared", 2);
        shared.join(0, 0);
        shared.join(1, 0);
        shared.decide().unwrap();
        assert!(shared.communicators().is_none());
        let partial = NcclGroup::new("partial", 2);
        partial.join(0, 0);
        partial.decide().unwrap();
        assert!(partial.communicators().is_none());
        partial.abort();
    }
}
