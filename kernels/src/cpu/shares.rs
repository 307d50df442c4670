//! Contiguous shares of an index range over a kernel's threads.

use std::ops::Range;

/// Runs `work` on `0..len` split into `min(threads, len)` contiguous shares, one per rayon
/// task, or on the whole range on this thread when that is one share. Each index lies in
/// exactly one share, so work that writes only its own indices gives the same result on
/// any thread count.
///
/// All shares go to the pool while this (stream) thread waits: running the first share here
/// instead measured 7–15 % slower on the MLP at two threads (three threads then contend for
/// two cores while rayon's idle worker looks for work).
pub(crate) fn in_shares(threads: usize, len: usize, work: impl Fn(Range<usize>) + Sync) {
    let shares = threads.min(len);
    if shares <= 1 {
        work(0..len);
        return;
    }
    rayon::scope(|scope| {
        let work = &work;
        for share in 0..shares {
            scope.spawn(move |_| work(share * len / shares..(share + 1) * len / shares));
        }
    });
}
