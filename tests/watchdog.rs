//! The watchdog turns a job that cannot progress into an error carrying the wait-for graph,
//! in bounded time, and leaves a job that merely waits on its user alone.

use regflow::prelude::*;
use regflow::runtime::Wait;
use std::sync::mpsc;
use std::time::Duration;

/// Runs `f` on a thread and fails the test (instead of hanging it) if it takes longer than
/// `limit`. This bounds a hang; it asserts nothing about speed.
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit).expect("the job hung instead of failing")
}

/// `src (count) -> a -> join <- fed`, with the fed source never fed: `src` and `a` fill
/// their single registers and `join` waits on the fed input for ever.
fn join_with_unfed_input() -> Plan {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s0 = b.stream(cpu, StreamKind::Compute);
    let s1 = b.stream(cpu, StreamKind::Compute);
    let src = b.actor("src", s0, ActorKind::Source { pieces: SourcePieces::Count(10) });
    let x = b.regst("src.out", src, 8, 1);
    let a = b.actor("a", s1, ActorKind::Compute { kernel: KernelConf::Copy });
    b.consume(a, x);
    let y = b.regst("a.out", a, 8, 1);
    let fed = b.actor("fed", s0, ActorKind::Source { pieces: SourcePieces::Fed });
    let f = b.regst("fed.out", fed, 8, 1);
    let join = b.actor("join", s1, ActorKind::Compute { kernel: KernelConf::Copy });
    b.consume(join, y).consume(join, f);
    let z = b.regst("join.out", join, 8, 1);
    let sink = b.actor("sink", s0, ActorKind::Sink);
    b.consume(sink, z);
    b.build().unwrap()
}

#[test]
fn watchdog_reports_the_wait_for_graph_of_a_stalled_job() {
    let err = within(Duration::from_secs(60), || {
        let mut job = Job::builder(join_with_unfed_input()).watchdog(Duration::from_millis(200)).build().unwrap();
        let _feeder_held_open = job.feeder("fed").unwrap();
        job.wait().unwrap_err()
    });
    let RuntimeError::Stalled { graph, .. } = &err else { panic!("expected a stall, got {err}") };
    let join = graph.actor("join").expect("join is stuck");
    assert!(join.waits.contains(&Wait::Input { regst: "fed.out".into(), producer: "fed".into() }), "{graph}");
    let a = graph.actor("a").expect("a is stuck");
    assert!(
        a.waits.contains(&Wait::OutputFull { regst: "a.out".into(), register_num: 1, holders: vec!["join".into()] }),
        "{graph}"
    );
    let src = graph.actor("src").expect("src is stuck");
    assert!(
        src.waits.contains(&Wait::OutputFull { regst: "src.out".into(), register_num: 1, holders: vec!["a".into()] }),
        "{graph}"
    );
    assert!(graph.actor("fed").unwrap().waits.contains(&Wait::Feed), "{graph}");
    let edges = graph.edges();
    assert!(edges.contains(&("join".into(), "fed".into(), "fed.out".into())), "{edges:?}");
    let text = err.to_string();
    assert!(text.contains("job stalled"), "{text}");
    assert!(text.contains("'join'") && text.contains("waits on input 'fed.out': empty, produced by 'fed'"), "{text}");
    assert!(text.contains("output 'a.out' is full: all 1 slot(s) held by ['join']"), "{text}");
}

struct Stuck(crossbeam_channel::Receiver<()>);

impl Kernel for Stuck {
    fn run(&mut self, _io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let _ = self.0.recv();
        Ok(())
    }
}

#[test]
fn watchdog_names_the_actor_whose_kernel_never_returns() {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s0 = b.stream(cpu, StreamKind::Compute);
    let s1 = b.stream(cpu, StreamKind::Compute);
    let src = b.actor("src", s0, ActorKind::Source { pieces: SourcePieces::Count(4) });
    let x = b.regst("src.out", src, 8, 2);
    let stuck = b.actor("stuck", s1, ActorKind::Compute { kernel: KernelConf::Custom { name: "stuck".into() } });
    b.consume(stuck, x);
    let y = b.regst("stuck.out", stuck, 8, 1);
    let sink = b.actor("sink", s0, ActorKind::Sink);
    b.consume(sink, y);
    let (release, blocked) = crossbeam_channel::unbounded::<()>();
    let plan = b.build().unwrap();
    let err = within(Duration::from_secs(60), move || {
        Job::builder(plan)
            .watchdog(Duration::from_millis(200))
            .kernel("stuck", move |_| Ok(Box::new(Stuck(blocked.clone()))))
            .build()
            .unwrap()
            .wait()
            .unwrap_err()
    });
    drop(release); // lets the abandoned kernel return, so its thread ends
    let RuntimeError::Stalled { graph, .. } = &err else { panic!("expected a stall, got {err}") };
    assert_eq!(graph.silent_streams.len(), 1, "{graph}");
    assert!(graph.silent_streams[0].contains("busy in the kernel of 'stuck'"), "{graph}");
    let src = graph.actor("src").expect("src waits on the stuck actor");
    assert!(
        matches!(&src.waits[..], [Wait::OutputFull { holders, .. }] if holders == &["stuck".to_string()]),
        "{graph}"
    );
}

#[test]
fn watchdog_leaves_a_job_waiting_on_its_user_alone() {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s = b.stream(cpu, StreamKind::Compute);
    let src = b.actor("src", s, ActorKind::Source { pieces: SourcePieces::Fed });
    let x = b.regst("x", src, 8, 1);
    let sink = b.actor("sink", s, ActorKind::Sink);
    b.consume(sink, x);
    let mut job = Job::builder(b.build().unwrap()).watchdog(Duration::from_millis(50)).fetch_depth(1).build().unwrap();
    let mut feeder = job.feeder("src").unwrap();
    let fetcher = job.fetcher("sink").unwrap();
    feeder.push(&7u64.to_le_bytes()).unwrap();
    // The sink delivered piece 0 and, with fetch depth 1, waits for us to take it: idle
    // with a piece held, but on the user's account. Several watchdog periods pass.
    std::thread::sleep(Duration::from_millis(300));
    feeder.push(&8u64.to_le_bytes()).unwrap();
    let first = fetcher.recv().unwrap();
    assert_eq!(first.bytes(), 7u64.to_le_bytes());
    drop(first);
    // Nothing pending at all: the job waits for the next push.
    assert_eq!(fetcher.recv().unwrap().bytes(), 8u64.to_le_bytes());
    std::thread::sleep(Duration::from_millis(300));
    feeder.close().unwrap();
    assert!(fetcher.recv().is_none());
    let report = job.wait().unwrap();
    assert_eq!(report.actor("sink").unwrap().fires, 2);
}

/// A training job whose program takes longer than the watchdog's timeout between steps
/// holds only loop state (the variables, the step token) while it waits: idle, not stuck.
#[test]
fn a_training_job_idle_between_steps_longer_than_the_timeout_is_not_stalled() {
    use regflow::graph::{CompileOptions, DType, Graph, HostArray, Init, Optimizer};
    let g = Graph::new();
    let x = g.input("x", [4, 3], DType::F32).unwrap();
    let y = g.input("y", [4], DType::I64).unwrap();
    let w = g.variable("w", [3, 2], DType::F32, Init::Xavier { seed: 1 }).unwrap();
    let loss = x.matmul(&w).unwrap().sparse_cross_entropy(&y).unwrap();
    let train = g.minimize(loss, &Optimizer::adamw(1e-2, 0.0)).unwrap();
    let compiled = g.compile(&[train.loss], &train.updates, &CompileOptions::default()).unwrap();
    let mut job = Job::builder(compiled.plan.clone()).watchdog(Duration::from_millis(100)).build().unwrap();
    let mut feeds = job.graph_feeds().unwrap();
    let losses = job.fetcher(&compiled.fetches[0]).unwrap();
    for _ in 0..2 {
        feeds.push("x", &HostArray::f32([4, 3], vec![0.5; 12]).unwrap()).unwrap();
        feeds.push("y", &HostArray::i64([4], vec![0, 1, 0, 1]).unwrap()).unwrap();
        assert!(losses.recv().is_some(), "the step's loss");
        std::thread::sleep(Duration::from_millis(500));
    }
    feeds.close().unwrap();
    assert!(losses.recv().is_none());
    drop(losses);
    job.wait().unwrap();
}
