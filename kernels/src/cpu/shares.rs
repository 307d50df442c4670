//! Contiguous shares of an index range over a kernel's threads.

use std::ops::Range;

/// Runs `work` on `0..len` split into `min(threads, len)` contiguous shares: the first on
/// this thread (the stream's, which would otherwise sleep while the pool works, and a pool
/// thread fewer to wake), the others as rayon tasks; the whole range on this thread when
/// that is one share. Each index lies in exactly one share, so work that writes only its
/// own indices gives the same result on any thread count.
pub(crate) fn in_shares(threads: usize, len: usize, work: impl Fn(Range<usize>) + Sync) {
    let shares = threads.min(len);
    if shares <= 1 {
        work(0..len);
        return;
    }
    let share = |k: usize| k * len / shares..(k + 1) * len / shares;
    rayon::in_place_scope(|scope| {
        let work = &work;
        for k in 1..shares {
            scope.spawn(move |_| work(share(k)));
        }
        work(share(0));
    });
}
