//! Where a product split over two threads is cut: at the share of the work the stream
//! thread's measured speed earns it, not at the middle.
//!
//! Why: on the 2-vCPU machines this project runs on, one vCPU runs slower than the other
//! by 7–33 % for minutes at a time (its neighbours on the host), and a product cut in two
//! equal halves waits for the slower one. Counted over the digits MLP's two-thread steps,
//! the stream thread waited for its helper 0.05–0.41 s, or the helper idled as long, per
//! 1.5 s of products (BENCHMARKS.md, issue 13, thirty-eighth session). Finer shares that
//! the faster thread claims more of cost gemm 3–6 % more work on one thread (each block
//! packs its shared operand again), so instead each two-thread product is cut once, where
//! the two threads' rates on the products before it say they finish together.
//!
//! The cut changes no bit: gemm blocks the depth by its length alone, so an output
//! element is the same sum in the same order in a block of any width
//! (`tests/matmul_threads.rs` checks cuts pinned at both ends of the range). The rates are
//! this stream thread's own (a thread-local): each stream thread has its own helper.

use std::cell::Cell;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// The stream thread's share of a two-thread product is kept within these bounds, so that
/// one slow product (a page fault, a preempted thread) cannot starve either thread.
const SHARE_RANGE: (f32, f32) = (0.3, 0.7);

/// How far each product's measured rates move the share (an exponential average): about
/// the last eight products count.
const LEARNING_RATE: f32 = 0.125;

/// Cuts fall on multiples of this many rows or columns, so that blocks stay whole register
/// tiles of gemm's AVX2 kernels (16 f32 rows); the end of the range is the only partial one.
const CUT_ALIGN: usize = 16;

thread_local! {
    /// The calling stream thread's share of its two-thread products.
    static SHARE: Cell<f32> = const { Cell::new(0.5) };
}

/// A share pinned for every thread (its bits; 0: none), for tests and benchmarks.
static PINNED: AtomicU32 = AtomicU32::new(0);

/// Pins the stream thread's share of every two-thread product to `share` (clamped to the
/// bounds the learned share keeps to), process-wide, or lets each stream thread learn its
/// own again (`None`). For tests, which pin both ends to show that the cut changes no
/// bit, and for benchmarks that time the learned cut against the middle.
pub fn pin_stream_thread_share(share: Option<f32>) {
    let bits = share.map_or(0, |s| clamp(s).to_bits());
    PINNED.store(bits, Ordering::Relaxed);
}

fn clamp(share: f32) -> f32 {
    if share.is_nan() {
        0.5
    } else {
        share.clamp(SHARE_RANGE.0, SHARE_RANGE.1)
    }
}

/// The share the calling stream thread gives itself now.
pub(crate) fn stream_thread_share() -> f32 {
    match PINNED.load(Ordering::Relaxed) {
        0 => SHARE.with(Cell::get),
        bits => f32::from_bits(bits),
    }
}

/// Where `0..len` is cut for a stream thread taking `share` of it: a multiple of
/// [`CUT_ALIGN`], with at least one such tile on each side; `None` when `len` is too short
/// for two.
pub(crate) fn cut(len: usize, share: f32) -> Option<usize> {
    let tiles = len / CUT_ALIGN;
    if tiles < 2 {
        return None;
    }
    let mine = ((len as f32 * share) / CUT_ALIGN as f32).round() as usize;
    Some(mine.clamp(1, tiles - 1) * CUT_ALIGN)
}

/// Moves the calling stream thread's share towards the one under which both threads would
/// have finished together: the stream thread did `mine` units of work in `my_time`, its
/// helper `theirs` in `their_time`. Ignored when either did nothing or took no time.
pub(crate) fn learn(mine: usize, my_time: Duration, theirs: usize, their_time: Duration) {
    let (my_secs, their_secs) = (my_time.as_secs_f32(), their_time.as_secs_f32());
    if mine == 0 || theirs == 0 || my_secs <= 0.0 || their_secs <= 0.0 {
        return;
    }
    let (my_rate, their_rate) = (mine as f32 / my_secs, theirs as f32 / their_secs);
    let balanced = my_rate / (my_rate + their_rate);
    SHARE.with(|share| {
        let now = share.get();
        share.set(clamp(now + LEARNING_RATE * (balanced - now)));
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_fall_on_whole_tiles_with_one_at_least_on_each_side() {
        assert_eq!(cut(1024, 0.5), Some(512));
        assert_eq!(cut(1024, 0.6), Some(608));
        assert_eq!(cut(784, 0.5), Some(400));
        assert_eq!(cut(250, 0.5), Some(128));
        // The nearest tile, and never all of it to one side.
        assert_eq!(cut(40, 0.3), Some(16));
        assert_eq!(cut(40, 0.7), Some(16));
        assert_eq!(cut(31, 0.5), None);
        assert_eq!(cut(0, 0.5), None);
    }

    #[test]
    fn the_share_follows_the_threads_rates_within_its_bounds() {
        let ms = Duration::from_millis;
        SHARE.with(|s| s.set(0.5));
        // Equal work in equal time: balanced already.
        learn(100, ms(10), 100, ms(10));
        assert_eq!(SHARE.with(Cell::get), 0.5);
        // The helper twice as slow: the stream thread's share grows towards 2/3, step by
        // step, and stays below the upper bound however long it goes on.
        learn(100, ms(10), 100, ms(20));
        let after_one = SHARE.with(Cell::get);
        assert!((after_one - (0.5 + LEARNING_RATE * (2.0 / 3.0 - 0.5))).abs() < 1e-6, "{after_one}");
        for _ in 0..200 {
            learn(100, ms(1), 100, ms(100));
        }
        assert_eq!(SHARE.with(Cell::get), SHARE_RANGE.1);
        // Nothing measured, nothing learned.
        learn(0, ms(1), 100, ms(1));
        learn(100, Duration::ZERO, 100, ms(1));
        assert_eq!(SHARE.with(Cell::get), SHARE_RANGE.1);
        SHARE.with(|s| s.set(0.5));
    }

    #[test]
    fn a_pinned_share_is_clamped_and_overrides_the_learned_one() {
        pin_stream_thread_share(Some(0.9));
        assert_eq!(stream_thread_share(), SHARE_RANGE.1);
        pin_stream_thread_share(Some(f32::NAN));
        assert_eq!(stream_thread_share(), 0.5);
        pin_stream_thread_share(None);
        assert_eq!(stream_thread_share(), SHARE.with(Cell::get));
    }
}
