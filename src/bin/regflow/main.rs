//! `regflow`: inspect and run regflow plans from the command line.
//!
//! ```text
//! regflow plan show <plan.json> [--actors]     per device: streams, actors by kind, peak memory
//! regflow plan dot <plan.json> [-o out.dot]    Graphviz: devices as clusters, boxing highlighted
//! regflow run <plan.json> [--feeds feeds.safetensors] [--steps N] [--threads T] [--data-dir DIR]
//! regflow launch --nodes N|MIN:MAX [--max-restarts R] [--devices-per-node K] [--master-port P] [--grace S]
//!                -- PROGRAM [ARGS...]
//! regflow trace merge <out.json> <in.json>...  one Perfetto timeline from each node's trace
//! regflow env                                  the CPU, products, CUDA, NVRTC and kernel cache
//! ```
//!
//! A plan file is the JSON that `Plan::to_json` writes; `-` reads it from stdin. The file is
//! validated as the runtime would validate it before anything is printed, so a plan that
//! `regflow plan show` accepts is one `Job::builder` accepts too. `regflow run` runs it by
//! itself and prints one line per step with its scalar outputs (`step 0 loss 2.3025851`).

mod describe;
mod dot;
mod env;
mod feeds;
mod launch;
mod run;
mod show;
mod trace;

use clap::{Parser, Subcommand};
use regflow::graph::plan::{Plan, PlanError};
use regflow::runtime::RuntimeError;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Command line of the `regflow` tool.
#[derive(Debug, Parser)]
#[command(name = "regflow", version, about = "Inspect and run regflow plans", propagate_version = true)]
struct Cli {
    /// What to do.
    #[command(subcommand)]
    command: Command,
}

/// Top-level commands.
#[derive(Debug, Subcommand)]
enum Command {
    /// Inspect a plan file (the JSON that `Plan::to_json` writes).
    #[command(subcommand)]
    Plan(PlanCommand),
    /// Run a plan file by itself and print its scalar outputs, one line per step.
    ///
    /// Kernels come from the registry and variables from their initializers. Fed inputs
    /// take their values from `--feeds`: a safetensors file with one tensor per input of
    /// the plan's signature, named after it, of the input's dtype and shape
    /// `[steps, ...input shape]`; step k feeds row k. A plan whose source reads a dataset
    /// file needs no feeds. Each line reads `step k loss v`, then `name v` for every
    /// further scalar output; floats are printed in their shortest round-trip form.
    Run {
        /// Plan file (JSON); `-` reads stdin.
        plan: PathBuf,
        /// Values of the plan's fed inputs (safetensors, see above).
        #[arg(long, value_name = "FILE")]
        feeds: Option<PathBuf>,
        /// Steps to run: the first N rows of the feeds, or N pieces of every dataset source
        /// (default: every row of the feeds, or the pieces the plan names).
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
        steps: Option<u64>,
        /// Threads one cpu kernel may use (results are bitwise the same for any count).
        #[arg(long, value_name = "T", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
        threads: u16,
        /// Directory relative dataset paths resolve against (default: the plan file's).
        #[arg(long, value_name = "DIR")]
        data_dir: Option<PathBuf>,
        /// Which node of a multi-node plan this process runs.
        #[command(flatten)]
        node: NodeFlags,
    },
    /// Run one node of a multi-node job whose plan rank 0 shares.
    ///
    /// Joins the cluster (rank, world and master from `--rank/--world/--master`, or from
    /// the variables of torchrun, Slurm, Open MPI or PMI; see docs/distributed.md), takes
    /// the plan rank 0 runs (`regflow run plan.json` there), and runs this node's actors:
    /// its dataset sources read their own shards; fed inputs need `--feeds`, as on rank 0.
    /// The node that receives the first output prints the step lines.
    Daemon {
        /// Values of the plan's fed inputs (safetensors, as for `run`).
        #[arg(long, value_name = "FILE")]
        feeds: Option<PathBuf>,
        /// Threads one cpu kernel may use.
        #[arg(long, value_name = "T", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
        threads: u16,
        /// Directory relative dataset paths resolve against (default: the working directory).
        #[arg(long, value_name = "DIR")]
        data_dir: Option<PathBuf>,
        /// Which node this process runs.
        #[command(flatten)]
        node: NodeFlags,
    },
    /// Start one process per node on this host, as `torchrun --standalone` does.
    ///
    /// Each rank gets RANK, WORLD_SIZE, LOCAL_RANK (= RANK), LOCAL_WORLD_SIZE,
    /// MASTER_ADDR=127.0.0.1, MASTER_PORT, REGFLOW_DEVICES_PER_NODE and, unless
    /// REGFLOW_SECRET or REGFLOW_SECRET_FILE is set, a fresh random REGFLOW_SECRET. Its
    /// output lines are forwarded prefixed `[rank k] `. When a rank fails, the others get
    /// `--grace` seconds to end, then SIGTERM and, 2 s later, SIGKILL. Exit code: 0 when
    /// every rank exits 0, 130 when interrupted (Ctrl-C, SIGTERM), 1 otherwise.
    Launch(launch::LaunchArgs),
    /// Work with the Chrome / Perfetto traces jobs write.
    #[command(subcommand)]
    Trace(TraceCommand),
    /// Print what this machine and build give regflow: the CPU, the matrix products'
    /// backend and instruction set, the CUDA backend and its devices, NVRTC, and the kernel
    /// cache. Fails after the report when an environment variable's value is refused.
    Env,
}

/// `regflow trace ...` commands.
#[derive(Debug, Subcommand)]
enum TraceCommand {
    /// Merge the traces each node of a job wrote into one file Perfetto opens.
    ///
    /// Every event is kept. A pid (node) that two files both have events on is renumbered
    /// in the later file, and its process name says which file it came from; flow arrows
    /// keep their ids, so hand-offs between nodes stay connected. Each file's timestamps
    /// count from its own job's start: the files are aligned at their starts.
    Merge {
        /// The merged trace to write.
        output: PathBuf,
        /// The traces to merge, in the order their events are written.
        #[arg(required = true)]
        inputs: Vec<PathBuf>,
    },
}

/// Where a process stands in a multi-node job, when not from a launcher's variables.
#[derive(Debug, Clone, clap::Args)]
struct NodeFlags {
    /// This node's rank (with --world and --master; default: from the launcher's variables).
    #[arg(long, value_name = "R", requires_all = ["world", "master"])]
    rank: Option<u32>,
    /// Nodes in the job.
    #[arg(long, value_name = "N", requires_all = ["rank", "master"])]
    world: Option<u32>,
    /// Rank 0's control plane, `host:port`.
    #[arg(long, value_name = "HOST:PORT", requires_all = ["rank", "world"])]
    master: Option<String>,
    /// Seconds joining the other nodes may take.
    #[arg(long, value_name = "S", default_value_t = 60)]
    join_timeout: u64,
}

/// `regflow plan ...` commands.
#[derive(Debug, Subcommand)]
enum PlanCommand {
    /// Summarize a plan per device: streams, actors by kind, collectives, peak memory.
    ///
    /// Per device: its streams with their actor counts, its actors grouped by kind (source,
    /// compute, copy, collective, acc, repeat, sink), its collectives with op, group and
    /// rank, and its peak memory (the arena the runtime allocates for the plan: every
    /// register slot plus the shared region); then totals over the plan.
    Show {
        /// Plan file (JSON); `-` reads stdin.
        plan: PathBuf,
        /// Also list every actor with its inputs and outputs and their register counts.
        #[arg(long)]
        actors: bool,
    },
    /// Write the plan as a Graphviz digraph: devices as clusters, boxing highlighted.
    ///
    /// Actors are nodes, register descriptors are edges from their producer to each consumer
    /// labelled `×register_num · bytes`. Collectives are orange, local boxing actors light
    /// orange, registers crossing devices bold red, zero-byte registers dashed gray and
    /// preloaded (loop) registers have a hollow arrowhead. Render with `dot -Tsvg`.
    Dot {
        /// Plan file (JSON); `-` reads stdin.
        plan: PathBuf,
        /// Write the graph to this file instead of stdout.
        #[arg(short, long, value_name = "FILE")]
        output: Option<PathBuf>,
    },
}

/// Why a command failed; every variant names the file involved.
#[derive(Debug)]
enum CliError {
    /// The plan file could not be read.
    Read {
        /// File as given on the command line (`<stdin>` for `-`).
        file: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file is not a valid plan.
    Plan {
        /// File as given on the command line.
        file: String,
        /// What is wrong with it.
        source: PlanError,
    },
    /// The plan cannot run by itself, or its feeds are missing.
    Setup {
        /// Plan file as given on the command line.
        file: String,
        /// Why, as a sentence.
        message: String,
    },
    /// The feeds file could not be read or does not fit the plan's signature.
    Feeds {
        /// Feeds file as given on the command line.
        file: String,
        /// What does not fit, naming the tensor, the input and both shapes.
        message: String,
    },
    /// The job could not be built (kernels, dataset, memory).
    Build {
        /// Plan file as given on the command line.
        file: String,
        /// The runtime's error, naming the actor.
        source: RuntimeError,
    },
    /// The job failed while running.
    Failed {
        /// Plan file as given on the command line.
        file: String,
        /// The runtime's error, naming the actor.
        source: RuntimeError,
    },
    /// Pushing the feeds failed.
    Feeding {
        /// Plan file as given on the command line.
        file: String,
        /// Why.
        message: String,
    },
    /// `regflow launch` could not start or watch its ranks.
    Launch(String),
    /// `regflow env` found settings it refuses (each a sentence naming its variable).
    Env(Vec<String>),
    /// A trace file could not be read or is not a Chrome trace.
    Trace {
        /// File as given on the command line.
        file: String,
        /// What is wrong with it.
        message: String,
    },
    /// The output could not be written.
    Write {
        /// Output file (`<stdout>` for standard output).
        file: String,
        /// The OS error.
        source: std::io::Error,
    },
}

impl std::fmt::Display for CliError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CliError::Read { file, source } => write!(f, "cannot read plan file {file}: {source}"),
            CliError::Plan { file, source } => write!(f, "{file} is not a valid plan: {source}"),
            CliError::Setup { file, message } => write!(f, "cannot run {file}: {message}"),
            CliError::Feeds { file, message } => write!(f, "feeds file {file}: {message}"),
            CliError::Build { file, source } => write!(f, "cannot run {file}: {source}"),
            CliError::Failed { file, source } => write!(f, "running {file} failed: {source}"),
            CliError::Feeding { file, message } => write!(f, "feeding {file} failed: {message}"),
            CliError::Launch(message) => write!(f, "{message}"),
            CliError::Env(refused) => write!(f, "refused settings: {}", refused.join("; ")),
            CliError::Trace { file, message } => write!(f, "trace {file}: {message}"),
            CliError::Write { file, source } => write!(f, "cannot write {file}: {source}"),
        }
    }
}

impl std::error::Error for CliError {}

/// Reads and validates a plan; returns it with the name to use for it in messages.
fn load(path: &Path) -> Result<(String, Plan), CliError> {
    let (file, text) = if path == Path::new("-") {
        let file = "<stdin>".to_string();
        let mut text = String::new();
        match std::io::stdin().read_to_string(&mut text) {
            Ok(_) => (file, text),
            Err(source) => return Err(CliError::Read { file, source }),
        }
    } else {
        let file = path.display().to_string();
        match std::fs::read_to_string(path) {
            Ok(text) => (file, text),
            Err(source) => return Err(CliError::Read { file, source }),
        }
    };
    match Plan::from_json(&text) {
        Ok(plan) => Ok((file, plan)),
        Err(source) => Err(CliError::Plan { file, source }),
    }
}

/// Writes `text` to `output`, or to stdout when `None`. A closed stdout (`| head`) is not
/// an error: the reader has what it wanted.
fn emit(text: &str, output: Option<&Path>) -> Result<(), CliError> {
    match output {
        Some(path) => {
            std::fs::write(path, text).map_err(|source| CliError::Write { file: path.display().to_string(), source })
        }
        None => {
            let mut stdout = std::io::stdout().lock();
            match stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush()) {
                Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                    Err(CliError::Write { file: "<stdout>".into(), source: e })
                }
                _ => Ok(()),
            }
        }
    }
}

/// Runs one command; its exit code when it did not fail outright.
fn run(cli: Cli) -> Result<ExitCode, CliError> {
    let done = match cli.command {
        Command::Plan(PlanCommand::Show { plan, actors }) => {
            let (file, plan) = load(&plan)?;
            let text = show::render(&file, &plan, actors).map_err(|source| CliError::Plan { file, source })?;
            emit(&text, None)
        }
        Command::Plan(PlanCommand::Dot { plan, output }) => {
            let (file, plan) = load(&plan)?;
            let text = dot::render(&plan).map_err(|source| CliError::Plan { file, source })?;
            emit(&text, output.as_deref())
        }
        Command::Run { plan, feeds, steps, threads, data_dir, node } => run::run(run::RunArgs {
            plan: Some(plan),
            feeds,
            steps,
            threads: usize::from(threads),
            data_dir,
            node: run::node_of(node.rank, node.world, node.master, node.join_timeout, false)?,
        }),
        Command::Daemon { feeds, threads, data_dir, node } => run::run(run::RunArgs {
            plan: None,
            feeds,
            steps: None,
            threads: usize::from(threads),
            data_dir,
            node: run::node_of(node.rank, node.world, node.master, node.join_timeout, true)?,
        }),
        Command::Launch(args) => return launch::run(args),
        Command::Trace(TraceCommand::Merge { output, inputs }) => trace::merge(&output, &inputs),
        Command::Env => {
            let report = env::report();
            emit(&(report.lines.join("\n") + "\n"), None)?;
            if report.refused.is_empty() {
                Ok(())
            } else {
                Err(CliError::Env(report.refused))
            }
        }
    };
    done.map(|()| ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn command_line_definition_is_consistent() {
        Cli::command().debug_assert();
    }
}
