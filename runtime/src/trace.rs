//! Timelines: each stream thread records its firings and register hand-offs into a
//! buffer of its own; at the end the job writes them as Chrome-trace / Perfetto JSON
//! (pid = node, tid = stream, one slice per firing, flow arrows for `Ready` messages).
//! A device that queues kernels and times them on the device (`cuda`) adds a second row
//! per stream, tid = streams + stream, named `... gpu`, of slices (category `gpu`) giving
//! when the device ran each kernel; the stream's own row then shows the host's launches.

use regflow_actors::ActorId;
use regflow_plan::{Plan, RegstDescId};
use serde::Serialize;
use std::io::Write;
use std::time::Instant;

/// One recorded event of one stream thread.
#[derive(Debug, Clone, Copy)]
pub(crate) enum TraceEvent {
    /// A firing of plan actor `actor` on piece `piece`.
    Slice { actor: u32, piece: u64, start: Instant, end: Instant },
    /// A register handed to a consumer: start of a flow arrow.
    FlowOut { id: u64, at: Instant },
    /// The consumer's firing that reads it: end of the arrow.
    FlowIn { id: u64, at: Instant },
    /// When the device ran the kernel of a firing of plan actor `actor` on piece `piece`
    /// (the launch is the firing's `Slice`).
    DeviceSlice { actor: u32, piece: u64, start: Instant, end: Instant },
}

/// Identifies the arrow of piece `piece` of `desc` going to `consumer`; both ends compute it.
pub(crate) fn flow_id(desc: RegstDescId, piece: u64, consumer: ActorId) -> u64 {
    // SplitMix64 finalizer over the three fields: distinct arrows get distinct ids in practice.
    let mut x = consumer.bits() ^ (u64::from(desc.0) << 40) ^ piece.rotate_left(17);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (x ^ (x >> 31)) >> 11 // keep it exact in a JSON double
}

/// Events of one stream thread.
#[derive(Debug)]
pub(crate) struct TraceBuffer {
    pub(crate) stream: usize,
    pub(crate) events: Vec<TraceEvent>,
}

impl TraceBuffer {
    /// A buffer with room for many events up front; it grows if a run records more
    /// (tracing is opt-in, so that allocation is not in the default hot path).
    pub(crate) fn new(stream: usize) -> Self {
        Self { stream, events: Vec::with_capacity(1 << 16) }
    }
}

#[derive(Serialize)]
struct JsonEvent<'a> {
    name: &'a str,
    ph: &'static str,
    pid: u16,
    tid: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    ts: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    dur: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cat: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    bp: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    args: Option<serde_json::Value>,
}

impl<'a> JsonEvent<'a> {
    /// A metadata event (`M`): `name` is `process_name` or `thread_name`, `value` the name.
    fn metadata(name: &'static str, pid: u16, tid: usize, value: String) -> Self {
        let args = Some(serde_json::json!({ "name": value }));
        Self { name, ph: "M", pid, tid, ts: None, dur: None, id: None, cat: None, bp: None, args }
    }

    /// A complete slice (`X`) of a firing on `piece`, from `ts` for `dur` microseconds.
    fn slice(name: &'a str, (pid, tid): (u16, usize), (ts, dur): (f64, f64), cat: &'static str, piece: u64) -> Self {
        let args = Some(serde_json::json!({ "piece": piece }));
        Self { name, ph: "X", pid, tid, ts: Some(ts), dur: Some(dur), id: None, cat: Some(cat), bp: None, args }
    }
}

/// Writes the buffers as a Chrome trace (`{"traceEvents": [...]}`).
pub(crate) fn write_chrome_trace<W: Write>(
    out: W,
    plan: &Plan,
    epoch: Instant,
    buffers: &[TraceBuffer],
) -> std::io::Result<()> {
    let micros = |t: Instant| t.saturating_duration_since(epoch).as_nanos() as f64 / 1000.0;
    let mut events = Vec::new();
    for (s, stream) in plan.streams.iter().enumerate() {
        let device = &plan.devices[stream.device.index()];
        let name = format!("{} {:?}#{s}", device.label(), stream.kind);
        events.push(JsonEvent::metadata("thread_name", device.node, s, name));
    }
    let mut nodes: Vec<u16> = plan.devices.iter().map(|d| d.node).collect();
    nodes.sort_unstable();
    nodes.dedup();
    for node in nodes {
        events.push(JsonEvent::metadata("process_name", node, 0, format!("node {node}")));
    }
    for buffer in buffers {
        let stream = &plan.streams[buffer.stream];
        let device = &plan.devices[stream.device.index()];
        let pid = device.node;
        let tid = buffer.stream;
        // The device's own row, where it timed kernels (see the module docs).
        let device_tid = plan.streams.len() + buffer.stream;
        if buffer.events.iter().any(|e| matches!(e, TraceEvent::DeviceSlice { .. })) {
            let name = format!("{} {:?}#{} gpu", device.label(), stream.kind, buffer.stream);
            events.push(JsonEvent::metadata("thread_name", pid, device_tid, name));
        }
        for event in &buffer.events {
            let flow = |ph, id, at| JsonEvent {
                name: "regst",
                ph,
                pid,
                tid,
                ts: Some(micros(at)),
                dur: None,
                id: Some(id),
                cat: Some("regst"),
                bp: Some("e"),
                args: None,
            };
            events.push(match *event {
                TraceEvent::Slice { actor, piece, start, end } => {
                    let span = (micros(start), micros(end) - micros(start));
                    JsonEvent::slice(&plan.actors[actor as usize].name, (pid, tid), span, "firing", piece)
                }
                TraceEvent::DeviceSlice { actor, piece, start, end } => {
                    let span = (micros(start), micros(end) - micros(start));
                    JsonEvent::slice(&plan.actors[actor as usize].name, (pid, device_tid), span, "gpu", piece)
                }
                TraceEvent::FlowOut { id, at } => flow("s", id, at),
                TraceEvent::FlowIn { id, at } => flow("f", id, at),
            });
        }
    }
    let mut out = std::io::BufWriter::new(out);
    serde_json::to_writer(&mut out, &serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ns" }))?;
    out.flush()
}
