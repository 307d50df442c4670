//! `regflow trace merge`: every event of every node's trace lands in one file, nodes keep
//! distinct pids (renumbered only when two files claim the same one), flow arrows keep
//! their ids, and a file that is not a trace is named with what is wrong.

use regflow::prelude::*;
use serde_json::Value;
use std::path::{Path, PathBuf};

use crate::common;
use common::{failure, regflow, temp_dir};

/// On each node in `nodes`: a counted source on one stream feeding a copy on a second
/// stream and a sink back on the first, so every piece crosses streams twice.
fn chains(nodes: &[u16]) -> Plan {
    let mut b = PlanBuilder::new();
    for &node in nodes {
        let cpu = b.device(node, DeviceKind::Cpu, 0);
        let (s0, s1) = (b.stream(cpu, StreamKind::Compute), b.stream(cpu, StreamKind::Compute));
        let src = b.actor(&format!("src@{node}"), s0, ActorKind::Source { pieces: SourcePieces::Count(4) });
        let x = b.regst(&format!("x@{node}"), src, 8, 2);
        let copy = b.actor(&format!("copy@{node}"), s1, ActorKind::Compute { kernel: KernelConf::Copy });
        b.consume(copy, x);
        let y = b.regst(&format!("y@{node}"), copy, 8, 2);
        let sink = b.actor(&format!("sink@{node}"), s0, ActorKind::Sink);
        b.consume(sink, y);
    }
    b.build().unwrap()
}

/// Runs the actors of `node` of `plan` and returns the trace it wrote to `path`.
fn trace(plan: Plan, node: u16, path: PathBuf) -> Vec<Value> {
    let mut job = Job::builder(plan).node(node).trace(&path).build().unwrap();
    drop(job.fetcher(&format!("sink@{node}")).unwrap());
    job.wait().unwrap();
    events(&path)
}

fn events(path: &Path) -> Vec<Value> {
    let trace: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    trace["traceEvents"].as_array().unwrap().clone()
}

/// `(ph, id)` of every flow event, sorted.
fn flows<'a>(events: impl Iterator<Item = &'a Value>) -> Vec<(String, u64)> {
    let mut flows: Vec<(String, u64)> = events
        .filter(|e| e["ph"] == "s" || e["ph"] == "f")
        .map(|e| (e["ph"].as_str().unwrap().to_string(), e["id"].as_u64().unwrap()))
        .collect();
    flows.sort();
    flows
}

/// The pids of events that are not metadata.
fn active_pids(events: &[Value]) -> Vec<u64> {
    let mut pids: Vec<u64> = events.iter().filter(|e| e["ph"] != "M").map(|e| e["pid"].as_u64().unwrap()).collect();
    pids.sort_unstable();
    pids.dedup();
    pids
}

fn process_names(events: &[Value], pid: u64) -> Vec<&str> {
    events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "process_name" && e["pid"] == pid)
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect()
}

fn merge(dir: &Path, inputs: &[&Path]) -> (Vec<Value>, String) {
    let out = dir.join("merged.json");
    let mut args = vec!["trace", "merge", out.to_str().unwrap()];
    args.extend(inputs.iter().map(|p| p.to_str().unwrap()));
    let run = regflow(&args, None);
    let stderr = String::from_utf8(run.stderr).unwrap();
    assert!(run.status.success(), "{stderr}");
    (events(&out), stderr)
}

#[test]
fn traces_of_different_nodes_keep_their_pids_events_and_arrows() {
    let dir = temp_dir("trace_merge", "nodes");
    let (a, b) = (dir.join("node0.json"), dir.join("node1.json"));
    let node0 = trace(chains(&[0, 1]), 0, a.clone());
    let node1 = trace(chains(&[0, 1]), 1, b.clone());
    assert_eq!((active_pids(&node0), active_pids(&node1)), (vec![0], vec![1]));
    assert_eq!(flows(node0.iter()).len(), 16, "4 pieces, 2 hand-offs each, 2 ends each");

    let (merged, stderr) = merge(&dir, &[&a, &b]);
    assert_eq!(stderr, "", "nothing to renumber, no arrow shared");
    assert_eq!(merged.len(), node0.len() + node1.len());
    assert_eq!(active_pids(&merged), [0, 1]);
    let of_pid = |pid: u64| merged.iter().filter(move |e| e["pid"] == pid);
    assert_eq!(flows(of_pid(0)), flows(node0.iter()));
    assert_eq!(flows(of_pid(1)), flows(node1.iter()));
    // Each node's trace names every node of the plan; the names stay as written.
    assert_eq!(process_names(&merged, 0), ["node 0", "node 0"]);
    assert_eq!(process_names(&merged, 1), ["node 1", "node 1"]);
}

#[test]
fn a_pid_two_files_claim_is_renumbered_in_the_later_file() {
    let dir = temp_dir("trace_merge", "same_pid");
    let (a, b) = (dir.join("first.json"), dir.join("second.json"));
    let first = trace(chains(&[0]), 0, a.clone());
    let second = trace(chains(&[0]), 0, b.clone());

    let (merged, stderr) = merge(&dir, &[&a, &b]);
    assert_eq!(merged.len(), first.len() + second.len());
    // Input order is kept: the first file's events, then the second's on pid 1.
    let (head, tail) = merged.split_at(first.len());
    assert!(head.iter().all(|e| e["pid"] == 0));
    assert!(tail.iter().all(|e| e["pid"] == 1));
    for (merged, original) in tail.iter().zip(&second) {
        let mut expected = original.clone();
        expected["pid"] = 1.into();
        if expected["name"] == "process_name" {
            expected["args"]["name"] = "node 0 (second.json)".into();
        }
        assert_eq!(merged, &expected);
    }
    assert_eq!(process_names(&merged, 1), ["node 0 (second.json)"]);
    assert_eq!(flows(tail.iter()), flows(second.iter()));
    assert_eq!(flows(head.iter()), flows(first.iter()));
    // Two runs of one plan give the same arrow ids, which Perfetto would join: said so.
    assert!(stderr.contains(&format!("{}'s pid 0 is pid 1", b.display())), "{stderr}");
    assert!(stderr.contains(&format!("flow arrows start in both {} and {}", a.display(), b.display())), "{stderr}");
}

#[test]
fn a_file_that_is_not_a_trace_is_named_with_what_is_wrong() {
    let dir = temp_dir("trace_merge", "bad");
    let out = dir.join("out.json");
    let out = out.to_str().unwrap();
    let good = dir.join("good.json");
    std::fs::write(&good, r#"{"traceEvents": []}"#).unwrap();
    let good = good.to_str().unwrap();
    let cases = [
        ("text.json", "not json", "it is not JSON: expected ident at line 1 column 2"),
        ("object.json", r#"{"events": []}"#, "it has no traceEvents array"),
        ("number.json", "3", "it is a number, not a Chrome trace object"),
        ("pid.json", r#"{"traceEvents": [{"ph": "X", "pid": "gpu"}]}"#, r#"event 0 has pid "gpu", not a whole number"#),
    ];
    for (name, text, reason) in cases {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        let path = path.to_str().unwrap();
        let stderr = failure(&["trace", "merge", out, good, path], None);
        assert!(stderr.starts_with(&format!("error: trace {path}: {reason}")), "{stderr}");
    }
    let missing = dir.join("missing.json");
    let stderr = failure(&["trace", "merge", out, missing.to_str().unwrap()], None);
    assert!(
        stderr.starts_with(&format!("error: trace {}: cannot read it: No such file", missing.display())),
        "{stderr}"
    );
    assert!(!Path::new(out).exists(), "nothing is written when an input is bad");
}
