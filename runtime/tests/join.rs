//! Nodes joining each other through rank 0's control plane (threads of this process, each
//! a node with its own flags): a job across the joined nodes, and every refusal — wrong
//! secret, another plan, a world-size mismatch, a rank taken twice, an unreachable master,
//! a public bind without a secret — is a clear error on the nodes involved, in bounded time.

mod common;
use common::within;

use regflow_plan::{ActorKind, DeviceKind, KernelConf, Plan, PlanBuilder, SourcePieces, StreamKind};
use regflow_runtime::{Cluster, ClusterEnv, ClusterOptions, Job, RuntimeError, Secret};
use std::time::Duration;

/// `in` (fed, node 0) -> `copy` (node 1) -> `out` (sink, node 1), `bytes` per piece.
fn chain(bytes: u64) -> Plan {
    let mut b = PlanBuilder::new();
    let d0 = b.device(0, DeviceKind::Cpu, 0);
    let d1 = b.device(1, DeviceKind::Cpu, 0);
    let s0 = b.stream(d0, StreamKind::Compute);
    let s1 = b.stream(d1, StreamKind::Compute);
    let src = b.actor("in", s0, ActorKind::Source { pieces: SourcePieces::Fed });
    let x = b.regst("x", src, bytes, 2);
    let copy = b.actor("copy", s1, ActorKind::Compute { kernel: KernelConf::Copy });
    b.consume(copy, x);
    let y = b.regst("y", copy, bytes, 2);
    let out = b.actor("out", s1, ActorKind::Sink);
    b.consume(out, y);
    b.build().unwrap()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn options(secret: &str, timeout_ms: u64) -> ClusterOptions {
    ClusterOptions {
        timeout: Duration::from_millis(timeout_ms),
        secret: Some(Secret::new(secret.as_bytes().to_vec())),
        ..ClusterOptions::default()
    }
}

/// Joins nodes `(rank, world, plan, options)` on threads against one master; their results.
fn join_all(nodes: Vec<(u32, u32, Plan, ClusterOptions)>) -> Vec<Result<Cluster, RuntimeError>> {
    let master = format!("127.0.0.1:{}", free_port());
    let threads: Vec<_> = nodes
        .into_iter()
        .map(|(rank, world, plan, options)| {
            let master = master.clone();
            std::thread::spawn(move || {
                let env = ClusterEnv::from_flags(rank, world, &master).unwrap();
                Cluster::join(&env, &plan, &options)
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

#[test]
fn joined_nodes_run_a_job_together() {
    let got = within(Duration::from_secs(30), || {
        let plan = chain(8);
        let mut clusters = join_all(vec![
            (0, 2, plan.clone(), options("s3cret", 10_000)),
            (1, 2, plan.clone(), options("s3cret", 10_000)),
        ])
        .into_iter()
        .map(Result::unwrap);
        let (c0, c1) = (clusters.next().unwrap(), clusters.next().unwrap());
        assert_eq!((c0.rank(), c1.rank(), c0.world()), (0, 1, 2));
        run_chain(plan, c0, c1)
    });
    let want: Vec<Vec<u8>> = (0..5u64).map(|i| i.to_le_bytes().to_vec()).collect();
    assert_eq!(got, want);
}

/// Runs [`chain`] on the two joined nodes: node 0 pushes pieces 0..5, node 1 fetches them.
fn run_chain(plan: Plan, c0: Cluster, c1: Cluster) -> Vec<Vec<u8>> {
    let plan1 = plan.clone();
    let node1 = std::thread::spawn(move || {
        let mut job = Job::builder(plan1).cluster(c1).build().unwrap();
        let out = job.fetcher("out").unwrap();
        let got: Vec<Vec<u8>> = std::iter::from_fn(|| out.recv()).map(|p| p.bytes().to_vec()).collect();
        job.wait().unwrap();
        got
    });
    let mut job = Job::builder(plan).cluster(c0).build().unwrap();
    let mut feeder = job.feeder("in").unwrap();
    for i in 0..5u64 {
        feeder.push(&i.to_le_bytes()).unwrap();
    }
    feeder.close().unwrap();
    job.wait().unwrap();
    node1.join().unwrap()
}

fn message(result: &Result<Cluster, RuntimeError>) -> String {
    match result {
        Ok(_) => panic!("joining should have failed"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_wrong_secret_is_refused() {
    let results = within(Duration::from_secs(30), || {
        let plan = chain(8);
        join_all(vec![(0, 2, plan.clone(), options("right", 3_000)), (1, 2, plan, options("wrong", 3_000))])
    });
    let text = message(&results[1]);
    assert!(text.contains("secret"), "{text}");
    assert!(results[0].is_err(), "rank 0 cannot complete without rank 1");
}

#[test]
fn a_node_running_another_plan_is_refused_naming_both_fingerprints() {
    let results = within(Duration::from_secs(30), || {
        join_all(vec![(0, 2, chain(8), options("s", 3_000)), (1, 2, chain(16), options("s", 3_000))])
    });
    let (a, b) = (chain(8).fingerprint(), chain(16).fingerprint());
    let texts = [message(&results[0]), message(&results[1])];
    assert!(
        texts.iter().any(|t| t.contains(&a[..8]) && t.contains(&b[..8])),
        "no error names both plans {a} and {b}: {texts:?}"
    );
}

#[test]
fn a_world_size_mismatch_is_refused() {
    let results = within(Duration::from_secs(30), || {
        let plan = chain(8);
        join_all(vec![(0, 2, plan.clone(), options("s", 3_000)), (1, 3, plan, options("s", 3_000))])
    });
    let text = message(&results[1]);
    assert!(text.contains('2') && text.contains('3') && text.contains("world"), "{text}");
}

#[test]
fn a_rank_taken_twice_is_refused() {
    let results = within(Duration::from_secs(30), || {
        let plan = chain(8);
        join_all(vec![
            (0, 2, plan.clone(), options("s", 3_000)),
            (1, 2, plan.clone(), options("s", 3_000)),
            (1, 2, plan, options("s", 3_000)),
        ])
    });
    let refused: Vec<String> = results.iter().filter_map(|r| r.as_ref().err()).map(ToString::to_string).collect();
    assert!(refused.iter().any(|t| t.contains("twice")), "{refused:?}");
}

#[test]
fn an_unreachable_master_is_named() {
    let results = within(Duration::from_secs(30), || join_all(vec![(1, 2, chain(8), options("s", 300))]));
    let text = message(&results[0]);
    assert!(text.contains("127.0.0.1:") && text.contains("unreachable"), "{text}");
}

#[test]
fn a_public_bind_without_a_secret_is_refused() {
    let results = within(Duration::from_secs(30), || {
        let options = ClusterOptions {
            timeout: Duration::from_millis(500),
            bind: Some("0.0.0.0".parse().unwrap()),
            secret: Some(Secret::none()),
            ..ClusterOptions::default()
        };
        join_all(vec![(1, 2, chain(8), options)])
    });
    let text = message(&results[0]);
    assert!(text.contains("REGFLOW_SECRET"), "{text}");
}

#[test]
fn strangers_at_a_data_port_are_dropped_and_the_nodes_still_join() {
    use regflow_net::handshake::{handshake, Expect, Identity};
    let got = within(Duration::from_secs(30), || {
        let plan = chain(8);
        // Two distinct free ports (both held while picking, so the OS cannot hand out one twice).
        let (a, b) =
            (std::net::TcpListener::bind("127.0.0.1:0").unwrap(), std::net::TcpListener::bind("127.0.0.1:0").unwrap());
        let (master, data_port) =
            (format!("127.0.0.1:{}", a.local_addr().unwrap().port()), b.local_addr().unwrap().port());
        drop((a, b));
        let rank0 = {
            let (plan, master) = (plan.clone(), master.clone());
            let options = ClusterOptions { data_port: Some(data_port), ..options("s3cret", 20_000) };
            std::thread::spawn(move || Cluster::join(&ClusterEnv::from_flags(0, 2, &master).unwrap(), &plan, &options))
        };
        // Strangers, while the nodes join: garbage, then one claiming rank 1 without the
        // secret. (A loop of connects to a port nobody listens on yet can connect a socket
        // to itself on Linux: such a connection is dropped and tried again.)
        let strangers = {
            let plan = plan.clone();
            std::thread::spawn(move || {
                let connect = || loop {
                    match std::net::TcpStream::connect(("127.0.0.1", data_port)) {
                        Ok(stream) if stream.local_addr().unwrap().port() != data_port => break stream,
                        _ => std::thread::sleep(Duration::from_millis(5)),
                    }
                };
                let mut garbage = connect();
                std::io::Write::write_all(&mut garbage, b"GET / HTTP/1.1\r\n\r\n").unwrap();
                drop(garbage);
                let mut stranger = connect();
                let me = Identity::new(1, 2, plan.fingerprint());
                handshake(&mut stranger, &me, &Secret::new(b"wrong".to_vec()), Expect::Rank(0)).map(|_| ())
            })
        };
        // The real rank 1 joins (after the strangers have had their try), and the two run
        // a job.
        std::thread::sleep(Duration::from_millis(300));
        let c1 =
            Cluster::join(&ClusterEnv::from_flags(1, 2, &master).unwrap(), &plan, &options("s3cret", 20_000)).unwrap();
        assert!(strangers.join().unwrap().is_err(), "a wrong secret passed the handshake");
        let c0 = rank0.join().unwrap().unwrap();
        run_chain(plan, c0, c1)
    });
    assert_eq!(got.len(), 5);
}
