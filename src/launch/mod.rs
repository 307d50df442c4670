//! Starting the processes of a multi-process job on this host, as `torchrun --standalone` does.
//!
//! [`launch`] picks a loopback port for the control plane (unless one is given), starts one
//! process per node with the torchrun variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), `REGFLOW_DEVICES_PER_NODE` and, when
//! the caller has no secret of its own, a fresh `REGFLOW_SECRET`. It forwards each rank's
//! output line by line with a `[rank k] ` prefix, or captures it per rank, and when one rank
//! fails it gives the others a grace period to end by themselves, then stops them.
//!
//! Each rank runs in a process group of its own, so stopping a rank stops whatever it
//! started too (a shell wrapper's children, data loader workers). On Linux a rank also gets
//! `SIGTERM` if the launching process dies without stopping it.
//!
//! With [`LaunchOptions::max_restarts`], a failed job is started again as a whole, each
//! attempt with a fresh port and `REGFLOW_RESTART` (and torchrun's
//! `TORCHELASTIC_RESTART_COUNT`) counting the attempts from 0, so the program resumes from
//! its latest checkpoint. With [`LaunchOptions::min_nodes`] the job is elastic: a rank killed
//! by a signal counts as a lost node and the next attempt has one node fewer per lost rank,
//! down to `min_nodes`.
//!
//! ```
//! use regflow::launch::{launch, LaunchOptions};
//!
//! let mut options = LaunchOptions::new(2, "sh");
//! options.args = vec!["-c".into(), "echo rank $RANK of $WORLD_SIZE".into()];
//! options.capture = true;
//! let outcome = launch(&options)?;
//! assert!(outcome.success());
//! assert_eq!(outcome.ranks[1].stdout, "rank 1 of 2\n");
//! # Ok::<(), regflow::launch::LaunchError>(())
//! ```

mod rank;
mod restart;

use rank::{stop, Rank, Watch};
use restart::Next;
use std::ffi::OsString;
use std::io::Read;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::AtomicBool;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// How long the launcher waits for the last output of ranks that have all ended: a process a
/// rank left behind may hold its pipes open, and the launcher does not wait for it.
const OUTPUT_GRACE: Duration = Duration::from_secs(2);

/// Variables other launchers set that name a rank or a world size. They are removed from
/// the ranks' environment, so a launcher started inside an `srun` or `mpirun` step does
/// not hand its own rank to every process it starts.
const FOREIGN_RANK_VARIABLES: &[&str] = &[
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_NPROCS",
    "SLURM_LOCALID",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "JOB_COMPLETION_INDEX",
];

/// What to start and how.
#[derive(Debug, Clone)]
pub struct LaunchOptions {
    /// Processes to start, one per node; rank `k` is node `k`. In an elastic job (with
    /// `min_nodes`) the most there can be: the first attempt starts this many.
    pub nodes: u32,
    /// Devices each node drives (`REGFLOW_DEVICES_PER_NODE`).
    pub devices_per_node: u32,
    /// Port of the control plane on rank 0 (`MASTER_PORT`); `None` picks a free one.
    pub master_port: Option<u16>,
    /// How long the other ranks may run after one has failed before they are stopped.
    pub grace: Duration,
    /// The program every rank runs (looked up in `PATH` when it has no `/`).
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Further variables for every rank, set after the launcher's own (so they win).
    pub env: Vec<(String, String)>,
    /// `true`: keep each rank's output in its [`RankOutcome`] and print nothing;
    /// `false`: forward it to this process's stdout and stderr, each line prefixed
    /// `[rank k] `, and report failures and stopped ranks on stderr as they happen.
    pub capture: bool,
    /// Set to `true` (by a signal handler, say) to stop every rank at once.
    pub stop: Option<Arc<AtomicBool>>,
    /// How many times the whole job is started again after it failed: once a rank has
    /// failed and the others were stopped, every rank starts anew with a fresh
    /// `MASTER_PORT` (unless `master_port` is given) and `REGFLOW_RESTART` one higher.
    pub max_restarts: u32,
    /// `Some(min)` makes the job elastic (torchrun's `--nnodes MIN:MAX`, with `nodes` the
    /// maximum): each rank an attempt loses to a signal counts as a lost node, and the
    /// restart runs with that many nodes fewer, as long as at least `min` remain; below, the
    /// launcher gives up. `None`: every attempt has `nodes` ranks, whatever ended them.
    pub min_nodes: Option<u32>,
}

impl LaunchOptions {
    /// `nodes` copies of `program` without arguments: one device per node, a free port,
    /// 10 seconds of grace, output forwarded, no restarts, a fixed number of nodes.
    pub fn new(nodes: u32, program: impl Into<PathBuf>) -> Self {
        Self {
            nodes,
            devices_per_node: 1,
            master_port: None,
            grace: Duration::from_secs(10),
            program: program.into(),
            args: Vec::new(),
            env: Vec::new(),
            capture: false,
            stop: None,
            max_restarts: 0,
            min_nodes: None,
        }
    }
}

/// How one rank ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankStatus {
    /// It exited by itself with this status.
    Exited(i32),
    /// It was killed by this signal, not by the launcher.
    Signaled(i32),
    /// It was still running when the launcher stopped the job (after another rank failed,
    /// or when the launcher was asked to stop).
    Stopped,
}

impl RankStatus {
    /// Whether the rank exited with status 0.
    pub fn success(self) -> bool {
        self == RankStatus::Exited(0)
    }

    fn of(status: ExitStatus) -> Self {
        match (status.code(), status.signal()) {
            (Some(code), _) => RankStatus::Exited(code),
            (None, Some(signal)) => RankStatus::Signaled(signal),
            // Neither a code nor a signal is not a state a reaped child can be in.
            (None, None) => RankStatus::Exited(-1),
        }
    }
}

impl std::fmt::Display for RankStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RankStatus::Exited(code) => write!(f, "exited with status {code}"),
            RankStatus::Signaled(signal) => write!(f, "was killed by signal {signal}"),
            RankStatus::Stopped => write!(f, "was still running and was stopped"),
        }
    }
}

/// One rank of a finished launch.
#[derive(Debug, Clone)]
pub struct RankOutcome {
    /// Its rank (and node).
    pub rank: u32,
    /// How it ended.
    pub status: RankStatus,
    /// What it wrote to stdout, when captured (invalid UTF-8 replaced); empty otherwise.
    pub stdout: String,
    /// What it wrote to stderr, when captured; empty otherwise.
    pub stderr: String,
}

/// One start of the whole job: its size and what became of each rank.
#[derive(Debug, Clone)]
pub struct AttemptOutcome {
    /// 0 for the first start, then 1, 2, … (the ranks' `REGFLOW_RESTART`).
    pub attempt: u32,
    /// How many ranks it started (their `WORLD_SIZE`).
    pub world_size: u32,
    /// The control plane's port its ranks were given.
    pub master_port: u16,
    /// One entry per rank, in rank order.
    pub ranks: Vec<RankOutcome>,
    /// The first rank that failed, whose failure stopped the others.
    pub first_failure: Option<u32>,
    /// Whether it was stopped through [`LaunchOptions::stop`].
    pub interrupted: bool,
}

impl AttemptOutcome {
    /// Whether every rank exited with status 0.
    pub fn success(&self) -> bool {
        !self.interrupted && self.ranks.iter().all(|r| r.status.success())
    }

    /// The rank whose failure ended the attempt. A rank the launcher stopped is never the
    /// cause: it is reported as [`RankStatus::Stopped`] and not counted here.
    pub fn failure(&self) -> Option<&RankOutcome> {
        self.first_failure.and_then(|rank| self.ranks.iter().find(|r| r.rank == rank))
    }

    /// The ranks killed by a signal (not by the launcher), in rank order: the nodes an
    /// elastic job counts as lost.
    pub fn lost_ranks(&self) -> Vec<u32> {
        self.ranks.iter().filter(|r| matches!(r.status, RankStatus::Signaled(_))).map(|r| r.rank).collect()
    }
}

/// What became of every rank, in the last attempt and in each one before it.
#[derive(Debug, Clone)]
pub struct LaunchOutcome {
    /// The control plane's port the ranks of the last attempt were given.
    pub master_port: u16,
    /// One entry per rank of the last attempt, in rank order.
    pub ranks: Vec<RankOutcome>,
    /// The first rank that failed in the last attempt, whose failure stopped the others.
    pub first_failure: Option<u32>,
    /// Whether the job was stopped through [`LaunchOptions::stop`], during the last attempt
    /// or before it could be started again.
    pub interrupted: bool,
    /// Every attempt, the first one first; the last one is the one the fields above
    /// describe. One entry unless the job was restarted.
    pub attempts: Vec<AttemptOutcome>,
    /// `Some(n)` when the launcher gave up on an elastic job because the nodes lost in the
    /// last attempt would have left `n` nodes, fewer than [`LaunchOptions::min_nodes`].
    pub too_few_nodes: Option<u32>,
}

impl LaunchOutcome {
    /// Whether every rank of the last attempt exited with status 0.
    pub fn success(&self) -> bool {
        !self.interrupted && self.ranks.iter().all(|r| r.status.success())
    }

    /// The rank whose failure ended the last attempt, and how it ended.
    pub fn failure(&self) -> Option<&RankOutcome> {
        self.first_failure.and_then(|rank| self.ranks.iter().find(|r| r.rank == rank))
    }
}

/// Why the ranks could not be started or watched.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// `nodes` was 0.
    #[error("cannot launch a job of 0 nodes: it needs at least one")]
    NoNodes,
    /// `min_nodes` was 0 or more than `nodes`.
    #[error(
        "cannot launch an elastic job of at least {min_nodes} and at most {nodes} nodes: the minimum must be \
         at least 1 and at most the maximum"
    )]
    NodeRange {
        /// The minimum asked for.
        min_nodes: u32,
        /// The maximum (`nodes`).
        nodes: u32,
    },
    /// `devices_per_node` was 0.
    #[error("cannot launch a job with 0 devices per node: each node needs at least one")]
    NoDevices,
    /// No loopback port could be bound for `MASTER_PORT`.
    #[error("cannot find a free port on 127.0.0.1 for MASTER_PORT: {source}")]
    Port {
        /// The OS error.
        source: std::io::Error,
    },
    /// `/dev/urandom` could not be read for `REGFLOW_SECRET`.
    #[error("cannot draw a REGFLOW_SECRET from /dev/urandom: {source}")]
    Secret {
        /// The OS error.
        source: std::io::Error,
    },
    /// The program could not be started; the ranks started before it were stopped.
    #[error("cannot start {program} for rank {rank}: {source}")]
    Spawn {
        /// The rank it was started for.
        rank: u32,
        /// The program as given.
        program: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A rank's state could not be read; every rank was stopped.
    #[error("cannot wait for rank {rank} (pid {pid}): {source}")]
    Wait {
        /// The rank.
        rank: u32,
        /// Its process id.
        pid: u32,
        /// The OS error.
        source: std::io::Error,
    },
}

/// Starts `options.nodes` processes, waits for all of them, and says how each ended;
/// starts the job again after a failure, up to `options.max_restarts` times.
///
/// Returns `Ok` whenever the ranks could be started, also when some failed: look at
/// [`LaunchOutcome::success`]. When a rank fails, the others get `options.grace` to end by
/// themselves; those still running then get `SIGTERM` and, 2 seconds later, `SIGKILL`
/// (each to its whole process group), and are reported as [`RankStatus::Stopped`]. An
/// error in a later attempt (a program that cannot be started any more) is returned as
/// such, without the attempts before it.
pub fn launch(options: &LaunchOptions) -> Result<LaunchOutcome, LaunchError> {
    if options.nodes == 0 {
        return Err(LaunchError::NoNodes);
    }
    if let Some(min_nodes) = options.min_nodes.filter(|&min| min == 0 || min > options.nodes) {
        return Err(LaunchError::NodeRange { min_nodes, nodes: options.nodes });
    }
    if options.devices_per_node == 0 {
        return Err(LaunchError::NoDevices);
    }
    let mut attempts: Vec<AttemptOutcome> = Vec::new();
    let mut world_size = options.nodes;
    let (last, too_few_nodes, stopped_between) = loop {
        let previous = attempts.last();
        let master_port = match options.master_port {
            Some(port) => port,
            None => fresh_port(previous.map(|a| a.master_port))?,
        };
        let start = AttemptStart {
            attempt: attempts.len() as u32,
            world_size,
            world_changed: previous.is_some_and(|a| a.world_size != world_size),
            master_port,
        };
        let outcome = run_attempt(options, &start)?;
        match restart::next(options, &outcome) {
            Next::Finish => break (outcome, None, false),
            Next::Interrupted => break (outcome, None, true),
            Next::TooFewNodes { remaining } => break (outcome, Some(remaining), false),
            Next::Restart { world_size: next_size } => {
                world_size = next_size;
                attempts.push(outcome);
            }
        }
    };
    attempts.push(last.clone());
    Ok(LaunchOutcome {
        master_port: last.master_port,
        ranks: last.ranks,
        first_failure: last.first_failure,
        interrupted: last.interrupted || stopped_between,
        attempts,
        too_few_nodes,
    })
}

/// What one attempt's ranks are told besides their rank.
#[derive(Debug, Clone, Copy)]
struct AttemptStart {
    /// `REGFLOW_RESTART`.
    attempt: u32,
    /// `WORLD_SIZE`.
    world_size: u32,
    /// `REGFLOW_WORLD_CHANGED`: whether the previous attempt had another size.
    world_changed: bool,
    /// `MASTER_PORT`.
    master_port: u16,
}

/// Starts one attempt's ranks and waits until every one has ended.
fn run_attempt(options: &LaunchOptions, start: &AttemptStart) -> Result<AttemptOutcome, LaunchError> {
    let secret =
        if has_secret(options) { None } else { Some(fresh_secret().map_err(|source| LaunchError::Secret { source })?) };
    let (done_sender, done) = mpsc::channel();
    let mut ranks: Vec<Rank> = Vec::new();
    for rank in 0..start.world_size {
        let command = rank_command(options, start, rank, secret.as_deref());
        match Rank::start(rank, command, options.capture, &done_sender) {
            Ok(started) => ranks.push(started),
            Err(source) => {
                stop(&mut ranks, false);
                return Err(LaunchError::Spawn { rank, program: options.program.display().to_string(), source });
            }
        }
    }
    drop(done_sender);
    let mut watch = Watch { options, ranks, first_failure: None, interrupted: false };
    watch.run()?;
    let Watch { mut ranks, first_failure, interrupted, .. } = watch;
    // Every rank has ended; its pipes close unless something it left behind holds them.
    let deadline = Instant::now() + OUTPUT_GRACE;
    for _ in 0..2 * ranks.len() {
        if done.recv_timeout(deadline.saturating_duration_since(Instant::now())).is_err() {
            break;
        }
    }
    let outcomes = ranks
        .iter_mut()
        .map(|r| RankOutcome {
            rank: r.rank,
            status: r.status.unwrap_or(RankStatus::Stopped),
            stdout: r.stdout.take(),
            stderr: r.stderr.take(),
        })
        .collect();
    Ok(AttemptOutcome {
        attempt: start.attempt,
        world_size: start.world_size,
        master_port: start.master_port,
        ranks: outcomes,
        first_failure,
        interrupted,
    })
}

/// The command of one rank: the program, its arguments and its environment.
fn rank_command(options: &LaunchOptions, start: &AttemptStart, rank: u32, secret: Option<&str>) -> Command {
    let mut command = Command::new(&options.program);
    command.args(&options.args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    for name in FOREIGN_RANK_VARIABLES {
        command.env_remove(name);
    }
    let nodes = start.world_size.to_string();
    command
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", &nodes)
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", &nodes)
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", start.master_port.to_string())
        .env("REGFLOW_DEVICES_PER_NODE", options.devices_per_node.to_string())
        .env("REGFLOW_RESTART", start.attempt.to_string())
        .env("TORCHELASTIC_RESTART_COUNT", start.attempt.to_string())
        .env("TORCHELASTIC_MAX_RESTARTS", options.max_restarts.to_string())
        .env("REGFLOW_WORLD_CHANGED", if start.world_changed { "1" } else { "0" });
    if let Some(secret) = secret {
        command.env("REGFLOW_SECRET", secret);
    }
    command.envs(options.env.iter().map(|(name, value)| (name, value)));
    // A group of its own, so that stopping the rank stops what it started too.
    command.process_group(0);
    #[cfg(target_os = "linux")]
    {
        // SAFETY: `getpid` is called before the fork; the closure runs in the child between
        // fork and exec and calls only async-signal-safe functions (prctl, getppid, _exit).
        let launcher = unsafe { libc::getpid() };
        unsafe {
            command.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The launcher died before the prctl took effect: nobody would stop this rank.
                if libc::getppid() != launcher {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
    }
    command
}

/// Whether the caller has a secret for the ranks already.
fn has_secret(options: &LaunchOptions) -> bool {
    let names = ["REGFLOW_SECRET", "REGFLOW_SECRET_FILE"];
    names.iter().any(|name| std::env::var_os(name).is_some())
        || options.env.iter().any(|(name, _)| names.contains(&name.as_str()))
}

/// A port nothing listens on right now, other than `previous` (the last attempt's, whose
/// sockets may linger). Another process could take it before rank 0 binds it;
/// `torchrun --standalone` takes the same chance.
fn fresh_port(previous: Option<u16>) -> Result<u16, LaunchError> {
    let free = || -> std::io::Result<u16> { Ok(std::net::TcpListener::bind(("127.0.0.1", 0))?.local_addr()?.port()) };
    let mut port = free().map_err(|source| LaunchError::Port { source })?;
    // The kernel seldom hands out the same port twice in a row; a few tries are plenty.
    for _ in 0..8 {
        if Some(port) != previous {
            break;
        }
        port = free().map_err(|source| LaunchError::Port { source })?;
    }
    Ok(port)
}

/// 32 random bytes as 64 lowercase hex digits.
fn fresh_secret() -> std::io::Result<String> {
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}
