//! `regflow launch`: starts one process per node on this host with torchrun's variables,
//! forwards their output with `[rank k] ` prefixes and stops them all when one fails.

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
    /// Processes to start, one per node: ranks 0..N.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    nodes: u32,
    /// Devices each node drives (REGFLOW_DEVICES_PER_NODE).
    #[arg(long, value_name = "K", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    devices_per_node: u32,
    /// Port of the control plane on rank 0 (MASTER_PORT); default: a free loopback port.
    #[arg(long, value_name = "P", value_parser = clap::value_parser!(u16).range(1..))]
    master_port: Option<u16>,
    /// Seconds the other ranks may still run after one fails, before they are stopped.
    #[arg(long, value_name = "SECONDS", default_value = "10", value_parser = parse_seconds)]
    grace: Duration,
    /// The program every rank runs, and its arguments (after `--`).
    #[arg(value_name = "PROGRAM", required = true, num_args = 1.., trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<OsString>,
}

/// `--grace`: a non-negative number of seconds, fractions allowed.
fn parse_seconds(text: &str) -> Result<Duration, String> {
    let seconds: f64 = text.parse().map_err(|_| format!("'{text}' is not a number of seconds"))?;
    Duration::try_from_secs_f64(seconds).map_err(|_| format!("{text} is not a duration (it must be 0 or more seconds)"))
}

/// Runs the job; the exit code is 0 when every rank exits 0, 130 when the launcher was
/// interrupted, 1 otherwise.
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
        nodes: args.nodes,
        devices_per_node: args.devices_per_node,
        master_port: args.master_port,
        grace: args.grace,
        program: program.into(),
        args: command.collect(),
        env: Vec::new(),
        capture: false,
        stop: Some(stop),
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
