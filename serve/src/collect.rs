//! The collector: reads every output's sink in piece order, which is the order the
//! dispatcher pushed the pieces in, so the k-th piece fetched answers the k-th batch sent;
//! cuts each request's rows out of the batch and answers it. When the dispatcher is gone it
//! waits for the job and keeps its report.

use crate::batch::InFlight;
use crate::metrics::Metrics;
use crate::reply::GaveUp;
use crate::ServeError;
use crossbeam_channel::Receiver;
use regflow_plan::{HostArray, TensorMeta};
use regflow_runtime::{Fetcher, Job, JobReport};
use std::sync::Arc;

/// What the collector needs; runs on its own thread until the dispatcher is gone.
pub(crate) struct Collector {
    pub(crate) job: Job,
    pub(crate) in_flight: Receiver<InFlight>,
    /// One fetcher per plan output, with the output's meta, in the signature's order.
    pub(crate) outputs: Vec<(Fetcher, TensorMeta)>,
    /// Whether requests are rows of a batch (else each piece is one whole request).
    pub(crate) batched: bool,
    pub(crate) metrics: Arc<Metrics>,
}

impl Collector {
    /// Answers pieces until the dispatcher closes, then ends the job.
    pub(crate) fn run(self) -> Result<JobReport, ServeError> {
        let Collector { job, in_flight, outputs, batched, metrics } = self;
        let mut stopped: Option<ServeError> = None;
        for piece in in_flight.iter() {
            if let Some(reason) = &stopped {
                for part in piece.parts {
                    part.reply.answer(Err(reason.clone()));
                }
                continue;
            }
            let mut values = Vec::with_capacity(outputs.len());
            for (fetcher, meta) in &outputs {
                let value = match fetcher.recv() {
                    Some(fetched) => HostArray::from_le_bytes(meta, fetched.bytes())
                        .map_err(|e| ServeError::Stopped(format!("an output does not fit its meta: {e}"))),
                    None => Err(ServeError::Stopped("the model's job ended before answering".into())),
                };
                match value {
                    Ok(value) => values.push(value),
                    Err(error) => {
                        stopped = Some(error);
                        break;
                    }
                }
            }
            if let Some(reason) = &stopped {
                Metrics::add(&metrics.failed, piece.parts.len() as u64);
                for part in piece.parts {
                    part.reply.answer(Err(reason.clone()));
                }
                continue;
            }
            let single = piece.parts.len() == 1 && !batched;
            let mut values = Some(values);
            for part in piece.parts {
                if part.reply.gave_up() != GaveUp::No {
                    // It ran, but nobody waits for it: not cancelled (it used compute), not
                    // answered.
                    continue;
                }
                let answer = if single {
                    values.take().unwrap_or_default()
                } else {
                    values.iter().flatten().map(|v| rows_of(v, part.start, part.rows)).collect()
                };
                metrics.record_latency(part.submitted.elapsed());
                Metrics::add(&metrics.answered, 1);
                part.reply.answer(Ok(answer));
            }
        }
        drop(outputs);
        let report = job.wait();
        match (report, stopped) {
            (Ok(report), None) => Ok(report),
            (Ok(_), Some(reason)) => Err(reason),
            (Err(error), _) => Err(ServeError::from(error)),
        }
    }
}

/// Rows `start..start + rows` of `value` (its first dimension is the batch).
fn rows_of(value: &HostArray, start: usize, rows: usize) -> HostArray {
    let mut ranges: Vec<std::ops::Range<usize>> = value.shape.dims().iter().map(|&d| 0..d).collect();
    ranges[0] = start..start + rows;
    value.region(&ranges)
}
