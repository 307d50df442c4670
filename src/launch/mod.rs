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

use rank::{stop, Rank, Watch};
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
    /// Processes to start, one per node; rank `k` is node `k`.
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
}

impl LaunchOptions {
    /// `nodes` copies of `program` without arguments: one device per node, a free port,
    /// 10 seconds of grace, output forwarded.
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

/// What became of every rank.
#[derive(Debug, Clone)]
pub struct LaunchOutcome {
    /// The control plane's port the ranks were given.
    pub master_port: u16,
    /// One entry per rank, in rank order.
    pub ranks: Vec<RankOutcome>,
    /// The first rank that failed, whose failure stopped the others.
    pub first_failure: Option<u32>,
    /// Whether the job was stopped through [`LaunchOptions::stop`].
    pub interrupted: bool,
}

impl LaunchOutcome {
    /// Whether every rank exited with status 0.
    pub fn success(&self) -> bool {
        !self.interrupted && self.ranks.iter().all(|r| r.status.success())
    }
}

/// Why the ranks could not be started or watched.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// `nodes` was 0.
    #[error("cannot launch a job of 0 nodes: it needs at least one")]
    NoNodes,
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

/// Starts `options.nodes` processes, waits for all of them, and says how each ended.
///
/// Returns `Ok` whenever the ranks could be started, also when some failed: look at
/// [`LaunchOutcome::success`]. When a rank fails, the others get `options.grace` to end by
/// themselves; those still running then get `SIGTERM` and, 2 seconds later, `SIGKILL`
/// (each to its whole process group), and are reported as [`RankStatus::Stopped`].
pub fn launch(options: &LaunchOptions) -> Result<LaunchOutcome, LaunchError> {
    if options.nodes == 0 {
        return Err(LaunchError::NoNodes);
    }
    if options.devices_per_node == 0 {
        return Err(LaunchError::NoDevices);
    }
    let master_port = match options.master_port {
        Some(port) => port,
        None => free_loopback_port().map_err(|source| LaunchError::Port { source })?,
    };
    let secret =
        if has_secret(options) { None } else { Some(fresh_secret().map_err(|source| LaunchError::Secret { source })?) };
    let (done_sender, done) = mpsc::channel();
    let mut ranks: Vec<Rank> = Vec::new();
    for rank in 0..options.nodes {
        let command = rank_command(options, rank, master_port, secret.as_deref());
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
    Ok(LaunchOutcome { master_port, ranks: outcomes, first_failure, interrupted })
}

/// The command of one rank: the program, its arguments and its environment.
fn rank_command(options: &LaunchOptions, rank: u32, master_port: u16, secret: Option<&str>) -> Command {
    let mut command = Command::new(&options.program);
    command.args(&options.args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    for name in FOREIGN_RANK_VARIABLES {
        command.env_remove(name);
    }
    let nodes = options.nodes.to_string();
    command
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", &nodes)
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", &nodes)
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", master_port.to_string())
        .env("REGFLOW_DEVICES_PER_NODE", options.devices_per_node.to_string());
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

/// A port nothing listens on right now. Another process could take it before rank 0
/// binds it; `torchrun --standalone` takes the same chance.
fn free_loopback_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind(("127.0.0.1", 0))?.local_addr()?.port())
}

/// 32 random bytes as 64 lowercase hex digits.
fn fresh_secret() -> std::io::Result<String> {
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}
