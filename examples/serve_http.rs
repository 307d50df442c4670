//! Serves an MLP over HTTP with dynamic batching: `POST /v1/infer`, `GET /metrics`,
//! `GET /healthz` (see `docs/serving.md`).
//!
//! ```text
//! cargo run --release --example train_digits -- --save digits.safetensors
//! cargo run --release --example serve_http -- --checkpoint digits.safetensors --addr 127.0.0.1:8080
//! curl -s localhost:8080/v1/infer -d '{"inputs": {"x": {"shape": [1, 64], "data": [0, 0, 5, ...]}}}'
//! ```
//!
//! Without `--checkpoint` it serves a `--layers` MLP (784-1024-1024-10 by default) with its
//! initial weights. It prints `listening on http://ADDR` once bound; Ctrl-C (or SIGTERM, or
//! `--requests N` answers) stops accepting, finishes the requests in flight and shuts the
//! model down.

#[path = "common/http.rs"]
mod http;
#[path = "common/mlp.rs"]
mod mlp;

use clap::Parser;
use regflow_serve::Model;
use std::io::Write as _;
use std::path::PathBuf;
use std::time::Duration;

/// Serves an MLP over HTTP with dynamic batching.
#[derive(Debug, Parser)]
struct Options {
    /// The address to listen on (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:8080")]
    addr: String,
    /// A safetensors checkpoint of `train_digits` (w1, b1, w2, b2, …): its sizes and weights.
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// The MLP's widths without a checkpoint, input first.
    #[arg(long, default_value = "784,1024,1024,10")]
    layers: String,
    /// Rows per piece: the plan's batch; a request has 1 to this many rows.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    max_batch: u64,
    /// How long the first request of a batch waits for others, in microseconds.
    #[arg(long, default_value_t = 200)]
    max_delay_us: u64,
    /// Requests that may wait in the queue before the server answers 429.
    #[arg(long, default_value_t = regflow_serve::DEFAULT_QUEUE as u64, value_parser = clap::value_parser!(u64).range(1..))]
    queue: u64,
    /// Threads each CPU kernel may use.
    #[arg(long, default_value_t = 1)]
    cpu_threads: usize,
    /// Exit after answering this many inference requests (for tests and scripts).
    #[arg(long)]
    requests: Option<u64>,
}

/// Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            eprintln!("cannot listen for Ctrl-C ({e}); stop the server with SIGTERM or --requests");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
    eprintln!("shutting down: finishing the requests in flight");
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let options = Options::parse();
    let shape = match &options.checkpoint {
        Some(path) => mlp::MlpShape::of_checkpoint(path)?,
        None => mlp::MlpShape::parse(&options.layers)?,
    };
    let plan = shape.plan(options.max_batch as usize)?;
    let mut builder = Model::builder(plan)
        .queue_capacity(options.queue as usize)
        .dynamic_batching(Duration::from_micros(options.max_delay_us))
        .cpu_threads(options.cpu_threads);
    if let Some(path) = &options.checkpoint {
        builder = builder.checkpoint(path);
    }
    let model = builder.build()?;
    let listener = tokio::net::TcpListener::bind(&options.addr).await?;
    println!("listening on http://{}", listener.local_addr()?);
    println!(
        "model: MLP {:?}, batch {}, max delay {} us, queue {}",
        shape.widths, options.max_batch, options.max_delay_us, options.queue
    );
    std::io::stdout().flush()?;
    http::serve(listener, model, options.requests, shutdown_signal()).await?;
    println!("stopped");
    Ok(())
}
