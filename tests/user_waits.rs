//! The program embedding a job is part of the watchdog's wait-for graph: a push blocked
//! while nobody reads a full fetcher, `wait` with a full unread fetcher and an input never
//! fed end with errors that name the feeder, the fetcher or the input, never a hang. Also:
//! non-blocking pushes, dropped fetchers, unknown names, plans too big for the device.

use crate::common;
use common::fed_chain;

use regflow::graph::{CompileOptions, CompiledGraph, DType, Graph, Init};
use regflow::plan::HostArray;
use regflow::prelude::*;
use regflow::runtime::UserWait;
use std::time::Duration;

/// Short enough for tests; every test ends within a couple of these.
const WATCHDOG: Duration = Duration::from_millis(200);

/// `z = x + y` over typed inputs `x` and `y` of f32[2].
fn sum_graph() -> CompiledGraph {
    let g = Graph::new();
    let x = g.input("x", [2], DType::F32).unwrap();
    let y = g.input("y", [2], DType::F32).unwrap();
    let z = x.add(&y).unwrap();
    g.compile(&[z], &[], &CompileOptions::default()).unwrap()
}

fn pair(a: f32, b: f32) -> HostArray {
    HostArray::f32(vec![2], vec![a, b]).unwrap()
}

/// Case 1: the thread that should read the fetches pushes more than the job holds.
#[test]
fn a_push_blocked_while_nobody_reads_the_fetcher_is_a_user_side_deadlock() {
    let mut job = Job::builder(fed_chain(1)).watchdog(WATCHDOG).build().unwrap();
    let mut feeder = job.feeder("src").unwrap();
    let _fetcher = job.fetcher("sink").unwrap();
    // The job holds a bounded number of pieces; the push past them waits, then fails.
    let error = (0..100u64).find_map(|v| feeder.push(&v.to_le_bytes()).err()).expect("a push past the job's pieces");
    let message = error.to_string();
    assert!(message.starts_with("push to source 'src' failed: job stalled: user-side deadlock"), "{message}");
    assert!(message.contains("the fetcher of sink 'sink' holds 4 unread piece(s)"), "{message}");
    let RuntimeError::Stalled { graph, .. } = job.wait().unwrap_err() else { panic!("expected a stall") };
    assert!(graph.user.iter().any(|u| matches!(u, UserWait::Push { source, .. } if source == "src")), "{graph}");
    assert!(graph.user.contains(&UserWait::Unread { sink: "sink".into(), pieces: 4, taken: true }), "{graph}");
    let cycle = graph.cycle.clone().expect("a cycle through the program");
    for node in ["push to source 'src'", "src", "f", "sink", "fetcher of 'sink'"] {
        assert!(cycle.iter().any(|n| n == node), "{node} not in {cycle:?}");
    }
}

/// Case 1 through typed feeds: the feeder is named by the graph's input.
#[test]
fn a_blocked_typed_push_names_the_input() {
    let compiled = sum_graph();
    let sink = compiled.plan.actors[compiled.plan.signature.outputs[0].actor.index()].name.clone();
    let mut job = Job::builder(compiled.plan.clone()).watchdog(WATCHDOG).build().unwrap();
    let mut feeds = job.graph_feeds().unwrap();
    let _fetcher = job.fetcher(&sink).unwrap();
    let error = (0..100)
        .find_map(|i| feeds.push("x", &pair(i as f32, 0.0)).and_then(|()| feeds.push("y", &pair(0.0, 1.0))).err())
        .expect("a push past the job's pieces");
    let message = error.to_string();
    assert!(message.starts_with("push to input '"), "{message}");
    assert!(message.contains("user-side deadlock"), "{message}");
    assert!(message.contains(&format!("the fetcher of sink '{sink}'")), "{message}");
    assert!(job.wait().is_err());
}

/// Case 2: `wait` with a fetcher only the waiting thread could read fails at once (the
/// watchdog is off: this is `wait`'s own check).
#[test]
fn wait_with_a_full_unread_fetcher_fails_naming_it() {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s = b.stream(cpu, StreamKind::Compute);
    let src = b.actor("src", s, ActorKind::Source { pieces: SourcePieces::Count(50) });
    let x = b.regst("x", src, 8, 1);
    let sink = b.actor("results", s, ActorKind::Sink);
    b.consume(sink, x);
    let mut job = Job::builder(b.build().unwrap()).fetch_depth(2).without_watchdog().build().unwrap();
    let fetcher = job.fetcher("results").unwrap();
    let error = job.wait().unwrap_err();
    assert!(matches!(error, RuntimeError::UnreadFetcher { ref sink, unread: 2 } if sink == "results"), "{error}");
    let message = error.to_string();
    assert!(message.contains("fetcher of sink 'results' holds 2 unread piece(s)"), "{message}");
    assert!(message.contains("before calling wait()"), "{message}");
    drop(fetcher);
}

/// Case 2 through the watchdog: the fetcher is read by another thread that stops reading.
#[test]
fn wait_while_another_thread_holds_the_unread_fetcher_is_in_the_graph() {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s = b.stream(cpu, StreamKind::Compute);
    let src = b.actor("src", s, ActorKind::Source { pieces: SourcePieces::Count(50) });
    let x = b.regst("x", src, 8, 1);
    let sink = b.actor("sink", s, ActorKind::Sink);
    b.consume(sink, x);
    let mut job = Job::builder(b.build().unwrap()).fetch_depth(2).watchdog(WATCHDOG).build().unwrap();
    let fetcher = job.fetcher("sink").unwrap();
    let (read_one, stop) = (std::sync::mpsc::channel::<()>(), std::sync::mpsc::channel::<()>());
    let reader = std::thread::spawn(move || {
        drop(fetcher.recv());
        read_one.0.send(()).unwrap();
        // Stops reading, keeps the fetcher until the test is done.
        let _ = stop.1.recv();
        drop(fetcher);
    });
    read_one.1.recv().unwrap();
    let error = job.wait().unwrap_err();
    stop.0.send(()).unwrap();
    reader.join().unwrap();
    let RuntimeError::Stalled { graph, .. } = &error else { panic!("expected a stall, got {error}") };
    assert!(graph.user.contains(&UserWait::JobWait), "{graph}");
    let message = error.to_string();
    assert!(message.contains("Job::wait() waits for the job while the fetcher of sink 'sink' holds 2"), "{message}");
}

/// Reading one sink while another sink's fetcher is full and unread: a cycle through the
/// reading thread.
#[test]
fn reading_one_sink_while_another_is_full_and_unread_is_a_user_side_deadlock() {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s = b.stream(cpu, StreamKind::Compute);
    let src = b.actor("src", s, ActorKind::Source { pieces: SourcePieces::Count(50) });
    let x = b.regst("x", src, 8, 1);
    let first = b.actor("first", s, ActorKind::Sink);
    let second = b.actor("second", s, ActorKind::Sink);
    b.consume(first, x).consume(second, x);
    let mut job = Job::builder(b.build().unwrap()).fetch_depth(2).watchdog(WATCHDOG).build().unwrap();
    let (first, _second) = (job.fetcher("first").unwrap(), job.fetcher("second").unwrap());
    let read = std::iter::from_fn(|| first.recv()).count();
    assert!(read < 50, "'first' cannot get every piece while 'second' is unread");
    let message = job.wait().unwrap_err().to_string();
    assert!(
        message.contains("the program waits for a piece of sink 'first' while the fetcher of sink 'second' holds 2"),
        "{message}"
    );
}

/// Case 3: one input pushed, the other never.
#[test]
fn an_input_never_fed_is_named_with_what_the_others_got() {
    let compiled = sum_graph();
    let sink = compiled.plan.actors[compiled.plan.signature.outputs[0].actor.index()].name.clone();
    let mut job = Job::builder(compiled.plan.clone()).watchdog(WATCHDOG).build().unwrap();
    let mut feeds = job.graph_feeds().unwrap();
    let fetcher = job.fetcher(&sink).unwrap();
    // Never more than the source holds, so these do not wait.
    for i in 0..2 {
        assert!(feeds.try_push("x", &pair(i as f32, 1.0)).unwrap());
    }
    assert!(fetcher.recv().is_none(), "the stalled job delivers nothing");
    let message = job.wait().unwrap_err().to_string();
    assert!(message.contains("input 'y' was never fed: 0 pieces pushed while 'x' got 2"), "{message}");
    drop(feeds);
}

/// `try_push` and `push_timeout` answer `Ok(false)` on a full source and push nothing.
#[test]
fn try_push_and_push_timeout_say_full_without_pushing() {
    let mut job = Job::builder(fed_chain(1)).watchdog(WATCHDOG).build().unwrap();
    let mut feeder = job.feeder("src").unwrap();
    let fetcher = job.fetcher("sink").unwrap();
    let mut pushed = 0u64;
    while feeder.try_push(&pushed.to_le_bytes()).unwrap() {
        pushed += 1;
        assert!(pushed < 64, "the job holds a bounded number of pieces");
    }
    while feeder.push_timeout(&pushed.to_le_bytes(), Duration::from_millis(20)).unwrap() {
        pushed += 1;
        assert!(pushed < 64, "the job holds a bounded number of pieces");
    }
    assert!(matches!(feeder.try_push(&[1, 2]), Err(RuntimeError::FeedSize { .. })), "a wrong size is an error");
    feeder.close().unwrap();
    let got: Vec<u64> =
        std::iter::from_fn(|| fetcher.recv()).map(|p| u64::from_le_bytes(p.bytes().try_into().unwrap())).collect();
    assert_eq!(got, (0..pushed).collect::<Vec<_>>());
    job.wait().unwrap();
}

/// A typed value goes to every part or to none.
#[test]
fn typed_try_push_pushes_whole_values() {
    let compiled = sum_graph();
    let sink = compiled.plan.actors[compiled.plan.signature.outputs[0].actor.index()].name.clone();
    let mut job = Job::builder(compiled.plan.clone()).watchdog(WATCHDOG).build().unwrap();
    let mut feeds = job.graph_feeds().unwrap();
    let fetcher = job.fetcher(&sink).unwrap();
    let mut pushed = 0;
    while feeds.try_push("x", &pair(pushed as f32, 0.0)).unwrap() {
        assert!(feeds.push_timeout("y", &pair(0.0, pushed as f32), Duration::from_secs(5)).unwrap());
        pushed += 1;
        assert!(pushed < 64, "the job holds a bounded number of pieces");
    }
    feeds.close().unwrap();
    let got: Vec<Vec<u8>> = std::iter::from_fn(|| fetcher.recv()).map(|p| p.bytes().to_vec()).collect();
    let expected: Vec<Vec<u8>> = (0..pushed).map(|i| pair(i as f32, i as f32).to_le_bytes()).collect();
    assert_eq!(got, expected);
    job.wait().unwrap();
}

/// Case 4: pieces queued in a dropped fetcher go back to the sink, which keeps draining.
#[test]
fn a_fetcher_dropped_with_queued_pieces_does_not_stall_the_job() {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s = b.stream(cpu, StreamKind::Compute);
    let src = b.actor("src", s, ActorKind::Source { pieces: SourcePieces::Count(200) });
    let x = b.regst("x", src, 8, 1);
    let sink = b.actor("sink", s, ActorKind::Sink);
    b.consume(sink, x);
    let plan = b.build().unwrap();
    for _ in 0..20 {
        let mut job = Job::builder(plan.clone()).fetch_depth(2).watchdog(WATCHDOG).build().unwrap();
        let fetcher = job.fetcher("sink").unwrap();
        // The sink has delivered: pieces are queued when the fetcher goes.
        drop(fetcher.recv().unwrap());
        drop(fetcher);
        assert_eq!(job.wait().unwrap().actor("sink").unwrap().fires, 200);
    }
}

#[test]
fn unknown_feed_and_fetch_names_list_the_nearest() {
    let mut job = Job::local(fed_chain(1)).unwrap();
    assert_eq!(
        job.feeder("srx").unwrap_err().to_string(),
        "no fed source named 'srx'; did you mean 'src'? (nearest fed sources: 'src')"
    );
    assert_eq!(
        job.fetcher("snk").unwrap_err().to_string(),
        "no sink named 'snk'; did you mean 'sink'? (nearest sinks: 'sink')"
    );
    drop(job);
    let compiled = sum_graph();
    let mut job = Job::local(compiled.plan.clone()).unwrap();
    let mut feeds = job.graph_feeds().unwrap();
    assert_eq!(
        feeds.push("nope", &pair(0.0, 0.0)).unwrap_err().to_string(),
        "no input named 'nope' (nearest inputs: 'x', 'y')"
    );
    assert_eq!(
        feeds.try_push("xx", &pair(0.0, 0.0)).unwrap_err().to_string(),
        "no input named 'xx'; did you mean 'x'? (nearest inputs: 'x', 'y')"
    );
}

/// A register no machine holds (2^50 bytes) is an error at build naming it, not an abort.
#[test]
fn a_register_larger_than_the_device_is_an_error_naming_it() {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s = b.stream(cpu, StreamKind::Compute);
    let src = b.actor("src", s, ActorKind::Source { pieces: SourcePieces::Count(1) });
    let x = b.regst("huge", src, 1 << 50, 1);
    let sink = b.actor("sink", s, ActorKind::Sink);
    b.consume(sink, x);
    let message = Job::local(b.build().unwrap()).unwrap_err().to_string();
    assert!(
        message.starts_with("device node0/cpu:0 cannot hold this plan: it needs 1125899906842624 bytes"),
        "{message}"
    );
    assert!(message.contains("register 'huge' (1 x 1125899906842624 bytes)"), "{message}");
    if cfg!(target_os = "linux") {
        assert!(message.contains("bytes of host memory"), "{message}");
    }
}

/// A variable no machine holds (f32[2^24, 2^24], 4 PiB) names the variable.
#[test]
fn a_variable_larger_than_the_device_is_an_error_naming_it() {
    let g = Graph::new();
    let x = g.input("x", [1, 1 << 24], DType::F32).unwrap();
    let w = g.variable("weights", [1 << 24, 1 << 24], DType::F32, Init::Zeros).unwrap();
    let y = x.matmul(&w).unwrap();
    let compiled = g.compile(&[y], &[], &CompileOptions::default()).unwrap();
    let message = Job::local(compiled.plan).unwrap_err().to_string();
    assert!(message.contains("cannot hold this plan: it needs"), "{message}");
    assert!(message.contains("variable 'weights' in register"), "{message}");
    assert!(message.contains("(1 x 1125899906842624 bytes)"), "{message}");
}
