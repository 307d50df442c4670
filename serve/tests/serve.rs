//! Serving a plan: concurrent callers each get the answer to their own input; a full queue
//! answers `Overloaded` at once and the accepted requests still complete; expired and
//! cancelled requests never reach a kernel; dynamic batching gives the unbatched answers.

use regflow_graph::plan::{DType, DeviceKind, KernelConf};
use regflow_graph::{CompileOptions, Graph, HostArray, Init};
use regflow_kernels::{Kernel, KernelError, KernelIo, KernelRegistry, KernelSpec};
use regflow_serve::{Answer, InferFuture, Model, ServeError};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

const FEATURES: usize = 4;
const HIDDEN: usize = 5;
const CLASSES: usize = 3;

fn w1() -> Vec<f32> {
    (0..FEATURES * HIDDEN).map(|i| ((i * 7 % 11) as f32 - 5.0) / 8.0).collect()
}

fn w2() -> Vec<f32> {
    (0..HIDDEN * CLASSES).map(|i| ((i * 5 % 13) as f32 - 6.0) / 9.0).collect()
}

/// `relu(x · w1) · w2` for a batch of `rows`, compiled for one cpu device.
fn mlp_plan(rows: usize) -> regflow_graph::plan::Plan {
    let g = Graph::new();
    let x = g.input("x", [rows, FEATURES], DType::F32).unwrap();
    let w1 = g.variable("w1", [FEATURES, HIDDEN], DType::F32, Init::Zeros).unwrap();
    let w2 = g.variable("w2", [HIDDEN, CLASSES], DType::F32, Init::Zeros).unwrap();
    let y = x.matmul(&w1).unwrap().relu().unwrap().matmul(&w2).unwrap();
    g.compile(&[y], &[], &CompileOptions::default()).unwrap().plan
}

fn model(rows: usize, batching: bool) -> regflow_serve::ModelBuilder {
    let builder = Model::builder(mlp_plan(rows))
        .variable("w1", HostArray::f32([FEATURES, HIDDEN], w1()).unwrap())
        .variable("w2", HostArray::f32([HIDDEN, CLASSES], w2()).unwrap())
        .watchdog(Some(Duration::from_secs(20)));
    if batching {
        builder.dynamic_batching(Duration::from_micros(200))
    } else {
        builder
    }
}

/// The answer computed on the host, in f64.
fn offline(x: &[f32], rows: usize) -> Vec<f64> {
    let (w1, w2) = (w1(), w2());
    let mut out = Vec::with_capacity(rows * CLASSES);
    for r in 0..rows {
        let hidden: Vec<f64> = (0..HIDDEN)
            .map(|h| {
                let v: f64 =
                    (0..FEATURES).map(|f| f64::from(x[r * FEATURES + f]) * f64::from(w1[f * HIDDEN + h])).sum();
                v.max(0.0)
            })
            .collect();
        for c in 0..CLASSES {
            out.push((0..HIDDEN).map(|h| hidden[h] * f64::from(w2[h * CLASSES + c])).sum());
        }
    }
    out
}

/// A request's input, unique to (caller, index).
fn input(caller: usize, index: usize, rows: usize) -> Vec<f32> {
    (0..rows * FEATURES).map(|k| ((caller * 1000 + index) as f32).sin() * (k as f32 + 1.0) / 3.0).collect()
}

fn assert_answer(answer: &HostArray, x: &[f32], rows: usize, what: &str) {
    let want = offline(x, rows);
    let got = answer.to_f64_vec();
    assert_eq!(answer.shape.dims(), &[rows, CLASSES], "{what}");
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "{what}: got {got:?}, want {want:?}");
    }
}

fn concurrent_callers_get_their_own_answers(batching: bool, rows_of: fn(usize) -> usize) {
    let model = model(8, batching).build().unwrap();
    let (callers, requests) = (64, 1000);
    let threads: Vec<_> = (0..callers)
        .map(|caller| {
            let model = model.clone();
            std::thread::spawn(move || {
                for index in 0..requests {
                    let rows = rows_of(caller + index);
                    let x = input(caller, index, rows);
                    let answer = model.infer([("x", HostArray::f32([rows, FEATURES], x.clone()).unwrap())]).unwrap();
                    assert_answer(&answer[0], &x, rows, &format!("caller {caller}, request {index}"));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let metrics = model.metrics();
    assert_eq!(metrics.requests, (callers * requests) as u64);
    assert_eq!(metrics.answered, (callers * requests) as u64, "none lost, none duplicated");
    assert_eq!(metrics.queued, 0);
    let report = model.shutdown().unwrap();
    let fires: u64 = report.actors.iter().filter(|a| a.name.starts_with("matmul")).map(|a| a.fires).max().unwrap();
    assert_eq!(fires, metrics.pieces, "one firing per piece pushed");
    if batching {
        assert!(metrics.pieces < metrics.requests, "batching packed requests: {metrics:?}");
    } else {
        assert_eq!(metrics.pieces, metrics.requests);
    }
}

#[test]
fn sixty_four_callers_each_get_the_answer_to_their_own_input() {
    concurrent_callers_get_their_own_answers(false, |_| 8);
}

#[test]
fn sixty_four_callers_with_dynamic_batching_of_mixed_sizes_get_their_own_rows() {
    concurrent_callers_get_their_own_answers(true, |k| 1 + k % 5);
}

/// A `matmul` kernel that waits for a permit before each firing and counts its firings.
#[derive(Clone, Default)]
struct Gate {
    permits: Arc<(Mutex<u64>, std::sync::Condvar)>,
    fired: Arc<AtomicU64>,
}

impl Gate {
    fn release(&self, n: u64) {
        *self.permits.0.lock().unwrap() += n;
        self.permits.1.notify_all();
    }

    fn install(&self, builder: regflow_serve::ModelBuilder) -> regflow_serve::ModelBuilder {
        let gate = self.clone();
        builder.configure_job(move |job| {
            job.op_kernel("matmul", DeviceKind::Cpu, DType::F32, move |spec: &KernelSpec<'_>| {
                let mut registry = KernelRegistry::new();
                regflow_kernels::cpu::register(&mut registry, DeviceKind::Cpu);
                let inner = registry.make(&KernelConf::Op(spec.op.cloned().unwrap()), spec)?;
                Ok(Box::new(Gated { inner, gate: gate.clone() }) as Box<dyn Kernel>)
            })
        })
    }
}

struct Gated {
    inner: Box<dyn Kernel>,
    gate: Gate,
}

impl Kernel for Gated {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let (lock, ready) = &*self.gate.permits;
        let mut permits = lock.lock().unwrap();
        while *permits == 0 {
            permits = ready.wait(permits).unwrap();
        }
        *permits -= 1;
        drop(permits);
        self.gate.fired.fetch_add(1, Ordering::SeqCst);
        self.inner.run(io)
    }
}

/// Polls a future once.
fn poll_once(future: &mut InferFuture) -> Poll<Answer> {
    let mut cx = Context::from_waker(Waker::noop());
    Pin::new(future).poll(&mut cx)
}

struct Unpark(std::thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// Runs a future to its end on this thread (no async runtime needed).
fn block_on(mut future: InferFuture) -> Answer {
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(answer) = Pin::new(&mut future).poll(&mut cx) {
            return answer;
        }
        std::thread::park();
    }
}

fn one_row(caller: usize) -> [(&'static str, HostArray); 1] {
    [("x", HostArray::f32([8, FEATURES], input(caller, 0, 8)).unwrap())]
}

#[test]
fn a_full_queue_answers_overloaded_at_once_and_the_accepted_requests_complete() {
    let gate = Gate::default();
    let model =
        gate.install(model(8, false).queue_capacity(4).default_deadline(Duration::from_secs(20))).build().unwrap();
    let mut accepted = Vec::new();
    // Submit until refused, then wait for the queue to stop moving: until the dispatcher is
    // blocked in its push it may take one more request out of the queue, and then the queue
    // has room again; fill it again.
    let mut refusals = 0;
    let refused = loop {
        refusals += 1;
        let refused = loop {
            let mut future = model.infer_async(one_row(accepted.len()));
            match poll_once(&mut future) {
                Poll::Ready(Err(error)) => break error,
                Poll::Ready(Ok(_)) => panic!("answered while the kernel is held"),
                Poll::Pending => accepted.push(future),
            }
            assert!(accepted.len() < 1000, "the queue never filled");
        };
        let mut last = model.metrics().queued;
        let mut still = 0;
        while still < 3 {
            std::thread::sleep(Duration::from_millis(10));
            let now = model.metrics().queued;
            still = if now == last { still + 1 } else { 0 };
            last = now;
        }
        if last == 4 {
            break refused;
        }
    };
    assert!(matches!(refused, ServeError::Overloaded { capacity: 4, .. }), "{refused}");
    assert!(refused.to_string().contains("overloaded") && refused.to_string().contains("4"), "{refused}");
    // The blocking form refuses at once too (the dispatcher is blocked in its push; the
    // model's default deadline would turn a mistake here into a failure, not a hang).
    assert!(matches!(model.try_infer(one_row(0)), Err(ServeError::Overloaded { .. })));
    // The queue holds 4; the rest are in the plan's feeds and registers.
    assert!(accepted.len() >= 4, "{}", accepted.len());
    gate.release(u64::MAX / 2);
    for (caller, future) in accepted.into_iter().enumerate() {
        let answer = block_on(future).unwrap();
        assert_answer(&answer[0], &input(caller, 0, 8), 8, &format!("accepted request {caller}"));
    }
    let metrics = model.metrics();
    assert_eq!(metrics.overloaded, refusals + 1, "each refusal counted once, try_infer's too");
    model.shutdown().unwrap();
}

#[test]
fn expired_and_cancelled_requests_never_reach_a_kernel() {
    let gate = Gate::default();
    let model = gate.install(model(8, false).queue_capacity(16)).build().unwrap();
    // The first request holds the first matmul; the plan's feeds and registers fill behind
    // it, then the dispatcher blocks in a push and requests stay queued.
    let first = model.infer_async(one_row(0));
    let mut behind = Vec::new();
    loop {
        behind.push(model.infer_async(one_row(behind.len() + 1)));
        std::thread::sleep(Duration::from_millis(2));
        if model.metrics().queued >= 2 {
            std::thread::sleep(Duration::from_millis(20));
            if model.metrics().queued >= 2 {
                break;
            }
        }
        assert!(behind.len() < 16, "the dispatcher never blocked");
    }
    // Three more wait behind them: one whose deadline passes, one dropped, one kept.
    let expired = model.infer_async_within(one_row(100), Duration::from_millis(1));
    let dropped = model.infer_async(one_row(101));
    let kept = model.infer_async(one_row(102));
    drop(dropped);
    std::thread::sleep(Duration::from_millis(10));
    gate.release(u64::MAX / 2);
    block_on(first).unwrap();
    let ran = 1 + behind.len() as u64 + 1;
    for future in behind {
        block_on(future).unwrap();
    }
    let answer = block_on(kept).unwrap();
    assert_answer(&answer[0], &input(102, 0, 8), 8, "the request kept");
    match block_on(expired) {
        Err(ServeError::DeadlineExceeded { when, .. }) => assert_eq!(when, "in the queue, before it ran"),
        other => panic!("expected DeadlineExceeded, got {other:?}"),
    }
    let metrics = model.metrics();
    let report = model.shutdown().unwrap();
    // Pieces pushed: every request but the expired and the dropped one.
    assert_eq!(metrics.pieces, ran, "{metrics:?}");
    assert_eq!(metrics.cancelled, 1);
    assert_eq!(metrics.deadline_exceeded, 1);
    // Each piece fires each of the two matmuls once: the expired and the dropped requests
    // never reached a kernel.
    assert_eq!(gate.fired.load(Ordering::SeqCst), 2 * ran);
    let fires: Vec<u64> = report.actors.iter().filter(|a| a.name.starts_with("matmul")).map(|a| a.fires).collect();
    assert_eq!(fires, vec![ran, ran]);
}

#[test]
fn bad_inputs_are_refused_naming_the_input_and_the_shapes() {
    let model = model(8, true).build().unwrap();
    let err = |r: Answer| r.unwrap_err().to_string();
    assert_eq!(
        err(model.infer([("y", HostArray::f32([1, FEATURES], vec![0.0; FEATURES]).unwrap())])),
        "the model has no input 'y'; did you mean 'x'? (its inputs: 'x')"
    );
    assert_eq!(
        err(model.infer([("x", HostArray::f32([9, FEATURES], vec![0.0; 9 * FEATURES]).unwrap())])),
        "input 'x': expected f32[n, 4] with 1 <= n <= 8, got f32[9, 4]"
    );
    assert_eq!(
        err(model.infer([("x", HostArray::f64([2, FEATURES], vec![0.0; 2 * FEATURES]).unwrap())])),
        "input 'x': expected f32[n, 4] with 1 <= n <= 8, got f64[2, 4]"
    );
    assert_eq!(err(model.infer(Vec::<(&str, HostArray)>::new())), "input 'x' (f32[8, 4]) is missing");
    assert_eq!(model.metrics().bad_input, 4);
    model.shutdown().unwrap();
    assert!(matches!(model.infer(one_row(0)), Err(ServeError::Stopped(_))));
    assert!(matches!(model.shutdown(), Err(ServeError::Stopped(_))));
}

#[test]
fn a_plan_without_a_batch_dimension_cannot_be_batched() {
    let g = Graph::new();
    let x = g.input("x", [4], DType::F32).unwrap();
    let total = x.sum_all().unwrap();
    let plan = g.compile(&[total], &[], &CompileOptions::default()).unwrap().plan;
    let err = Model::builder(plan).dynamic_batching(Duration::from_millis(1)).build().unwrap_err();
    assert_eq!(
        err.to_string(),
        "cannot serve this plan: dynamic batching needs every input and output to have the batch as its first \
         dimension: input 'x' is f32[4], but 'fetch:0' is f32[]"
    );
}

#[test]
fn prometheus_text_counts_requests_errors_batches_and_latency() {
    let model = model(8, true).build().unwrap();
    for k in 0..10 {
        model.infer([("x", HostArray::f32([2, FEATURES], input(k, 0, 2)).unwrap())]).unwrap();
    }
    let _ = model.infer([("z", HostArray::f32([2, FEATURES], input(0, 0, 2)).unwrap())]);
    let text = model.metrics().to_prometheus("digits");
    for line in [
        "digits_requests_total 11",
        "digits_answered_total 10",
        "digits_errors_total{kind=\"bad_input\"} 1",
        "digits_latency_seconds_count 10",
        "# TYPE digits_latency_seconds histogram",
        "digits_batch_requests{size=\"1\"}",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
    model.shutdown().unwrap();
}

#[test]
fn a_blocking_request_past_its_deadline_is_answered_deadline_exceeded_once() {
    let gate = Gate::default();
    let model = gate.install(model(8, false)).build().unwrap();
    let err = model.infer_within(one_row(0), Duration::from_millis(20)).unwrap_err();
    assert!(matches!(err, ServeError::DeadlineExceeded { when: "before its answer came", .. }), "{err}");
    assert!(err.to_string().starts_with("the request's deadline of 20ms passed before its answer came"), "{err}");
    gate.release(u64::MAX / 2);
    let answer = model.infer(one_row(1)).unwrap();
    assert_answer(&answer[0], &input(1, 0, 8), 8, "the next request");
    let metrics = model.metrics();
    assert_eq!((metrics.deadline_exceeded, metrics.cancelled, metrics.answered), (1, 0, 1), "{metrics:?}");
    model.shutdown().unwrap();
}

/// A plan file compiled for two tensor-parallel devices, served with a checkpoint of whole
/// weights: each device gets its part, and the answers are the one-device ones.
#[test]
fn a_plan_file_and_a_checkpoint_serve_a_tensor_parallel_layout() {
    use regflow_graph::sbp::{Mesh, NdSbp, Sbp};
    let g = Graph::new();
    let x = g.input("x", [8, FEATURES], DType::F32).unwrap();
    let v1 = g.variable("w1", [FEATURES, HIDDEN], DType::F32, Init::Zeros).unwrap();
    let v2 = g.variable("w2", [HIDDEN, CLASSES], DType::F32, Init::Zeros).unwrap();
    let mesh = Mesh::cpu(&[2], &["tp"]).unwrap();
    g.set_layout(x, &mesh, NdSbp(vec![Sbp::Broadcast])).unwrap();
    g.set_layout(v1, &mesh, NdSbp(vec![Sbp::Split(1)])).unwrap();
    g.set_layout(v2, &mesh, NdSbp(vec![Sbp::Split(0)])).unwrap();
    let y = x.matmul(&v1).unwrap().relu().unwrap().matmul(&v2).unwrap();
    let compiled = g.compile_parallel(&[y], &[], &regflow_graph::ParallelOptions::new(mesh)).unwrap();
    let dir = std::env::temp_dir().join(format!("regflow-serve-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (plan_path, checkpoint) = (dir.join("plan.json"), dir.join("weights.safetensors"));
    std::fs::write(&plan_path, compiled.plan.to_json()).unwrap();
    let weights = vec![
        ("w1".to_string(), HostArray::f32([FEATURES, HIDDEN], w1()).unwrap()),
        ("w2".to_string(), HostArray::f32([HIDDEN, CLASSES], w2()).unwrap()),
    ];
    regflow_graph::checkpoint::save(&checkpoint, &weights).unwrap();
    let plan = regflow_graph::plan::Plan::from_json(&std::fs::read_to_string(&plan_path).unwrap()).unwrap();
    let model = Model::builder(plan).checkpoint(&checkpoint).build().unwrap();
    for caller in 0..4 {
        let answer = model.infer(one_row(caller)).unwrap();
        assert_answer(&answer[0], &input(caller, 0, 8), 8, &format!("request {caller} on tp2"));
    }
    model.shutdown().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A model that waits for requests longer than its watchdog's timeout is idle, not stuck.
#[test]
fn an_idle_model_outlives_its_watchdog() {
    let model = model(8, true).watchdog(Some(Duration::from_millis(100))).build().unwrap();
    let answer = model.infer(one_row(0)).unwrap();
    assert_answer(&answer[0], &input(0, 0, 8), 8, "before idling");
    std::thread::sleep(Duration::from_millis(600));
    let answer = model.infer(one_row(1)).unwrap();
    assert_answer(&answer[0], &input(1, 0, 8), 8, "after idling");
    model.shutdown().unwrap();
}

/// A kernel that fails on its third firing.
struct FailsOnThird(u64);

impl Kernel for FailsOnThird {
    fn run(&mut self, _io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        self.0 += 1;
        if self.0 == 3 {
            return Err(KernelError("refusing the third piece".into()));
        }
        Ok(())
    }
}

/// When the model's job fails, every caller hears it — those in flight, those queued and
/// those who come later — and nobody waits for ever.
#[test]
fn a_failing_job_answers_every_caller() {
    let model = model(8, false)
        .configure_job(|job| {
            job.op_kernel("unary", DeviceKind::Cpu, DType::F32, |_: &KernelSpec<'_>| {
                Ok(Box::new(FailsOnThird(0)) as Box<dyn Kernel>)
            })
        })
        .build()
        .unwrap();
    let futures: Vec<InferFuture> = (0..16).map(|k| model.infer_async(one_row(k))).collect();
    let answers: Vec<Answer> = futures.into_iter().map(block_on).collect();
    let failed = answers.iter().filter(|a| a.is_err()).count();
    let ok = answers.iter().filter(|a| a.is_ok()).count();
    assert_eq!(ok + failed, 16);
    assert!(failed >= 1, "{answers:?}");
    let later = model.infer(one_row(99));
    assert!(matches!(later, Err(ServeError::Stopped(_))), "{later:?}");
    let report = model.shutdown();
    let message = report.map(|_| ()).unwrap_err().to_string();
    assert!(message.contains("refusing the third piece"), "{message}");
}
