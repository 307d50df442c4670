//! The flight recorder of one connection: the last frames sent and received, with sequence
//! numbers, kept in rings allocated once, and rendered in plan names when a job fails.
//!
//! Recording is on the path of every frame, so it takes no lock: each direction has a ring
//! written by one thread only (the writer records what it sends, the reader what it
//! receives), each entry a few atomic words under a sequence number stored last. A dump
//! (another thread, when the job fails) skips an entry whose sequence number changed while
//! it read it.

use regflow_net::frame::{Header, WireBody, WireMessage};
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::time::Instant;

/// Frames kept per connection: half of them sent, half received.
pub(crate) const RECORDED_FRAMES: usize = 32;
const PER_DIRECTION: usize = RECORDED_FRAMES / 2;

/// Names of the frame kinds recorded as themselves only (`Header::kind`).
const OTHER_KINDS: [&str; 8] = ["hello", "proof", "refused", "abort", "bye", "snapshot request", "snapshot", "frame"];

/// Entry tags: what the words `a`, `b`, `c` of an entry hold.
const READY: u64 = 1; // a = desc << 32 | slot, b = piece, c = len
const ACK: u64 = 2; // a = desc << 32 | slot
const EORD: u64 = 3; // a = desc
const COLLECTIVE: u64 = 4; // a = group << 32 | rank, b = round
const HEARTBEAT: u64 = 5; // b = fires
const RING: u64 = 6; // a = group << 32 | step, b = round, c = len
const OTHER: u64 = 7; // a = index in OTHER_KINDS

/// One recorded frame: `seq` (0 while being written) and its fields.
#[derive(Debug, Default)]
struct Entry {
    seq: AtomicU64,
    tag: AtomicU64,
    a: AtomicU64,
    b: AtomicU64,
    c: AtomicU64,
    /// Nanoseconds since the recorder was made.
    at: AtomicU64,
}

/// The frames of one direction; written by one thread.
#[derive(Debug)]
struct Ring {
    count: AtomicU64,
    entries: Vec<Entry>,
}

impl Ring {
    fn new() -> Self {
        Self { count: AtomicU64::new(0), entries: (0..PER_DIRECTION).map(|_| Entry::default()).collect() }
    }

    /// Only the ring's own thread calls this (the writer, or the reader).
    fn push(&self, [tag, a, b, c]: [u64; 4], at: u64) {
        let seq = self.count.load(Ordering::Relaxed) + 1;
        let entry = &self.entries[(seq - 1) as usize % PER_DIRECTION];
        entry.seq.store(0, Ordering::Relaxed);
        fence(Ordering::Release);
        entry.tag.store(tag, Ordering::Relaxed);
        entry.a.store(a, Ordering::Relaxed);
        entry.b.store(b, Ordering::Relaxed);
        entry.c.store(c, Ordering::Relaxed);
        entry.at.store(at, Ordering::Relaxed);
        entry.seq.store(seq, Ordering::Release);
        self.count.store(seq, Ordering::Release);
    }

    /// The entries not being written right now: (seq, [tag, a, b, c], at).
    fn read(&self) -> Vec<(u64, [u64; 4], u64)> {
        let mut out = Vec::with_capacity(PER_DIRECTION);
        for entry in &self.entries {
            let seq = entry.seq.load(Ordering::Acquire);
            let words = [&entry.tag, &entry.a, &entry.b, &entry.c].map(|w| w.load(Ordering::Relaxed));
            let at = entry.at.load(Ordering::Relaxed);
            fence(Ordering::Acquire);
            if seq != 0 && entry.seq.load(Ordering::Relaxed) == seq {
                out.push((seq, words, at));
            }
        }
        out
    }
}

/// The last [`RECORDED_FRAMES`] frames of one connection, both ways.
#[derive(Debug)]
pub(crate) struct FlightRecorder {
    peer: u16,
    start: Instant,
    sent: Ring,
    received: Ring,
}

impl FlightRecorder {
    pub(crate) fn new(peer: u16) -> Self {
        Self { peer, start: Instant::now(), sent: Ring::new(), received: Ring::new() }
    }

    /// Records a frame: no lock, no allocation. `sent` frames only from the connection's
    /// writer, received ones only from its reader.
    pub(crate) fn record(&self, sent: bool, header: &Header) {
        let pair = |hi: u32, lo: u32| u64::from(hi) << 32 | u64::from(lo);
        let words = match header {
            Header::Actor(WireMessage { body, .. }) => match *body {
                WireBody::Ready { desc, slot, piece, len } => [READY, pair(desc, slot), piece, len],
                WireBody::Ack { desc, slot } => [ACK, pair(desc, slot), 0, 0],
                WireBody::Eord { desc } => [EORD, u64::from(desc), 0, 0],
            },
            Header::Collective { group, round, rank, .. } => [COLLECTIVE, pair(*group, *rank), *round, 0],
            Header::Ring { group, round, step, len } => [RING, pair(*group, *step), *round, *len],
            Header::Heartbeat { fires } => [HEARTBEAT, 0, *fires, 0],
            other => {
                let kind = OTHER_KINDS.iter().position(|k| *k == other.kind()).unwrap_or(OTHER_KINDS.len() - 1);
                [OTHER, kind as u64, 0, 0]
            }
        };
        let at = self.start.elapsed().as_nanos() as u64;
        if sent { &self.sent } else { &self.received }.push(words, at);
    }

    /// The recorded frames, oldest first, one line each, in plan names (`descs`: register
    /// names by index; `groups`: collective groups by wire index).
    pub(crate) fn dump(&self, descs: &[String], groups: &[String]) -> Vec<String> {
        let now = self.start.elapsed().as_nanos() as u64;
        let mut entries: Vec<(bool, u64, [u64; 4], u64)> = Vec::with_capacity(RECORDED_FRAMES);
        entries.extend(self.sent.read().into_iter().map(|(seq, w, at)| (true, seq, w, at)));
        entries.extend(self.received.read().into_iter().map(|(seq, w, at)| (false, seq, w, at)));
        entries.sort_by_key(|e| e.3);
        let regst = |d: u64| descs.get(d as usize).map_or_else(|| format!("#{d}"), |r| format!("'{r}'"));
        let group = |g: u64| groups.get(g as usize).map_or_else(|| format!("#{g}"), |g| format!("'{g}'"));
        let (hi, lo) = (|x: u64| x >> 32, |x: u64| x & 0xffff_ffff);
        let mut lines = vec![format!(
            "connection with node {}: {} frame(s) sent, {} received; the last {}:",
            self.peer,
            self.sent.count.load(Ordering::Acquire),
            self.received.count.load(Ordering::Acquire),
            entries.len()
        )];
        for (sent, seq, [tag, a, b, c], at) in entries {
            let what = match tag {
                READY => format!("ready {} slot {} piece {b} ({c} bytes)", regst(hi(a)), lo(a)),
                ACK => format!("ack {} slot {}", regst(hi(a)), lo(a)),
                EORD => format!("end of {}", regst(a)),
                COLLECTIVE => format!("collective {} rank {} round {b}", group(hi(a)), lo(a)),
                RING => format!("ring chunk of {} step {} round {b} ({c} bytes)", group(hi(a)), lo(a)),
                HEARTBEAT => format!("heartbeat ({b} firings)"),
                _ => OTHER_KINDS.get(a as usize).copied().unwrap_or("frame").to_string(),
            };
            let direction = if sent { "sent" } else { "received" };
            let ago = now.saturating_sub(at) as f64 / 1e6;
            lines.push(format!("  {direction} #{seq} {what}, {ago:.1} ms ago"));
        }
        lines
    }
}
