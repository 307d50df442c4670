//! What the program embedding a job is blocked on or holding: pushes waiting for a free
//! buffer, fetchers holding pieces nobody reads, `Job::wait` running. A few atomics per
//! feeder and fetcher, written by the user's threads and the sink kernels and read by the
//! watchdog, so a deadlock through the user is a cycle of the wait-for graph, not a hang.
//!
//! Plain `std` atomics, not the loom switch: the hand-offs they describe go through
//! crossbeam channels, which loom does not model; they are diagnostics, not the protocol.

use crate::watchdog::UserWait;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// One fed source's feeder.
#[derive(Debug)]
pub(crate) struct FeedRecord {
    /// The source actor's name.
    pub(crate) source: String,
    /// The typed input it feeds (a part of), if the plan's signature names one.
    pub(crate) input: Option<String>,
    /// Its buffers: pieces it holds before a push waits.
    pub(crate) depth: u64,
    /// Pieces pushed so far.
    pub(crate) pushed: AtomicU64,
    /// Nanoseconds from the job's start, plus one, since a push has been waiting; 0 when none.
    blocked_since: AtomicU64,
    /// Closed (or dropped) by the user.
    pub(crate) closed: AtomicBool,
}

impl FeedRecord {
    /// How messages name this feed: by its input when it has one.
    pub(crate) fn label(&self) -> String {
        match &self.input {
            Some(input) => format!("input '{input}' (source '{}')", self.source),
            None => format!("source '{}'", self.source),
        }
    }
}

/// One channel sink's fetcher.
#[derive(Debug)]
pub(crate) struct FetchRecord {
    /// The sink actor's name.
    pub(crate) sink: String,
    /// Pieces the sink may deliver ahead of the user's fetches (its credits).
    pub(crate) depth: u64,
    /// Delivered into the channel and not yet received.
    pub(crate) queued: AtomicU64,
    /// Received, and their `Fetched` not yet dropped.
    pub(crate) held: AtomicU64,
    /// Received so far.
    pub(crate) received: AtomicU64,
    /// Threads inside `recv` right now.
    pub(crate) readers: AtomicU64,
    /// The thread that last took or read the fetcher (see [`thread_token`]).
    pub(crate) reader: AtomicU64,
    /// Taken by the user (`Job::fetcher`).
    pub(crate) taken: AtomicBool,
    /// Dropped: its pieces go back to the sink as they arrive.
    pub(crate) dropped: AtomicBool,
    /// The sink's kernel is gone (its stream ended): nothing more will be delivered.
    pub(crate) sink_gone: AtomicBool,
}

impl FetchRecord {
    /// Pieces delivered and not given back: the sink's credits in use.
    pub(crate) fn unread(&self) -> u64 {
        self.queued.load(Ordering::SeqCst) + self.held.load(Ordering::SeqCst)
    }
}

/// The user side of one job.
#[derive(Debug)]
pub(crate) struct UserWaits {
    epoch: Instant,
    pub(crate) feeds: Vec<FeedRecord>,
    pub(crate) fetches: Vec<FetchRecord>,
    /// `Job::wait` is running.
    pub(crate) waiting: AtomicBool,
}

impl UserWaits {
    pub(crate) fn new() -> Self {
        Self { epoch: Instant::now(), feeds: Vec::new(), fetches: Vec::new(), waiting: AtomicBool::new(false) }
    }

    /// Adds a feed's record; returns its index.
    pub(crate) fn add_feed(&mut self, source: &str, input: Option<String>, depth: u64) -> usize {
        self.feeds.push(FeedRecord {
            source: source.to_string(),
            input,
            depth,
            pushed: AtomicU64::new(0),
            blocked_since: AtomicU64::new(0),
            closed: AtomicBool::new(false),
        });
        self.feeds.len() - 1
    }

    /// Adds a fetch's record; returns its index.
    pub(crate) fn add_fetch(&mut self, sink: &str, depth: u64) -> usize {
        self.fetches.push(FetchRecord {
            sink: sink.to_string(),
            depth,
            queued: AtomicU64::new(0),
            held: AtomicU64::new(0),
            received: AtomicU64::new(0),
            readers: AtomicU64::new(0),
            reader: AtomicU64::new(0),
            taken: AtomicBool::new(false),
            dropped: AtomicBool::new(false),
            sink_gone: AtomicBool::new(false),
        });
        self.fetches.len() - 1
    }

    /// A push on feed `feed` starts waiting for a free buffer.
    pub(crate) fn push_blocked(&self, feed: usize) {
        let since = self.epoch.elapsed().as_nanos().min(u128::from(u64::MAX - 1)) as u64 + 1;
        self.feeds[feed].blocked_since.store(since, Ordering::SeqCst);
    }

    /// The push on feed `feed` stopped waiting.
    pub(crate) fn push_unblocked(&self, feed: usize) {
        self.feeds[feed].blocked_since.store(0, Ordering::SeqCst);
    }

    /// The user-side nodes of the wait-for graph now: blocked pushes, threads in `recv`,
    /// fetchers holding pieces nobody is reading, inputs never fed while others were,
    /// `Job::wait`.
    pub(crate) fn nodes(&self) -> Vec<UserWait> {
        let mut nodes = Vec::new();
        let now = self.epoch.elapsed();
        for feed in &self.feeds {
            let since = feed.blocked_since.load(Ordering::SeqCst);
            if since > 0 {
                nodes.push(UserWait::Push {
                    feed: feed.label(),
                    source: feed.source.clone(),
                    buffers: feed.depth,
                    blocked_for: now.saturating_sub(Duration::from_nanos(since - 1)),
                });
            }
        }
        for fetch in &self.fetches {
            if fetch.readers.load(Ordering::SeqCst) > 0 {
                nodes.push(UserWait::Recv { sink: fetch.sink.clone() });
            }
            let unread = fetch.unread();
            let idle = fetch.readers.load(Ordering::SeqCst) == 0 && !fetch.dropped.load(Ordering::SeqCst);
            if idle && unread > 0 && unread >= fetch.depth {
                nodes.push(UserWait::Unread {
                    sink: fetch.sink.clone(),
                    pieces: unread,
                    taken: fetch.taken.load(Ordering::SeqCst),
                });
            }
        }
        nodes.extend(self.never_fed());
        if self.waiting.load(Ordering::SeqCst) {
            nodes.push(UserWait::JobWait);
        }
        nodes
    }

    /// Inputs (or untyped fed sources) with no piece pushed and not closed, while another
    /// input got some: each names how many the others got.
    fn never_fed(&self) -> Vec<UserWait> {
        // Per input (or source): pieces pushed (the most of its parts) and whether it is open.
        let mut inputs: Vec<(String, u64, bool)> = Vec::new();
        for feed in &self.feeds {
            let name = feed.input.clone().unwrap_or_else(|| feed.source.clone());
            let pushed = feed.pushed.load(Ordering::SeqCst);
            let open = !feed.closed.load(Ordering::SeqCst);
            match inputs.iter_mut().find(|(n, ..)| *n == name) {
                Some(entry) => {
                    entry.1 = entry.1.max(pushed);
                    entry.2 |= open;
                }
                None => inputs.push((name, pushed, open)),
            }
        }
        let mut nodes = Vec::new();
        for (name, pushed, open) in &inputs {
            if *pushed > 0 || !open {
                continue;
            }
            let others: Vec<(String, u64)> =
                inputs.iter().filter(|(_, p, _)| *p > 0).map(|(n, p, _)| (n.clone(), *p)).collect();
            if !others.is_empty() {
                nodes.push(UserWait::NeverFed { input: name.clone(), others });
            }
        }
        nodes
    }

    /// A fetcher whose sink has used every credit, that nobody is reading, last read (or
    /// taken) by thread `me`: while `me` waits in `Job::wait`, nobody will read it. Returns
    /// the record's index and the pieces received so far (the caller checks they do not
    /// change over a grace period).
    pub(crate) fn unread_by(&self, me: u64) -> Option<(usize, u64)> {
        self.fetches.iter().enumerate().find_map(|(f, fetch)| {
            let abandoned = fetch.taken.load(Ordering::SeqCst)
                && !fetch.dropped.load(Ordering::SeqCst)
                && !fetch.sink_gone.load(Ordering::SeqCst)
                && fetch.readers.load(Ordering::SeqCst) == 0
                && fetch.reader.load(Ordering::SeqCst) == me
                && fetch.unread() >= fetch.depth;
            abandoned.then(|| (f, fetch.received.load(Ordering::SeqCst)))
        })
    }
}

/// A number for the calling thread, unique in the process (0 is never used): cheaper than
/// hashing a `ThreadId` on every fetch.
pub(crate) fn thread_token() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static TOKEN: u64 = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    TOKEN.with(|t| *t)
}
