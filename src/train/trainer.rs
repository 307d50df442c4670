//! [`Trainer`]: runs a compiled training step for a number of steps, feeding the batches a
//! closure makes, with a progress bar, an evaluation every K steps and a checkpoint every
//! N steps, and returns the loss [`History`] with the final state.
//!
//! A job's variables can be read only once it has ended, so an evaluation or a checkpoint
//! ends the job at that step and the next steps run in a fresh job preloaded with its
//! state: a job build (arenas, threads) and a copy of every variable out and back in per
//! boundary. Resuming that way is exact: the losses are bitwise those of one long job.

use super::state::{LoadStateDict, ReportState, StateDict};
use super::{BoxError, TrainError};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use regflow_graph::CompiledGraph;
use regflow_plan::{HostArray, Plan};
use regflow_runtime::{Job, JobBuilder};
use std::path::PathBuf;
use std::time::Instant;

type EvalHook<'a> = Box<dyn FnMut(&Evaluation<'_>) -> Result<f64, BoxError> + 'a>;
type Configure<'a> = Box<dyn Fn(JobBuilder) -> JobBuilder + 'a>;

/// What the evaluation hook sees: the step just done, the state after it, the losses so far.
#[derive(Debug)]
pub struct Evaluation<'s> {
    /// Steps done (the next step's number).
    pub step: u64,
    /// Every variable after that step.
    pub state: &'s StateDict,
    /// The loss of every step this run made, in order.
    pub losses: &'s [f64],
}

/// What a [`Trainer`] run returns.
#[derive(Debug, Clone, Default)]
pub struct History {
    /// The loss of every step, in order (step `first_step + i` at `i`).
    pub losses: Vec<f64>,
    /// The first step's number.
    pub first_step: u64,
    /// `(step, value)` of every evaluation.
    pub evals: Vec<(u64, f64)>,
    /// The checkpoint files written, in order.
    pub checkpoints: Vec<PathBuf>,
    /// Every variable after the last step.
    pub state: StateDict,
    /// How many jobs ran (one more per evaluation or checkpoint boundary before the end).
    pub jobs: usize,
}

impl History {
    /// Writes the loss curve to `path` (`.png` or `.svg`), as [`super::save_loss_plot`].
    pub fn save_loss_plot(&self, path: impl AsRef<std::path::Path>) -> Result<(), TrainError> {
        super::save_loss_plot(path, &self.losses)
    }
}

/// A training loop over a compiled step:
/// `Trainer::new(&compiled).steps(100).checkpoint_every(50, dir).on_eval(25, hook).run(batches)`.
///
/// Each step pushes one value of every fed input (what the batch closure returns for that
/// step) and fetches one loss. With micro-batches, a step here is one piece (one
/// micro-batch); put evaluations and checkpoints on whole optimizer steps.
pub struct Trainer<'a> {
    plan: Plan,
    loss: Option<String>,
    steps: u64,
    first_step: u64,
    state: Option<StateDict>,
    checkpoint: Option<(u64, PathBuf)>,
    eval: Option<(u64, EvalHook<'a>)>,
    progress: bool,
    samples_per_step: Option<u64>,
    configure: Option<Configure<'a>>,
}

impl std::fmt::Debug for Trainer<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("loss", &self.loss)
            .field("steps", &self.steps)
            .field("first_step", &self.first_step)
            .field("checkpoint", &self.checkpoint)
            .field("eval_every", &self.eval.as_ref().map(|(every, _)| every))
            .finish_non_exhaustive()
    }
}

impl<'a> Trainer<'a> {
    /// A trainer of `compiled`'s plan whose loss is its first fetch.
    pub fn new(compiled: &CompiledGraph) -> Self {
        Self::from_plan(compiled.plan.clone(), compiled.fetches.first().cloned())
    }

    /// A trainer of `plan` (e.g. read from a plan file) whose loss is the output `loss`
    /// (`fetch:0`, or its sink's name).
    pub fn from_plan(plan: Plan, loss: Option<String>) -> Self {
        Self {
            plan,
            loss,
            steps: 0,
            first_step: 0,
            state: None,
            checkpoint: None,
            eval: None,
            progress: true,
            samples_per_step: None,
            configure: None,
        }
    }

    /// Steps to run (at least 1).
    pub fn steps(mut self, steps: u64) -> Self {
        self.steps = steps;
        self
    }

    /// The loss is output `name` (a scalar fetch) instead of the first fetch.
    pub fn loss(mut self, name: &str) -> Self {
        self.loss = Some(name.to_string());
        self
    }

    /// Starts from `state` (e.g. [`StateDict::load`] of a checkpoint) at step `first_step`:
    /// the batch closure is asked for steps `first_step..first_step + steps`. The state must
    /// hold every variable of the plan, and only those.
    pub fn resume(mut self, state: StateDict, first_step: u64) -> Self {
        self.state = Some(state);
        self.first_step = first_step;
        self
    }

    /// Saves the state every `every` steps (counted from step 0) as
    /// `dir/step-<step>.safetensors` (8 digits), creating `dir`.
    pub fn checkpoint_every(mut self, every: u64, dir: impl Into<PathBuf>) -> Self {
        self.checkpoint = Some((every, dir.into()));
        self
    }

    /// Calls `hook` every `every` steps (counted from step 0) with the state after that
    /// step; its value goes into [`History::evals`] and the progress bar.
    pub fn on_eval<F>(mut self, every: u64, hook: F) -> Self
    where
        F: FnMut(&Evaluation<'_>) -> Result<f64, BoxError> + 'a,
    {
        self.eval = Some((every, Box::new(hook)));
        self
    }

    /// Shows the progress bar (loss and samples/s per step) on standard error (default:
    /// yes; it hides itself when standard error is not a terminal).
    pub fn progress(mut self, show: bool) -> Self {
        self.progress = show;
        self
    }

    /// Samples one step trains, for samples/s (default: the first dimension of the first
    /// fed input).
    pub fn samples_per_step(mut self, samples: u64) -> Self {
        self.samples_per_step = Some(samples);
        self
    }

    /// Applies `configure` to every job's builder (watchdog, threads, kernels).
    pub fn configure<F>(mut self, configure: F) -> Self
    where
        F: Fn(JobBuilder) -> JobBuilder + 'a,
    {
        self.configure = Some(Box::new(configure));
        self
    }

    /// Runs the steps. `batches(step)` returns the value of every fed input for that step,
    /// by input name.
    pub fn run<F, N, E>(mut self, mut batches: F) -> Result<History, TrainError>
    where
        F: FnMut(u64) -> Result<Vec<(N, HostArray)>, E>,
        N: AsRef<str>,
        E: Into<BoxError>,
    {
        self.check()?;
        let (first, end) = (self.first_step, self.first_step + self.steps);
        let bar = self.bar();
        let mut history = History { first_step: first, ..History::default() };
        let mut state = self.state.take();
        let mut step = first;
        while step < end {
            let stop = self.next_boundary(step, end);
            let after = self.segment(step, stop, state.as_ref(), &mut batches, &bar, &mut history)?;
            history.jobs += 1;
            step = stop;
            if let Some((every, dir)) = &self.checkpoint {
                if step % every == 0 {
                    std::fs::create_dir_all(dir).map_err(|e| {
                        TrainError::Options(format!("checkpoint directory '{}' cannot be created: {e}", dir.display()))
                    })?;
                    let path = dir.join(format!("step-{step:08}.safetensors"));
                    after.save(&path)?;
                    history.checkpoints.push(path);
                }
            }
            if let Some((every, hook)) = &mut self.eval {
                if step % *every == 0 {
                    let evaluation = Evaluation { step, state: &after, losses: &history.losses };
                    let value = hook(&evaluation).map_err(|e| TrainError::Eval { step, message: e.to_string() })?;
                    history.evals.push((step, value));
                    bar.println(format!("step {step}: eval {value:.4}"));
                }
            }
            state = Some(after);
        }
        bar.finish_and_clear();
        history.state = state.unwrap_or_default();
        Ok(history)
    }

    /// Refuses options that cannot work, naming them.
    fn check(&self) -> Result<(), TrainError> {
        if self.steps == 0 {
            return Err(TrainError::Options("steps(0): a run needs at least one step".into()));
        }
        if self.checkpoint.as_ref().is_some_and(|(every, _)| *every == 0) {
            return Err(TrainError::Options("checkpoint_every(0, ..): checkpoints need a period of at least 1".into()));
        }
        if self.eval.as_ref().is_some_and(|(every, _)| *every == 0) {
            return Err(TrainError::Options("on_eval(0, ..): evaluations need a period of at least 1".into()));
        }
        if self.plan.signature.inputs.is_empty() {
            return Err(TrainError::Options(
                "the plan has no fed inputs: a Trainer pushes batches into the graph's inputs (compile without a \
                 dataset source)"
                    .into(),
            ));
        }
        if self.loss.is_none() {
            return Err(TrainError::Options("the plan fetches nothing: the loss must be a fetch".into()));
        }
        Ok(())
    }

    /// The first step after `step` where an evaluation or a checkpoint falls, or `end`.
    fn next_boundary(&self, step: u64, end: u64) -> u64 {
        let periods = self.checkpoint.iter().map(|(every, _)| *every).chain(self.eval.iter().map(|(every, _)| *every));
        periods.map(|every| (step / every + 1) * every).fold(end, u64::min)
    }

    fn bar(&self) -> ProgressBar {
        if !self.progress {
            return ProgressBar::hidden();
        }
        let bar = ProgressBar::with_draw_target(Some(self.steps), ProgressDrawTarget::stderr());
        if let Ok(style) = ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}") {
            bar.set_style(style);
        }
        bar
    }

    /// Samples per step for the bar: as set, or the first dimension of the first input.
    fn samples(&self) -> u64 {
        self.samples_per_step.unwrap_or_else(|| {
            let first = self.plan.signature.inputs.first();
            first.and_then(|i| i.meta.shape.dims().first().copied()).unwrap_or(1) as u64
        })
    }

    /// Steps `first..stop` in one job started from `state`; the state after them.
    fn segment<F, N, E>(
        &self,
        first: u64,
        stop: u64,
        state: Option<&StateDict>,
        batches: &mut F,
        bar: &ProgressBar,
        history: &mut History,
    ) -> Result<StateDict, TrainError>
    where
        F: FnMut(u64) -> Result<Vec<(N, HostArray)>, E>,
        N: AsRef<str>,
        E: Into<BoxError>,
    {
        let mut builder = Job::builder(self.plan.clone()).keep_state();
        if let Some(configure) = &self.configure {
            builder = configure(builder);
        }
        if let Some(state) = state {
            builder = builder.load_state_dict(state, true)?.0;
        }
        let mut job = builder.build()?;
        let mut feeds = job.graph_feeds()?;
        let loss_name = self.loss.as_deref().unwrap_or("fetch:0");
        let loss = job.graph_fetcher(loss_name)?;
        // Every other output is taken and dropped, so its sink drains instead of filling.
        let others: Vec<String> = self.plan.signature.outputs.iter().map(|o| o.name.clone()).collect();
        for name in others.iter().filter(|n| n.as_str() != loss.name()) {
            drop(job.graph_fetcher(name)?);
        }
        let mut push = |step: u64| -> Result<(), TrainError> {
            let values = batches(step).map_err(|e| {
                let e: BoxError = e.into();
                TrainError::Batch { step, message: e.to_string() }
            })?;
            for (name, value) in &values {
                feeds.push(name.as_ref(), value)?;
            }
            Ok(())
        };
        let samples = self.samples() as f64;
        let started = Instant::now();
        // One step pushed ahead of the loss awaited, so the job never waits for the next batch.
        push(first)?;
        for step in first..stop {
            if step + 1 < stop {
                push(step + 1)?;
            }
            let Some(value) = loss.recv_scalar()? else {
                drop((feeds, loss));
                job.wait()?;
                return Err(TrainError::EndedEarly { first, delivered: step - first, expected: stop - first });
            };
            history.losses.push(value);
            bar.inc(1);
            let rate = samples * (step + 1 - first) as f64 / started.elapsed().as_secs_f64().max(1e-9);
            bar.set_message(format!("loss {value:.4}  {rate:.0} samples/s"));
        }
        feeds.close()?;
        drop((feeds, loss));
        job.wait()?.state_dict()
    }
}
