//! A 4-stage pipeline on the `sim` device: writes a Chrome-trace / Perfetto timeline that
//! shows the stages overlapping, and compares the run time with the ideal (m + p - 1)·t.
//!
//! ```text
//! cargo run --release --example pipeline_sim -- [pieces] [register_num] [trace.json]
//! ```
//! Open the JSON at <https://ui.perfetto.dev> or `chrome://tracing`.

use regflow::prelude::*;
use std::time::Duration;

const STAGES: usize = 4;
const STAGE_TIME: Duration = Duration::from_millis(1);

fn pipeline(pieces: u64, register_num: u32) -> Result<Plan, PlanError> {
    let mut b = PlanBuilder::new();
    let host = b.device(0, DeviceKind::Cpu, 0);
    let io = b.stream(host, StreamKind::Compute);
    let src = b.actor("src", io, ActorKind::Source { pieces: SourcePieces::Count(pieces) });
    let mut prev = b.regst("src.out", src, 64, register_num);
    for stage in 0..STAGES {
        // One sim device per stage, as a pipeline puts each stage on its own accelerator.
        let device = b.device(0, DeviceKind::Sim, stage as u16);
        let stream = b.stream(device, StreamKind::Compute);
        let actor = b.actor(&format!("stage{stage}"), stream, ActorKind::Compute { kernel: KernelConf::Copy });
        b.sim_nanos(actor, STAGE_TIME.as_nanos() as u64);
        b.consume(actor, prev);
        prev = b.regst(&format!("stage{stage}.out"), actor, 64, register_num);
    }
    let sink = b.actor("sink", io, ActorKind::Sink);
    b.consume(sink, prev);
    b.build()
}

fn main() -> Result<(), regflow::Report> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let pieces: u64 = args.first().map(|s| s.parse()).transpose()?.unwrap_or(8);
    let register_num: u32 = args.get(1).map(|s| s.parse()).transpose()?.unwrap_or(2);
    let trace = args.get(2).cloned().unwrap_or_else(|| "pipeline_sim.trace.json".into());

    let plan = pipeline(pieces, register_num)?;
    print!("{plan}");
    let mut job = Job::builder(plan).trace(&trace).build()?;
    println!("memory:\n{}", job.memory_report());
    let fetcher = job.fetcher("sink")?;
    let delivered = std::iter::from_fn(|| fetcher.recv()).count();
    let report = job.wait()?;

    let ideal = STAGE_TIME * (pieces as u32 + STAGES as u32 - 1);
    println!(
        "{delivered} pieces through {STAGES} stages of {STAGE_TIME:?} with {register_num} register(s) per edge: \
         {:.2?} (ideal (m+p-1)·t = {ideal:?}, ratio {:.3})",
        report.elapsed,
        report.elapsed.as_secs_f64() / ideal.as_secs_f64()
    );
    println!("timeline written to {trace}: open it at https://ui.perfetto.dev");
    Ok(())
}
