//! `regflow run` and `regflow daemon`: run a plan by itself (kernels from the registry,
//! variables from their initializers, inputs from a feeds file or the dataset the plan
//! names) and print one line per step with its scalar outputs. Under a launcher (or with
//! `--rank/--world/--master`) each process runs one node of the plan; a daemon takes the
//! plan rank 0 shares.

use crate::feeds::Feeds;
use crate::{load, CliError};
use regflow::graph::plan::{ActorKind, DType, KernelConf, Plan, SourcePieces};
use regflow::runtime::{Cluster, ClusterEnv, ClusterOptions, Fetcher, GraphFeeds, Job, RuntimeError};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc;

/// What `regflow run` (or `regflow daemon`) was asked to do.
#[derive(Debug)]
pub(crate) struct RunArgs {
    /// The plan file (`-`: stdin); `None` for a daemon, which takes rank 0's.
    pub(crate) plan: Option<PathBuf>,
    /// The values of the plan's fed inputs.
    pub(crate) feeds: Option<PathBuf>,
    /// Steps to run (default: all the feeds file holds, or the plan's dataset pieces).
    pub(crate) steps: Option<u64>,
    /// Threads one cpu kernel may use.
    pub(crate) threads: usize,
    /// Where relative dataset paths resolve (default: the plan file's directory).
    pub(crate) data_dir: Option<PathBuf>,
    /// The node this process runs, in a multi-node job.
    pub(crate) node: Option<(ClusterEnv, ClusterOptions)>,
}

/// Where this process stands: flags, else a launcher's variables, else one process. A
/// daemon must be a node of something.
pub(crate) fn node_of(
    rank: Option<u32>,
    world: Option<u32>,
    master: Option<String>,
    join_timeout: u64,
    daemon: bool,
) -> Result<Option<(ClusterEnv, ClusterOptions)>, CliError> {
    let fail = |message: String| CliError::Setup { file: "the cluster".into(), message };
    let env = match (rank, world, master) {
        (Some(rank), Some(world), Some(master)) => {
            Some(ClusterEnv::from_flags(rank, world, &master).map_err(|e| fail(e.to_string()))?)
        }
        _ => ClusterEnv::from_env().map_err(|e| fail(e.to_string()))?,
    };
    if daemon && env.is_none() {
        return Err(fail(
            "a daemon is one node of a job: give --rank, --world and --master, or start it under a launcher \
             (regflow launch, torchrun, srun, mpirun) that sets RANK and WORLD_SIZE or their equivalents"
                .into(),
        ));
    }
    let options = ClusterOptions { timeout: std::time::Duration::from_secs(join_timeout), ..ClusterOptions::default() };
    Ok(env.map(|env| (env, options)))
}

/// An output read on every step: printed on the step's line if it is a scalar.
struct Column {
    /// `loss` for the first output, else the output's name.
    label: String,
    dtype: DType,
    scalar: bool,
    fetcher: Fetcher,
}

/// Loads the plan, checks that it can run by itself and that the feeds fit it, runs it,
/// and prints `step k loss v [name v]...` per step as the values arrive.
pub(crate) fn run(args: RunArgs) -> Result<(), CliError> {
    // A plan file is made ready (its step count set) before joining, so that every node
    // compares the plan it will run; a daemon runs rank 0's as shared.
    let (file, given) = match &args.plan {
        Some(path) => {
            let (file, mut plan) = load(path)?;
            if let Some(steps) = args.steps {
                set_source_pieces(&mut plan, steps);
            }
            (file, Some(plan))
        }
        None => ("the plan rank 0 shared".to_string(), None),
    };
    let (cluster, plan) = match (&args.node, given) {
        (Some((env, options)), given) => {
            let joined = Cluster::join_sharing(env, given.as_ref(), options);
            let (cluster, plan) = joined.map_err(|source| CliError::Build { file: file.clone(), source })?;
            (Some(cluster), plan)
        }
        (None, Some(plan)) => (None, plan),
        (None, None) => unreachable!("node_of refuses a daemon without a node"),
    };
    run_plan(&args, file, plan, cluster)
}

fn run_plan(args: &RunArgs, file: String, mut plan: Plan, cluster: Option<Cluster>) -> Result<(), CliError> {
    let setup = |message: String| CliError::Setup { file: file.clone(), message };
    check_runs_by_itself(&plan).map_err(setup)?;
    let feeds = match (&args.feeds, plan.signature.inputs.as_slice()) {
        (None, []) => None,
        (None, inputs) => {
            let names: Vec<&str> = inputs.iter().map(|i| i.name.as_str()).collect();
            return Err(setup(format!(
                "it has fed inputs ({}) and no --feeds file gives their values; pass a safetensors file with one \
                 tensor per input, named after it, of shape [steps, ...input shape] (see docs/cli.md)",
                names.join(", ")
            )));
        }
        (Some(path), []) => {
            return Err(setup(format!(
                "--feeds {} was given, but the plan has no fed inputs (its sources produce their own pieces)",
                path.display()
            )))
        }
        (Some(path), inputs) => {
            let feeds_error = |message| CliError::Feeds { file: path.display().to_string(), message };
            let feeds = Feeds::read(path, inputs).map_err(feeds_error)?;
            if let Some(steps) = args.steps.filter(|&steps| steps > feeds.steps()) {
                return Err(feeds_error(format!(
                    "it holds {} steps, fewer than the {steps} that --steps asks for",
                    feeds.steps()
                )));
            }
            Some(feeds)
        }
    };
    let steps = args.steps.or(feeds.as_ref().map(Feeds::steps));
    // Across nodes the step count was set before joining (from --steps), or is rank 0's.
    if let (Some(steps), None) = (steps, &cluster) {
        set_source_pieces(&mut plan, steps);
    }
    let data_dir = args.data_dir.clone().unwrap_or_else(|| args.plan.as_deref().map_or(PathBuf::from("."), plan_dir));
    let build = |source| CliError::Build { file: file.clone(), source };
    let mut builder = Job::builder(plan).data_dir(data_dir).cpu_threads(args.threads);
    if let Some(cluster) = cluster {
        builder = builder.cluster(cluster);
    }
    let mut job = builder.build().map_err(build)?;
    let graph_feeds = match feeds {
        Some(_) => Some(job.graph_feeds().map_err(build)?),
        None => None,
    };
    let (first, others, drained) = take_fetchers(&mut job).map_err(build)?;

    let (fed, printed) = std::thread::scope(|scope| {
        let feeding = match (graph_feeds, &feeds) {
            (Some(graph_feeds), Some(feeds)) => {
                let steps = steps.unwrap_or(feeds.steps());
                Some(scope.spawn(move || feed(graph_feeds, feeds, steps)))
            }
            _ => None,
        };
        for fetcher in drained {
            scope.spawn(move || while fetcher.recv().is_some() {});
        }
        // The first output paces the lines; the other scalar outputs are read on threads
        // of their own, so that no sink waits on another's fetches.
        let mut columns = Vec::with_capacity(others.len());
        for column in others {
            let (values, received) = mpsc::channel();
            let Column { label, dtype, fetcher, .. } = column;
            scope.spawn(move || {
                while let Some(piece) = fetcher.recv() {
                    if values.send(scalar_text(dtype, piece.bytes())).is_err() {
                        break;
                    }
                }
            });
            columns.push((label, received));
        }
        let printed = match &first {
            Some(first) => print_steps(first, &columns),
            None => Ok(()),
        };
        let fed = match feeding.map(|f| f.join()) {
            None | Some(Ok(Ok(()))) => Ok(()),
            Some(Ok(Err(message))) => Err(message),
            Some(Err(_)) => Err("the feeding thread panicked".to_string()),
        };
        (fed, printed)
    });
    // The job's own error (a kernel failed, a stall) explains a feed that stopped early.
    job.wait().map_err(|source| CliError::Failed { file: file.clone(), source })?;
    fed.map_err(|message| CliError::Feeding { file, message })?;
    printed
}

/// Prints one line per piece of the first output, with every scalar output's value.
/// Stdout failing stops the printing, not the fetching (a sink nobody fetches from would
/// stall the job); a closed stdout (`| head`) is no error: the reader has what it wanted.
fn print_steps(first: &Column, others: &[(String, mpsc::Receiver<String>)]) -> Result<(), CliError> {
    let mut stdout = std::io::stdout().lock();
    let mut open = true;
    let mut failed = None;
    let mut step = 0u64;
    while let Some(piece) = first.fetcher.recv() {
        let mut line = format!("step {step}");
        if first.scalar {
            line.push_str(&format!(" {} {}", first.label, scalar_text(first.dtype, piece.bytes())));
        }
        drop(piece);
        for (label, values) in others {
            if let Ok(value) = values.recv() {
                line.push_str(&format!(" {label} {value}"));
            }
        }
        line.push('\n');
        if open {
            if let Err(e) = stdout.write_all(line.as_bytes()).and_then(|()| stdout.flush()) {
                open = false;
                if e.kind() != std::io::ErrorKind::BrokenPipe {
                    failed = Some(e);
                }
            }
        }
        step += 1;
    }
    match failed {
        Some(source) => Err(CliError::Write { file: "<stdout>".into(), source }),
        None => Ok(()),
    }
}

/// Pushes rows `0..steps` of every input, then closes the inputs.
fn feed(mut graph_feeds: GraphFeeds, feeds: &Feeds, steps: u64) -> Result<(), String> {
    for step in 0..steps {
        for value in feeds.step(step) {
            let (name, value) = value?;
            graph_feeds.push(name, &value).map_err(|e| format!("step {step}: {e}"))?;
        }
    }
    graph_feeds.close().map_err(|e| e.to_string())
}

/// A scalar as text that reads back to the same bits: Rust prints floats in their
/// shortest round-trip form.
fn scalar_text(dtype: DType, bytes: &[u8]) -> String {
    let text = match dtype {
        DType::F32 => bytes.get(..4).and_then(|b| b.try_into().ok()).map(|b| f32::from_le_bytes(b).to_string()),
        DType::F64 => bytes.get(..8).and_then(|b| b.try_into().ok()).map(|b| f64::from_le_bytes(b).to_string()),
        DType::I64 => bytes.get(..8).and_then(|b| b.try_into().ok()).map(|b| i64::from_le_bytes(b).to_string()),
        DType::Bf16 => {
            bytes.get(..2).and_then(|b| b.try_into().ok()).map(|b| regflow::plan::bf16::from_le_bytes(b).to_string())
        }
        DType::F16 => {
            bytes.get(..2).and_then(|b| b.try_into().ok()).map(|b| regflow::plan::f16::from_le_bytes(b).to_string())
        }
    };
    text.unwrap_or_else(|| format!("<{} bytes>", bytes.len()))
}

/// Refuses what only the program that built a plan could run: sources and kernels it
/// registers itself, fed sources outside the signature, and a plan without outputs.
fn check_runs_by_itself(plan: &Plan) -> Result<(), String> {
    if plan.signature.outputs.is_empty() {
        return Err("its signature has no outputs, so there is nothing to print (a plan built by hand is fed and \
                    fetched by actor name from a program)"
            .into());
    }
    for (a, actor) in plan.actors.iter().enumerate() {
        match &actor.kind {
            ActorKind::Source { pieces: SourcePieces::Custom { kernel, .. } } => {
                return Err(format!(
                    "source '{}' gets its pieces from kernel '{kernel}', which only the program that built the plan \
                     registers; regflow run runs plans whose sources are fed (--feeds) or read a record file \
                     (`pieces: dataset`)",
                    actor.name
                ))
            }
            ActorKind::Source { pieces: SourcePieces::Fed } => {
                let index = a as u32;
                let fed = plan.signature.inputs.iter().any(|i| i.parts.iter().any(|p| p.actor.0 == index));
                if !fed {
                    return Err(format!(
                        "source '{}' is fed, but no input of the signature feeds it, so there are no values for it",
                        actor.name
                    ));
                }
            }
            ActorKind::Compute { kernel: KernelConf::Custom { name } }
            | ActorKind::Acc { kernel: KernelConf::Custom { name }, .. } => {
                return Err(format!(
                    "actor '{}' runs kernel '{name}', which only the program that built the plan registers",
                    actor.name
                ))
            }
            _ => {}
        }
    }
    Ok(())
}

/// Makes every counted or dataset source produce `steps` pieces (a dataset source goes
/// on into further epochs, reshuffled, when `steps` is more than one epoch).
fn set_source_pieces(plan: &mut Plan, steps: u64) {
    for actor in &mut plan.actors {
        match &mut actor.kind {
            ActorKind::Source { pieces: SourcePieces::Dataset(dataset) } => dataset.pieces = steps,
            ActorKind::Source { pieces: SourcePieces::Count(count) } => *count = steps,
            _ => {}
        }
    }
}

/// The directory of the plan file (the working directory for stdin).
fn plan_dir(plan: &Path) -> PathBuf {
    match plan.parent() {
        Some(dir) if plan != Path::new("-") && !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// What [`take_fetchers`] takes: the first column, the other columns, sinks to drain.
type Fetchers = (Option<Column>, Vec<Column>, Vec<Fetcher>);

/// The first output's column (it paces the lines; `None` on a node that does not deliver
/// it), the other scalar outputs' columns, and the fetchers of every other sink this node
/// runs (drained, so that no sink stalls the job).
fn take_fetchers(job: &mut Job) -> Result<Fetchers, RuntimeError> {
    let plan = job.plan().clone();
    let mut columns = Vec::new();
    let mut drained = Vec::new();
    let mut taken: Vec<&str> = Vec::new();
    for (k, output) in plan.signature.outputs.iter().enumerate() {
        let sink = plan.actors[output.actor.index()].name.as_str();
        // Another node delivers it (and prints its column).
        if taken.contains(&sink) || !job.has_output(sink) {
            continue;
        }
        taken.push(sink);
        let fetcher = job.fetcher(sink)?;
        let scalar = output.meta.shape.numel() == 1;
        if k == 0 || scalar {
            let label = if k == 0 { "loss".to_string() } else { output.name.clone() };
            columns.push(Column { label, dtype: output.meta.dtype, scalar, fetcher });
        } else {
            drained.push(fetcher);
        }
    }
    for actor in &plan.actors {
        if matches!(actor.kind, ActorKind::Sink) && !taken.contains(&actor.name.as_str()) {
            match job.fetcher(&actor.name) {
                Ok(fetcher) => drained.push(fetcher),
                Err(RuntimeError::NotLocal { .. }) => {}
                Err(e) => return Err(e),
            }
        }
    }
    // Only the node that delivers the first output prints the step lines.
    let first_here = plan.signature.outputs.first().is_some_and(|o| job.has_output(&o.name));
    let mut columns = columns.into_iter();
    let first = if first_here { columns.next() } else { None };
    Ok((first, columns.collect(), drained))
}
