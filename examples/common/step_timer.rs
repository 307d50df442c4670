//! Timing of training-step benchmarks: seconds per step read off the fetched losses.

use regflow::prelude::Fetcher;
use std::time::Instant;

/// Receives `warmup + steps` f32 losses from `losses` and returns the seconds per step of
/// the last `steps` (from the moment the last warm-up loss arrived) and the last loss.
pub(crate) fn seconds_per_step(
    losses: &Fetcher,
    warmup: usize,
    steps: usize,
) -> Result<(f64, f32), Box<dyn std::error::Error>> {
    let mut start = Instant::now();
    let mut last = 0.0f32;
    for step in 0..warmup + steps {
        if step == warmup {
            start = Instant::now();
        }
        let piece = losses.recv().ok_or("the job ended early")?;
        last = f32::from_le_bytes(piece.bytes().try_into()?);
    }
    Ok((start.elapsed().as_secs_f64() / steps as f64, last))
}
