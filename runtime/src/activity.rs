//! Whether a waiting thread may spin: only while the process's stream threads that are not
//! asleep fit on its cores.
//!
//! A stream thread waits in two places: an empty inbox and a collective's barrier. Both
//! spin up to tens of microseconds (50 and 100) before they sleep, because a message or a
//! peer that close is caught without a futex sleep and wake-up (tens of microseconds on a
//! VM, and with lanes a heavy barrier as long). That holds while every thread that has
//! work has a core. The inbox's spin yields its core after a few rounds, so it keeps
//! nobody off one; the barrier's only pauses.
//! With more runnable threads than cores (four devices of a 2 × 2 mesh on a 2-core
//! machine), the thread a barrier waits for is often the one its spin keeps off the core:
//! the tiny GPT on a `[dp2, tp2]` mesh spent a third of its time spinning in barriers and
//! ran 5× slower than on one device. So every stream thread counts itself awake while it
//! runs, and out while it waits on its inbox or sleeps at a barrier; a barrier's waiter
//! spins only while the awake count is at most the cores
//! (`std::thread::available_parallelism`), and otherwise sleeps at once. It spins long
//! (100 µs) only while all the process's stream threads fit on the cores
//! ([`all_stream_threads_fit`]), since a thread just woken is not counted awake until it
//! runs: 100 µs of pausing made the 8-device GPT on 2 cores 3× slower than 12 µs.
//!
//! The count is process-wide, across jobs, since the jobs of a process share its cores. So
//! is the count of the jobs' stream threads ([`StreamThreads`]), which a job being built
//! reads to choose its lanes' barrier (`crate::lane`). Both only steer speed, never
//! correctness, so they stay plain `std` atomics under loom (the models' spins are bounded
//! by their own round counts).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Stream threads of the process that are not asleep.
static AWAKE: AtomicUsize = AtomicUsize::new(0);

/// The cores this process may run on, asked once.
pub(crate) fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Whether a waiting stream thread may spin before it sleeps: the awake stream threads
/// (the waiter among them) fit on the cores.
pub(crate) fn may_spin() -> bool {
    AWAKE.load(Ordering::Relaxed) <= cores()
}

thread_local! {
    /// Whether the calling thread is a stream thread, counted in [`AWAKE`].
    static COUNTED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Counts the calling stream thread awake for as long as it is held.
#[derive(Debug)]
pub(crate) struct Awake(());

impl Awake {
    /// The calling stream thread starts to run.
    pub(crate) fn start() -> Self {
        AWAKE.fetch_add(1, Ordering::Relaxed);
        COUNTED.set(true);
        Awake(())
    }
}

impl Drop for Awake {
    fn drop(&mut self) {
        COUNTED.set(false);
        AWAKE.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Runs `sleep` (a blocking wait) with the calling thread counted out of the awake ones,
/// if it is a counted stream thread (other threads, a test's, are not counted at all).
pub(crate) fn asleep<R>(sleep: impl FnOnce() -> R) -> R {
    if !COUNTED.get() {
        return sleep();
    }
    AWAKE.fetch_sub(1, Ordering::Relaxed);
    let woken = Woken;
    let result = sleep();
    drop(woken);
    result
}

/// Counts the thread back in when its sleep ends, even by unwinding.
struct Woken;

impl Drop for Woken {
    fn drop(&mut self) {
        AWAKE.fetch_add(1, Ordering::Relaxed);
    }
}

/// Stream threads of the process's jobs, counted from each job's build to its end: what a
/// new job adds its own to when it asks whether all of them fit on the cores.
static CLAIMED: AtomicUsize = AtomicUsize::new(0);

/// A job's stream threads, counted in the process's total for as long as it is held.
#[derive(Debug)]
pub(crate) struct StreamThreads(usize);

impl StreamThreads {
    /// Counts `threads` more stream threads, for a job being built.
    pub(crate) fn claim(threads: usize) -> Self {
        CLAIMED.fetch_add(threads, Ordering::Relaxed);
        Self(threads)
    }
}

/// Whether the stream threads of all the process's jobs fit on its cores now, awake or
/// not. A waiter may then spin long without keeping a thread with work off a core: none
/// can be waiting for one. [`may_spin`] alone does not say that: a thread woken from its
/// sleep counts itself awake only once it runs, which a spinner holding its core delays.
pub(crate) fn all_stream_threads_fit() -> bool {
    CLAIMED.load(Ordering::Relaxed) <= cores()
}

impl Drop for StreamThreads {
    fn drop(&mut self) {
        CLAIMED.fetch_sub(self.0, Ordering::Relaxed);
    }
}
