//! Jobs that run one node each of a multi-node plan, connected over loopback TCP inside
//! this process (one thread per node): registers crossing nodes with their bytes and their
//! backpressure, collectives across nodes bitwise equal to one process, aborts that reach
//! every node, and peers that vanish or send what the plan does not allow.

mod common;
use common::within;

use regflow_net::frame::{FrameWriter, Header, WireBody, WireMessage};
use regflow_plan::{
    ActorKind, CollectiveConf, CollectiveOp, DType, DeviceKind, KernelConf, Plan, PlanBuilder, SourcePieces, StreamKind,
};
use regflow_runtime::{Cluster, Job, PeerLink, RuntimeError};
use std::sync::mpsc;
use std::time::Duration;

/// `in` (fed, node 0) -> x (3 slots of 16 bytes) -> `copy` and `tap` (node 1); `copy` ->
/// `out` (sink, node 1); `tap` is a second consumer of the same register on node 1.
fn two_node_chain() -> Plan {
    let mut b = PlanBuilder::new();
    let d0 = b.device(0, DeviceKind::Cpu, 0);
    let d1 = b.device(1, DeviceKind::Cpu, 0);
    let s0 = b.stream(d0, StreamKind::Compute);
    let s1 = b.stream(d1, StreamKind::Compute);
    let src = b.actor("in", s0, ActorKind::Source { pieces: SourcePieces::Fed });
    let x = b.regst("x", src, 16, 3);
    let copy = b.actor("copy", s1, ActorKind::Compute { kernel: KernelConf::Copy });
    b.consume(copy, x);
    let y = b.regst("y", copy, 16, 2);
    let out = b.actor("out", s1, ActorKind::Sink);
    b.consume(out, y);
    let tap = b.actor("tap", s1, ActorKind::Sink);
    b.consume(tap, x);
    b.build().unwrap()
}

fn piece_bytes(piece: u64) -> Vec<u8> {
    (0..16).map(|i| (piece as u8).wrapping_mul(31).wrapping_add(i)).collect()
}

#[test]
fn a_register_crosses_nodes_with_its_bytes_to_two_consumers() {
    let report = within(Duration::from_secs(30), || {
        let mut clusters = Cluster::loopback(2).unwrap().into_iter();
        let (c0, c1) = (clusters.next().unwrap(), clusters.next().unwrap());
        let node1 = std::thread::spawn(move || {
            let mut job = Job::builder(two_node_chain()).cluster(c1).build().unwrap();
            let out = job.fetcher("out").unwrap();
            let tap = job.fetcher("tap").unwrap();
            let mut got = Vec::new();
            while let Some(piece) = out.recv() {
                let tapped = tap.recv().expect("the tap got every piece too");
                assert_eq!(tapped.bytes(), piece.bytes());
                got.push((piece.piece(), piece.bytes().to_vec()));
            }
            (got, job.wait().unwrap())
        });
        let mut job = Job::builder(two_node_chain()).cluster(c0).build().unwrap();
        assert_eq!(job.node(), Some(0));
        let mut feeder = job.feeder("in").unwrap();
        for piece in 0..40 {
            feeder.push(&piece_bytes(piece)).unwrap();
        }
        feeder.close().unwrap();
        let report0 = job.wait().unwrap();
        let (got, report1) = node1.join().unwrap();
        (got, report0, report1)
    });
    let (got, report0, report1) = report;
    assert_eq!(got.len(), 40);
    for (i, (piece, bytes)) in got.iter().enumerate() {
        assert_eq!(*piece, i as u64);
        assert_eq!(*bytes, piece_bytes(i as u64));
    }
    let producer = report0.actor("in").unwrap();
    assert_eq!(producer.fires, 40);
    // Never more pieces in flight across the network than the register has slots.
    assert!(producer.max_in_flight.iter().all(|&(most, slots)| most <= slots), "{:?}", producer.max_in_flight);
    assert_eq!(report1.actor("copy").unwrap().fires, 40);
    assert!(report0.actor("copy").is_none(), "node 0 ran node 1's actor");
}

#[test]
fn a_consumer_that_reads_nothing_stops_its_producer_on_the_other_node() {
    let accepted = within(Duration::from_secs(30), || {
        let mut clusters = Cluster::loopback(2).unwrap().into_iter();
        let (c0, c1) = (clusters.next().unwrap(), clusters.next().unwrap());
        let (ready_tx, ready_rx) = mpsc::channel::<()>();
        let node1 = std::thread::spawn(move || {
            let mut job = Job::builder(two_node_chain()).cluster(c1).fetch_depth(1).build().unwrap();
            let out = job.fetcher("out").unwrap();
            let tap = job.fetcher("tap").unwrap();
            // Read nothing until node 0 found its input full.
            ready_rx.recv().unwrap();
            // Both consumers of x in step: each holds slots the other's pieces need.
            while out.recv().is_some() | tap.recv().is_some() {}
            job.wait().unwrap()
        });
        let mut job = Job::builder(two_node_chain()).cluster(c0).build().unwrap();
        let mut feeder = job.feeder("in").unwrap();
        let mut accepted = 0u64;
        // Pieces go out until the slots, the mirrors and node 1's fetch depth are full.
        while feeder.push_timeout(&piece_bytes(accepted), Duration::from_millis(500)).unwrap() {
            accepted += 1;
            assert!(accepted < 100, "the producer was never held back");
        }
        ready_tx.send(()).unwrap();
        feeder.close().unwrap();
        job.wait().unwrap();
        node1.join().unwrap();
        accepted
    });
    assert!(accepted >= 3, "the producer should fill the register's 3 slots, got {accepted}");
}

fn conf(rank: usize, size: usize, op: CollectiveOp, shape: &[usize]) -> CollectiveConf {
    CollectiveConf {
        group: "g".into(),
        rank: rank as u32,
        size: size as u32,
        op,
        dtype: DType::F32,
        shape: shape.to_vec(),
    }
}

/// Rank `r` on device `r % per_node` of node `r / per_node`: `in{r}` (fed) -> `c{r}` (the
/// collective, comm stream) -> `out{r}` (sink).
fn collective_plan(size: usize, per_node: usize, op: CollectiveOp, shape: &[usize]) -> Plan {
    let mut b = PlanBuilder::new();
    for r in 0..size {
        let c = conf(r, size, op, shape);
        let bytes = |s: Vec<usize>| (s.iter().product::<usize>() * 4) as u64;
        let device = b.device((r / per_node) as u16, DeviceKind::Cpu, (r % per_node) as u16);
        let compute = b.stream(device, StreamKind::Compute);
        let comm = b.stream(device, StreamKind::Comm);
        let src = b.actor(&format!("in{r}"), compute, ActorKind::Source { pieces: SourcePieces::Fed });
        let x = b.regst(&format!("x{r}"), src, bytes(c.input_shape()), 2);
        let output = bytes(c.output_shape());
        let member = b.actor(&format!("c{r}"), comm, ActorKind::Compute { kernel: KernelConf::Collective(c) });
        b.consume(member, x);
        let y = b.regst(&format!("y{r}"), member, output, 2);
        let sink = b.actor(&format!("out{r}"), compute, ActorKind::Sink);
        b.consume(sink, y);
    }
    b.build().unwrap()
}

/// Rank `r`'s input of piece `p`: values whose sum order shows in f32.
fn input(r: usize, p: u64, len: usize) -> Vec<f32> {
    (0..len).map(|i| ((r * 7919 + i * 31 + p as usize * 13) % 1000) as f32 * 0.1 + 1e-3 / (i % 7 + 1) as f32).collect()
}

/// Feeds the ranks whose sources `job` runs, then fetches the ranks whose sinks it runs.
fn run_ranks(mut job: Job, plan: &Plan, size: usize, pieces: u64) -> Vec<(usize, Vec<Vec<u8>>)> {
    for r in 0..size {
        if let Ok(mut feeder) = job.feeder(&format!("in{r}")) {
            let bytes = plan.regst_descs.iter().find(|d| d.name == format!("x{r}")).unwrap().bytes as usize;
            for p in 0..pieces {
                let values: Vec<u8> = input(r, p, bytes / 4).iter().flat_map(|v| v.to_le_bytes()).collect();
                feeder.push(&values).unwrap();
            }
            feeder.close().unwrap();
        }
    }
    let fetchers: Vec<_> = (0..size).filter_map(|r| Some((r, job.fetcher(&format!("out{r}")).ok()?))).collect();
    let results = fetchers
        .iter()
        .map(|(r, f)| (*r, (0..pieces).map(|_| f.recv().expect("a piece").bytes().to_vec()).collect()))
        .collect();
    drop(fetchers);
    job.wait().unwrap();
    results
}

/// Every rank's outputs, piece by piece, of `plan` run as `nodes` nodes (or one process).
fn run_collective(plan: &Plan, size: usize, nodes: Option<u16>, pieces: u64) -> Vec<Vec<Vec<u8>>> {
    let mut outputs = vec![Vec::new(); size];
    let results: Vec<(usize, Vec<Vec<u8>>)> = match nodes {
        None => {
            let job = Job::builder(plan.clone()).watchdog(Duration::from_secs(20)).build().unwrap();
            run_ranks(job, plan, size, pieces)
        }
        Some(n) => {
            let threads: Vec<_> = Cluster::loopback(n)
                .unwrap()
                .into_iter()
                .map(|cluster| {
                    let plan = plan.clone();
                    std::thread::spawn(move || {
                        let builder = Job::builder(plan.clone()).cluster(cluster).watchdog(Duration::from_secs(20));
                        run_ranks(builder.build().unwrap(), &plan, size, pieces)
                    })
                })
                .collect();
            threads.into_iter().flat_map(|t| t.join().unwrap()).collect()
        }
    };
    for (r, o) in results {
        outputs[r] = o;
    }
    outputs
}

#[test]
fn collectives_across_nodes_equal_one_process_bit_for_bit() {
    within(Duration::from_secs(60), || {
        let shape = [7, 5, 3];
        let ops = [
            CollectiveOp::AllReduce,
            CollectiveOp::ReduceScatter { dim: 0 },
            CollectiveOp::AllGather { dim: 1 },
            CollectiveOp::AllToAll { from: 0, to: 2 },
        ];
        for op in ops {
            let local = run_collective(&collective_plan(4, 4, op, &shape), 4, None, 3);
            for per_node in [2, 1] {
                let plan = collective_plan(4, per_node, op, &shape);
                let nodes = (4 / per_node) as u16;
                let remote = run_collective(&plan, 4, Some(nodes), 3);
                assert_eq!(remote, local, "{op:?} on {nodes} nodes differs from one process");
            }
        }
    });
}

/// Node 0 of [`two_node_chain`] against a hand-driven peer: the raw socket of "node 1".
fn node0_against_raw_peer() -> (Job, std::net::TcpStream) {
    node0_against_raw_peer_silent_after(Duration::from_secs(10))
}

/// As [`node0_against_raw_peer`], with the peer allowed `silence` without a frame.
fn node0_against_raw_peer_silent_after(silence: Duration) -> (Job, std::net::TcpStream) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let peer = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (ours, _) = listener.accept().unwrap();
    let link = PeerLink { rank: 1, host: "fake-host".into(), transport: Box::new(ours) };
    let cluster = Cluster::from_links(0, 2, "localhost", vec![link]).unwrap().with_silence_limit(silence);
    let job = Job::builder(two_node_chain()).cluster(cluster).watchdog(Duration::from_secs(20)).build().unwrap();
    (job, peer)
}

fn failure_of(mut job: Job, pieces: u64) -> RuntimeError {
    let mut feeder = job.feeder("in").unwrap();
    for piece in 0..pieces {
        if feeder.push(&piece_bytes(piece)).is_err() {
            break;
        }
    }
    let _ = feeder.close();
    job.wait().expect_err("the job should fail")
}

#[test]
fn a_peer_that_vanishes_fails_the_job_naming_it() {
    let error = within(Duration::from_secs(30), || {
        let (job, peer) = node0_against_raw_peer();
        drop(peer);
        failure_of(job, 10)
    });
    let message = error.to_string();
    assert!(matches!(error, RuntimeError::PeerLost { node: 1, .. }), "{error:?}");
    assert!(message.contains("lost node 1 (fake-host)"), "{message}");
}

/// How node 0 fails when "node 1" sends these raw bytes.
fn failure_after_bytes(bytes: &'static [u8]) -> RuntimeError {
    within(Duration::from_secs(30), move || {
        let (job, mut peer) = node0_against_raw_peer();
        std::io::Write::write_all(&mut peer, bytes).unwrap();
        let error = failure_of(job, 3);
        drop(peer);
        error
    })
}

#[test]
fn garbage_from_a_peer_fails_the_job_naming_it_without_a_panic() {
    let error = failure_after_bytes(&[7, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
    let message = error.to_string();
    assert!(matches!(error, RuntimeError::PeerLost { node: 1, .. }), "{error:?}");
    assert!(message.contains("does not decode"), "{message}");
}

#[test]
fn an_oversized_header_or_a_wrong_payload_length_is_refused() {
    // A header length over the bound: refused before anything is allocated for it.
    let error = failure_after_bytes(&[0xff; 4]);
    assert!(error.to_string().contains("headers are at most"), "{error}");

    // An `Ack` for a register node 1 does not consume: the plan has no such edge.
    let error = within(Duration::from_secs(30), || {
        let (job, peer) = node0_against_raw_peer();
        let ids = regflow_actors::PlanIds::assign(job.plan()).unwrap();
        let index = |name: &str| job.plan().actor_by_name(name).unwrap().index();
        let (src, copy) = (ids.actors[index("in")], ids.actors[index("copy")]);
        let mut writer = FrameWriter::new(&peer);
        let wrong = WireMessage { dst: copy.bits(), src: src.bits(), body: WireBody::Ack { desc: 0, slot: 0 } };
        writer.write(&Header::Actor(wrong), &[]).unwrap();
        writer.flush().unwrap();
        let error = failure_of(job, 3);
        drop(peer);
        error
    });
    let message = error.to_string();
    assert!(message.contains("lost node 1 (fake-host)"), "{message}");
    assert!(message.contains("node 0 to an actor of node 1"), "{message}");
}

#[test]
fn a_failing_node_fails_every_node_naming_it() {
    let (error0, error1) = within(Duration::from_secs(30), || {
        let mut clusters = Cluster::loopback(2).unwrap().into_iter();
        let (c0, c1) = (clusters.next().unwrap(), clusters.next().unwrap());
        let node1 = std::thread::spawn(move || {
            let mut job = Job::builder(two_node_chain()).cluster(c1).build().unwrap();
            let out = job.fetcher("out").unwrap();
            let tap = job.fetcher("tap").unwrap();
            // Take two pieces, then stop the job as a failing kernel would.
            for _ in 0..2 {
                out.recv().unwrap();
                tap.recv().unwrap();
            }
            job.abort(RuntimeError::Panicked { stream: "node1/cpu:0 compute".into(), message: "boom".into() });
            job.wait().expect_err("node 1 aborted")
        });
        let job = Job::builder(two_node_chain()).cluster(c0).build().unwrap();
        let error0 = failure_of(job, 1000);
        (error0, node1.join().unwrap())
    });
    assert!(matches!(error1, RuntimeError::Panicked { .. }), "{error1:?}");
    let message = error0.to_string();
    assert!(matches!(error0, RuntimeError::PeerFailed { node: 1, .. }), "{error0:?}");
    assert!(message.contains("node 1 (localhost) failed") && message.contains("boom"), "{message}");
}

#[test]
fn a_node_that_cannot_start_tells_the_others() {
    let error = within(Duration::from_secs(30), || {
        let mut clusters = Cluster::loopback(2).unwrap().into_iter();
        let (c0, c1) = (clusters.next().unwrap(), clusters.next().unwrap());
        // Node 1 refuses to start: its preload names no register.
        let refused = Job::builder(two_node_chain()).cluster(c1).preload("no-such-register", vec![0; 4]).build();
        assert!(refused.is_err());
        let job = Job::builder(two_node_chain()).cluster(c0).build().unwrap();
        failure_of(job, 1000)
    });
    let message = error.to_string();
    assert!(matches!(error, RuntimeError::PeerFailed { node: 1, .. }), "{error:?}");
    assert!(message.contains("node 1 could not start") && message.contains("no-such-register"), "{message}");
}

#[test]
fn a_cluster_that_does_not_fit_the_plan_is_refused() {
    let mut clusters = Cluster::loopback(3).unwrap().into_iter();
    let error = Job::builder(two_node_chain()).cluster(clusters.next().unwrap()).build().unwrap_err();
    assert!(error.to_string().contains("places devices on 2 node(s), but the cluster has 3"), "{error}");
}

#[test]
fn a_peer_that_goes_silent_without_closing_is_lost_naming_it() {
    // The peer beats once (its job is up), then sends nothing and keeps the connection
    // open: a stuck process or a cut network, which no end-of-stream would reveal.
    let error = within(Duration::from_secs(30), || {
        let (job, peer) = node0_against_raw_peer_silent_after(Duration::from_millis(600));
        let mut writer = FrameWriter::new(&peer);
        writer.write(&Header::Heartbeat { fires: 7 }, &[]).unwrap();
        writer.flush().unwrap();
        let error = failure_of(job, 3);
        drop(peer);
        error
    });
    let message = error.to_string();
    assert!(matches!(error, RuntimeError::PeerLost { node: 1, .. }), "{error:?}");
    assert!(message.contains("not even a heartbeat") && message.contains("fired 7 times"), "{message}");
    // The connection's flight recorder comes with the error.
    assert!(
        message.contains("connection with node 1:") && message.contains("received #1 heartbeat (7 firings)"),
        "{message}"
    );
}

#[test]
fn an_idle_peer_that_beats_is_not_lost() {
    // Node 1 takes its time (3 × the silence limit) before reading anything: its heartbeats
    // keep node 0 waiting rather than failing.
    let report = within(Duration::from_secs(30), || {
        let mut clusters = Cluster::loopback(2).unwrap().into_iter();
        let silence = Duration::from_millis(1200);
        let c0 = clusters.next().unwrap().with_silence_limit(silence);
        let c1 = clusters.next().unwrap().with_silence_limit(silence);
        let node1 = std::thread::spawn(move || {
            let mut job = Job::builder(two_node_chain()).cluster(c1).build().unwrap();
            let (out, tap) = (job.fetcher("out").unwrap(), job.fetcher("tap").unwrap());
            std::thread::sleep(Duration::from_millis(3600));
            while out.recv().is_some() | tap.recv().is_some() {}
            job.wait().unwrap()
        });
        let mut job = Job::builder(two_node_chain()).cluster(c0).build().unwrap();
        let mut feeder = job.feeder("in").unwrap();
        // More pieces than node 1's slots and fetch depths hold: node 0 waits on it.
        for piece in 0..40 {
            feeder.push(&piece_bytes(piece)).unwrap();
        }
        feeder.close().unwrap();
        let report = job.wait().unwrap();
        node1.join().unwrap();
        report
    });
    assert_eq!(report.actor("in").unwrap().fires, 40);
}

/// An accumulation of 3 pieces beside a bypass of 1 slot, split over two nodes: `src` and
/// the bypass `a` on node 0, `acc`, `repeat`, `join` and `sink` on node 1. The join holds
/// the bypass's only slot while it waits for the accumulation, which waits for pieces
/// `src` cannot make: a cycle through both nodes (the compiler's progress proof refuses
/// such plans; this one is built by hand).
fn cross_node_deadlock() -> Plan {
    let mut b = PlanBuilder::new();
    let d0 = b.device(0, DeviceKind::Cpu, 0);
    let d1 = b.device(1, DeviceKind::Cpu, 0);
    let s0 = b.stream(d0, StreamKind::Compute);
    let s1 = b.stream(d1, StreamKind::Compute);
    let copy = || ActorKind::Compute { kernel: KernelConf::Copy };
    let src = b.actor("src", s0, ActorKind::Source { pieces: SourcePieces::Count(6) });
    let x = b.regst("x", src, 8, 1);
    let a = b.actor("a", s0, copy());
    b.consume(a, x);
    let ax = b.regst("a.out", a, 8, 1);
    let acc = b.actor("acc", s1, ActorKind::Acc { count: 3, kernel: KernelConf::Noop });
    b.consume(acc, x);
    let summed = b.regst("acc.out", acc, 8, 1);
    let repeat = b.actor("repeat", s1, ActorKind::Repeat { count: 3 });
    b.consume(repeat, summed);
    let repeated = b.regst("repeat.out", repeat, 8, 1);
    let join = b.actor("join", s1, copy());
    b.consume(join, ax).consume(join, repeated);
    let out = b.regst("join.out", join, 8, 1);
    let sink = b.actor("sink", s1, ActorKind::Sink);
    b.consume(sink, out);
    b.build().unwrap()
}

#[test]
fn a_deadlock_across_nodes_is_reported_with_the_cycle_on_every_node() {
    let (error0, error1) = within(Duration::from_secs(30), || {
        let mut clusters = Cluster::loopback(2).unwrap().into_iter();
        let (c0, c1) = (clusters.next().unwrap(), clusters.next().unwrap());
        let node1 = std::thread::spawn(move || {
            // Node 1's watchdog is slower: node 0's reports first, with node 1's snapshot.
            let job = Job::builder(cross_node_deadlock()).cluster(c1).watchdog(Duration::from_secs(20)).build();
            let mut job = job.unwrap();
            let sink = job.fetcher("sink").unwrap();
            while sink.recv().is_some() {}
            drop(sink);
            job.wait().expect_err("node 1 is part of the deadlock")
        });
        let job = Job::builder(cross_node_deadlock()).cluster(c0).watchdog(Duration::from_millis(300)).build();
        (job.unwrap().wait().expect_err("a deadlock"), node1.join().unwrap())
    });
    let RuntimeError::Stalled { graph, .. } = &error0 else { panic!("node 0 should report the stall: {error0}") };
    // Node 1's actors are in node 0's graph, with their streams on node 1, and the cycle
    // through both nodes is named.
    let join = graph.actor("join").unwrap_or_else(|| panic!("node 1's 'join' is missing from the graph:\n{graph}"));
    assert!(join.stream.contains("node1"), "{}", join.stream);
    let cycle = graph.cycle.clone().unwrap_or_else(|| panic!("no cycle found:\n{graph}"));
    assert!(cycle.contains(&"a".to_string()) && cycle.contains(&"join".to_string()), "{cycle:?}\n{graph}");
    // The flight recorder of the connection: the pieces of 'x' that went to node 1.
    let network = graph.network.join("\n");
    assert!(network.contains("connection with node 1:"), "{network}");
    assert!(network.contains("sent #1 ") && network.contains("ready 'x' slot 0 piece 0 (8 bytes)"), "{network}");
    // Node 1 stops too, with node 0's report.
    let message = error1.to_string();
    assert!(matches!(error1, RuntimeError::PeerFailed { node: 0, .. }), "{error1:?}");
    assert!(message.contains("deadlock cycle"), "{message}");
}

#[test]
fn a_large_all_reduce_over_3_and_4_nodes_goes_around_a_ring_within_f32_rounding() {
    within(Duration::from_secs(60), || {
        // 512 KiB of f32 (at least RING_MIN_BYTES): one member per node reduces around a
        // ring, in ring order; every rank gets the same bits, within rounding of rank order.
        let shape = [256, 512];
        for size in [3, 4] {
            let plan = collective_plan(size, 1, CollectiveOp::AllReduce, &shape);
            let local = run_collective(&collective_plan(size, size, CollectiveOp::AllReduce, &shape), size, None, 3);
            let ring = run_collective(&plan, size, Some(size as u16), 3);
            for piece in 0..3 {
                let floats = |b: &[u8]| -> Vec<f32> {
                    b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
                };
                let first = &ring[0][piece];
                for (r, outputs) in ring.iter().enumerate().skip(1) {
                    assert_eq!(&outputs[piece], first, "rank {r} of {size} differs from rank 0 (piece {piece})");
                }
                let differing = floats(first)
                    .iter()
                    .zip(floats(&local[0][piece]))
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                // The ring sums in ring order: some last bits differ (so the ring did run).
                assert!(differing > 0, "{size} nodes: bitwise rank order, so the ring was not used");
                for (i, (a, b)) in floats(first).iter().zip(floats(&local[0][piece])).enumerate() {
                    let relative = (a - b).abs() / b.abs().max(1e-6);
                    assert!(relative <= 1e-6, "{size} nodes, piece {piece}, element {i}: ring {a}, rank order {b}");
                }
            }
        }
    });
}
