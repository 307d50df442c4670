//! Where one request's answer lands: a slot the serving threads fill once and the caller
//! waits on, blocking ([`Reply::wait`]) or as a future ([`InferFuture`]) that works with any
//! async runtime. Dropping the future cancels the request.

use crate::metrics::Metrics;
use crate::ServeError;
use regflow_plan::HostArray;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// The outputs of one request, in the plan signature's order.
pub type Answer = Result<Vec<HostArray>, ServeError>;

#[derive(Debug, Default)]
struct State {
    answer: Option<Answer>,
    waker: Option<Waker>,
}

/// One request's answer slot, shared by the caller and the serving threads.
#[derive(Debug, Default)]
pub(crate) struct Reply {
    state: Mutex<State>,
    ready: Condvar,
    /// Whether and how the caller gave up ([`GaveUp`]): the request is skipped if it has
    /// not run, its answer dropped.
    gave_up: AtomicU8,
}

/// How a caller gave up on its request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum GaveUp {
    /// It still waits.
    No = 0,
    /// It dropped the future: the dispatcher counts the request as cancelled.
    Dropped = 1,
    /// Its deadline passed while it waited: it counted that itself.
    TimedOut = 2,
}

impl Reply {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Fills the slot (the first answer wins) and wakes the caller.
    pub(crate) fn answer(&self, answer: Answer) {
        let waker = {
            let mut state = self.lock();
            if state.answer.is_some() {
                return;
            }
            state.answer = Some(answer);
            state.waker.take()
        };
        self.ready.notify_all();
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    /// Whether and how the caller gave up.
    pub(crate) fn gave_up(&self) -> GaveUp {
        match self.gave_up.load(Ordering::Acquire) {
            0 => GaveUp::No,
            1 => GaveUp::Dropped,
            _ => GaveUp::TimedOut,
        }
    }

    /// The caller gives up (the first reason given stays).
    pub(crate) fn give_up(&self, why: GaveUp) {
        let _ = self.gave_up.compare_exchange(0, why as u8, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Waits for the answer until `deadline`; `None` when it passed first.
    pub(crate) fn wait(&self, deadline: Option<Instant>) -> Option<Answer> {
        let mut state = self.lock();
        loop {
            if let Some(answer) = state.answer.take() {
                return Some(answer);
            }
            state = match deadline {
                None => self.ready.wait(state).unwrap_or_else(PoisonError::into_inner),
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return None;
                    }
                    self.ready.wait_timeout(state, left).unwrap_or_else(PoisonError::into_inner).0
                }
            };
        }
    }
}

/// The serving side's hold on a request's answer slot. Whatever path a request takes —
/// answered, refused, or dropped with a queue or a batch when the job stops — its caller
/// hears: a responder dropped before its request was answered answers `Stopped`.
#[derive(Debug)]
pub(crate) struct Responder(pub(crate) Arc<Reply>);

impl std::ops::Deref for Responder {
    type Target = Reply;

    fn deref(&self) -> &Reply {
        &self.0
    }
}

impl Drop for Responder {
    fn drop(&mut self) {
        // A no-op when the request was answered (the first answer wins).
        self.0.answer(Err(ServeError::Stopped("the model stopped before answering this request".into())));
    }
}

/// The answer to [`crate::Model::infer_async`]: a future that needs no particular async
/// runtime (the serving threads wake it). Dropping it before it is ready cancels the
/// request: if it has not run yet it never will, and its place in the queue is freed.
#[derive(Debug)]
pub struct InferFuture {
    pub(crate) reply: Option<Arc<Reply>>,
    /// The model's counters (a late answer counts as a missed deadline).
    pub(crate) metrics: Option<Arc<Metrics>>,
    /// The request's deadline and the duration it was given, to answer `DeadlineExceeded`
    /// if the answer is late (the dispatcher answers requests that expire in the queue).
    pub(crate) deadline: Option<(Instant, Duration)>,
}

impl InferFuture {
    /// A future that is ready at once with `answer` (a request refused on submission).
    pub(crate) fn ready(answer: Answer) -> Self {
        let reply = Arc::new(Reply::default());
        reply.answer(answer);
        Self { reply: Some(reply), metrics: None, deadline: None }
    }

    /// Waits for the answer on this thread, with no async runtime; the request's deadline
    /// still applies.
    pub fn wait(mut self) -> Answer {
        let Some(reply) = self.reply.take() else { return Err(polled_after_ready()) };
        match reply.wait(self.deadline.map(|(at, _)| at)) {
            Some(answer) => answer,
            None => self.timed_out(&reply),
        }
    }

    /// The caller stops waiting at the deadline: counted once, here.
    fn timed_out(&self, reply: &Reply) -> Answer {
        reply.give_up(GaveUp::TimedOut);
        if let Some(metrics) = &self.metrics {
            Metrics::add(&metrics.deadline_exceeded, 1);
        }
        let deadline = self.deadline.map_or(Duration::ZERO, |(_, given)| given);
        Err(ServeError::DeadlineExceeded { deadline, when: "before its answer came" })
    }
}

fn polled_after_ready() -> ServeError {
    ServeError::Stopped("the future was polled after it completed".into())
}

impl Future for InferFuture {
    type Output = Answer;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Answer> {
        let Some(reply) = self.reply.clone() else { return Poll::Ready(Err(polled_after_ready())) };
        let mut state = reply.lock();
        if let Some(answer) = state.answer.take() {
            drop(state);
            self.reply = None;
            return Poll::Ready(answer);
        }
        if self.deadline.is_some_and(|(deadline, _)| Instant::now() >= deadline) {
            drop(state);
            self.reply = None;
            return Poll::Ready(self.timed_out(&reply));
        }
        state.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

impl Drop for InferFuture {
    fn drop(&mut self) {
        if let Some(reply) = self.reply.take() {
            reply.give_up(GaveUp::Dropped);
        }
    }
}
