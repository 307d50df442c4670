//! The dispatcher: takes requests from the bounded queue, drops the cancelled and the
//! expired ones before they use compute, gathers the rest into batches (up to the plan's
//! batch rows or a maximum wait, Triton's `max_queue_delay`), pads and pushes each batch as
//! one piece, and tells the collector which rows of it belong to which request.

use crate::metrics::Metrics;
use crate::reply::{GaveUp, Responder};
use crate::ServeError;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use regflow_plan::{HostArray, HostData, TensorMeta};
use regflow_runtime::GraphFeeds;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One submitted request.
#[derive(Debug)]
pub(crate) struct Request {
    /// One value per plan input, in the signature's order, each `rows` rows.
    pub(crate) inputs: Vec<HostArray>,
    pub(crate) rows: usize,
    pub(crate) submitted: Instant,
    /// The deadline and the duration it was given.
    pub(crate) deadline: Option<(Instant, Duration)>,
    pub(crate) reply: Responder,
}

/// A piece on its way through the plan: which rows answer which request.
#[derive(Debug)]
pub(crate) struct InFlight {
    pub(crate) parts: Vec<Part>,
}

/// Rows `start..start + rows` of a piece's outputs answer this request.
#[derive(Debug)]
pub(crate) struct Part {
    pub(crate) reply: Responder,
    pub(crate) start: usize,
    pub(crate) rows: usize,
    pub(crate) submitted: Instant,
}

/// How the dispatcher packs requests.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Packing {
    /// One request per piece; its inputs are the plan's inputs exactly.
    Single,
    /// Requests of any number of rows up to `rows` (the plan's batch dimension) per piece,
    /// waiting at most `max_delay` after the first for more.
    Batched { rows: usize, max_delay: Duration },
}

/// What the dispatcher needs; runs on its own thread until the queue closes.
pub(crate) struct Dispatcher {
    pub(crate) queue: Receiver<Request>,
    pub(crate) feeds: GraphFeeds,
    pub(crate) inputs: Vec<(String, TensorMeta)>,
    pub(crate) packing: Packing,
    pub(crate) in_flight: Sender<InFlight>,
    pub(crate) metrics: Arc<Metrics>,
    /// The batch buffers, one per input, reused piece after piece.
    pub(crate) buffers: Vec<HostArray>,
}

impl Dispatcher {
    /// Serves until every handle is gone (the queue disconnects), then closes the feeds so
    /// the job ends once the pieces in flight are through.
    pub(crate) fn run(mut self) {
        let mut carried: Option<Request> = None;
        loop {
            let first = match carried.take() {
                Some(request) => request,
                None => match self.queue.recv() {
                    Ok(request) => {
                        self.metrics.queued.fetch_sub(1, Ordering::Relaxed);
                        request
                    }
                    Err(_) => break,
                },
            };
            let Some(first) = self.admit(first) else { continue };
            let mut batch = vec![first];
            if let Packing::Batched { rows, max_delay } = self.packing {
                // Triton's `max_queue_delay`: the first request waits at most this long for company.
                let until = batch[0].submitted.checked_add(max_delay).unwrap_or_else(Instant::now);
                let mut used = batch[0].rows;
                while used < rows {
                    let next = match self.queue.recv_deadline(until) {
                        Ok(next) => next,
                        Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => break,
                    };
                    self.metrics.queued.fetch_sub(1, Ordering::Relaxed);
                    let Some(next) = self.admit(next) else { continue };
                    if used + next.rows > rows {
                        carried = Some(next);
                        break;
                    }
                    used += next.rows;
                    batch.push(next);
                }
            }
            if let Err(error) = self.push(batch) {
                // The job stopped: every request queued now or later gets the reason. The
                // dispatcher keeps receiving until the last handle is gone, so a request
                // sent after the failure cannot sit unanswered in the channel.
                let reason = ServeError::Stopped(error.to_string());
                if let Some(request) = carried.take() {
                    request.reply.answer(Err(reason.clone()));
                }
                for request in self.queue.iter() {
                    self.metrics.queued.fetch_sub(1, Ordering::Relaxed);
                    request.reply.answer(Err(reason.clone()));
                }
                break;
            }
        }
        let _ = self.feeds.close();
    }

    /// The request if it should run: a cancelled one is dropped, an expired one answered.
    fn admit(&self, request: Request) -> Option<Request> {
        match request.reply.gave_up() {
            GaveUp::No => {}
            GaveUp::Dropped => {
                Metrics::add(&self.metrics.cancelled, 1);
                return None;
            }
            // The caller counted its missed deadline.
            GaveUp::TimedOut => return None,
        }
        if let Some((deadline, given)) = request.deadline {
            if Instant::now() >= deadline {
                Metrics::add(&self.metrics.deadline_exceeded, 1);
                let when = "in the queue, before it ran";
                request.reply.answer(Err(ServeError::DeadlineExceeded { deadline: given, when }));
                return None;
            }
        }
        Some(request)
    }

    /// Packs the batch into one piece (padding the rest of the rows with zeros), pushes it
    /// and hands its parts to the collector.
    fn push(&mut self, batch: Vec<Request>) -> Result<(), ServeError> {
        let mut parts = Vec::with_capacity(batch.len());
        let rows: usize = batch.iter().map(|r| r.rows).sum();
        match self.packing {
            Packing::Single => {
                let request = &batch[0];
                for ((name, _), value) in self.inputs.iter().zip(&request.inputs) {
                    self.feeds.push(name, value)?;
                }
            }
            Packing::Batched { .. } => {
                for (i, (name, _)) in self.inputs.iter().enumerate() {
                    let buffer = &mut self.buffers[i];
                    let mut row = 0;
                    for request in &batch {
                        copy_rows(buffer, row, &request.inputs[i]);
                        row += request.rows;
                    }
                    zero_rows_from(buffer, row);
                    self.feeds.push(name, buffer)?;
                }
            }
        }
        self.metrics.record_batch(batch.len(), rows);
        let mut start = 0;
        for request in batch {
            parts.push(Part { reply: request.reply, start, rows: request.rows, submitted: request.submitted });
            start += request.rows;
        }
        self.in_flight
            .send(InFlight { parts })
            .map_err(|_| ServeError::Stopped("the collector of answers has stopped".into()))
    }
}

/// Elements per row of an array whose first dimension is its rows.
fn row_len(array: &HostArray) -> usize {
    array.shape.dims().iter().skip(1).product()
}

/// Writes `part`'s rows into `buffer` from row `at` (same dtype and row shape: checked on
/// submission).
fn copy_rows(buffer: &mut HostArray, at: usize, part: &HostArray) {
    let width = row_len(buffer);
    let from = at * width;
    match (&mut buffer.data, &part.data) {
        (HostData::F32(b), HostData::F32(p)) => b[from..from + p.len()].copy_from_slice(p),
        (HostData::F64(b), HostData::F64(p)) => b[from..from + p.len()].copy_from_slice(p),
        (HostData::I64(b), HostData::I64(p)) => b[from..from + p.len()].copy_from_slice(p),
        (HostData::Bf16(b), HostData::Bf16(p)) => b[from..from + p.len()].copy_from_slice(p),
        (HostData::F16(b), HostData::F16(p)) => b[from..from + p.len()].copy_from_slice(p),
        _ => unreachable!("request dtypes are checked against the plan's on submission"),
    }
}

/// Zeros every row of `buffer` from row `at`: padding carries no earlier request's data.
fn zero_rows_from(buffer: &mut HostArray, at: usize) {
    let from = at * row_len(buffer);
    match &mut buffer.data {
        HostData::F32(b) => b[from..].fill(0.0),
        HostData::F64(b) => b[from..].fill(0.0),
        HostData::I64(b) => b[from..].fill(0),
        HostData::Bf16(b) => b[from..].fill(regflow_plan::bf16::ZERO),
        HostData::F16(b) => b[from..].fill(regflow_plan::f16::ZERO),
    }
}
