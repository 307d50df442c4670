//! The HTTP front of `examples/serve_http.rs` (its server module, run in-process on loopback)
//! driven by hyper's HTTP/1 client: concurrent answers equal the model's own, bad inputs
//! answer 400 with the model's reason, a full queue 429, an expired deadline 504, a stopped
//! model 503, `/metrics` and `/healthz` answer, and a graceful shutdown finishes the request
//! in flight. Every wait is bounded.

#[path = "../examples/common/http.rs"]
mod http;
#[path = "../examples/common/mlp.rs"]
mod mlp;

use axum::body::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use regflow::graph::HostArray;
use regflow::kernels::{Kernel, KernelError, KernelIo, KernelRegistry, KernelSpec};
use regflow::plan::{DType, DeviceKind, KernelConf};
use regflow_serve::{Model, ModelBuilder};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// The longest any one step of a test may take before it fails instead of hanging.
const BOUND: Duration = Duration::from_secs(60);
const BATCH: usize = 8;

fn shape() -> mlp::MlpShape {
    mlp::MlpShape { widths: vec![784, 32, 10] }
}

fn builder() -> ModelBuilder {
    let mut builder = Model::builder(shape().plan(BATCH).expect("the test MLP compiles"))
        .dynamic_batching(Duration::from_micros(200))
        .watchdog(Some(Duration::from_secs(30)));
    for (name, value) in shape().weights() {
        builder = builder.variable(&name, value);
    }
    builder
}

/// `rows` deterministic input rows, different per `seed`.
fn rows(rows: usize, seed: u64) -> Vec<f32> {
    (0..rows).flat_map(|r| mlp::input_row(784, seed * 100 + r as u64)).collect()
}

fn body(x: &[f32], rows: usize) -> Value {
    json!({"inputs": {"x": {"shape": [rows, 784], "data": x}}})
}

/// A server on a free loopback port, stopped by `stop`.
struct Server {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), Box<dyn std::error::Error + Send + Sync>>>,
}

impl Server {
    async fn start(model: Model) -> Server {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a loopback port");
        let addr = listener.local_addr().expect("a bound address");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(http::serve(listener, model, None, async move {
            let _ = stopped.await;
        }));
        Server { addr, stop: Some(stop), task }
    }

    /// Signals the shutdown and waits (bounded) for the server to end.
    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let ended = tokio::time::timeout(BOUND, self.task).await.expect("the server ends after its shutdown signal");
        ended.expect("the server task did not panic").expect("the server ended cleanly");
    }
}

/// One request on its own connection: the status and the body.
async fn call(addr: SocketAddr, method: &str, path: &str, body: Option<String>) -> (u16, String) {
    let exchange = async {
        let stream = tokio::net::TcpStream::connect(addr).await.expect("connect to the server");
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.expect("an HTTP/1 handshake");
        tokio::spawn(connection);
        let request = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", addr.to_string())
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .expect("a well-formed request");
        let response = sender.send_request(request).await.expect("an answer");
        let status = response.status().as_u16();
        let bytes = response.into_body().collect().await.expect("the whole body").to_bytes();
        (status, String::from_utf8(bytes.to_vec()).expect("a UTF-8 body"))
    };
    tokio::time::timeout(BOUND, exchange).await.expect("the server answers within the bound")
}

async fn infer(addr: SocketAddr, body: &Value) -> (u16, Value) {
    let (status, text) = call(addr, "POST", "/v1/infer", Some(body.to_string())).await;
    let value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("a JSON body ({e}): {text}"));
    (status, value)
}

/// The model's own answer, computed directly (off the async workers).
async fn direct(model: &Model, x: Vec<f32>, rows: usize) -> Vec<f32> {
    let model = model.clone();
    let answer = tokio::task::spawn_blocking(move || model.infer([("x", HostArray::f32([rows, 784], x).unwrap())]))
        .await
        .expect("the direct call did not panic")
        .expect("the model answers directly");
    answer[0].to_f64_vec().into_iter().map(|v| v as f32).collect()
}

/// The logits of an HTTP answer.
fn logits(answer: &Value, rows: usize) -> Vec<f32> {
    let output = &answer["outputs"][0];
    assert_eq!(output["shape"], json!([rows, 10]), "{answer}");
    assert_eq!(output["dtype"], "f32", "{answer}");
    let data = output["data"].as_array().expect("data is an array");
    data.iter().map(|v| v.as_f64().expect("numbers") as f32).collect()
}

/// Polls `done` every millisecond until it holds, failing after the bound.
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let wait = async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    tokio::time::timeout(BOUND, wait).await.unwrap_or_else(|_| panic!("timed out waiting for {what}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_http_answers_equal_the_models_own_and_metrics_count_them() {
    let model = builder().build().unwrap();
    let server = Server::start(model.clone()).await;
    let requests: Vec<(usize, Vec<f32>)> = (0..48).map(|k| (1 + k % 3, rows(1 + k % 3, k as u64))).collect();
    let answers: Vec<_> = requests
        .iter()
        .map(|(n, x)| {
            let (addr, body) = (server.addr, body(x, *n));
            tokio::spawn(async move { infer(addr, &body).await })
        })
        .collect();
    for ((n, x), answer) in requests.iter().zip(answers) {
        let (status, answer) = answer.await.unwrap();
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["outputs"][0]["name"], json!(model.outputs()[0].0));
        let (got, want) = (logits(&answer, *n), direct(&model, x.clone(), *n).await);
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            // The same model, its rows possibly batched with others: equal up to rounding.
            assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "HTTP {got:?} vs direct {want:?}");
        }
    }
    let (status, health) = call(server.addr, "GET", "/healthz", None).await;
    assert_eq!((status, health.as_str()), (200, "ok\n"));
    let (status, text) = call(server.addr, "GET", "/metrics", None).await;
    assert_eq!(status, 200);
    for line in [
        "regflow_model_requests_total 96",
        "regflow_model_answered_total 96",
        "regflow_model_errors_total{kind=\"overloaded\"} 0",
        "regflow_model_latency_seconds_count 96",
        "regflow_http_responses_total{status=\"200\"} 48",
        "regflow_http_responses_total{status=\"429\"} 0",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_answer_400_an_expired_deadline_504_and_a_stopped_model_503() {
    let model = builder().build().unwrap();
    let server = Server::start(model.clone()).await;
    let x = rows(2, 7);
    let cases = [
        (
            json!({"inputs": {"x": {"shape": [2, 783], "data": x[..2 * 783]}}}),
            "input 'x': expected f32[n, 784] with 1 <= n <= 8, got f32[2, 783]",
        ),
        (
            json!({"inputs": {"y": {"shape": [2, 784], "data": x}}}),
            "the model has no input 'y'; did you mean 'x'? (its inputs: 'x')",
        ),
        (
            json!({"inputs": {"x": {"shape": [2, 784], "data": x, "dtype": "f64"}}}),
            "input 'x': expected f32[n, 784] with 1 <= n <= 8, got f64[2, 784]",
        ),
        (
            json!({"inputs": {"x": {"shape": [9, 784], "data": rows(9, 1)}}}),
            "expected f32[n, 784] with 1 <= n <= 8, got f32[9, 784]",
        ),
        (json!({"inputs": {"x": {"shape": [3, 784], "data": x}}}), "input 'x': "),
        (json!({"inputs": {}}), "input 'x' (f32[8, 784]) is missing"),
        (json!({"input": {}}), "the body is not a request"),
    ];
    for (request, reason) in &cases {
        let (status, answer) = infer(server.addr, request).await;
        assert_eq!(status, 400, "{answer}");
        assert_eq!(answer["error"], "bad_input", "{answer}");
        let message = answer["message"].as_str().unwrap();
        assert!(message.contains(reason), "{message:?} should say {reason:?}");
    }
    let (status, text) = call(server.addr, "POST", "/v1/infer", Some("{not json".into())).await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("\"error\":\"bad_input\"") && text.contains("the body is not a request"), "{text}");

    let mut expired = body(&x, 2);
    expired["deadline_ms"] = json!(0);
    let (status, answer) = infer(server.addr, &expired).await;
    assert_eq!((status, &answer["error"]), (504, &json!("deadline_exceeded")), "{answer}");
    assert!(answer["message"].as_str().unwrap().contains("deadline of 0ns passed"), "{answer}");
    let mut generous = body(&x, 2);
    generous["deadline_ms"] = json!(60_000);
    assert_eq!(infer(server.addr, &generous).await.0, 200);

    // The model stops (another handle shut it down) while the server still runs.
    tokio::task::spawn_blocking({
        let model = model.clone();
        move || model.shutdown()
    })
    .await
    .unwrap()
    .unwrap();
    let (status, answer) = infer(server.addr, &body(&x, 2)).await;
    assert_eq!((status, &answer["error"]), (503, &json!("stopped")), "{answer}");
    let (_, text) = call(server.addr, "GET", "/metrics", None).await;
    for line in [
        "regflow_http_responses_total{status=\"400\"} 8",
        "regflow_http_responses_total{status=\"504\"} 1",
        "regflow_http_responses_total{status=\"503\"} 1",
        "regflow_model_errors_total{kind=\"bad_input\"} 5",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
    server.stop().await;
}

/// A `matmul` kernel that waits for permits: holds the model's compute while a test fills
/// its queue or shuts its server down.
#[derive(Clone, Default)]
struct Gate {
    permits: Arc<(Mutex<u64>, Condvar)>,
}

impl Gate {
    fn release(&self) {
        *self.permits.0.lock().unwrap() = u64::MAX / 2;
        self.permits.1.notify_all();
    }

    fn install(&self, builder: ModelBuilder) -> ModelBuilder {
        let gate = self.clone();
        builder.configure_job(move |job| {
            job.op_kernel("matmul", DeviceKind::Cpu, DType::F32, move |spec: &KernelSpec<'_>| {
                let mut registry = KernelRegistry::new();
                regflow::kernels::cpu::register(&mut registry, DeviceKind::Cpu);
                let op = spec.op.cloned().ok_or_else(|| KernelError("a matmul kernel without its op".into()))?;
                let inner = registry.make(&KernelConf::Op(op), spec)?;
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
        self.inner.run(io)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_429_and_the_accepted_requests_complete() {
    let gate = Gate::default();
    let model = gate.install(builder().queue_capacity(1)).build().unwrap();
    let server = Server::start(model.clone()).await;
    let mut sent = Vec::new();
    // One request at a time until the model refuses one: the held kernel fills the plan's
    // registers, then the queue of one.
    while model.metrics().overloaded == 0 {
        assert!(sent.len() < 300, "the queue never filled: {:?}", model.metrics());
        let x = rows(1, sent.len() as u64);
        let (addr, request) = (server.addr, body(&x, 1));
        sent.push((x, tokio::spawn(async move { infer(addr, &request).await })));
        let submitted = sent.len() as u64;
        until("the request to reach the model", || model.metrics().requests >= submitted).await;
    }
    gate.release();
    let mut refused = 0;
    for (x, answer) in sent {
        let (status, answer) = answer.await.unwrap();
        match status {
            429 => {
                refused += 1;
                assert_eq!(answer["error"], "overloaded", "{answer}");
                assert!(answer["message"].as_str().unwrap().contains("queue of 1"), "{answer}");
            }
            200 => {
                let want = direct(&model, x, 1).await;
                let got = logits(&answer, 1);
                for (g, w) in got.iter().zip(&want) {
                    assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "{got:?} vs {want:?}");
                }
            }
            other => panic!("status {other}: {answer}"),
        }
    }
    assert!(refused >= 1);
    assert_eq!(model.metrics().overloaded, refused);
    let (_, text) = call(server.addr, "GET", "/metrics", None).await;
    assert!(text.contains(&format!("regflow_http_responses_total{{status=\"429\"}} {refused}")), "{text}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_shutdown_finishes_the_request_in_flight_then_stops_the_model() {
    let gate = Gate::default();
    let model = gate.install(builder()).build().unwrap();
    let server = Server::start(model.clone()).await;
    let x = rows(3, 42);
    let reference = builder().build().unwrap();
    let want = direct(&reference, x.clone(), 3).await;
    let in_flight = {
        let (addr, request) = (server.addr, body(&x, 3));
        tokio::spawn(async move { infer(addr, &request).await })
    };
    until("the request to reach the plan", || model.metrics().pieces >= 1).await;
    let addr = server.addr;
    let Server { stop, task, .. } = server;
    let _ = stop.expect("not stopped yet").send(());
    // The server waits for the held request: it cannot have ended.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!task.is_finished(), "the server ended with a request in flight");
    gate.release();
    let (status, answer) = in_flight.await.unwrap();
    assert_eq!(status, 200, "{answer}");
    let got = logits(&answer, 3);
    let ended = tokio::time::timeout(BOUND, task).await.expect("the server ends once the request is answered");
    ended.unwrap().unwrap();
    // The model was shut down after the last answer; the port is closed.
    let stopped = {
        let model = model.clone();
        tokio::task::spawn_blocking(move || model.infer([("x", HostArray::f32([3, 784], x).unwrap())])).await.unwrap()
    };
    assert_eq!(stopped.unwrap_err().kind(), "stopped");
    assert!(tokio::net::TcpStream::connect(addr).await.is_err(), "the server still accepts connections");
    assert_eq!(model.metrics().answered, 1);
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "{got:?} vs {want:?}");
    }
}

#[test]
fn a_checkpoint_with_train_digits_names_sizes_the_mlp_and_loads_its_weights() {
    let trained = mlp::MlpShape { widths: vec![64, 16, 10] };
    let path = std::env::temp_dir().join(format!("regflow-serve-http-{}.safetensors", std::process::id()));
    regflow::graph::checkpoint::save(&path, &trained.weights()).unwrap();
    let shape = mlp::MlpShape::of_checkpoint(&path).unwrap();
    assert_eq!(shape, trained);
    let from_file = Model::builder(shape.plan(4).unwrap()).checkpoint(&path).build().unwrap();
    let mut preloaded = Model::builder(trained.plan(4).unwrap());
    for (name, value) in trained.weights() {
        preloaded = preloaded.variable(&name, value);
    }
    let preloaded = preloaded.build().unwrap();
    let x = || [("x", HostArray::f32([4, 64], (0..4).flat_map(|r| mlp::input_row(64, r)).collect()).unwrap())];
    assert_eq!(from_file.infer(x()).unwrap(), preloaded.infer(x()).unwrap());
    std::fs::remove_file(&path).unwrap();
    assert!(mlp::MlpShape::of_checkpoint(&path).is_err(), "a missing file is an error, not a panic");
    assert_eq!(mlp::MlpShape::parse("784, 32,10").unwrap().widths, vec![784, 32, 10]);
    assert!(mlp::MlpShape::parse("784").is_err());
}
