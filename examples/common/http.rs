//! An HTTP front for a [`Model`] (axum on tokio), shared by `examples/serve_http.rs` and
//! `tests/serve_http.rs`:
//!
//! - `POST /v1/infer` with `{"inputs": {"x": {"shape": [n, 784], "data": [...]}}, "deadline_ms": 5}`
//!   answers `{"outputs": [{"name", "dtype", "shape", "data"}]}`; an error answers
//!   `{"error": kind, "message": sentence}` with 400 (bad input or JSON), 429 (overloaded),
//!   504 (deadline exceeded), 503 (stopped) or 500.
//! - `GET /metrics`: the model's counters and the HTTP answers by status, Prometheus text.
//! - `GET /healthz`: 200 while serving.
//!
//! Handlers await [`Model::infer_async`], so no tokio worker blocks on the model; a client
//! that hangs up drops the future, which cancels its request.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use regflow::graph::{DType, HostArray};
use regflow::plan::HostData;
use regflow_serve::{Model, ServeError};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;

/// The statuses `/metrics` counts answers of `/v1/infer` by.
const STATUSES: [u16; 7] = [200, 400, 429, 500, 503, 504, 499];

/// What the handlers share.
#[derive(Debug)]
struct App {
    model: Model,
    /// `/v1/infer` answers by status, in [`STATUSES`]' order.
    answers: [AtomicU64; STATUSES.len()],
    /// Shut down after this many `/v1/infer` answers (`--requests N`).
    limit: Option<u64>,
    /// Told when the limit is reached.
    limit_reached: Notify,
}

impl App {
    fn count(&self, status: StatusCode) {
        let i = STATUSES.iter().position(|&s| s == status.as_u16()).unwrap_or(STATUSES.len() - 1);
        self.answers[i].fetch_add(1, Ordering::Relaxed);
        let total: u64 = self.answers.iter().map(|a| a.load(Ordering::Relaxed)).sum();
        if self.limit.is_some_and(|limit| total >= limit) {
            self.limit_reached.notify_one();
        }
    }
}

/// A request body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct InferRequest {
    inputs: BTreeMap<String, JsonTensor>,
    /// Answer within this many milliseconds of arrival, or 504.
    #[serde(default)]
    deadline_ms: Option<u64>,
}

/// A tensor in JSON: shape and row-major elements (numbers); the dtype is the model's
/// input's unless given.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonTensor {
    shape: Vec<usize>,
    data: Vec<f64>,
    #[serde(default)]
    dtype: Option<String>,
}

/// An answer body.
#[derive(Debug, Serialize)]
struct InferResponse {
    outputs: Vec<JsonOutput>,
}

/// One output tensor of an answer.
#[derive(Debug, Serialize)]
struct JsonOutput {
    name: String,
    dtype: String,
    shape: Vec<usize>,
    data: JsonData,
}

/// Elements, as the dtype writes them (f32 values print as f32, not widened).
#[derive(Debug, Serialize)]
#[serde(untagged)]
enum JsonData {
    /// i64 elements.
    I64(Vec<i64>),
    /// f32 elements.
    F32(Vec<f32>),
    /// f64 elements.
    F64(Vec<f64>),
}

/// An error body.
#[derive(Debug, Serialize)]
struct JsonError {
    error: String,
    message: String,
}

fn json_response(status: StatusCode, body: &impl Serialize) -> Response {
    match serde_json::to_vec(body) {
        Ok(bytes) => (status, [(header::CONTENT_TYPE, "application/json")], bytes).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("cannot write the answer as JSON: {e}")).into_response(),
    }
}

fn error_response(status: StatusCode, kind: &str, message: String) -> Response {
    json_response(status, &JsonError { error: kind.to_string(), message })
}

/// The HTTP status of a serving error.
fn status_of(error: &ServeError) -> StatusCode {
    match error {
        ServeError::BadInput(_) => StatusCode::BAD_REQUEST,
        ServeError::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
        ServeError::DeadlineExceeded { .. } => StatusCode::GATEWAY_TIMEOUT,
        ServeError::Stopped(_) => StatusCode::SERVICE_UNAVAILABLE,
        // The client went away first: nobody reads this one (nginx's 499).
        ServeError::Cancelled => StatusCode::from_u16(499).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// A JSON tensor as the dtype `dtype`; errors are sentences for a 400.
fn to_array(name: &str, tensor: JsonTensor, dtype: DType) -> Result<HostArray, String> {
    let dtype = match tensor.dtype.as_deref() {
        None => dtype,
        Some("f32") => DType::F32,
        Some("f64") => DType::F64,
        Some("i64") => DType::I64,
        Some("bf16") => DType::Bf16,
        Some("f16") => DType::F16,
        Some(other) => {
            return Err(format!("input '{name}': unknown dtype '{other}' (expected f32, f64, i64, bf16 or f16)"))
        }
    };
    let data = match dtype {
        DType::F32 => HostData::F32(tensor.data.iter().map(|&v| v as f32).collect()),
        DType::F64 => HostData::F64(tensor.data),
        DType::Bf16 => HostData::Bf16(tensor.data.iter().map(|&v| regflow::plan::bf16_from_f64(v)).collect()),
        DType::F16 => HostData::F16(tensor.data.iter().map(|&v| regflow::plan::f16_from_f64(v)).collect()),
        DType::I64 => HostData::I64(
            tensor
                .data
                .iter()
                .map(|&v| {
                    if v.fract() == 0.0 && v.abs() < 9.007_199_254_740_992e15 {
                        Ok(v as i64)
                    } else {
                        Err(format!("input '{name}' is i64 but holds {v}"))
                    }
                })
                .collect::<Result<_, _>>()?,
        ),
    };
    HostArray::new(tensor.shape, data).map_err(|e| format!("input '{name}': {e}"))
}

async fn infer(State(app): State<Arc<App>>, body: Bytes) -> Response {
    let response = answer(&app, &body).await;
    app.count(response.status());
    response
}

async fn answer(app: &App, body: &[u8]) -> Response {
    let request: InferRequest = match serde_json::from_slice(body) {
        Ok(request) => request,
        Err(e) => {
            return error_response(StatusCode::BAD_REQUEST, "bad_input", format!("the body is not a request: {e}"))
        }
    };
    let mut inputs = Vec::with_capacity(request.inputs.len());
    for (name, tensor) in request.inputs {
        // An unknown name gets the model's own error (with its suggestion) on submission.
        let dtype = app.model.inputs().iter().find(|(n, _)| *n == name).map_or(DType::F32, |(_, meta)| meta.dtype);
        match to_array(&name, tensor, dtype) {
            Ok(array) => inputs.push((name, array)),
            Err(message) => return error_response(StatusCode::BAD_REQUEST, "bad_input", message),
        }
    }
    let answer = match request.deadline_ms {
        Some(ms) => app.model.infer_async_within(inputs, Duration::from_millis(ms)).await,
        None => app.model.infer_async(inputs).await,
    };
    match answer {
        Ok(values) => {
            let outputs = app
                .model
                .outputs()
                .iter()
                .zip(values)
                .map(|((name, _), value)| JsonOutput {
                    name: name.clone(),
                    dtype: value.dtype().to_string(),
                    shape: value.shape.dims().to_vec(),
                    data: match value.data {
                        HostData::F32(v) => JsonData::F32(v),
                        HostData::F64(v) => JsonData::F64(v),
                        HostData::I64(v) => JsonData::I64(v),
                        // JSON numbers: a bf16 or f16 output widens to f32 exactly.
                        HostData::Bf16(v) => JsonData::F32(v.iter().map(|x| x.to_f32()).collect()),
                        HostData::F16(v) => JsonData::F32(v.iter().map(|x| x.to_f32()).collect()),
                    },
                })
                .collect();
            json_response(StatusCode::OK, &InferResponse { outputs })
        }
        Err(error) => error_response(status_of(&error), error.kind(), error.to_string()),
    }
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    let mut text = app.model.metrics().to_prometheus("regflow_model");
    text.push_str(
        "# HELP regflow_http_responses_total Answers of /v1/infer by HTTP status.\n\
         # TYPE regflow_http_responses_total counter\n",
    );
    for (status, count) in STATUSES.iter().zip(&app.answers) {
        text.push_str(&format!(
            "regflow_http_responses_total{{status=\"{status}\"}} {}\n",
            count.load(Ordering::Relaxed)
        ));
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

async fn healthz() -> &'static str {
    "ok\n"
}

/// Serves `model` on `listener` until `shutdown` completes or `limit` answers of
/// `/v1/infer` were given; then stops accepting, finishes the requests in flight and shuts
/// the model down (returning its error, if any).
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    model: Model,
    limit: Option<u64>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let app = Arc::new(App { model: model.clone(), answers: Default::default(), limit, limit_reached: Notify::new() });
    let router = Router::new()
        .route("/v1/infer", post(infer))
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .with_state(app.clone());
    let stop = async move {
        tokio::select! {
            () = shutdown => {}
            () = app.limit_reached.notified(), if app.limit.is_some() => {}
        }
    };
    axum::serve(listener, router).with_graceful_shutdown(stop).await?;
    // Every connection is closed: no request is left but those the model still finishes.
    // A model shut down already (by another handle) is no error here.
    match tokio::task::spawn_blocking(move || model.shutdown()).await? {
        Ok(_) | Err(ServeError::Stopped(_)) => Ok(()),
        Err(error) => Err(error.into()),
    }
}
