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
