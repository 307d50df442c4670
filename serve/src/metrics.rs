//! What a model has done, in counters a service exports: requests by outcome, queue depth,
//! batch sizes and a latency histogram, rendered in the Prometheus text format. Updated with
//! relaxed atomics (no lock, no allocation per request).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the latency buckets, in microseconds (the last bucket is `+Inf`).
pub const LATENCY_BUCKETS_US: [u64; 14] =
    [50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000];

/// The counters of one model, shared by its clones.
#[derive(Debug, Default)]
pub struct Metrics {
    pub(crate) requests: AtomicU64,
    pub(crate) answered: AtomicU64,
    pub(crate) overloaded: AtomicU64,
    pub(crate) deadline_exceeded: AtomicU64,
    pub(crate) cancelled: AtomicU64,
    pub(crate) bad_input: AtomicU64,
    pub(crate) failed: AtomicU64,
    pub(crate) pieces: AtomicU64,
    pub(crate) batched_rows: AtomicU64,
    pub(crate) queued: AtomicU64,
    /// Pieces by how many requests they carried: `batch_requests[k - 1]`, the last one
    /// counting every size past it.
    pub(crate) batch_requests: [AtomicU64; 8],
    pub(crate) latency: [AtomicU64; LATENCY_BUCKETS_US.len() + 1],
    pub(crate) latency_sum_us: AtomicU64,
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MetricsSnapshot {
    /// Requests submitted (accepted or not).
    pub requests: u64,
    /// Requests answered with outputs.
    pub answered: u64,
    /// Requests refused because the queue was full.
    pub overloaded: u64,
    /// Requests whose deadline passed (in the queue or while they ran).
    pub deadline_exceeded: u64,
    /// Requests the caller gave up before they ran.
    pub cancelled: u64,
    /// Requests refused for their inputs.
    pub bad_input: u64,
    /// Requests that got a runtime error.
    pub failed: u64,
    /// Pieces pushed into the plan (one per batch): what reached the kernels.
    pub pieces: u64,
    /// Request rows carried by those pieces (padding excluded).
    pub batched_rows: u64,
    /// Requests waiting in the queue now.
    pub queued: u64,
    /// Pieces by the number of requests they carried (index k: k + 1 requests; the last
    /// entry counts every larger batch too).
    pub batch_requests: Vec<u64>,
    /// Answered requests per latency bucket ([`LATENCY_BUCKETS_US`], then `+Inf`).
    pub latency: Vec<u64>,
    /// Sum of answered requests' latencies, in microseconds.
    pub latency_sum_us: u64,
}

impl Metrics {
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn record_latency(&self, latency: Duration) {
        let us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        let bucket = LATENCY_BUCKETS_US.iter().position(|&b| us <= b).unwrap_or(LATENCY_BUCKETS_US.len());
        Self::add(&self.latency[bucket], 1);
        Self::add(&self.latency_sum_us, us);
    }

    pub(crate) fn record_batch(&self, requests: usize, rows: usize) {
        Self::add(&self.pieces, 1);
        Self::add(&self.batched_rows, rows as u64);
        let index = requests.clamp(1, self.batch_requests.len()) - 1;
        Self::add(&self.batch_requests[index], 1);
    }

    /// The counters now.
    pub fn snapshot(&self) -> MetricsSnapshot {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        MetricsSnapshot {
            requests: load(&self.requests),
            answered: load(&self.answered),
            overloaded: load(&self.overloaded),
            deadline_exceeded: load(&self.deadline_exceeded),
            cancelled: load(&self.cancelled),
            bad_input: load(&self.bad_input),
            failed: load(&self.failed),
            pieces: load(&self.pieces),
            batched_rows: load(&self.batched_rows),
            queued: load(&self.queued),
            batch_requests: self.batch_requests.iter().map(load).collect(),
            latency: self.latency.iter().map(load).collect(),
            latency_sum_us: load(&self.latency_sum_us),
        }
    }
}

impl MetricsSnapshot {
    /// The counters in the Prometheus text exposition format, every name prefixed with
    /// `prefix` (e.g. `regflow_model`).
    pub fn to_prometheus(&self, prefix: &str) -> String {
        let mut out = String::new();
        let mut counter = |name: &str, help: &str, kind: &str, value: u64| {
            let _ =
                writeln!(out, "# HELP {prefix}_{name} {help}\n# TYPE {prefix}_{name} {kind}\n{prefix}_{name} {value}");
        };
        counter("requests_total", "Requests submitted.", "counter", self.requests);
        counter("answered_total", "Requests answered with outputs.", "counter", self.answered);
        counter("pieces_total", "Pieces (batches) run through the plan.", "counter", self.pieces);
        counter("batched_rows_total", "Request rows run, padding excluded.", "counter", self.batched_rows);
        counter("queue_depth", "Requests waiting in the queue.", "gauge", self.queued);
        let _ = writeln!(
            out,
            "# HELP {prefix}_errors_total Requests not answered, by kind.\n# TYPE {prefix}_errors_total counter"
        );
        for (kind, value) in [
            ("overloaded", self.overloaded),
            ("deadline_exceeded", self.deadline_exceeded),
            ("cancelled", self.cancelled),
            ("bad_input", self.bad_input),
            ("runtime", self.failed),
        ] {
            let _ = writeln!(out, "{prefix}_errors_total{{kind=\"{kind}\"}} {value}");
        }
        let _ = writeln!(
            out,
            "# HELP {prefix}_batch_requests Pieces by the number of requests batched in them.\n\
             # TYPE {prefix}_batch_requests counter"
        );
        for (k, value) in self.batch_requests.iter().enumerate() {
            let size = if k + 1 == self.batch_requests.len() { format!("{}+", k + 1) } else { (k + 1).to_string() };
            let _ = writeln!(out, "{prefix}_batch_requests{{size=\"{size}\"}} {value}");
        }
        let _ = writeln!(
            out,
            "# HELP {prefix}_latency_seconds Time from submission to answer.\n# TYPE {prefix}_latency_seconds histogram"
        );
        let mut cumulative = 0;
        for (i, value) in self.latency.iter().enumerate() {
            cumulative += value;
            let le = LATENCY_BUCKETS_US.get(i).map_or("+Inf".to_string(), |us| format!("{}", *us as f64 / 1e6));
            let _ = writeln!(out, "{prefix}_latency_seconds_bucket{{le=\"{le}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{prefix}_latency_seconds_sum {}", self.latency_sum_us as f64 / 1e6);
        let _ = writeln!(out, "{prefix}_latency_seconds_count {cumulative}");
        out
    }
}
