//! The timeline a job writes is a valid Chrome trace: one slice per firing on the right
//! pid/tid, thread names, and flow arrows whose ends pair up.

use regflow::prelude::*;
use serde_json::Value;
use std::collections::HashMap;

#[test]
fn trace_has_a_slice_per_firing_and_paired_flow_arrows() {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let sim = b.device(0, DeviceKind::Sim, 0);
    let s0 = b.stream(cpu, StreamKind::Compute);
    let s1 = b.stream(sim, StreamKind::Compute);
    let src = b.actor("src", s0, ActorKind::Source { pieces: SourcePieces::Count(6) });
    let x = b.regst("x", src, 8, 2);
    let work = b.actor("work", s1, ActorKind::Compute { kernel: KernelConf::Copy });
    b.sim_nanos(work, 100_000);
    b.consume(work, x);
    let y = b.regst("y", work, 8, 2);
    let sink = b.actor("sink", s0, ActorKind::Sink);
    b.consume(sink, y);
    let path = std::env::temp_dir().join(format!("regflow-trace-test-{}.json", std::process::id()));
    let mut job = Job::builder(b.build().unwrap()).trace(&path).build().unwrap();
    drop(job.fetcher("sink").unwrap());
    let report = job.wait().unwrap();
    assert_eq!(report.trace.as_deref(), Some(path.as_path()));

    let trace: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    std::fs::remove_file(&path).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();

    let mut slices: HashMap<&str, Vec<(u64, u64)>> = HashMap::new();
    for e in events.iter().filter(|e| e["ph"] == "X") {
        let piece = e["args"]["piece"].as_u64().unwrap();
        slices.entry(e["name"].as_str().unwrap()).or_default().push((e["tid"].as_u64().unwrap(), piece));
        assert_eq!(e["pid"], 0);
        assert!(e["dur"].as_f64().unwrap() >= 0.0);
    }
    for (name, tid) in [("src", 0), ("work", 1), ("sink", 0)] {
        let expected: Vec<(u64, u64)> = (0..6).map(|p| (tid, p)).collect();
        assert_eq!(slices[name], expected, "{name}");
    }
    // Sim slices last the modeled 100 µs.
    let work_durations: Vec<f64> =
        events.iter().filter(|e| e["ph"] == "X" && e["name"] == "work").map(|e| e["dur"].as_f64().unwrap()).collect();
    assert!(work_durations.iter().all(|&d| (d - 100.0).abs() < 1e-6), "{work_durations:?}");

    let names: Vec<&str> = events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["node0/cpu:0 Compute#0", "node0/sim:0 Compute#1"]);

    // Every register hand-off src->work and work->sink is an arrow: 12 starts, 12 ends, paired by id.
    let ids = |ph: &str| -> Vec<u64> {
        let mut v: Vec<u64> = events.iter().filter(|e| e["ph"] == ph).map(|e| e["id"].as_u64().unwrap()).collect();
        v.sort_unstable();
        v
    };
    let (starts, ends) = (ids("s"), ids("f"));
    assert_eq!(starts.len(), 12);
    assert_eq!(starts, ends);
}

/// On `sim`, a kernel whose every peer is on its stream completes at launch (no timer), and
/// its stream runs the next one after it; a consumer on another stream still starts only
/// once everything before it on the producer's stream has ended (modeled time).
#[test]
fn a_sim_stream_runs_its_own_chain_in_order_and_others_wait_for_its_end() {
    const PIECES: u64 = 4;
    const NANOS: u64 = 300_000;
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let sim = b.device(0, DeviceKind::Sim, 0);
    let s0 = b.stream(cpu, StreamKind::Compute);
    let (s1, s2) = (b.stream(sim, StreamKind::Compute), b.stream(sim, StreamKind::Compute));
    let src = b.actor("src", s0, ActorKind::Source { pieces: SourcePieces::Count(PIECES) });
    let mut prev = b.regst("x", src, 8, 4);
    for (name, stream) in [("a", s1), ("b", s1), ("c", s2)] {
        let actor = b.actor(name, stream, ActorKind::Compute { kernel: KernelConf::Copy });
        b.sim_nanos(actor, NANOS);
        b.consume(actor, prev);
        prev = b.regst(&format!("{name}.out"), actor, 8, 2);
    }
    let sink = b.actor("sink", s0, ActorKind::Sink);
    b.consume(sink, prev);
    let path = std::env::temp_dir().join(format!("regflow-trace-chain-{}.json", std::process::id()));
    let mut job = Job::builder(b.build().unwrap()).trace(&path).build().unwrap();
    let fetcher = job.fetcher("sink").unwrap();
    let values: Vec<u64> =
        (0..PIECES).map(|_| u64::from_le_bytes(fetcher.recv().unwrap().bytes().try_into().unwrap())).collect();
    drop(fetcher);
    job.wait().unwrap();
    assert_eq!(values, (0..PIECES).collect::<Vec<_>>(), "every piece arrives, in order");

    let trace: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    std::fs::remove_file(&path).unwrap();
    let mut span: HashMap<(&str, u64), (f64, f64)> = HashMap::new();
    for e in trace["traceEvents"].as_array().unwrap().iter().filter(|e| e["ph"] == "X") {
        let (ts, dur) = (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap());
        span.insert((e["name"].as_str().unwrap(), e["args"]["piece"].as_u64().unwrap()), (ts, ts + dur));
    }
    let eps = 1e-3; // µs: the trace's rounding
    for p in 0..PIECES {
        let (a, b, c) = (span[&("a", p)], span[&("b", p)], span[&("c", p)]);
        assert!(b.0 + eps >= a.1, "piece {p}: b started at {} before a ended at {}", b.0, a.1);
        assert!(c.0 + eps >= b.1, "piece {p}: c (another stream) started at {} before b ended at {}", c.0, b.1);
    }
}
