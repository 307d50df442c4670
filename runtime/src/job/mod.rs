//! `Job`: loads a plan in-process, starts one thread per stream, lets the embedding program
//! push pieces in and take results out, and waits for the end (or the first error).
//! Building a job (validation, memory, threads) is in `start`.

mod make;
mod setup;
mod start;
mod state;
mod user_waits;

use crate::arenas::PlanArenas;
use crate::bus::Router;
use crate::io::{Feeder, Fetcher};
use crate::stream::{ActorStats, JobShared, StreamExit};
use crate::sync::{lock, Arc};
use crate::RuntimeError;
use regflow_memory::MemoryReport;
use regflow_plan::{ActorKind, Plan, SourcePieces};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[cfg(loom)]
pub(crate) use setup::max_arity;
pub use start::JobBuilder;
pub use state::StatePart;
pub(crate) use state::{host_array, logical_name};
pub(crate) use user_waits::{thread_token, FetchRecord, UserWaits};

/// How long `wait` lets a fetcher it found full and unread stay so (nothing fired, nothing
/// fetched) before it fails: the program may have moved it to another thread that is about
/// to call `recv` (on a loaded machine a new thread may take a while to run).
const UNREAD_GRACE: Duration = Duration::from_secs(1);

/// Default watchdog timeout: long enough for any sane kernel, short enough to notice a hang.
pub const DEFAULT_WATCHDOG: Duration = Duration::from_secs(60);

/// Most threads one kernel of a `cpu` device may use ([`JobBuilder::cpu_threads`]): far
/// above any machine's cores today; a larger count is a typo, not a request.
pub const MAX_CPU_THREADS: usize = 1024;

/// After an abort, how long `wait` gives stream threads to stop before it leaves behind
/// those still inside a kernel (they keep the job's memory alive until they return).
const ABORT_GRACE: Duration = Duration::from_secs(2);

/// A plan running in this process.
#[derive(Debug)]
pub struct Job {
    plan: Arc<Plan>,
    threads: Vec<(usize, JoinHandle<StreamExit>)>,
    /// Each stream thread sends its index here as it ends.
    exits: crossbeam_channel::Receiver<usize>,
    shared: Arc<JobShared>,
    router: Router,
    feeders: HashMap<String, Feeder>,
    fetchers: HashMap<String, Fetcher>,
    /// Sinks that deliver to an `on_sink` callback (no fetcher can take them).
    callback_sinks: Vec<String>,
    watchdog: Option<(crossbeam_channel::Sender<()>, JoinHandle<()>)>,
    memory: MemoryReport,
    arenas: Option<Arc<PlanArenas>>,
    /// What the program's threads wait on and hold (feeders, fetchers, `wait`).
    user: std::sync::Arc<UserWaits>,
    epoch: Instant,
    trace_path: Option<PathBuf>,
    /// Read every variable's final value when the job ends (`JobBuilder::keep_state`).
    keep_state: bool,
    /// The connections to the other nodes, in a job that runs one node of several.
    net: Option<crate::net::NetPlane>,
    /// Ops on GPU devices whose kernels run on the host ([`Job::host_kernels`]).
    host_kernels: Vec<String>,
    /// The kernels' own device memory ([`Job::kernel_memory`]).
    kernel_memory: MemoryReport,
    /// Its stream threads in the process's count, which later jobs read to choose their
    /// lanes' barrier (`crate::activity::StreamThreads`); released when the job ends.
    _stream_threads: crate::activity::StreamThreads,
}

/// What a finished job reports.
#[derive(Debug, Clone)]
pub struct JobReport {
    /// Counters per actor, in plan order of streams.
    pub actors: Vec<ActorStats>,
    /// From start to the last thread's end.
    pub elapsed: Duration,
    /// Bytes per device.
    pub memory: MemoryReport,
    /// Where the timeline was written, if it was recorded.
    pub trace: Option<PathBuf>,
    /// With [`JobBuilder::keep_state`]: the final value of every variable (weights and
    /// optimizer state), whole, by its logical name, in the plan's order; `None` otherwise.
    /// A variable with a part on a node this job does not run is left out.
    pub state: Option<Vec<(String, regflow_plan::HostArray)>>,
    /// With [`JobBuilder::keep_state`]: every part of a variable a device of this job held
    /// when it ended (what this node writes to a sharded checkpoint), in the plan's device
    /// order; `None` otherwise. A zero part (a `Partial` summand another device holds) is
    /// left out, and a part held by several devices (a `Broadcast` replica) is reported only
    /// by the job of the first of them in the plan's device order, so that the parts of all
    /// the nodes' jobs of a plan hold every element once.
    pub state_parts: Option<Vec<StatePart>>,
    /// Messages between this job's stream threads that found the lane to their stream full
    /// and waited for room. Lanes are sized from the plan's register counts so that this
    /// stays 0; anything else is a bug in that sizing (the tests assert it).
    pub lane_waits: u64,
}

impl JobReport {
    /// Counters of the actor with this name.
    pub fn actor(&self, name: &str) -> Option<&ActorStats> {
        self.actors.iter().find(|a| a.name == name)
    }

    /// Bytes the job's kernels kept between firings outside the plan's registers when it
    /// ended, summed over its actors ([`ActorStats::held_bytes`]): what the job used beyond
    /// [`JobReport::memory`] and the streams' scratch ([`Job::kernel_memory`]).
    pub fn held_by_kernels(&self) -> u64 {
        self.actors.iter().map(|a| a.held_bytes).sum()
    }

    /// The final value of variable `name` (its logical name), when the state was kept.
    pub fn variable(&self, name: &str) -> Option<&regflow_plan::HostArray> {
        self.state.as_ref()?.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }
}

impl Job {
    /// The feeder of fed source `name` (once). An unknown name is an error listing the
    /// nearest fed sources.
    pub fn feeder(&mut self, name: &str) -> Result<Feeder, RuntimeError> {
        self.take(name, "feeder", |job| job.feeders.remove(name), "a feeder needs a source with `pieces: fed`")
    }

    /// The fetcher of sink `name` (once). Pieces of a sink whose fetcher is never taken are
    /// dropped when [`Job::wait`] runs. An unknown name is an error listing the nearest sinks.
    pub fn fetcher(&mut self, name: &str) -> Result<Fetcher, RuntimeError> {
        let fetcher = self.take(
            name,
            "fetcher",
            |job| job.fetchers.remove(name),
            "a fetcher needs a sink without an on_sink callback",
        )?;
        let record = &self.user.fetches[fetcher.record];
        record.taken.store(true, Ordering::SeqCst);
        record.reader.store(thread_token(), Ordering::SeqCst);
        Ok(fetcher)
    }

    fn take<T>(
        &mut self,
        name: &str,
        what: &'static str,
        remove: impl FnOnce(&mut Self) -> Option<T>,
        expected: &'static str,
    ) -> Result<T, RuntimeError> {
        if let Some(found) = remove(self) {
            return Ok(found);
        }
        let Some(index) = self.plan.actor_by_name(name) else {
            let (kind, fits): (&'static str, fn(&ActorKind) -> bool) = match what {
                "feeder" => ("fed source", |k| matches!(k, ActorKind::Source { pieces: SourcePieces::Fed })),
                _ => ("sink", |k| matches!(k, ActorKind::Sink)),
            };
            let valid: Vec<&str> = self.plan.actors.iter().filter(|a| fits(&a.kind)).map(|a| a.name.as_str()).collect();
            return Err(RuntimeError::unknown_name(kind, name, &valid));
        };
        let actor = &self.plan.actors[index.index()];
        let node = self.plan.devices[self.plan.device_of(index).index()].node;
        if !self.router.hosts(node) {
            return Err(RuntimeError::NotLocal { name: name.to_string(), node });
        }
        let fits = matches!(
            (what, &actor.kind),
            ("feeder", ActorKind::Source { pieces: SourcePieces::Fed }) | ("fetcher", ActorKind::Sink)
        );
        if what == "fetcher" && self.callback_sinks.iter().any(|s| s == name) {
            let expected = "it delivers to the on_sink callback the job was built with; a fetcher needs a sink \
                            without one";
            Err(RuntimeError::WrongKind { name: name.to_string(), kind: actor.kind.name(), expected })
        } else if fits {
            Err(RuntimeError::AlreadyTaken { what, name: name.to_string() })
        } else {
            Err(RuntimeError::WrongKind { name: name.to_string(), kind: actor.kind.name(), expected })
        }
    }

    /// Whether this job runs plan actor `actor` (every actor, unless it runs one node).
    pub(crate) fn runs(&self, actor: regflow_plan::ActorIndex) -> bool {
        self.router.hosts(self.plan.devices[self.plan.device_of(actor).index()].node)
    }

    /// Whether output `name` of the plan's signature (or its sink) is delivered on this
    /// node: in a job that runs one node of several, only there can it be fetched.
    pub fn has_output(&self, name: &str) -> bool {
        let outputs = &self.plan.signature.outputs;
        outputs
            .iter()
            .find(|o| o.name == name || self.plan.actors[o.actor.index()].name == name)
            .is_some_and(|o| self.runs(o.actor))
    }

    /// The node this job runs, when it runs one node of a multi-node plan.
    pub fn node(&self) -> Option<u16> {
        self.router.hosted_node()
    }

    /// Bytes per device, known before anything ran: the plan's registers, as its memory
    /// layout places them in one arena per device.
    pub fn memory_report(&self) -> &MemoryReport {
        &self.memory
    }

    /// Bytes per device of the scratch its streams lend their kernels, outside the plan's
    /// registers: one scratch per stream, as large as the most any of its kernels asks
    /// (`Kernel::scratch_bytes`). On `cuda` devices that is the partial sums of two-launch
    /// reductions, the cross-entropy's row losses and the aligned staging of 16-bit
    /// products with an odd leading dimension (GPT-2 124M in bf16: 92.3 MB); 0 on `cpu`
    /// and `sim`. A device's memory in use is this plus [`Job::memory_report`]'s.
    pub fn kernel_memory(&self) -> &MemoryReport {
        &self.kernel_memory
    }

    /// The ops on GPU devices whose kernels run on the host, as `actor (op dtype)`: an op
    /// with no device kernel for its dtype is computed by its CPU kernel over managed
    /// memory, after its stream drains. Such a plan runs right, but slowly where the tensors
    /// are large, so this is the first thing to read when a GPU step is slow. Empty on
    /// other devices, and where every op of a GPU device has a device kernel.
    pub fn host_kernels(&self) -> &[String] {
        &self.host_kernels
    }

    /// The plan being run.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Aborts the job: every stream stops at once; `wait` then returns this error.
    pub fn abort(&self, reason: RuntimeError) {
        self.shared.abort(reason, &self.router);
    }

    /// Waits until every actor has finished, then reports; or returns the first error.
    ///
    /// Feeders not taken are closed; pieces for fetchers not taken are dropped. A fed
    /// source whose feeder the caller still holds open keeps the job running.
    ///
    /// A fetcher the caller holds is not drained: its pieces are the caller's. If its sink
    /// has delivered as many pieces as it may ahead of the fetches (the fetch depth), nobody
    /// is inside [`Fetcher::recv`], and this thread was the last to read (or take) it, the
    /// job could only go on once this very thread reads: `wait` then fails at once (after a
    /// short grace in which nothing fires and nothing is fetched) with
    /// [`RuntimeError::UnreadFetcher`], naming the sink and its unread pieces. Read the
    /// fetcher to its end, or drop it, before calling `wait`. A fetcher read to its end and
    /// still in scope is fine. A fetcher moved to another thread counts as this thread's
    /// until that thread first calls `recv`, so that thread should do so within a second
    /// (or take the fetcher itself). A fetcher read by another thread that stops reading is
    /// the watchdog's to report (a cycle through `Job::wait` in its wait-for graph).
    pub fn wait(mut self) -> Result<JobReport, RuntimeError> {
        self.feeders.clear();
        self.fetchers.clear();
        self.user.waiting.store(true, Ordering::SeqCst);
        let end = self.join_threads();
        self.user.waiting.store(false, Ordering::SeqCst);
        let mut actors = Vec::new();
        let mut buffers = Vec::new();
        for exit in end.exits {
            actors.extend(exit.snapshots);
            buffers.extend(exit.trace);
        }
        let failed = lock(&self.shared.error).take();
        // Read while the arenas live (`stop_helpers` frees them) and every thread has ended.
        let state = match (&failed, self.keep_state, &self.arenas) {
            (None, true, Some(arenas)) => Some(state::read_variables(&self.plan, arenas, &actors)),
            _ => None,
        };
        self.stop_helpers();
        if let Some(error) = failed {
            return Err(error);
        }
        let (state, state_parts) = match state.transpose()? {
            Some(read) => (Some(read.wholes), Some(read.parts)),
            None => (None, None),
        };
        if let Some(path) = &self.trace_path {
            let file = std::fs::File::create(path)
                .map_err(|e| RuntimeError::Trace { path: path.display().to_string(), message: e.to_string() })?;
            crate::trace::write_chrome_trace(file, &self.plan, self.epoch, &buffers)
                .map_err(|e| RuntimeError::Trace { path: path.display().to_string(), message: e.to_string() })?;
        }
        Ok(JobReport {
            actors,
            elapsed: end.at - self.epoch,
            memory: self.memory.clone(),
            trace: self.trace_path.clone(),
            state,
            state_parts,
            lane_waits: self.shared.send_waits.count(),
        })
    }

    /// Waits for every stream thread to end. After an abort, threads still inside a kernel
    /// after [`ABORT_GRACE`] are left behind rather than waited on for ever.
    fn join_threads(&mut self) -> Joined {
        let mut ended = Vec::with_capacity(self.threads.len());
        let mut aborted_at: Option<Instant> = None;
        let mut at = Instant::now();
        let mut unread = UnreadWatch::default();
        while ended.len() < self.threads.len() {
            match self.exits.recv_timeout(Duration::from_millis(50)) {
                Ok(s) => {
                    ended.push(s);
                    at = Instant::now();
                }
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                    if let Some(error) = unread.check(&self.user, &self.shared) {
                        self.shared.abort(error, &self.router);
                    }
                    if self.shared.aborting.load(crate::sync::Ordering::Acquire) {
                        let since = *aborted_at.get_or_insert_with(Instant::now);
                        if since.elapsed() >= ABORT_GRACE {
                            break;
                        }
                    }
                }
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
            }
        }
        let mut exits = Vec::new();
        for (s, handle) in std::mem::take(&mut self.threads) {
            // A thread that sent its notice has left its body: joining it returns at once.
            if ended.contains(&s) {
                if let Ok(exit) = handle.join() {
                    exits.push(exit);
                }
            } else {
                tracing::warn!(stream = s, "stream thread still inside a kernel after the abort; leaving it behind");
            }
        }
        Joined { exits, at }
    }

    fn stop_helpers(&mut self) {
        if let Some(mut net) = self.net.take() {
            net.finish();
        }
        if let Some((stop, handle)) = self.watchdog.take() {
            drop(stop);
            let _ = handle.join();
        }
        self.arenas.take();
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            // Dropped without `wait`: stop the threads rather than leave them running.
            self.shared.abort(RuntimeError::Stopped, &self.router);
            self.join_threads();
        }
        self.stop_helpers();
    }
}

/// `wait`'s watch over fetchers only the waiting thread could read (see [`Job::wait`]).
#[derive(Debug, Default)]
struct UnreadWatch {
    /// The fetcher found full and unread, its pieces received and the job's firings then,
    /// and since when.
    seen: Option<(usize, u64, u64, Instant)>,
}

impl UnreadWatch {
    /// The error to abort with once a fetcher stayed full, unread and idle for the grace.
    fn check(&mut self, user: &UserWaits, shared: &JobShared) -> Option<RuntimeError> {
        if shared.aborting.load(crate::sync::Ordering::Acquire) {
            return None;
        }
        let fires: u64 = shared.probes.iter().map(|p| p.fires.load(crate::sync::Ordering::Relaxed)).sum();
        let Some((fetch, received)) = user.unread_by(thread_token()) else {
            self.seen = None;
            return None;
        };
        match self.seen {
            Some((f, r, n, since)) if (f, r, n) == (fetch, received, fires) => {
                if since.elapsed() < UNREAD_GRACE {
                    return None;
                }
                let record = &user.fetches[fetch];
                Some(RuntimeError::UnreadFetcher { sink: record.sink.clone(), unread: record.unread() })
            }
            _ => {
                self.seen = Some((fetch, received, fires, Instant::now()));
                None
            }
        }
    }
}

/// Stream threads that ended, and when the last one did.
struct Joined {
    exits: Vec<StreamExit>,
    at: Instant,
}
