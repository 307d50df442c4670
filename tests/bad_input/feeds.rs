//! Feeds: feeders asked of the wrong actor, pushes of the wrong size, dtype, shape or
//! name, pushes after close. Every job here has the catalogue's short watchdog.

use crate::{quick, Catalogue};
use regflow::graph::{CompileOptions, DType, Graph, HostArray, Init};
use regflow::prelude::*;

/// `src` (fed, 8 bytes) -> `f` (copy) -> `sink`; plus `count` (2 counted pieces) -> `tail`.
pub(crate) fn fed_chain() -> Plan {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s = b.stream(cpu, StreamKind::Compute);
    let src = b.actor("src", s, ActorKind::Source { pieces: SourcePieces::Fed });
    let x = b.regst("x", src, 8, 1);
    let f = b.actor("f", s, ActorKind::Compute { kernel: KernelConf::Copy });
    b.consume(f, x);
    let y = b.regst("y", f, 8, 1);
    let sink = b.actor("sink", s, ActorKind::Sink);
    b.consume(sink, y);
    let count = b.actor("count", s, ActorKind::Source { pieces: SourcePieces::Count(2) });
    let z = b.regst("z", count, 8, 1);
    let tail = b.actor("tail", s, ActorKind::Sink);
    b.consume(tail, z);
    b.build().expect("the plan validates")
}

/// Runs `body` on a job of `plan`, then closes everything and waits: `body`'s error, or
/// the job's.
pub(crate) fn with_job<T>(
    plan: Plan,
    body: impl FnOnce(&mut Job) -> Result<T, RuntimeError>,
) -> Result<T, RuntimeError> {
    let fed: Vec<String> = plan
        .actors
        .iter()
        .filter(|a| matches!(a.kind, ActorKind::Source { pieces: SourcePieces::Fed }))
        .map(|a| a.name.clone())
        .collect();
    let mut job = quick(plan).build()?;
    let result = body(&mut job);
    // Feeders the body did not take are taken and dropped: their feeds close, the job ends.
    for name in fed {
        drop(job.feeder(&name));
    }
    let waited = job.wait();
    let value = result?;
    waited?;
    Ok(value)
}

/// A compiled step: `x` f32[2, 3] times variable `w` f32[3, 1], fed and fetched.
fn compiled() -> regflow::graph::CompiledGraph {
    let g = Graph::new();
    let x = g.input("x", [2, 3], DType::F32).expect("input");
    let w = g.variable("w", [3, 1], DType::F32, Init::Ones).expect("variable");
    let y = x.matmul(&w).expect("matmul").sum_all().expect("sum");
    g.compile(&[y], &[], &CompileOptions::default()).expect("compiles")
}

#[test]
fn feeds() {
    let mut c = Catalogue::new("feeds");
    c.case(
        "a feeder for an unknown actor",
        || with_job(fed_chain(), |job| job.feeder("srcc").map(drop)),
        "RuntimeError::UnknownName",
        &["'srcc'"],
    );
    c.case(
        "a feeder for a sink",
        || with_job(fed_chain(), |job| job.feeder("sink").map(drop)),
        "RuntimeError::WrongKind",
        &["'sink'", "sink actor", "pieces: fed"],
    );
    c.case(
        "a feeder for a counted source",
        || with_job(fed_chain(), |job| job.feeder("count").map(drop)),
        "RuntimeError::WrongKind",
        &["'count'", "source", "pieces: fed"],
    );
    c.case(
        "a feeder for a compute actor",
        || with_job(fed_chain(), |job| job.feeder("f").map(drop)),
        "RuntimeError::WrongKind",
        &["'f'", "compute"],
    );
    c.case(
        "a feeder taken twice",
        || {
            with_job(fed_chain(), |job| {
                let first = job.feeder("src")?;
                let second = job.feeder("src").map(drop);
                drop(first);
                second
            })
        },
        "RuntimeError::AlreadyTaken",
        &["feeder", "'src'"],
    );
    c.case(
        "a push of 3 bytes into an 8-byte register",
        || with_job(fed_chain(), |job| job.feeder("src")?.push(&[1, 2, 3])),
        "RuntimeError::FeedSize",
        &["'src'", "3 bytes", "holds 8"],
    );
    c.case(
        "an empty push",
        || with_job(fed_chain(), |job| job.feeder("src")?.push(&[])),
        "RuntimeError::FeedSize",
        &["'src'", "0 bytes"],
    );
    c.case(
        "a push after close",
        || {
            with_job(fed_chain(), |job| {
                let mut feeder = job.feeder("src")?;
                feeder.close()?;
                feeder.push(&[0; 8])
            })
        },
        "RuntimeError::FeedClosed",
        &["'src'", "closed"],
    );
    c.case(
        "a feeder for an actor of a node this job does not run",
        || {
            let mut b = PlanBuilder::new();
            let d0 = b.device(0, DeviceKind::Cpu, 0);
            let d1 = b.device(1, DeviceKind::Cpu, 0);
            let s0 = b.stream(d0, StreamKind::Compute);
            let s1 = b.stream(d1, StreamKind::Compute);
            let src = b.actor("remote_src", s1, ActorKind::Source { pieces: SourcePieces::Fed });
            let x = b.regst("x", src, 8, 1);
            let sink = b.actor("remote_sink", s1, ActorKind::Sink);
            b.consume(sink, x);
            let local = b.actor("local", s0, ActorKind::Source { pieces: SourcePieces::Count(1) });
            let y = b.regst("y", local, 8, 1);
            let local_sink = b.actor("local_sink", s0, ActorKind::Sink);
            b.consume(local_sink, y);
            let plan = b.build().expect("the plan validates");
            let mut job = quick(plan).node(0).build()?;
            let feeder = job.feeder("remote_src").map(drop);
            drop(job.fetcher("local_sink"));
            let _ = job.wait();
            feeder
        },
        "RuntimeError::NotLocal",
        &["'remote_src'", "node 1"],
    );

    // Typed feeds of a compiled step.
    let plan = compiled().plan;
    let typed = |value: HostArray, name: &'static str| {
        with_job(plan.clone(), move |job| {
            let mut feeds = job.graph_feeds()?;
            feeds.push(name, &value)
        })
    };
    c.case(
        "a typed feed for an unknown input",
        || typed(HostArray::f32([2, 3], vec![0.0; 6]).expect("value"), "y"),
        "RuntimeError::UnknownName",
        &["input named 'y'", "did you mean 'x'"],
    );
    c.case(
        "a typed feed of the wrong shape",
        || typed(HostArray::f32([3, 2], vec![0.0; 6]).expect("value"), "x"),
        "RuntimeError::Feed",
        &["input 'x'", "f32[3, 2]", "f32[2, 3]"],
    );
    c.case(
        "a typed feed of the wrong dtype",
        || typed(HostArray::f64([2, 3], vec![0.0; 6]).expect("value"), "x"),
        "RuntimeError::Feed",
        &["input 'x'", "f64[2, 3]", "f32[2, 3]"],
    );
    c.case(
        "a typed feed of a scalar",
        || typed(HostArray::f32([], vec![0.0]).expect("value"), "x"),
        "RuntimeError::Feed",
        &["input 'x'", "f32[]"],
    );
    c.case(
        "typed feeds after a feeder of their source was taken",
        || {
            with_job(plan.clone(), |job| {
                let feeder = job.feeder("input:x")?;
                let feeds = job.graph_feeds().map(drop);
                drop(feeder);
                feeds
            })
        },
        "RuntimeError::AlreadyTaken",
        &["'input:x'"],
    );
    c.case(
        "a typed push after close",
        || {
            with_job(plan.clone(), |job| {
                let mut feeds = job.graph_feeds()?;
                feeds.close()?;
                feeds.push("x", &HostArray::f32([2, 3], vec![0.0; 6]).expect("value"))
            })
        },
        "RuntimeError::FeedClosed",
        &["'input:x'", "closed"],
    );
    c.case(
        "typed feeds of a plan built by hand (no signature)",
        || {
            with_job(fed_chain(), |job| {
                let mut feeds = job.graph_feeds()?;
                feeds.push("src", &HostArray::f32([2], vec![0.0; 2]).expect("value"))
            })
        },
        "RuntimeError::UnknownName",
        &["'src'"],
    );
    c.finish();
}
