//! The flight recorder of one connection: the last frames sent and received, with sequence
//! numbers, kept in a ring allocated once, and rendered in plan names when a job fails.

use regflow_net::frame::{Header, WireBody, WireMessage};
use std::sync::Mutex;
use std::time::Instant;

/// Frames kept per connection.
pub(crate) const RECORDED_FRAMES: usize = 32;

/// What kind of frame an entry is, with the fields worth showing.
#[derive(Debug, Clone, Copy)]
enum What {
    Ready { desc: u32, slot: u32, piece: u64, len: u64 },
    Ack { desc: u32, slot: u32 },
    Eord { desc: u32 },
    Collective { group: u32, round: u64, rank: u32 },
    Heartbeat { fires: u64 },
    Other(&'static str),
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    seq: u64,
    sent: bool,
    what: What,
    at: Instant,
}

#[derive(Debug)]
struct Ring {
    sent: u64,
    received: u64,
    entries: Vec<Entry>,
    next: usize,
}

/// The last [`RECORDED_FRAMES`] frames of one connection, both ways.
#[derive(Debug)]
pub(crate) struct FlightRecorder {
    peer: u16,
    ring: Mutex<Ring>,
}

impl FlightRecorder {
    pub(crate) fn new(peer: u16) -> Self {
        let ring = Ring { sent: 0, received: 0, entries: Vec::with_capacity(RECORDED_FRAMES), next: 0 };
        Self { peer, ring: Mutex::new(ring) }
    }

    /// Records a frame (no allocation once the ring is full; the lock is uncontended but
    /// for a dump).
    pub(crate) fn record(&self, sent: bool, header: &Header) {
        let what = match header {
            Header::Actor(WireMessage { body, .. }) => match *body {
                WireBody::Ready { desc, slot, piece, len } => What::Ready { desc, slot, piece, len },
                WireBody::Ack { desc, slot } => What::Ack { desc, slot },
                WireBody::Eord { desc } => What::Eord { desc },
            },
            Header::Collective { group, round, rank, .. } => {
                What::Collective { group: *group, round: *round, rank: *rank }
            }
            Header::Heartbeat { fires } => What::Heartbeat { fires: *fires },
            other => What::Other(other.kind()),
        };
        let mut ring = self.ring.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let seq = if sent { &mut ring.sent } else { &mut ring.received };
        *seq += 1;
        let entry = Entry { seq: *seq, sent, what, at: Instant::now() };
        if ring.entries.len() < RECORDED_FRAMES {
            ring.entries.push(entry);
        } else {
            let next = ring.next;
            ring.entries[next] = entry;
        }
        ring.next = (ring.next + 1) % RECORDED_FRAMES;
    }

    /// The recorded frames, oldest first, one line each, in plan names (`descs`: register
    /// names by index; `groups`: collective groups by wire index).
    pub(crate) fn dump(&self, descs: &[String], groups: &[String]) -> Vec<String> {
        let ring = self.ring.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = Instant::now();
        let mut entries: Vec<Entry> = ring.entries.clone();
        entries.sort_by_key(|e| e.at);
        let regst = |d: u32| descs.get(d as usize).map_or_else(|| format!("#{d}"), |r| format!("'{r}'"));
        let mut lines = vec![format!(
            "connection with node {}: {} frame(s) sent, {} received; the last {}:",
            self.peer,
            ring.sent,
            ring.received,
            entries.len()
        )];
        for e in entries {
            let what = match e.what {
                What::Ready { desc, slot, piece, len } => {
                    format!("ready {} slot {slot} piece {piece} ({len} bytes)", regst(desc))
                }
                What::Ack { desc, slot } => format!("ack {} slot {slot}", regst(desc)),
                What::Eord { desc } => format!("end of {}", regst(desc)),
                What::Collective { group, round, rank } => {
                    let name = groups.get(group as usize).map_or_else(|| format!("#{group}"), |g| format!("'{g}'"));
                    format!("collective {name} rank {rank} round {round}")
                }
                What::Heartbeat { fires } => format!("heartbeat ({fires} firings)"),
                What::Other(kind) => kind.to_string(),
            };
            let direction = if e.sent { "sent" } else { "received" };
            let ago = now.saturating_duration_since(e.at).as_secs_f64() * 1e3;
            lines.push(format!("  {direction} #{} {what}, {ago:.1} ms ago", e.seq));
        }
        lines
    }
}
