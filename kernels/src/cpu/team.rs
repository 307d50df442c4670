//! A kernel's threads: the stream thread that fires it and `threads − 1` helpers of that
//! stream thread, which share one kernel's work by claiming its shares one at a time.
//!
//! Why not rayon's pool, which the CPU kernels used before: a call from a stream thread
//! (outside the pool) hands the whole job to the pool and sleeps until it is done, so every
//! parallel kernel cost a wake-up of the pool's workers and one of the stream thread, and
//! the pool's workers had gone to sleep again by the next kernel of a step. On this
//! project's 2-vCPU machines a wake-up is 10–60 µs: a character-GPT step (products of
//! 0.3–0.5 ms between short elementwise kernels) ran no faster on two threads than on one
//! (BENCHMARKS.md, issue 13, fourteenth session). Here the stream thread works too, claiming
//! shares like its helpers; a helper that finishes spins for [`HELPER_SPIN`] before it
//! parks, long enough to catch the next kernel of a step; and a helper that is late (its
//! core taken by another thread, or asleep) only means the stream thread claims more
//! shares itself: nobody waits for a share nobody started.
//!
//! Each share runs exactly once, on one thread, whatever the timing, so a kernel whose
//! shares write disjoint outputs gives the same bits on any thread count. A team belongs to
//! the thread that made it (a thread-local), lives as long as it and is never shared; a
//! share that calls back into the team (a parallel kernel inside a share) runs serially.

use std::cell::{Cell, RefCell};
use std::panic::resume_unwind;
use std::time::Duration;
use sync::{thread, Arc, AtomicBool, AtomicU64, AtomicUsize, Ordering, UnsafeCell};

/// std's threads and atomics, or loom's under `--cfg loom` (the model in `tests` below).
#[cfg(not(loom))]
mod sync {
    pub(super) use std::hint::spin_loop;
    pub(super) use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
    pub(super) use std::sync::Arc;
    pub(super) use std::thread;

    /// std's cell with loom's accessors.
    #[derive(Debug)]
    pub(super) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

    impl<T> UnsafeCell<T> {
        pub(super) fn new(value: T) -> Self {
            Self(std::cell::UnsafeCell::new(value))
        }

        pub(super) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
            f(self.0.get())
        }

        pub(super) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
            f(self.0.get())
        }
    }

    /// How long a helper has spun for the next job.
    pub(super) struct SpinClock(std::time::Instant);

    impl SpinClock {
        pub(super) fn start() -> Self {
            Self(std::time::Instant::now())
        }

        pub(super) fn expired(&self) -> bool {
            self.0.elapsed() >= super::HELPER_SPIN
        }
    }

    /// Runs a share, catching its panic: the panic's payload, if it panicked.
    pub(super) fn panics(work: &(dyn Fn(usize) + Sync), share: usize) -> Option<super::Payload> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(share))).err()
    }
}

#[cfg(loom)]
mod sync {
    pub(super) use loom::cell::UnsafeCell;
    pub(super) use loom::hint::spin_loop;
    pub(super) use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
    pub(super) use loom::sync::Arc;
    pub(super) use loom::thread;

    /// Time is not modeled: a helper parks as soon as it has paused and yielded once.
    pub(super) struct SpinClock;

    impl SpinClock {
        pub(super) fn start() -> Self {
            Self
        }

        pub(super) fn expired(&self) -> bool {
            true
        }
    }

    /// Runs a share (loom's own panics must reach the model).
    pub(super) fn panics(work: &(dyn Fn(usize) + Sync), share: usize) -> Option<super::Payload> {
        work(share);
        None
    }
}

/// How long a helper that ran out of shares spins for the next job before it parks. Kernels
/// of one step follow each other within tens of microseconds; waking a parked thread costs
/// as much again on a VM. After this a helper sleeps until a job wakes it, so an idle job
/// costs no core.
#[cfg_attr(loom, allow(dead_code))]
const HELPER_SPIN: Duration = Duration::from_micros(300);

/// Spin rounds of `spin_loop` before a waiting thread yields its core instead, each round
/// after: with more busy threads than cores, the thread it waits for may need this core.
#[cfg(not(loom))]
const PAUSE_ROUNDS: u32 = 64;
#[cfg(loom)]
const PAUSE_ROUNDS: u32 = 1;

/// Most shares one job may have: the claim word keeps the share count and the next share in
/// 16 bits each.
pub(crate) const MAX_SHARES: usize = u16::MAX as usize;

/// The job being shared: its work, with its lifetime erased (see [`Shared::job`]).
#[derive(Clone, Copy)]
struct Job {
    work: *const (dyn Fn(usize) + Sync + 'static),
}

/// What the stream thread and its helpers share.
struct Shared {
    /// The current job's claim word: its epoch (high 32 bits), its share count (next 16)
    /// and the next unclaimed share (low 16). A share is claimed by a compare-and-swap that
    /// also checks the epoch, so a helper late from an earlier job can never claim a share
    /// of the next with the earlier work.
    claim: AtomicU64,
    /// The current job's work. Written only by the owner, and only while no share of the
    /// previous job is running (it waits for all of them); read by a helper only between
    /// claiming a share of this epoch and counting it done, which the owner waits for.
    job: UnsafeCell<Job>,
    /// Shares of the current job that helpers finished.
    done: AtomicUsize,
    /// A share panicked; the owner panics in its turn once every share is over.
    panicked: AtomicBool,
    /// The first such panic's payload, raised again by the owner so that its message (the
    /// kernel's own) reaches whoever catches the stream thread's panic.
    first_panic: std::sync::Mutex<Option<Payload>>,
    /// The team is dropped: helpers exit.
    stop: AtomicBool,
    /// Per helper: it is parked or about to park, so a new job must unpark it.
    parked: Vec<AtomicBool>,
}

// SAFETY: `job` is the only field that is not thread-safe by itself; its accesses follow the
// protocol on the field (the owner writes it only while no helper can read it).
unsafe impl Sync for Shared {}
// SAFETY: as for `Sync`: the raw pointer inside is only dereferenced under that protocol.
unsafe impl Send for Shared {}

/// What a panic carries (its message, usually).
type Payload = Box<dyn std::any::Any + Send>;

/// The work of no job, before the first.
fn nothing(_share: usize) {}

fn pack(epoch: u32, shares: u16, next: u16) -> u64 {
    (u64::from(epoch) << 32) | (u64::from(shares) << 16) | u64::from(next)
}

fn unpack(word: u64) -> (u32, u16, u16) {
    ((word >> 32) as u32, (word >> 16) as u16, word as u16)
}

impl Shared {
    /// Claims the next share of epoch `epoch`, if that job has one left.
    fn claim(&self, epoch: u32) -> Option<usize> {
        let mut word = self.claim.load(Ordering::Acquire);
        loop {
            let (current, shares, next) = unpack(word);
            if current != epoch || next >= shares {
                return None;
            }
            match self.claim.compare_exchange_weak(word, word + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Some(usize::from(next)),
                Err(now) => word = now,
            }
        }
    }

    /// Runs `work` on share `share`, recording a panic instead of unwinding.
    fn run_share(&self, work: &(dyn Fn(usize) + Sync), share: usize) {
        if let Some(payload) = sync::panics(work, share) {
            // Poisoned only by a panic while holding it, which nothing here can do.
            if let Ok(mut first) = self.first_panic.lock() {
                first.get_or_insert(payload);
            }
            self.panicked.store(true, Ordering::Release);
        }
    }
}

/// A stream thread's helpers.
pub(crate) struct Team {
    shared: Arc<Shared>,
    helpers: Vec<thread::JoinHandle<()>>,
    /// Epoch of the last job published.
    epoch: u32,
}

impl Team {
    /// A team of `helpers` threads, or the error of the spawn that failed (the helpers
    /// already started are stopped).
    fn start(helpers: usize) -> std::io::Result<Team> {
        let shared = Arc::new(Shared {
            claim: AtomicU64::new(pack(0, 0, 0)),
            job: UnsafeCell::new(Job { work: &nothing as &(dyn Fn(usize) + Sync) }),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            first_panic: std::sync::Mutex::new(None),
            stop: AtomicBool::new(false),
            parked: (0..helpers).map(|_| AtomicBool::new(false)).collect(),
        });
        let owner = thread::current().name().unwrap_or("regflow").to_string();
        let mut team = Team { shared, helpers: Vec::with_capacity(helpers), epoch: 0 };
        for index in 0..helpers {
            let shared = Arc::clone(&team.shared);
            // Dropping `team` on an error stops the helpers started so far.
            let handle =
                thread::Builder::new().name(format!("{owner}+{}", index + 1)).spawn(move || help(&shared, index))?;
            team.helpers.push(handle);
        }
        Ok(team)
    }

    /// Runs `work(0)` … `work(shares − 1)`, each once, on this thread and the helpers;
    /// returns when all have run. A share's panic is raised here once every share is over.
    fn run(&mut self, shares: usize, work: &(dyn Fn(usize) + Sync)) {
        let shared = &*self.shared;
        self.epoch = self.epoch.wrapping_add(1);
        let epoch = self.epoch;
        shared.done.store(0, Ordering::Relaxed);
        // Every share of the previous job has finished (the last `run` waited for them), so
        // no helper reads `job`; the erased lifetime is sound because this call
        // returns only after every share of this job has finished (helpers read `job` only
        // to run a share they claimed in this epoch).
        let work_ptr: *const (dyn Fn(usize) + Sync + '_) = work;
        let job = Job {
            // SAFETY: only the lifetime changes; see above.
            work: unsafe {
                std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), *const (dyn Fn(usize) + Sync + 'static)>(
                    work_ptr,
                )
            },
        };
        // SAFETY: see above: no helper reads `job` now.
        shared.job.with_mut(|slot| unsafe { *slot = job });
        let shares16 = shares.min(MAX_SHARES) as u16;
        // SeqCst with the helpers' `parked` store and claim load (see `help`): either a
        // helper about to park sees this job, or this thread sees it parked and wakes it.
        shared.claim.store(pack(epoch, shares16, 0), Ordering::SeqCst);
        for (index, parked) in shared.parked.iter().enumerate() {
            if parked.load(Ordering::SeqCst) {
                self.helpers[index].thread().unpark();
            }
        }
        let mut mine = 0;
        while let Some(share) = shared.claim(epoch) {
            shared.run_share(work, share);
            mine += 1;
        }
        // The rest are running on helpers (claimed, so started): wait for them.
        let mut rounds = 0u32;
        while shared.done.load(Ordering::Acquire) + mine < usize::from(shares16) {
            rounds = rounds.saturating_add(1);
            if rounds <= PAUSE_ROUNDS {
                sync::spin_loop();
            } else {
                thread::yield_now();
            }
        }
        if shared.panicked.swap(false, Ordering::AcqRel) {
            let payload = shared.first_panic.lock().ok().and_then(|mut first| first.take());
            resume_unwind(payload.unwrap_or_else(|| Box::new("a share of a parallel kernel panicked")));
        }
    }

    /// Helpers in the team.
    fn helpers(&self) -> usize {
        self.helpers.len()
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        for handle in &self.helpers {
            handle.thread().unpark();
        }
        for handle in self.helpers.drain(..) {
            // A helper's own panics are caught per share: joining cannot fail but by a bug,
            // and a destructor has nobody to tell.
            let _ = handle.join();
        }
    }
}

/// A helper's loop: wait for a job (spin, then park), claim and run its shares, repeat.
fn help(shared: &Shared, index: usize) {
    IN_TEAM.with(|flag| flag.set(true));
    HELPER.with(|flag| flag.set(true));
    // The epoch the team starts at, not the one current when this thread gets to run: the
    // first job may be published before that.
    let mut seen = 0;
    loop {
        let mut spin = sync::SpinClock::start();
        let mut rounds = 0u32;
        let epoch = loop {
            if shared.stop.load(Ordering::Acquire) {
                return;
            }
            let epoch = unpack(shared.claim.load(Ordering::Acquire)).0;
            if epoch != seen {
                break epoch;
            }
            rounds = rounds.saturating_add(1);
            if rounds <= PAUSE_ROUNDS {
                sync::spin_loop();
                continue;
            }
            thread::yield_now();
            if !spin.expired() {
                continue;
            }
            // Park, unless a job came meanwhile (SeqCst: see `Team::run`).
            shared.parked[index].store(true, Ordering::SeqCst);
            if unpack(shared.claim.load(Ordering::SeqCst)).0 == seen && !shared.stop.load(Ordering::SeqCst) {
                thread::park();
            }
            shared.parked[index].store(false, Ordering::SeqCst);
            spin = sync::SpinClock::start();
            rounds = 0;
        };
        seen = epoch;
        while let Some(share) = shared.claim(epoch) {
            // SAFETY: a share of `epoch` is claimed and not yet counted done, so the owner is
            // inside `Team::run` for this epoch and `job` holds its live work.
            let work = unsafe { &*shared.job.with(|job| (*job).work) };
            shared.run_share(work, share);
            shared.done.fetch_add(1, Ordering::Release);
        }
    }
}

#[cfg(not(loom))]
thread_local! {
    /// This thread's team, made by its first parallel kernel.
    static TEAM: RefCell<Option<Team>> = const { RefCell::new(None) };
    /// This thread is a helper, or runs a share of its own team's job: a parallel kernel
    /// inside runs serially.
    static IN_TEAM: Cell<bool> = const { Cell::new(false) };
    /// This thread is a helper (not a stream thread).
    static HELPER: Cell<bool> = const { Cell::new(false) };
}

#[cfg(loom)]
loom::thread_local! {
    static TEAM: RefCell<Option<Team>> = RefCell::new(None);
    static IN_TEAM: Cell<bool> = Cell::new(false);
    static HELPER: Cell<bool> = Cell::new(false);
}

/// Whether the calling thread is a helper of a stream thread, rather than the stream
/// thread (or any other thread): a share can tell who runs it.
pub(crate) fn on_helper() -> bool {
    HELPER.with(Cell::get)
}

/// Runs `work(0)` … `work(shares − 1)`, each exactly once, on this thread and up to
/// `threads − 1` helpers of it (started by the first call that needs them); returns when
/// all have run. Serial where there is one share or one thread, inside a share, or where
/// the helpers could not be started (the machine refused a thread: slower, not wrong).
pub(crate) fn for_each_share(threads: usize, shares: usize, work: &(dyn Fn(usize) + Sync)) {
    assert!(shares <= MAX_SHARES, "{shares} shares of one kernel: at most {MAX_SHARES} (broken invariant)");
    if shares <= 1 || threads <= 1 || IN_TEAM.with(Cell::get) {
        (0..shares).for_each(work);
        return;
    }
    TEAM.with(|team| {
        let mut team = team.borrow_mut();
        if team.as_ref().is_none_or(|t| t.helpers() != threads - 1) {
            // The old team (another thread count) stops first.
            *team = None;
            *team = Team::start(threads - 1).ok();
        }
        match team.as_mut() {
            Some(team) => {
                IN_TEAM.with(|flag| flag.set(true));
                // Reset even if a share panics (the panic is raised by `run`).
                struct Reset;
                impl Drop for Reset {
                    fn drop(&mut self) {
                        IN_TEAM.with(|flag| flag.set(false));
                    }
                }
                let _reset = Reset;
                team.run(shares, work);
            }
            None => (0..shares).for_each(work),
        }
    });
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::sync::atomic::AtomicU32;
    use std::time::Instant;

    /// Every share runs exactly once, over many jobs in a row (helpers spinning between
    /// them) and after pauses long enough for the helpers to park.
    #[test]
    fn every_share_runs_once_per_job() {
        for threads in [2, 3, 4] {
            for job in 0..2000usize {
                let shares = 1 + job % 9;
                let counts: Vec<AtomicU32> = (0..shares).map(|_| AtomicU32::new(0)).collect();
                for_each_share(threads, shares, &|share| {
                    counts[share].fetch_add(1, Ordering::Relaxed);
                });
                assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1), "job {job}: {counts:?}");
                if job % 500 == 499 {
                    thread::sleep(HELPER_SPIN * 3);
                }
            }
        }
    }

    /// Helpers take part: with shares that wait for each other, one thread alone would
    /// never finish the first share.
    #[test]
    fn helpers_run_shares_at_the_same_time() {
        let arrived = AtomicUsize::new(0);
        for_each_share(2, 2, &|_| {
            arrived.fetch_add(1, Ordering::SeqCst);
            let start = Instant::now();
            while arrived.load(Ordering::SeqCst) < 2 {
                assert!(start.elapsed() < Duration::from_secs(60), "the other share never started");
                thread::yield_now();
            }
        });
        assert_eq!(arrived.load(Ordering::SeqCst), 2);
    }

    /// A parallel kernel inside a share runs serially, on the thread of that share.
    #[test]
    fn a_share_that_shares_again_runs_serially() {
        let total = AtomicUsize::new(0);
        for_each_share(2, 4, &|_| {
            let here = thread::current().id();
            for_each_share(2, 3, &|_| {
                assert_eq!(thread::current().id(), here);
                total.fetch_add(1, Ordering::Relaxed);
            });
        });
        assert_eq!(total.load(Ordering::Relaxed), 12);
    }

    /// A share's panic reaches the caller once the other shares are over, and the team
    /// still works afterwards.
    #[test]
    fn a_panicking_share_panics_the_caller_and_leaves_the_team_usable() {
        let ran = AtomicUsize::new(0);
        let result = catch_unwind(AssertUnwindSafe(|| {
            for_each_share(2, 8, &|share| {
                ran.fetch_add(1, Ordering::SeqCst);
                assert!(share != 5, "share 5 fails on purpose");
            })
        }));
        let payload = result.expect_err("the share's panic reaches the caller");
        let message = payload.downcast_ref::<String>().map(String::as_str).or(payload.downcast_ref::<&str>().copied());
        assert_eq!(message, Some("share 5 fails on purpose"), "the kernel's own message");
        assert_eq!(ran.load(Ordering::SeqCst), 8, "every share still ran");
        let after = AtomicUsize::new(0);
        for_each_share(2, 8, &|_| {
            after.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(after.load(Ordering::SeqCst), 8);
    }

    /// Another thread count replaces the team; dropping the thread stops its helpers.
    #[test]
    fn a_new_thread_count_makes_a_new_team() {
        thread::spawn(|| {
            let seen = std::sync::Mutex::new(std::collections::HashSet::new());
            for threads in [2, 4, 3] {
                for _ in 0..50 {
                    for_each_share(threads, 16, &|_| {
                        seen.lock().unwrap().insert(thread::current().id());
                        thread::sleep(Duration::from_micros(50));
                    });
                }
                assert_eq!(TEAM.with(|t| t.borrow().as_ref().map(Team::helpers)), Some(threads - 1));
            }
            assert!(seen.lock().unwrap().len() >= 2, "no helper ever ran a share");
        })
        .join()
        .unwrap();
    }
}

/// The claim protocol under loom, over two jobs of two shares with one helper that may spin,
/// park or be late: every share runs once, and no helper reads the job while the owner
/// replaces it (loom reports that access as a causality violation: a helper that read the
/// job before claiming a share, checked by hand, fails this model).
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;

    #[test]
    fn loom_each_share_runs_once_and_no_helper_reads_a_job_being_replaced() {
        // Bounded like the runtime's models: the spins would otherwise make the search
        // unbounded in practice.
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(3);
        builder.check(|| {
            let mut team = Team::start(1).expect("loom spawns");
            for _ in 0..2 {
                let counts = Arc::new([AtomicUsize::new(0), AtomicUsize::new(0)]);
                let seen = Arc::clone(&counts);
                team.run(2, &move |share| {
                    seen[share].fetch_add(1, Ordering::Relaxed);
                });
                assert_eq!(counts[0].load(Ordering::Relaxed), 1);
                assert_eq!(counts[1].load(Ordering::Relaxed), 1);
            }
            drop(team);
        });
    }
}
