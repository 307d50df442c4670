//! [`Model`]: a cheap-to-clone handle (`Clone + Send + Sync`) that serves requests through a
//! running plan. Callers submit typed inputs from any thread; a bounded queue answers
//! `Overloaded` at once when full; one dispatcher thread packs requests into pieces; one
//! collector thread hands each request its own rows of the answer.

use crate::batch::{Dispatcher, InFlight, Packing, Request};
use crate::collect::Collector;
use crate::metrics::{Metrics, MetricsSnapshot};
use crate::reply::{Answer, InferFuture, Reply, Responder};
use crate::ServeError;
use crossbeam_channel::{Sender, TrySendError};
use regflow_plan::{HostArray, Plan, TensorMeta};
use regflow_runtime::{Job, JobBuilder, JobReport};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Default bound of the request queue.
pub const DEFAULT_QUEUE: usize = 1024;

/// Pieces a sink may deliver ahead of the collector: outputs are read one after the other,
/// so one output may run ahead of another by the pieces in flight.
const FETCH_DEPTH: u64 = 64;

/// A change to the model's job before it starts (kernels of the program's own, a trace).
type JobConfig = Box<dyn FnOnce(JobBuilder) -> JobBuilder + Send>;

/// Configures a [`Model`]: `Model::builder(plan).checkpoint(path).dynamic_batching(..).build()?`.
pub struct ModelBuilder {
    plan: Plan,
    variables: Vec<(String, HostArray)>,
    checkpoint: Option<PathBuf>,
    queue: usize,
    max_delay: Option<Duration>,
    deadline: Option<Duration>,
    cpu_threads: usize,
    watchdog: Option<Duration>,
    configure: Option<JobConfig>,
}

impl std::fmt::Debug for ModelBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelBuilder")
            .field("actors", &self.plan.actors.len())
            .field("variables", &self.variables.len())
            .field("checkpoint", &self.checkpoint)
            .field("queue", &self.queue)
            .field("max_delay", &self.max_delay)
            .field("deadline", &self.deadline)
            .finish_non_exhaustive()
    }
}

impl ModelBuilder {
    /// Changes the model's job before it starts: e.g. `|job| job.op_kernel(..)` for kernels
    /// of the program's own, or `|job| job.trace(path)`.
    pub fn configure_job(mut self, configure: impl FnOnce(JobBuilder) -> JobBuilder + Send + 'static) -> Self {
        self.configure = Some(Box::new(configure));
        self
    }

    /// The value of variable `name` (its logical name), instead of its initializer's.
    pub fn variable(mut self, name: &str, value: HostArray) -> Self {
        self.variables.push((name.to_string(), value));
        self
    }

    /// Every variable from a safetensors checkpoint (by the names the graph gave them),
    /// each cut into the parts the plan's layout puts on its devices.
    pub fn checkpoint(mut self, path: impl Into<PathBuf>) -> Self {
        self.checkpoint = Some(path.into());
        self
    }

    /// The bound of the request queue ([`DEFAULT_QUEUE`] by default): past it,
    /// [`Model::try_infer`] and [`Model::infer_async`] answer [`ServeError::Overloaded`] at once.
    pub fn queue_capacity(mut self, requests: usize) -> Self {
        self.queue = requests;
        self
    }

    /// Dynamic batching: the plan's inputs and outputs have the batch as their first
    /// dimension; requests of 1 to that many rows are packed into one piece, the first
    /// waiting at most `max_delay` for others (Triton's `max_queue_delay`), padded with
    /// zeros, and each request gets exactly its rows back.
    pub fn dynamic_batching(mut self, max_delay: Duration) -> Self {
        self.max_delay = Some(max_delay);
        self
    }

    /// A deadline for every request submitted without one.
    pub fn default_deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// Threads each CPU kernel may use (`JobBuilder::cpu_threads`).
    pub fn cpu_threads(mut self, threads: usize) -> Self {
        self.cpu_threads = threads;
        self
    }

    /// The job's watchdog (`JobBuilder::watchdog`); `None` turns it off.
    pub fn watchdog(mut self, timeout: Option<Duration>) -> Self {
        self.watchdog = timeout;
        self
    }

    /// Starts the plan's job and the serving threads.
    pub fn build(self) -> Result<Model, ServeError> {
        if self.queue == 0 {
            return Err(ServeError::Setup("the request queue needs room for at least one request (queue 0)".into()));
        }
        let signature = self.plan.signature.clone();
        if signature.inputs.is_empty() || signature.outputs.is_empty() {
            return Err(ServeError::Setup(format!(
                "a served plan needs typed inputs and outputs (its signature has {} input(s) and {} output(s)): \
                 compile it from a graph",
                signature.inputs.len(),
                signature.outputs.len()
            )));
        }
        let inputs: Vec<(String, TensorMeta)> =
            signature.inputs.iter().map(|i| (i.name.clone(), i.meta.clone())).collect();
        let outputs: Vec<(String, TensorMeta)> =
            signature.outputs.iter().map(|o| (o.name.clone(), o.meta.clone())).collect();
        let packing = match self.max_delay {
            None => Packing::Single,
            Some(max_delay) => Packing::Batched { rows: batch_rows(&inputs, &outputs)?, max_delay },
        };
        let mut values = self.variables;
        if let Some(path) = &self.checkpoint {
            let loaded = regflow_graph::checkpoint::load(path).map_err(|e| ServeError::Setup(e.to_string()))?;
            values.extend(loaded);
        }
        let mut builder = Job::builder(self.plan).cpu_threads(self.cpu_threads).fetch_depth(FETCH_DEPTH);
        builder = match self.watchdog {
            Some(timeout) => builder.watchdog(timeout),
            None => builder.without_watchdog(),
        };
        for (name, value) in values {
            builder = builder.preload_variable(&name, value);
        }
        if let Some(configure) = self.configure {
            builder = configure(builder);
        }
        let mut job = builder.build()?;
        let feeds = job.graph_feeds()?;
        let mut fetchers = Vec::with_capacity(outputs.len());
        for output in &signature.outputs {
            let sink = &job.plan().actors[output.actor.index()].name.clone();
            fetchers.push((job.fetcher(sink)?, output.meta.clone()));
        }
        let metrics = Arc::new(Metrics::default());
        let (queue, requests) = crossbeam_channel::bounded::<Request>(self.queue);
        // Pieces the collector has yet to answer; the feeds' backpressure bounds them.
        let (in_flight_tx, in_flight_rx) = crossbeam_channel::unbounded::<InFlight>();
        let buffers = match packing {
            Packing::Single => Vec::new(),
            Packing::Batched { .. } => inputs.iter().map(|(_, meta)| HostArray::zeros(meta)).collect(),
        };
        let dispatcher = Dispatcher {
            queue: requests,
            feeds,
            inputs: inputs.clone(),
            packing,
            in_flight: in_flight_tx,
            metrics: metrics.clone(),
            buffers,
        };
        let collector = Collector {
            job,
            in_flight: in_flight_rx,
            outputs: fetchers,
            batched: matches!(packing, Packing::Batched { .. }),
            metrics: metrics.clone(),
        };
        let spawn_error = |e: std::io::Error| ServeError::Setup(format!("cannot start a serving thread: {e}"));
        let dispatch = std::thread::Builder::new()
            .name("regflow-serve-dispatch".into())
            .spawn(move || dispatcher.run())
            .map_err(spawn_error)?;
        let collect = std::thread::Builder::new()
            .name("regflow-serve-collect".into())
            .spawn(move || collector.run())
            .map_err(spawn_error)?;
        Ok(Model {
            shared: Arc::new(Shared {
                queue: Mutex::new(Some(queue)),
                capacity: self.queue,
                inputs,
                outputs,
                packing,
                deadline: self.deadline,
                metrics,
                threads: Mutex::new(Some((dispatch, collect))),
            }),
        })
    }
}

/// The batch dimension every input and output shares (their first), for dynamic batching.
fn batch_rows(inputs: &[(String, TensorMeta)], outputs: &[(String, TensorMeta)]) -> Result<usize, ServeError> {
    let first = |meta: &TensorMeta| meta.shape.dims().first().copied();
    let rows = first(&inputs[0].1).unwrap_or(0);
    for (name, meta) in inputs.iter().chain(outputs) {
        if first(meta) != Some(rows) || rows == 0 {
            return Err(ServeError::Setup(format!(
                "dynamic batching needs every input and output to have the batch as its first dimension: \
                 input '{}' is {}, but '{name}' is {meta}",
                inputs[0].0, inputs[0].1
            )));
        }
    }
    Ok(rows)
}

/// The dispatcher and the collector (which returns the job's report).
type ServingThreads = (JoinHandle<()>, JoinHandle<Result<JobReport, ServeError>>);

/// What every clone of a model shares.
#[derive(Debug)]
struct Shared {
    /// `None` once shut down.
    queue: Mutex<Option<Sender<Request>>>,
    capacity: usize,
    inputs: Vec<(String, TensorMeta)>,
    outputs: Vec<(String, TensorMeta)>,
    packing: Packing,
    deadline: Option<Duration>,
    metrics: Arc<Metrics>,
    threads: Mutex<Option<ServingThreads>>,
}

/// A served plan. Cheap to clone (an `Arc`); every clone submits to the same queue.
#[derive(Debug, Clone)]
pub struct Model {
    shared: Arc<Shared>,
}

/// A request's deadline and the duration it was given.
type Deadline = Option<(Instant, Duration)>;

/// Whether a submission waits for room in the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum QueueFull {
    Wait,
    Refuse,
}

impl Model {
    /// A builder for serving `plan` (compiled from a graph: it needs the typed signature).
    pub fn builder(plan: Plan) -> ModelBuilder {
        ModelBuilder {
            plan,
            variables: Vec::new(),
            checkpoint: None,
            queue: DEFAULT_QUEUE,
            max_delay: None,
            deadline: None,
            cpu_threads: 1,
            watchdog: Some(regflow_runtime::DEFAULT_WATCHDOG),
            configure: None,
        }
    }

    /// The inputs a request gives, by name, with their metas (under dynamic batching the
    /// first dimension is the most rows a request may have).
    pub fn inputs(&self) -> &[(String, TensorMeta)] {
        &self.shared.inputs
    }

    /// The outputs an answer holds, in order, with their metas.
    pub fn outputs(&self) -> &[(String, TensorMeta)] {
        &self.shared.outputs
    }

    /// The model's counters now.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.shared.metrics.snapshot()
    }

    /// Runs one request and waits for its answer, waiting for room in the queue if it is
    /// full; the model's default deadline, if any, applies.
    pub fn infer<N: AsRef<str>>(&self, inputs: impl IntoIterator<Item = (N, HostArray)>) -> Answer {
        self.blocking(inputs, self.shared.deadline, QueueFull::Wait)
    }

    /// Runs one request that must be answered within `deadline` of now: if it is still
    /// queued then, it never runs; either way the caller gets [`ServeError::DeadlineExceeded`].
    pub fn infer_within<N: AsRef<str>>(
        &self,
        inputs: impl IntoIterator<Item = (N, HostArray)>,
        deadline: Duration,
    ) -> Answer {
        self.blocking(inputs, Some(deadline), QueueFull::Wait)
    }

    /// Like [`Model::infer`], but answers [`ServeError::Overloaded`] at once when the queue
    /// is full instead of waiting for room.
    pub fn try_infer<N: AsRef<str>>(&self, inputs: impl IntoIterator<Item = (N, HostArray)>) -> Answer {
        self.blocking(inputs, self.shared.deadline, QueueFull::Refuse)
    }

    /// Submits one request and returns a future of its answer (any async runtime, or
    /// none: the serving threads wake it). A full queue answers `Overloaded` at once;
    /// dropping the future cancels the request.
    pub fn infer_async<N: AsRef<str>>(&self, inputs: impl IntoIterator<Item = (N, HostArray)>) -> InferFuture {
        self.future(inputs, self.shared.deadline)
    }

    /// [`Model::infer_async`] with a deadline counted from now.
    pub fn infer_async_within<N: AsRef<str>>(
        &self,
        inputs: impl IntoIterator<Item = (N, HostArray)>,
        deadline: Duration,
    ) -> InferFuture {
        self.future(inputs, Some(deadline))
    }

    fn blocking<N: AsRef<str>>(
        &self,
        inputs: impl IntoIterator<Item = (N, HostArray)>,
        deadline: Option<Duration>,
        full: QueueFull,
    ) -> Answer {
        let (reply, deadline) = self.submit(inputs, deadline, full)?;
        InferFuture { reply: Some(reply), metrics: Some(self.shared.metrics.clone()), deadline }.wait()
    }

    fn future<N: AsRef<str>>(
        &self,
        inputs: impl IntoIterator<Item = (N, HostArray)>,
        deadline: Option<Duration>,
    ) -> InferFuture {
        match self.submit(inputs, deadline, QueueFull::Refuse) {
            Ok((reply, deadline)) => {
                InferFuture { reply: Some(reply), metrics: Some(self.shared.metrics.clone()), deadline }
            }
            Err(error) => InferFuture::ready(Err(error)),
        }
    }

    /// Checks the inputs and queues the request.
    fn submit<N: AsRef<str>>(
        &self,
        inputs: impl IntoIterator<Item = (N, HostArray)>,
        deadline: Option<Duration>,
        full: QueueFull,
    ) -> Result<(Arc<Reply>, Deadline), ServeError> {
        let metrics = &self.shared.metrics;
        Metrics::add(&metrics.requests, 1);
        let submitted = Instant::now();
        let (inputs, rows) = self.check(inputs).inspect_err(|_| Metrics::add(&metrics.bad_input, 1))?;
        let deadline = deadline.map(|given| (submitted.checked_add(given).unwrap_or(submitted), given));
        let reply = Arc::new(Reply::default());
        let request = Request { inputs, rows, submitted, deadline, reply: Responder(reply.clone()) };
        let queue = self.shared.queue.lock().unwrap_or_else(PoisonError::into_inner).clone();
        let Some(queue) = queue else {
            return Err(ServeError::Stopped("the model was shut down".into()));
        };
        metrics.queued.fetch_add(1, Ordering::Relaxed);
        let sent = match full {
            QueueFull::Refuse => queue.try_send(request).map_err(|e| match e {
                TrySendError::Full(_) => {
                    Metrics::add(&metrics.overloaded, 1);
                    ServeError::Overloaded { queued: queue.len(), capacity: self.shared.capacity }
                }
                TrySendError::Disconnected(_) => ServeError::Stopped("the model's dispatcher has stopped".into()),
            }),
            QueueFull::Wait => {
                queue.send(request).map_err(|_| ServeError::Stopped("the model's dispatcher has stopped".into()))
            }
        };
        if sent.is_err() {
            metrics.queued.fetch_sub(1, Ordering::Relaxed);
        }
        sent.map(|()| (reply, deadline))
    }

    /// The request's inputs in the signature's order, and its rows; an error names the
    /// input and the expected and given metas.
    fn check<N: AsRef<str>>(
        &self,
        given: impl IntoIterator<Item = (N, HostArray)>,
    ) -> Result<(Vec<HostArray>, usize), ServeError> {
        let names: Vec<&str> = self.shared.inputs.iter().map(|(n, _)| n.as_str()).collect();
        let mut slots: Vec<Option<HostArray>> = vec![None; names.len()];
        for (name, value) in given {
            let name = name.as_ref();
            let Some(i) = names.iter().position(|n| *n == name) else {
                let hint = regflow_kernels::nearest(name, &names)
                    .map(|n| format!("; did you mean '{n}'?"))
                    .unwrap_or_default();
                return Err(ServeError::BadInput(format!(
                    "the model has no input '{name}'{hint} (its inputs: '{}')",
                    names.join("', '")
                )));
            };
            if slots[i].replace(value).is_some() {
                return Err(ServeError::BadInput(format!("input '{name}' is given twice")));
            }
        }
        let mut rows = None;
        let mut inputs = Vec::with_capacity(slots.len());
        for ((name, meta), slot) in self.shared.inputs.iter().zip(slots) {
            let Some(value) = slot else {
                return Err(ServeError::BadInput(format!("input '{name}' ({meta}) is missing")));
            };
            let got = value.meta();
            let fits = match self.shared.packing {
                Packing::Single => got == *meta,
                Packing::Batched { rows: most, .. } => {
                    let (dims, plan_dims) = (got.shape.dims(), meta.shape.dims());
                    got.dtype == meta.dtype
                        && dims.len() == plan_dims.len()
                        && dims[1..] == plan_dims[1..]
                        && (1..=most).contains(&dims[0])
                }
            };
            if !fits {
                let expected = match self.shared.packing {
                    Packing::Single => meta.to_string(),
                    Packing::Batched { rows: most, .. } => {
                        let tail: Vec<String> = meta.shape.dims()[1..].iter().map(|d| d.to_string()).collect();
                        format!("{}[n, {}] with 1 <= n <= {most}", meta.dtype, tail.join(", "))
                    }
                };
                return Err(ServeError::BadInput(format!("input '{name}': expected {expected}, got {got}")));
            }
            let value_rows = got.shape.dims().first().copied().unwrap_or(1);
            match rows {
                Some(r) if r != value_rows => {
                    return Err(ServeError::BadInput(format!(
                        "input '{name}' has {value_rows} row(s) but the request's other inputs have {r}"
                    )))
                }
                _ => rows = Some(value_rows),
            }
            inputs.push(value);
        }
        Ok((inputs, rows.unwrap_or(1)))
    }

    /// Stops taking requests, finishes those already queued and in flight, ends the job
    /// and returns its report. Later requests, from any clone, get [`ServeError::Stopped`];
    /// a second call answers `Stopped` too.
    pub fn shutdown(&self) -> Result<JobReport, ServeError> {
        self.shared.queue.lock().unwrap_or_else(PoisonError::into_inner).take();
        let threads = self.shared.threads.lock().unwrap_or_else(PoisonError::into_inner).take();
        let Some((dispatch, collect)) = threads else {
            return Err(ServeError::Stopped("the model was already shut down".into()));
        };
        let panicked = |what: &str| ServeError::Stopped(format!("the model's {what} thread panicked"));
        dispatch.join().map_err(|_| panicked("dispatcher"))?;
        collect.join().map_err(|_| panicked("collector"))?
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // The last handle: stop the threads (queued requests are finished first).
        self.queue.get_mut().unwrap_or_else(PoisonError::into_inner).take();
        if let Some((dispatch, collect)) = self.threads.get_mut().unwrap_or_else(PoisonError::into_inner).take() {
            let _ = dispatch.join();
            let _ = collect.join();
        }
    }
}
