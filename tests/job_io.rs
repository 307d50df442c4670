//! The embedding API: feeds and fetches, their errors, backpressure towards the user, the
//! remote route, and failures that abort the job with the actor's name.

use crate::common;
use common::fed_chain;

use regflow::prelude::*;
use std::time::Duration;

#[test]
fn fed_pieces_come_out_in_order_with_their_bytes() {
    let mut job = Job::local(fed_chain(2)).unwrap();
    let mut feeder = job.feeder("src").unwrap();
    let fetcher = job.fetcher("sink").unwrap();
    let pusher = std::thread::spawn(move || {
        for v in 0..100u64 {
            feeder.push(&(v * 3).to_le_bytes()).unwrap();
        }
        feeder.close().unwrap();
    });
    let got: Vec<(u64, u64)> = std::iter::from_fn(|| fetcher.recv())
        .map(|p| (p.piece(), u64::from_le_bytes(p.bytes().try_into().unwrap())))
        .collect();
    pusher.join().unwrap();
    assert_eq!(got, (0..100).map(|v| (v, v * 3)).collect::<Vec<_>>());
    let report = job.wait().unwrap();
    assert_eq!(report.actor("f").unwrap().fires, 100);
    assert_eq!(report.memory.total_bytes(), 4 * 64);
}

#[test]
fn feeds_of_the_wrong_size_are_refused_and_lose_nothing() {
    let mut job = Job::local(fed_chain(1)).unwrap();
    let mut feeder = job.feeder("src").unwrap();
    let fetcher = job.fetcher("sink").unwrap();
    let err = feeder.push(&[1, 2, 3]).unwrap_err();
    assert_eq!(err.to_string(), "feed for source 'src' has 3 bytes; its register holds 8");
    feeder.push(&5u64.to_le_bytes()).unwrap();
    feeder.close().unwrap();
    assert_eq!(feeder.push(&5u64.to_le_bytes()).unwrap_err().to_string(), "feed of source 'src' is closed");
    let pieces: Vec<Vec<u8>> = std::iter::from_fn(|| fetcher.recv()).map(|p| p.bytes().to_vec()).collect();
    assert_eq!(pieces, vec![5u64.to_le_bytes().to_vec()]);
    job.wait().unwrap();
}

#[test]
fn feeders_and_fetchers_are_checked_by_name_and_kind() {
    let mut job = Job::local(fed_chain(1)).unwrap();
    assert_eq!(job.feeder("nope").unwrap_err().to_string(), "no fed source named 'nope' (nearest fed sources: 'src')");
    assert_eq!(
        job.feeder("sink").unwrap_err().to_string(),
        "actor 'sink' is a sink actor; a feeder needs a source with `pieces: fed`"
    );
    assert_eq!(
        job.fetcher("f").unwrap_err().to_string(),
        "actor 'f' is a compute actor; a fetcher needs a sink without an on_sink callback"
    );
    let feeder = job.feeder("src").unwrap();
    assert_eq!(job.feeder("src").unwrap_err().to_string(), "the feeder of 'src' was already taken");
    drop(feeder); // closes the feed: the job ends
    job.wait().unwrap();
}

#[test]
fn a_sink_stops_at_its_fetch_depth_until_the_user_fetches() {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s = b.stream(cpu, StreamKind::Compute);
    let src = b.actor("src", s, ActorKind::Source { pieces: SourcePieces::Count(50) });
    let x = b.regst("x", src, 8, 1);
    let sink = b.actor("sink", s, ActorKind::Sink);
    b.consume(sink, x);
    let mut job = Job::builder(b.build().unwrap()).fetch_depth(3).build().unwrap();
    let fetcher = job.fetcher("sink").unwrap();
    // Nothing fetched yet: three pieces wait for us and no fourth arrives.
    let held: Vec<_> = (0..3).map(|_| fetcher.recv().unwrap()).collect();
    assert!(fetcher.recv_timeout(Duration::from_millis(100)).is_err(), "a fourth piece arrived past the depth");
    assert_eq!(held.iter().map(|p| p.piece()).collect::<Vec<_>>(), [0, 1, 2]);
    drop(held);
    let rest: Vec<u64> = std::iter::from_fn(|| fetcher.recv()).map(|p| p.piece()).collect();
    assert_eq!(rest, (3..50).collect::<Vec<_>>());
    job.wait().unwrap();
}

#[test]
fn a_dropped_fetcher_does_not_stall_the_job() {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s = b.stream(cpu, StreamKind::Compute);
    let src = b.actor("src", s, ActorKind::Source { pieces: SourcePieces::Count(100) });
    let x = b.regst("x", src, 8, 1);
    let sink = b.actor("sink", s, ActorKind::Sink);
    b.consume(sink, x);
    let mut job = Job::builder(b.build().unwrap()).fetch_depth(2).watchdog(Duration::from_secs(20)).build().unwrap();
    drop(job.fetcher("sink").unwrap());
    assert_eq!(job.wait().unwrap().actor("sink").unwrap().fires, 100);
}

#[test]
fn messages_to_a_node_this_job_does_not_run_fail_as_not_connected() {
    let mut b = PlanBuilder::new();
    let d0 = b.device(0, DeviceKind::Cpu, 0);
    let d1 = b.device(1, DeviceKind::Cpu, 0);
    let s0 = b.stream(d0, StreamKind::Compute);
    let s1 = b.stream(d1, StreamKind::Net);
    let src = b.actor("src", s0, ActorKind::Source { pieces: SourcePieces::Count(2) });
    let x = b.regst("x", src, 8, 1);
    let remote = b.actor("remote", s1, ActorKind::Sink);
    b.consume(remote, x);
    let plan = b.build().unwrap();
    // In-process, both nodes run and the job completes.
    Job::local(plan.clone()).unwrap().wait().unwrap();
    // Running node 0 alone, the transport is missing: a clear error, not a hang.
    let mut job = Job::builder(plan).node(0).build().unwrap();
    assert_eq!(
        job.fetcher("remote").unwrap_err().to_string(),
        "actor 'remote' runs on node 1, which this job does not run"
    );
    let message = job.wait().unwrap_err().to_string();
    assert_eq!(message, "actor 'src' (n0.d0.s0.a0): cannot reach actor n1.d1.s0.a0: node 1 is not connected");
}

struct FailOn(u64);

impl Kernel for FailOn {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        if io.piece() == self.0 {
            return Err(KernelError(format!("refusing piece {}", io.piece())));
        }
        Ok(())
    }
}

#[test]
fn a_failing_kernel_aborts_the_job_with_the_actor_name() {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s0 = b.stream(cpu, StreamKind::Compute);
    let s1 = b.stream(cpu, StreamKind::Compute);
    let src = b.actor("src", s0, ActorKind::Source { pieces: SourcePieces::Count(1000) });
    let x = b.regst("x", src, 8, 2);
    let picky = b.actor("picky", s1, ActorKind::Compute { kernel: KernelConf::Custom { name: "fail_on_7".into() } });
    b.consume(picky, x);
    let y = b.regst("y", picky, 8, 2);
    let sink = b.actor("sink", s0, ActorKind::Sink);
    b.consume(sink, y);
    let plan = b.build().unwrap();
    let message = Job::builder(plan.clone())
        .kernel("fail_on_7", |_| Ok(Box::new(FailOn(7))))
        .build()
        .unwrap()
        .wait()
        .unwrap_err()
        .to_string();
    assert_eq!(message, "actor 'picky' (n0.d0.s1.a0): kernel failed: refusing piece 7");
    // An unregistered kernel is refused before anything runs.
    let message = Job::local(plan).unwrap_err().to_string();
    assert_eq!(message, "cannot make the kernel of actor 'picky': actor 'picky' names kernel 'fail_on_7', which is not registered (the job registers no kernels by name: add it with JobBuilder::kernel)");
}

#[test]
fn a_panicking_kernel_aborts_the_job_instead_of_hanging_it() {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s0 = b.stream(cpu, StreamKind::Compute);
    let s1 = b.stream(cpu, StreamKind::Compute);
    let src = b.actor("src", s0, ActorKind::Source { pieces: SourcePieces::Count(10) });
    let x = b.regst("x", src, 8, 1);
    let boom = b.actor("boom", s1, ActorKind::Compute { kernel: KernelConf::Custom { name: "boom".into() } });
    b.consume(boom, x);
    let y = b.regst("y", boom, 8, 1);
    let sink = b.actor("sink", s0, ActorKind::Sink);
    b.consume(sink, y);
    struct Boom;
    impl Kernel for Boom {
        fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
            assert!(io.piece() < 3, "boom at piece {}", io.piece());
            Ok(())
        }
    }
    let job = Job::builder(b.build().unwrap()).kernel("boom", |_| Ok(Box::new(Boom))).build().unwrap();
    let message = job.wait().unwrap_err().to_string();
    assert_eq!(message, "stream thread node0/cpu:0/Compute#1 panicked: boom at piece 3");
}

#[test]
fn acc_and_repeat_run_micro_batches_through_the_runtime() {
    // weight (fed once) -> repeat x4 -> scale <- data (4 pieces); scale -> acc x4 -> sink.
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s0 = b.stream(cpu, StreamKind::Compute);
    let s1 = b.stream(cpu, StreamKind::Compute);
    let w = b.actor("w", s0, ActorKind::Source { pieces: SourcePieces::Fed });
    let wr = b.regst("w.out", w, 8, 1);
    let rep = b.actor("rep", s1, ActorKind::Repeat { count: 4 });
    b.consume(rep, wr);
    let wk = b.regst("rep.out", rep, 8, 2);
    let data = b.actor("data", s0, ActorKind::Source { pieces: SourcePieces::Fed });
    let d = b.regst("data.out", data, 8, 2);
    let sum = b.actor("sum", s1, ActorKind::Compute { kernel: KernelConf::SumF32 });
    b.consume(sum, wk).consume(sum, d);
    let sr = b.regst("sum.out", sum, 8, 2);
    let acc = b.actor("acc", s0, ActorKind::Acc { count: 4, kernel: KernelConf::SumF32 });
    b.consume(acc, sr);
    let a = b.regst("acc.out", acc, 8, 1);
    let sink = b.actor("sink", s1, ActorKind::Sink);
    b.consume(sink, a);
    let mut job = Job::local(b.build().unwrap()).unwrap();
    let (mut wf, mut df, fetcher) =
        (job.feeder("w").unwrap(), job.feeder("data").unwrap(), job.fetcher("sink").unwrap());
    let f32s = |v: [f32; 2]| [v[0].to_le_bytes(), v[1].to_le_bytes()].concat();
    wf.push(&f32s([10.0, 100.0])).unwrap();
    wf.close().unwrap();
    for i in 0..4 {
        df.push(&f32s([i as f32, -(i as f32)])).unwrap();
    }
    df.close().unwrap();
    let out = fetcher.recv().unwrap();
    let v: Vec<f32> = out.bytes().chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    // Sum over 4 micro-batches of (w + x_i): 4w + (0+1+2+3).
    assert_eq!(v, [46.0, 394.0]);
    drop(out);
    assert!(fetcher.recv().is_none());
    let report = job.wait().unwrap();
    assert_eq!(report.actor("rep").unwrap().fires, 4);
    assert_eq!(report.actor("acc").unwrap().fires, 4);
    assert_eq!(report.actor("sink").unwrap().fires, 1);
}

/// A compute actor with an input window reads that block of each slot as its whole input,
/// and the plan file keeps the window.
#[test]
fn a_window_reads_its_block_of_every_slot() {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s = b.stream(cpu, StreamKind::Compute);
    let src = b.actor("src", s, ActorKind::Source { pieces: SourcePieces::Fed });
    let whole = b.regst("src.out", src, 256, 2);
    let copy = b.actor("copy", s, ActorKind::Compute { kernel: KernelConf::Copy });
    b.consume_window(copy, whole, 128, 64);
    let part = b.regst("copy.out", copy, 64, 1);
    let sink = b.actor("sink", s, ActorKind::Sink);
    b.consume(sink, part);
    let plan = b.build().unwrap();
    let reloaded = Plan::from_json(&plan.to_json()).unwrap();
    assert_eq!(reloaded.actors[1].windows, plan.actors[1].windows);
    let mut job = Job::local(reloaded).unwrap();
    let (mut feeder, fetcher) = (job.feeder("src").unwrap(), job.fetcher("sink").unwrap());
    for piece in 0..3u8 {
        feeder.push(&(0..=255u8).map(|i| i.wrapping_add(piece)).collect::<Vec<u8>>()).unwrap();
    }
    feeder.close().unwrap();
    for piece in 0..3u8 {
        let out = fetcher.recv().unwrap();
        assert_eq!(out.bytes(), (128..192u8).map(|i| i.wrapping_add(piece)).collect::<Vec<u8>>().as_slice());
    }
    assert!(fetcher.recv().is_none());
    job.wait().unwrap();
}
