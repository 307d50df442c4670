//! `regflow launch`: starts one process per node on this host with torchrun's variables,
//! forwards their output with `[rank k] ` prefixes, stops them all when one fails and, with
//! `--max-restarts`, starts the job again (with fewer nodes for `--nodes MIN:MAX`).

use crate::CliError;
use regflow::launch::{launch, LaunchOptions};
use std::ffi::OsString;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

/// Exit code of a launcher stopped by Ctrl-C or SIGTERM (128 + SIGINT, as shells report it).
const INTERRUPTED: u8 = 130;

/// `regflow launch` as parsed from the command line.
#[derive(Debug, clap::Args)]
pub(crate) struct LaunchArgs {
    /// Processes to start, one per node: ranks 0..N. MIN:MAX makes the job elastic: MAX
    /// ranks start, and each rank killed by a signal is a lost node the restart goes on
    /// without, as long as at least MIN nodes remain.
    #[arg(long, value_name = "N", value_parser = parse_nodes)]
    nodes: NodeRange,
    /// Devices each node drives (REGFLOW_DEVICES_PER_NODE).
    #[arg(long, value_name = "K", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    devices_per_node: u32,
    /// Port of the control plane on rank 0 (MASTER_PORT); default: a free loopback port.
    #[arg(long, value_name = "P", value_parser = clap::value_parser!(u16).range(1..))]
    master_port: Option<u16>,
    /// Seconds the other ranks may still run after one fails, before they are stopped.
    #[arg(long, value_name = "SECONDS", default_value = "10", value_parser = parse_seconds)]
    grace: Duration,
    /// Times the whole job is started again after a rank failed (REGFLOW_RESTART counts
    /// the attempts from 0).
    #[arg(long, value_name = "R", default_value_t = 0)]
    max_restarts: u32,
    /// The program every rank runs, and its arguments (after `--`).
    #[arg(value_name = "PROGRAM", required = true, num_args = 1.., trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<OsString>,
}

/// `--nodes`: `N`, or `MIN:MAX` for an elastic job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct NodeRange {
    /// The fewest nodes an elastic job goes on with; `None` for a fixed size.
    min: Option<u32>,
    /// The nodes the first attempt starts.
    max: u32,
}

/// `--nodes`: a positive count, or two of them as `MIN:MAX` with `MIN <= MAX`.
fn parse_nodes(text: &str) -> Result<NodeRange, String> {
    let count = |part: &str| -> Result<u32, String> {
        let count: u32 = part
            .parse()
            .map_err(|_| format!("'{part}' is not a number of nodes (give N, or MIN:MAX for an elastic job)"))?;
        if count == 0 {
            return Err("a job needs at least 1 node, not 0".into());
        }
        Ok(count)
    };
    let Some((min, max)) = text.split_once(':') else {
        return Ok(NodeRange { min: None, max: count(text)? });
    };
    let (min, max) = (count(min)?, count(max)?);
    if min > max {
        return Err(format!("the minimum of {min} nodes is more than the maximum of {max}"));
    }
    Ok(NodeRange { min: Some(min), max })
}

/// `--grace`: a non-negative number of seconds, fractions allowed.
fn parse_seconds(text: &str) -> Result<Duration, String> {
    let seconds: f64 = text.parse().map_err(|_| format!("'{text}' is not a number of seconds"))?;
    Duration::try_from_secs_f64(seconds).map_err(|_| format!("{text} is not a duration (it must be 0 or more seconds)"))
}

/// Runs the job; the exit code is 0 when every rank of the last attempt exits 0, 130 when
/// the launcher was interrupted, 1 otherwise.
pub(crate) fn run(args: LaunchArgs) -> Result<ExitCode, CliError> {
    let mut command = args.command.into_iter();
    let Some(program) = command.next() else {
        // clap requires PROGRAM; this is only reached if that attribute goes away.
        return Err(CliError::Launch("no PROGRAM to launch was given after `--`".into()));
    };
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM, signal_hook::consts::SIGHUP] {
        signal_hook::flag::register(signal, Arc::clone(&stop))
            .map_err(|e| CliError::Launch(format!("cannot handle signal {signal}: {e}")))?;
    }
    let options = LaunchOptions {
        nodes: args.nodes.max,
        devices_per_node: args.devices_per_node,
        master_port: args.master_port,
        grace: args.grace,
        program: program.into(),
        args: command.collect(),
        env: Vec::new(),
        capture: false,
        stop: Some(stop),
        max_restarts: args.max_restarts,
        min_nodes: args.nodes.min,
    };
    let outcome = launch(&options).map_err(|e| CliError::Launch(e.to_string()))?;
    Ok(if outcome.success() {
        ExitCode::SUCCESS
    } else if outcome.interrupted {
        ExitCode::from(INTERRUPTED)
    } else {
        ExitCode::FAILURE
    })
}
