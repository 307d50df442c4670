//! Timing of training-step benchmarks: seconds per step read off the fetched losses.

use regflow::graph::SplitMix64;
use regflow::prelude::{Fetcher, Job, RuntimeError};
use std::time::Instant;

/// Receives `warmup + steps` f32 losses from `losses` and returns the seconds per step of
/// the last `steps` (from the moment the last warm-up loss arrived) and the last loss.
/// With `progress`, says on stderr when each loss arrived (for slow steps, so a run cut
/// short still tells how far it got).
pub(crate) fn seconds_per_step(
    losses: &Fetcher,
    warmup: usize,
    steps: usize,
    progress: bool,
) -> Result<(f64, f32), Box<dyn std::error::Error>> {
    let begin = Instant::now();
    let mut start = begin;
    let mut last = 0.0f32;
    for step in 0..warmup + steps {
        if step == warmup {
            start = Instant::now();
        }
        let piece = losses.recv().ok_or("the job ended early")?;
        last = f32::from_le_bytes(piece.bytes().try_into()?);
        if progress {
            eprintln!("  step {step} done at {:.3} s (loss {last:.4})", begin.elapsed().as_secs_f64());
        }
    }
    Ok((start.elapsed().as_secs_f64() / steps as f64, last))
}

/// Feeds a GPT step job (inputs `ids` and `targets`; the mask is the graph's
/// `causal_mask`, made on the device) `warmup + steps` batches
/// of `batch × t` random token ids below `vocab`, from a thread, and times the last `steps`
/// by the losses fetched from `fetch`: seconds per step and the last loss (`progress` as
/// for [`seconds_per_step`]).
#[allow(dead_code)] // bench_mlp times an MLP
pub(crate) fn time_gpt_steps(
    job: &mut Job,
    fetch: &str,
    (batch, t, vocab): (usize, usize, usize),
    warmup: usize,
    steps: usize,
    progress: bool,
) -> Result<(f64, f32), Box<dyn std::error::Error>> {
    let (mut feed_ids, mut feed_targets) = (job.feeder("input:ids")?, job.feeder("input:targets")?);
    let losses = job.fetcher(fetch)?;
    let mut rng = SplitMix64::new(0);
    let mut draw =
        || -> Vec<u8> { (0..batch * t).flat_map(|_| ((rng.next_u64() % vocab as u64) as i64).to_le_bytes()).collect() };
    let batches: Vec<(Vec<u8>, Vec<u8>)> = (0..warmup + steps).map(|_| (draw(), draw())).collect();
    let pusher = std::thread::spawn(move || -> Result<(), RuntimeError> {
        for (step_ids, step_targets) in &batches {
            feed_ids.push(step_ids)?;
            feed_targets.push(step_targets)?;
        }
        Ok(())
    });
    let timed = seconds_per_step(&losses, warmup, steps, progress);
    pusher.join().map_err(|_| "feeder panicked")??;
    timed
}
