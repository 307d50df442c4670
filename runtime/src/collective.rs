//! In-process CPU collectives: the members of a group meet in a rendezvous every firing,
//! and each computes its own output from all members' inputs.
//!
//! A group is `size` compute actors (one per device, each on its device's comm stream, so
//! each on its own thread) whose kernels name the same [`CollectiveConf::group`]. One round
//! per firing:
//!
//! 1. each member publishes where its input lies and waits until all `size` have arrived
//!    (barrier 1);
//! 2. each computes *its own* output by reading every member's input, so the work is
//!    spread over the members' threads;
//! 3. each waits until all have finished reading (barrier 2) and only then returns, so no
//!    member's input is acked (released to its producer) while a peer still reads it.
//!
//! A large all-reduce takes two steps between the barriers instead of one, a reduce-scatter
//! then an all-gather: each member sums only its part (`1/size` of the elements) into its
//! own output, all meet at a middle barrier, then each copies the other parts from their
//! owners' outputs. Every member then reads `2 - 1/size` tensors' worth of bytes instead of
//! `size` (with 8 members, 1.9 instead of 8), and every element is still summed once, in
//! rank order, so the result is bitwise the one the one-step sum gives.
//!
//! An all-gather along dimension 0 whose input already lies at its own part of the output
//! (a sharded weight gathered in place, `RegstDesc::within`) copies only the other members'
//! parts, and never holds a reference to its whole output while peers read its part
//! ([`CollectiveMember::gather_in_place`]).
//!
//! A member waiting at a barrier spins on the round's phase for a few microseconds before
//! it sleeps on the condition variable, so a peer that arrives just after costs no futex
//! wake-up (`rendezvous.rs`, `SPIN_ROUNDS`).
//!
//! Blocking the comm stream inside the kernel is intended: like NCCL, a collective occupies
//! its stream until the group completes, and the plan issues every device's collectives in
//! the same order. Sums of `Partial` values are taken in rank order `0..size`, so every
//! member gets bitwise the same result. When the job aborts, every rendezvous is woken:
//! members waiting at barrier 1 return an error naming the ranks that had not arrived.
//! Barrier 2 is not abortable: once barrier 1 completed, every member is computing and will
//! arrive, and returning earlier would let a peer read a released input.

mod bucket;
mod layout;
#[cfg(all(test, loom))]
mod loom_two_step;
mod nccl;
mod net;
mod rendezvous;
#[cfg(all(test, not(loom)))]
pub(crate) mod tests;

pub(crate) use net::{CollectiveSend, NetGroups};
pub(crate) use rendezvous::{PeerInput, Peers, Rendezvous};

use crate::kernel::{Kernel, KernelError, KernelIo, KernelSpec};
use crate::sync::{lock, Arc, Mutex};
use crate::RuntimeError;
use layout::Layout;
use regflow_plan::{CollectiveConf, PlanIndex, StreamKind};
use std::collections::HashMap;

/// One member of an in-process collective group, usable without a job (benchmarks, tests).
///
/// Inside a job the same member runs as the kernel of a collective actor. Each member must
/// run on its own thread: [`CollectiveMember::run`] blocks until every member of the group
/// has called it for the same round.
///
/// ```
/// use regflow_plan::{CollectiveConf, CollectiveOp};
/// use regflow_plan::DType;
/// use regflow_runtime::CollectiveMember;
///
/// let conf = CollectiveConf {
///     group: "g".into(), rank: 0, size: 2, op: CollectiveOp::AllReduce, dtype: DType::I64, shape: vec![2],
/// };
/// let members = CollectiveMember::group(&conf).unwrap();
/// let sums: Vec<Vec<u8>> = std::thread::scope(|s| {
///     let threads: Vec<_> = members
///         .into_iter()
///         .map(|mut member| {
///             s.spawn(move || {
///                 let r = i64::from(member.rank());
///                 let input: Vec<u8> = [r, 10 * r].iter().flat_map(|v| v.to_le_bytes()).collect();
///                 let mut output = vec![0u8; 16];
///                 member.run(&input, &mut output).unwrap();
///                 output
///             })
///         })
///         .collect();
///     threads.into_iter().map(|t| t.join().unwrap()).collect()
/// });
/// let expected: Vec<u8> = [1i64, 10].iter().flat_map(|v| v.to_le_bytes()).collect();
/// assert_eq!(sums, [expected.clone(), expected]);
/// ```
#[derive(Debug)]
pub struct CollectiveMember {
    rendezvous: Arc<Rendezvous>,
    layout: Layout,
    /// This member's copy of the input table, taken at barrier 1 (no allocation per round).
    peers: Vec<PeerInput>,
    /// Its copy of the output table, for two-step all-reduces (empty otherwise).
    peer_outputs: Vec<PeerInput>,
}

impl CollectiveMember {
    /// The `conf.size` members of a new group computing `conf` (`conf.rank` is ignored),
    /// in rank order.
    pub fn group(conf: &CollectiveConf) -> Result<Vec<CollectiveMember>, KernelError> {
        if conf.size == 0 {
            return Err(KernelError(format!("collective '{}': size is 0", conf.group)));
        }
        let rendezvous = Arc::new(Rendezvous::new(&conf.group, conf.size as usize));
        (0..conf.size)
            .map(|rank| {
                let conf = CollectiveConf { rank, ..conf.clone() };
                let layout =
                    Layout::new(&conf).map_err(|m| KernelError(format!("collective '{}': {m}", conf.group)))?;
                Ok(Self::new(rendezvous.clone(), layout))
            })
            .collect()
    }

    fn new(rendezvous: Arc<Rendezvous>, layout: Layout) -> Self {
        let peers = vec![PeerInput::empty(); layout.size];
        let peer_outputs = if layout.two_step() { vec![PeerInput::empty(); layout.size] } else { Vec::new() };
        Self { rendezvous, layout, peers, peer_outputs }
    }

    /// This member's rank.
    pub fn rank(&self) -> u32 {
        self.layout.rank as u32
    }

    /// Bytes of this member's input.
    pub fn input_bytes(&self) -> usize {
        self.layout.input_bytes
    }

    /// Bytes of this member's output.
    pub fn output_bytes(&self) -> usize {
        self.layout.output_bytes
    }

    /// One round: waits for every member, computes this member's output from all inputs,
    /// and returns once every member has finished reading `input`.
    pub fn run(&mut self, input: &[u8], output: &mut [u8]) -> Result<(), KernelError> {
        let (layout, group) = (&self.layout, &self.rendezvous.group);
        if input.len() != layout.input_bytes || output.len() != layout.output_bytes {
            return Err(KernelError(format!(
                "collective '{group}': rank {} got {} input and {} output bytes; it needs {} and {}",
                layout.rank,
                input.len(),
                output.len(),
                layout.input_bytes,
                layout.output_bytes
            )));
        }
        if layout.two_step() {
            // Peers read parts of `output` through the published address, so from here on
            // this member writes it only through that address too (never through `&mut`).
            let at = PeerInput::of_output(output);
            let (peers, outputs) = (&mut self.peers, &mut self.peer_outputs);
            return self.rendezvous.round_with_outputs(
                layout.rank,
                PeerInput::new(input),
                at,
                peers,
                outputs,
                |peers| {
                    // SAFETY: `at` is `output`, borrowed mutably for this call; peers read only
                    // the parts this member finished before the middle barrier (`Peers::output`).
                    unsafe { layout.all_reduce_in_two_steps(peers, at.output_ptr()) }
                },
            );
        }
        self.rendezvous
            .round(layout.rank, PeerInput::new(input), &mut self.peers, |peers| layout.compute(peers, output))
    }

    /// One round of an all-gather whose `input` already lies where this member's own part of
    /// `output` goes (a sharded update wrote it there, `RegstDesc::within`): copies only the
    /// other members' parts. Any other overlap of input and output is an error.
    ///
    /// # Safety
    /// `input` and `output` are valid for `input_len` and `output_len` bytes for the whole
    /// call, nobody else writes them meanwhile, and nobody else reads `output` outside the
    /// input's bytes.
    pub(crate) unsafe fn gather_in_place(
        &mut self,
        input: *const u8,
        input_len: usize,
        output: *mut u8,
        output_len: usize,
    ) -> Result<(), KernelError> {
        let (layout, group) = (&self.layout, &self.rendezvous.group);
        let own = layout.own_part.clone();
        let in_place = own.as_ref().is_some_and(|own| {
            input as usize == output as usize + own.start
                && input_len == own.len()
                && input_len == layout.input_bytes
                && output_len == layout.output_bytes
        });
        if !in_place {
            return Err(KernelError(format!(
                "collective '{group}': rank {}'s input ({input_len} bytes at offset {} of its output) overlaps its \
                 {output_len}-byte output other than as its own part of an all-gather along dimension 0{}",
                layout.rank,
                (input as usize).wrapping_sub(output as usize) as isize,
                own.map_or_else(String::new, |own| format!(" (bytes {}..{})", own.start, own.end))
            )));
        }
        // SAFETY: the caller's contract; this member only reads its input (its own part) and
        // writes the other parts, through `output`, never through a reference to all of it.
        let input = unsafe { std::slice::from_raw_parts(input, input_len) };
        self.rendezvous.round(layout.rank, PeerInput::new(input), &mut self.peers, |peers| {
            // SAFETY: as above; peers read only this member's own part (its input).
            unsafe { layout.gather_others(peers, output) }
        })
    }

    /// Aborts the whole group: members waiting for others, and every later round, fail.
    pub fn abort(&self) {
        self.rendezvous.abort();
    }
}

/// A collective actor's kernel: one round per firing, input 0 to output 0 (other registers
/// are zero-byte order tokens).
#[derive(Debug)]
struct CollectiveKernel(CollectiveMember);

impl Kernel for CollectiveKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        if io.overlaps(0, 0) {
            let (input, input_len) = (io.input_ptr(0), io.input_len(0));
            let output_len = io.output_len(0);
            // SAFETY: the views are this firing's slots (input Ready, output free), the
            // arenas outlive the job, and only this kernel touches them until it returns.
            return unsafe { self.0.gather_in_place(input, input_len, io.output_ptr(0), output_len) };
        }
        let input = io.input(0);
        self.0.run(input, io.output(0))
    }
}

/// A group as far as the job build has seen it.
#[derive(Debug)]
struct GroupEntry {
    /// The first member's configuration; the others must agree with it.
    conf: CollectiveConf,
    /// Actor name per rank.
    members: Vec<Option<String>>,
    rendezvous: Arc<Rendezvous>,
    /// Where the group may run on NCCL (cuda members; see `collective/nccl.rs`).
    nccl: Option<std::sync::Arc<nccl::NcclGroup>>,
}

/// The rendezvous of every collective group of one job, by group name. Kernels find their
/// group here when the job builds them; an abort of the job wakes them all.
#[derive(Debug)]
pub(crate) struct CollectiveGroups {
    groups: Mutex<HashMap<String, GroupEntry>>,
    /// Groups with members on other nodes, in a job that runs one node of several.
    net: std::sync::OnceLock<Arc<NetGroups>>,
}

impl Default for CollectiveGroups {
    fn default() -> Self {
        Self { groups: Mutex::new(HashMap::new()), net: std::sync::OnceLock::new() }
    }
}

impl CollectiveGroups {
    /// Makes the kernel of collective actor `spec.actor`, joining (or creating) its group.
    pub(crate) fn make_kernel(
        &self,
        conf: &CollectiveConf,
        spec: &KernelSpec<'_>,
    ) -> Result<Box<dyn Kernel>, KernelError> {
        let fail = |message: String| {
            KernelError(format!(
                "collective '{}' ({}, rank {} of {}): {message}",
                conf.group,
                conf.op_name(),
                conf.rank,
                conf.size
            ))
        };
        let layout = Layout::new(conf).map_err(fail)?;
        // Inputs and outputs `0..parts` carry the data (one of each, except in a bucket).
        // Further inputs only order or pace the actor (zero-byte order tokens chaining a
        // stream's collectives; the step's tick for a collective of a variable) and are not
        // read; further outputs are order tokens.
        let parts = conf.op.parts();
        if spec.input_bytes.len() < parts || spec.output_bytes.len() < parts {
            let needs = if parts == 1 {
                "a data input and a data output register".to_string()
            } else {
                format!("{parts} data input and output registers (one per bucket part)")
            };
            return Err(fail(format!(
                "a collective actor needs {needs}; this one has {} input(s) and {} output(s)",
                spec.input_bytes.len(),
                spec.output_bytes.len()
            )));
        }
        for (side, bytes) in [("output", spec.output_bytes)] {
            if let Some((i, extra)) = bytes.iter().enumerate().skip(parts).find(|(_, &b)| b != 0) {
                let data = if parts == 1 { format!("{side} 0 carries") } else { format!("{side}s 0..{parts} carry") };
                return Err(fail(format!(
                    "{side} {i} has {extra} bytes; only {data} data, further registers are zero-byte order tokens"
                )));
            }
        }
        let (inputs, outputs) = (&spec.input_bytes[..parts], &spec.output_bytes[..parts]);
        if conf.op.is_bucket() {
            bucket::check_parts(conf.op, conf.size, conf.dtype.size(), inputs, outputs).map_err(fail)?;
        }
        for (side, shape, got, needed) in [
            ("input", conf.input_shape(), inputs.iter().sum::<u64>(), layout.input_bytes),
            ("output", conf.output_shape(), outputs.iter().sum::<u64>(), layout.output_bytes),
        ] {
            if got != needed as u64 {
                let what = if parts == 1 {
                    format!("the {side} register has")
                } else {
                    format!("its {parts} {side} registers have")
                };
                return Err(fail(format!(
                    "{what} {got} bytes, but {side} shape {shape:?} of {} needs {needed}",
                    conf.dtype
                )));
            }
        }
        let (rendezvous, nccl) = self.join(spec, conf).map_err(fail)?;
        let net = self.net.get().and_then(|net| Some((net, net.get(&conf.group)?.clone())));
        let spans_nodes = net.is_some();
        let flat: Box<dyn Kernel> = match net {
            Some((net, group)) => net.kernel(group, layout).map_err(fail)?,
            None => Box::new(CollectiveKernel(CollectiveMember::new(rendezvous, layout))),
        };
        let host = match conf.op.is_bucket() {
            true => Box::new(bucket::BucketKernel::new(spec.actor, flat, conf, inputs, outputs).map_err(fail)?),
            false => flat,
        };
        // A cuda member of an in-process group whose layout NCCL expresses may run on NCCL,
        // decided for the whole group in `check`.
        match (nccl, nccl::shape_of(conf, inputs, outputs)) {
            (Some(group), Some((shape, element))) if !spans_nodes => {
                Ok(Box::new(nccl::NcclKernel::new(host, group, conf.rank as usize, shape, element)))
            }
            _ => Ok(host),
        }
    }

    /// Makes the groups that span nodes exchange inputs over the network (before any
    /// kernel is made).
    pub(crate) fn set_net(&self, groups: Arc<NetGroups>) {
        let _ = self.net.set(groups);
    }

    /// Registers actor `spec.actor` as `conf.rank` of its group; fails if it disagrees with
    /// a member already registered, or takes a rank already taken. Returns the group's
    /// rendezvous and, for a cuda member, its NCCL candidate.
    #[allow(clippy::type_complexity)]
    fn join(
        &self,
        spec: &KernelSpec<'_>,
        conf: &CollectiveConf,
    ) -> Result<(Arc<Rendezvous>, Option<std::sync::Arc<nccl::NcclGroup>>), String> {
        let actor = spec.actor;
        let mut groups = lock(&self.groups);
        let entry = groups.entry(conf.group.clone()).or_insert_with(|| GroupEntry {
            conf: conf.clone(),
            members: vec![None; conf.size as usize],
            rendezvous: Arc::new(Rendezvous::new(&conf.group, conf.size as usize)),
            nccl: (spec.device == regflow_plan::DeviceKind::Cuda)
                .then(|| std::sync::Arc::new(nccl::NcclGroup::new(&conf.group, conf.size as usize))),
        });
        let first = &entry.conf;
        let first_actor = entry.members.iter().flatten().next().map(String::as_str).unwrap_or("?");
        let disagreement = if first.size != conf.size {
            Some(("size", conf.size.to_string(), first.size.to_string()))
        } else if first.op != conf.op {
            Some(("op", format!("{:?}", conf.op), format!("{:?}", first.op)))
        } else if first.dtype != conf.dtype {
            Some(("dtype", conf.dtype.to_string(), first.dtype.to_string()))
        } else if first.shape != conf.shape {
            Some(("shape", format!("{:?}", conf.shape), format!("{:?}", first.shape)))
        } else {
            None
        };
        if let Some((what, mine, theirs)) = disagreement {
            return Err(format!(
                "members disagree on the {what}: this actor has {mine}, member '{first_actor}' has {theirs}"
            ));
        }
        let slot = &mut entry.members[conf.rank as usize];
        if let Some(holder) = slot {
            return Err(format!("rank {} is already taken by actor '{holder}'", conf.rank));
        }
        *slot = Some(actor.to_string());
        // A member that is not on a GPU leaves its rank unset: the group stays on the host.
        if let Some(group) = entry.nccl.as_ref().filter(|_| spec.device == regflow_plan::DeviceKind::Cuda) {
            group.join(conf.rank as usize, usize::from(spec.device_index));
        }
        Ok((entry.rendezvous.clone(), entry.nccl.clone()))
    }

    /// After every kernel is made: every group has all its ranks in this job (a job that runs
    /// one node of a multi-node plan may not), each member on a comm stream. Plan validation
    /// already put members on distinct devices and ordered each stream's collectives.
    pub(crate) fn check(&self, indexed: &PlanIndex<'_>) -> Result<(), RuntimeError> {
        let plan = indexed.plan();
        let groups = lock(&self.groups);
        let mut names: Vec<&String> = groups.keys().collect();
        names.sort_unstable();
        for name in names {
            let entry = &groups[name];
            let present: Vec<&str> = entry.members.iter().flatten().map(String::as_str).collect();
            let setup = |actor: &str, message: String| RuntimeError::KernelSetup {
                actor: actor.to_string(),
                message: format!("collective '{name}': {message}"),
            };
            let missing: Vec<usize> = (0..entry.members.len()).filter(|&r| entry.members[r].is_none()).collect();
            let spanning = self.net.get().is_some_and(|net| net.get(name).is_some());
            if !missing.is_empty() && !spanning {
                return Err(setup(
                    present.first().copied().unwrap_or("?"),
                    format!(
                        "size {} but ranks {missing:?} have no actor in this job (members: {present:?}); \
                         a job that runs one node of several needs a cluster for collectives across nodes",
                        entry.conf.size
                    ),
                ));
            }
            if let Some(group) = &entry.nccl {
                group.decide().map_err(|m| setup(present.first().copied().unwrap_or("?"), m))?;
            }
            for actor in present {
                let Some(index) = indexed.actor_by_name(actor) else { continue };
                let stream = &plan.streams[plan.actors[index.index()].stream.index()];
                // A cpu device's compute stream may block in a collective too: plan
                // validation checks that nothing then waits on it
                // (`Plan::check_blocking_collectives`).
                let cpu = plan.devices[stream.device.index()].kind == regflow_plan::DeviceKind::Cpu;
                if stream.kind != StreamKind::Comm && !(cpu && stream.kind == StreamKind::Compute) {
                    let kind = stream.kind;
                    return Err(setup(
                        actor,
                        format!(
                            "runs on a {kind:?} stream; collectives need a comm stream, or a cpu device's compute stream (they block it)"
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Wakes every group's waiting members with an error (the job is aborting).
    pub(crate) fn abort_all(&self) {
        for entry in lock(&self.groups).values() {
            entry.rendezvous.abort();
            if let Some(group) = &entry.nccl {
                group.abort();
            }
        }
        if let Some(net) = self.net.get() {
            net.abort_all();
        }
    }
}
