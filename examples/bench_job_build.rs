//! Times building a job from a big plan: a chain of copy actors on one cpu stream,
//! `source -> copy × (actors - 2) -> sink`, so the time shows how job build scales with
//! the plan's size (it should be linear). Prints plan validation alone, then the whole
//! `Job::builder(plan).build()` (which validates again), and the run of one piece.
//!
//! ```text
//! cargo run --release --example bench_job_build -- [actors ...]
//! ```
//!
//! `actors` defaults to 12500, 25000 and 50000.

use regflow::prelude::*;
use std::time::Instant;

/// The chain, built without validating it (the builder's `build` would validate it, which
/// is timed apart).
fn chain(actors: usize) -> Plan {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let stream = b.stream(cpu, StreamKind::Compute);
    let mut prev = b.actor("a0", stream, ActorKind::Source { pieces: SourcePieces::Count(1) });
    for i in 1..actors {
        let regst = b.regst(&format!("r{i}"), prev, 64, 1);
        let kind = if i + 1 == actors { ActorKind::Sink } else { ActorKind::Compute { kernel: KernelConf::Copy } };
        let next = b.actor(&format!("a{i}"), stream, kind);
        b.consume(next, regst);
        prev = next;
    }
    std::mem::replace(b.plan_mut(), Plan::empty())
}

fn main() -> Result<(), regflow::Report> {
    let sizes: Vec<usize> = match std::env::args().skip(1).map(|a| a.parse()).collect::<Result<Vec<_>, _>>() {
        Ok(sizes) if !sizes.is_empty() => sizes,
        Ok(_) => vec![12_500, 25_000, 50_000],
        Err(e) => return Err(format!("actors must be numbers: {e}").into()),
    };
    println!("{:>8} {:>12} {:>12} {:>12}", "actors", "validate", "job build", "run 1 piece");
    for actors in sizes {
        if actors < 2 {
            return Err("a chain needs at least 2 actors".into());
        }
        let plan = chain(actors);
        let start = Instant::now();
        plan.validate()?;
        let validate = start.elapsed();
        let start = Instant::now();
        let mut job = Job::builder(plan).without_watchdog().build()?;
        let build = start.elapsed();
        let start = Instant::now();
        let fetcher = job.fetcher(&format!("a{}", actors - 1))?;
        while fetcher.recv().is_some() {}
        drop(fetcher);
        job.wait()?;
        let run = start.elapsed();
        println!("{actors:>8} {validate:>12.2?} {build:>12.2?} {run:>12.2?}");
    }
    Ok(())
}
