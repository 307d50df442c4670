//! The started ranks: the threads that forward their output, the loop that watches them,
//! and stopping them.

use super::{LaunchError, LaunchOptions, RankStatus};
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStderr, ChildStdout, Command};
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// How often the launcher looks at its ranks and at the stop flag.
const POLL: Duration = Duration::from_millis(10);
/// How long a rank has between `SIGTERM` and `SIGKILL`.
const TERM_GRACE: Duration = Duration::from_secs(2);

/// A started rank.
#[derive(Debug)]
pub(super) struct Rank {
    pub(super) rank: u32,
    /// `None` once reaped.
    pub(super) child: Option<Child>,
    /// How it ended, once it has.
    pub(super) status: Option<RankStatus>,
    pub(super) stdout: Captured,
    pub(super) stderr: Captured,
}

impl Rank {
    /// Spawns the rank and the two threads that read its pipes; each thread sends on
    /// `done` when its pipe closes.
    pub(super) fn start(
        rank: u32,
        mut command: Command,
        capture: bool,
        done: &mpsc::Sender<()>,
    ) -> std::io::Result<Self> {
        let mut child = command.spawn()?;
        let mut started = Rank { rank, child: None, status: None, stdout: Captured::new(), stderr: Captured::new() };
        let pipes = (child.stdout.take(), child.stderr.take());
        started.child = Some(child);
        let forwarded = match pipes {
            (Some(out), Some(err)) => started.forward(out, err, capture, done),
            _ => Err(std::io::Error::other("the rank's stdout or stderr was not a pipe")),
        };
        if let Err(e) = forwarded {
            stop(std::slice::from_mut(&mut started), false);
            return Err(e);
        }
        Ok(started)
    }

    fn forward(
        &self,
        out: ChildStdout,
        err: ChildStderr,
        capture: bool,
        done: &mpsc::Sender<()>,
    ) -> std::io::Result<()> {
        let prefix = format!("[rank {}] ", self.rank);
        let out_sink = if capture { Sink::Capture(self.stdout.clone()) } else { Sink::Stdout };
        let err_sink = if capture { Sink::Capture(self.stderr.clone()) } else { Sink::Stderr };
        for (pipe, sink, name) in
            [(Box::new(out) as Box<dyn Read + Send>, out_sink, "stdout"), (Box::new(err), err_sink, "stderr")]
        {
            let (prefix, done) = (prefix.clone(), done.clone());
            std::thread::Builder::new().name(format!("rank {} {name}", self.rank)).spawn(move || {
                forward_lines(pipe, &prefix, &sink);
                let _ = done.send(());
            })?;
        }
        Ok(())
    }
}

/// Output of one pipe of one rank, shared with the thread that reads it.
#[derive(Debug, Clone)]
pub(super) struct Captured(Arc<Mutex<Vec<u8>>>);

impl Captured {
    fn new() -> Self {
        Captured(Arc::new(Mutex::new(Vec::new())))
    }

    /// What was read so far, as text.
    pub(super) fn take(&self) -> String {
        let bytes = std::mem::take(&mut *self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner()));
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// Where the lines of a pipe go.
enum Sink {
    Stdout,
    Stderr,
    Capture(Captured),
}

/// Copies `pipe` to `sink` a line at a time until it closes; a last line without a newline
/// is forwarded with one. A forwarded line is written in one call under the stream's lock,
/// so lines of different ranks never mix.
fn forward_lines(pipe: Box<dyn Read + Send>, prefix: &str, sink: &Sink) {
    let mut reader = BufReader::new(pipe);
    let mut line = Vec::new();
    loop {
        line.clear();
        line.extend_from_slice(prefix.as_bytes());
        match reader.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        // Writes that fail (a closed stdout) are dropped: the rank must still be drained.
        match sink {
            Sink::Capture(captured) => captured
                .0
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .extend_from_slice(&line[prefix.len()..]),
            Sink::Stdout | Sink::Stderr => {
                if line.last() != Some(&b'\n') {
                    line.push(b'\n');
                }
                let _ = match sink {
                    Sink::Stdout => std::io::stdout().lock().write_all(&line),
                    _ => std::io::stderr().lock().write_all(&line),
                };
            }
        }
    }
}

/// The ranks while they run.
pub(super) struct Watch<'a> {
    pub(super) options: &'a LaunchOptions,
    pub(super) ranks: Vec<Rank>,
    pub(super) first_failure: Option<u32>,
    pub(super) interrupted: bool,
}

impl Watch<'_> {
    /// Waits until every rank has ended, stopping the rest after a failure's grace period
    /// or at once when asked to stop.
    pub(super) fn run(&mut self) -> Result<(), LaunchError> {
        let mut stop_at: Option<Instant> = None;
        loop {
            self.reap(&mut stop_at)?;
            if self.ranks.iter().all(|r| r.child.is_none()) {
                return Ok(());
            }
            if self.options.stop.as_ref().is_some_and(|flag| flag.load(Ordering::Relaxed)) {
                self.interrupted = true;
                if !self.options.capture {
                    eprintln!("regflow launch: asked to stop; stopping every rank");
                }
                break;
            }
            if stop_at.is_some_and(|at| Instant::now() >= at) {
                break;
            }
            std::thread::sleep(POLL);
        }
        stop(&mut self.ranks, !self.options.capture);
        Ok(())
    }

    /// Records the ranks that have ended since the last look.
    fn reap(&mut self, stop_at: &mut Option<Instant>) -> Result<(), LaunchError> {
        for index in 0..self.ranks.len() {
            let rank = &mut self.ranks[index];
            let Some(child) = rank.child.as_mut() else { continue };
            let status = match child.try_wait() {
                Ok(Some(status)) => RankStatus::of(status),
                Ok(None) => continue,
                Err(source) => {
                    let (rank, pid) = (rank.rank, child.id());
                    stop(&mut self.ranks, !self.options.capture);
                    return Err(LaunchError::Wait { rank, pid, source });
                }
            };
            rank.child = None;
            rank.status = Some(status);
            if !status.success() {
                if !self.options.capture {
                    eprintln!("regflow launch: rank {} {status}", rank.rank);
                }
                if self.first_failure.is_none() {
                    self.first_failure = Some(rank.rank);
                    *stop_at = Some(Instant::now() + self.options.grace);
                }
            }
        }
        Ok(())
    }
}

/// Stops every rank still running: `SIGTERM` to its process group, `SIGKILL` 2 seconds
/// later to those still there, then reaps them. Each is marked [`RankStatus::Stopped`] and,
/// when `report`, named on stderr.
pub(super) fn stop(ranks: &mut [Rank], report: bool) {
    let running = |ranks: &[Rank]| ranks.iter().any(|r| r.child.is_some());
    signal_groups(ranks, libc::SIGTERM);
    let deadline = Instant::now() + TERM_GRACE;
    while running(ranks) && Instant::now() < deadline {
        std::thread::sleep(POLL);
        for rank in ranks.iter_mut() {
            if rank.child.as_mut().is_some_and(|child| !matches!(child.try_wait(), Ok(None))) {
                rank.child = None;
                rank.status = Some(RankStatus::Stopped);
            }
        }
    }
    signal_groups(ranks, libc::SIGKILL);
    for rank in ranks.iter_mut() {
        if let Some(mut child) = rank.child.take() {
            // After SIGKILL the wait ends at once; an error here leaves nothing to do.
            let _ = child.wait();
            rank.status = Some(RankStatus::Stopped);
        }
    }
    for rank in ranks.iter().filter(|r| r.status == Some(RankStatus::Stopped)) {
        if report {
            eprintln!("regflow launch: rank {} {}", rank.rank, RankStatus::Stopped);
        }
    }
}

/// Sends `signal` to the process group of every rank not yet reaped. Only unreaped ranks:
/// their process id, which is their group's id, cannot have been reused.
fn signal_groups(ranks: &[Rank], signal: libc::c_int) {
    for child in ranks.iter().filter_map(|r| r.child.as_ref()) {
        let Ok(group) = libc::pid_t::try_from(child.id()) else { continue };
        // SAFETY: kill has no memory-safety preconditions. A group that is gone already
        // answers ESRCH, which is what we want.
        unsafe {
            libc::kill(-group, signal);
        }
    }
}
