//! Where a node's rank, world size and master come from: command-line flags or a launcher.
//!
//! A launcher is recognised by its variables, first match wins:
//!
//! | launcher | rank | world | local rank | master |
//! |---|---|---|---|---|
//! | torchrun | `RANK` | `WORLD_SIZE` | `LOCAL_RANK` | `MASTER_ADDR`, `MASTER_PORT` |
//! | Slurm (`srun`) | `SLURM_PROCID` | `SLURM_NTASKS` (or `SLURM_NPROCS`) | `SLURM_LOCALID` | `MASTER_ADDR`, else the first host of the step's or job's node list |
//! | Open MPI (`mpirun`) | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK` | `MASTER_ADDR` |
//! | PMI (MPICH, Intel MPI) | `PMI_RANK` | `PMI_SIZE` | `MPI_LOCALRANKID` or `PMI_LOCAL_RANK` | `MASTER_ADDR` |
//!
//! A missing local rank is 0, a missing `MASTER_ADDR` is [`DEFAULT_MASTER_ADDR`] (except
//! under Slurm) and a missing `MASTER_PORT` is [`DEFAULT_MASTER_PORT`]. Torchrun comes first
//! because it is often started by one of the others: its variables describe the processes
//! that actually run.

use std::fmt;

mod nodelist;
#[cfg(test)]
mod tests;

pub use nodelist::{expand_nodelist, MAX_NODELIST_HOSTS};

/// The master's port when `MASTER_PORT` is not set (the port torchrun uses too).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// The master's host when a launcher other than Slurm sets no `MASTER_ADDR`.
pub const DEFAULT_MASTER_ADDR: &str = "127.0.0.1";

/// Node lists Slurm may set, the step's first.
const SLURM_NODELIST_VARS: [&str; 3] = ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"];

/// Who this node is in the job and where rank 0's control plane listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterEnv {
    /// This node's rank.
    pub rank: u32,
    /// The number of ranks.
    pub world: u32,
    /// This node's index among the ranks on its host (which local devices it uses).
    pub local_rank: u32,
    /// Rank 0's host (a name or an IP address, without brackets).
    pub master_addr: String,
    /// The port of rank 0's control plane.
    pub master_port: u16,
    /// Where all this came from.
    pub source: LaunchSource,
}

/// What launched this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaunchSource {
    /// `--rank`, `--world` and `--master` on the command line.
    Flags,
    /// PyTorch's `torchrun` (or anything setting its variables).
    Torchrun,
    /// Slurm's `srun`.
    Slurm,
    /// Open MPI's `mpirun`.
    OpenMpi,
    /// A PMI launcher (MPICH's or Intel MPI's `mpiexec`).
    Pmi,
}

impl fmt::Display for LaunchSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LaunchSource::Flags => "flags",
            LaunchSource::Torchrun => "torchrun",
            LaunchSource::Slurm => "Slurm",
            LaunchSource::OpenMpi => "Open MPI",
            LaunchSource::Pmi => "PMI",
        })
    }
}

/// A launcher's variables or flags that do not describe a job. Each names the variable and
/// its value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    /// A value that must be a number is not.
    #[error("{var}='{value}' is not a number")]
    NotANumber {
        /// The variable or flag.
        var: String,
        /// Its value.
        value: String,
    },
    /// A world of no ranks.
    #[error("{var}=0, but a job has at least one rank")]
    ZeroWorld {
        /// The variable or flag.
        var: String,
    },
    /// A rank (or local rank) not below the world size.
    #[error("{rank_var}={rank} is not below {world_var}={world} (ranks count from 0)")]
    RankOutOfRange {
        /// The rank's variable.
        rank_var: String,
        /// The rank.
        rank: u32,
        /// The world size's variable.
        world_var: String,
        /// The world size.
        world: u32,
    },
    /// One of a launcher's variables without its partner.
    #[error("{present} is set but {missing} is not; a launch by {launcher} sets both")]
    Partial {
        /// The launcher.
        launcher: LaunchSource,
        /// The variable set.
        present: String,
        /// The variable missing.
        missing: String,
    },
    /// A port outside 1 to 65535.
    #[error("{var}='{value}' is not a port (1 to 65535)")]
    PortOutOfRange {
        /// The variable or flag.
        var: String,
        /// Its value.
        value: String,
    },
    /// An empty master host.
    #[error("{var}='{value}' names no host; it must name rank 0's host")]
    EmptyMaster {
        /// The variable or flag.
        var: String,
        /// Its value.
        value: String,
    },
    /// A master without a port.
    #[error("{var}='{value}' has no port; write it as host:port, e.g. node1:29500")]
    NoPort {
        /// The flag.
        var: String,
        /// Its value.
        value: String,
    },
    /// A Slurm launch of several ranks with no node list and no `MASTER_ADDR`.
    #[error("a Slurm launch of {world} ranks sets no node list (SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, SLURM_NODELIST) to find rank 0's host in; set MASTER_ADDR")]
    NoSlurmMaster {
        /// The world size.
        world: u32,
    },
    /// A Slurm node list that does not parse.
    #[error("the Slurm node list '{list}' is malformed: {reason}")]
    Nodelist {
        /// The list.
        list: String,
        /// What is wrong.
        reason: String,
    },
    /// A Slurm node list expanding to too many hosts.
    #[error("the Slurm node list '{list}' expands to more than {MAX_NODELIST_HOSTS} hosts")]
    TooManyHosts {
        /// The list.
        list: String,
    },
}

/// The variables of one launcher.
struct Launcher {
    source: LaunchSource,
    rank: &'static str,
    /// The world size's variables, the first one set is used.
    world: &'static [&'static str],
    /// The local rank's variables, the first one set is used; none set means 0.
    local_rank: &'static [&'static str],
}

const LAUNCHERS: [Launcher; 4] = [
    Launcher { source: LaunchSource::Torchrun, rank: "RANK", world: &["WORLD_SIZE"], local_rank: &["LOCAL_RANK"] },
    Launcher {
        source: LaunchSource::Slurm,
        rank: "SLURM_PROCID",
        world: &["SLURM_NTASKS", "SLURM_NPROCS"],
        local_rank: &["SLURM_LOCALID"],
    },
    Launcher {
        source: LaunchSource::OpenMpi,
        rank: "OMPI_COMM_WORLD_RANK",
        world: &["OMPI_COMM_WORLD_SIZE"],
        local_rank: &["OMPI_COMM_WORLD_LOCAL_RANK"],
    },
    Launcher {
        source: LaunchSource::Pmi,
        rank: "PMI_RANK",
        world: &["PMI_SIZE"],
        local_rank: &["MPI_LOCALRANKID", "PMI_LOCAL_RANK"],
    },
];

impl ClusterEnv {
    /// The job as the process environment's launcher variables describe it; `None` when no
    /// launcher's variables are set.
    pub fn from_env() -> Result<Option<ClusterEnv>, EnvError> {
        ClusterEnv::from_vars(|name| std::env::var_os(name).map(|value| value.to_string_lossy().into_owned()))
    }

    /// [`ClusterEnv::from_env`] with the variables looked up through `get`.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<ClusterEnv>, EnvError> {
        let first_set = |names: &[&'static str]| names.iter().find_map(|&name| get(name).map(|value| (name, value)));
        for launcher in &LAUNCHERS {
            let (rank, world) = match (get(launcher.rank), first_set(launcher.world)) {
                (None, None) => continue,
                (Some(rank), Some(world)) => ((launcher.rank, rank), world),
                (Some(_), None) => return Err(partial(launcher.source, launcher.rank, launcher.world[0])),
                (None, Some((world_var, _))) => return Err(partial(launcher.source, world_var, launcher.rank)),
            };
            let (rank, world) = (number(rank.0, &rank.1)?, (world.0, number(world.0, &world.1)?));
            let local_rank = match first_set(launcher.local_rank) {
                Some((var, value)) => (var, number(var, &value)?),
                None => ("local rank", 0),
            };
            check_ranks((launcher.rank, rank), world, local_rank)?;
            let (master_addr, master_port) = master(launcher.source, world.1, &get)?;
            let env = ClusterEnv {
                rank,
                world: world.1,
                local_rank: local_rank.1,
                master_addr,
                master_port,
                source: launcher.source,
            };
            return Ok(Some(env));
        }
        Ok(None)
    }

    /// The job as the command line gives it: `--rank`, `--world` and `--master host:port`
    /// (an IPv6 master in brackets: `[fe80::1]:29500`).
    pub fn from_flags(rank: u32, world: u32, master: &str) -> Result<ClusterEnv, EnvError> {
        check_ranks(("--rank", rank), ("--world", world), ("local rank", 0))?;
        let flag = |value: &str| ("--master".to_string(), value.to_string());
        let Some((host, port)) = master.rsplit_once(':') else {
            let (var, value) = flag(master);
            return Err(EnvError::NoPort { var, value });
        };
        let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
        if host.trim().is_empty() {
            let (var, value) = flag(master);
            return Err(EnvError::EmptyMaster { var, value });
        }
        let master_port = port_number("--master", port).map_err(|_| {
            let (var, value) = flag(master);
            EnvError::PortOutOfRange { var, value }
        })?;
        let master_addr = host.to_string();
        Ok(ClusterEnv { rank, world, local_rank: 0, master_addr, master_port, source: LaunchSource::Flags })
    }

    /// The master as `host:port`, an IPv6 address in brackets: what `connect` takes.
    pub fn master(&self) -> String {
        if self.master_addr.contains(':') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }
}

fn partial(source: LaunchSource, present: &str, missing: &str) -> EnvError {
    EnvError::Partial { launcher: source, present: present.to_string(), missing: missing.to_string() }
}

fn number(var: &str, value: &str) -> Result<u32, EnvError> {
    value.trim().parse().map_err(|_| EnvError::NotANumber { var: var.to_string(), value: value.to_string() })
}

/// Checks that the world has ranks and both ranks are inside it; each pair is (name, value).
fn check_ranks(rank: (&str, u32), world: (&str, u32), local_rank: (&str, u32)) -> Result<(), EnvError> {
    if world.1 == 0 {
        return Err(EnvError::ZeroWorld { var: world.0.to_string() });
    }
    for (rank_var, rank) in [rank, local_rank] {
        if rank >= world.1 {
            let (rank_var, world_var) = (rank_var.to_string(), world.0.to_string());
            return Err(EnvError::RankOutOfRange { rank_var, rank, world_var, world: world.1 });
        }
    }
    Ok(())
}

fn port_number(var: &str, value: &str) -> Result<u16, EnvError> {
    let port: u64 = value.trim().parse().map_err(|_| EnvError::NotANumber { var: var.into(), value: value.into() })?;
    match u16::try_from(port) {
        Ok(port) if port != 0 => Ok(port),
        _ => Err(EnvError::PortOutOfRange { var: var.to_string(), value: value.to_string() }),
    }
}

/// The master's host and port for a launch by `source`.
fn master(source: LaunchSource, world: u32, get: &impl Fn(&str) -> Option<String>) -> Result<(String, u16), EnvError> {
    let port = match get("MASTER_PORT") {
        Some(value) => port_number("MASTER_PORT", &value)?,
        None => DEFAULT_MASTER_PORT,
    };
    if let Some(addr) = get("MASTER_ADDR") {
        if addr.trim().is_empty() {
            return Err(EnvError::EmptyMaster { var: "MASTER_ADDR".to_string(), value: addr });
        }
        return Ok((addr.trim().to_string(), port));
    }
    if source != LaunchSource::Slurm {
        return Ok((DEFAULT_MASTER_ADDR.to_string(), port));
    }
    match SLURM_NODELIST_VARS.iter().find_map(|&var| get(var)) {
        Some(list) => {
            let hosts = expand_nodelist(&list)?;
            // expand_nodelist never returns an empty list; the fallback only keeps this total.
            Ok((hosts.into_iter().next().unwrap_or_else(|| DEFAULT_MASTER_ADDR.to_string()), port))
        }
        None if world == 1 => Ok((DEFAULT_MASTER_ADDR.to_string(), port)),
        None => Err(EnvError::NoSlurmMaster { world }),
    }
}
