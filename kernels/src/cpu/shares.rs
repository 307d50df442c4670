//! Contiguous shares of an index range over a kernel's threads.

use std::ops::Range;

/// Runs `work` on `0..len` split into `min(threads, len)` contiguous shares, one per rayon
/// task, or on the whole range on this thread when that is one share. Each index lies in
/// exactly one share, so work that writes only its own indices gives the same result on
/// any thread count.
///
/// All shares go to the pool while this (stream) thread waits: running the first share here
/// instead measured 7–15 % slower on the MLP at two threads (three threads then contend for
/// two cores while rayon's idle worker looks for work). `rayon::join`, called from outside
/// the pool, runs both of its halves there too.
pub(crate) fn in_shares(threads: usize, len: usize, work: impl Fn(Range<usize>) + Sync) {
    let shares = threads.min(len);
    if shares <= 1 {
        work(0..len);
        return;
    }
    // The row split with rows of no elements: one halving over `rayon::join` for both.
    join_row_shares::<()>(0..shares, (len, 0), shares, &mut [], &|range, _| work(range));
}

/// The first index of share `share` of `len` indices cut into `shares` contiguous shares.
fn share_start(share: usize, len: usize, shares: usize) -> usize {
    share * len / shares
}

/// Elements below which a row-wise kernel stays on one thread whatever the device's thread
/// count: waking the pool's threads costs 10–60 µs on a loaded VM, which a share must
/// outweigh. 2^16 f32 of layer norm take 45 µs on one AVX-512 core and took 84 µs in two
/// shares (the character GPT's `[1024, 64]` rows: layer norm 0.38–0.61 → 0.27–0.36 ms per
/// step, its gradient 0.81–0.99 → 0.62–0.78, with this threshold raised from 2^16;
/// BENCHMARKS.md, issue 13, ninth session); 2^17 and more (GELU, masked softmax of the
/// same model at 2^18) still gain from a second core.
pub(crate) const ROWS_PARALLEL_MIN_ELEMENTS: usize = 1 << 17;

/// How many shares [`rows_in_shares`] cuts `len` elements of rows of `row_len` into.
pub(crate) fn row_shares(threads: usize, len: usize, row_len: usize) -> usize {
    let whole_rows = row_len > 0 && len.is_multiple_of(row_len);
    if whole_rows && len >= ROWS_PARALLEL_MIN_ELEMENTS {
        threads.min(len / row_len).max(1)
    } else {
        1
    }
}

/// Runs `work(rows, part)` over `out` cut into whole rows of `row_len` elements: `part` is
/// the slice of `out` holding `rows`. Up to `threads` contiguous shares of rows, each a rayon
/// task, when `out` has [`ROWS_PARALLEL_MIN_ELEMENTS`] elements or more; else (or for an
/// `out` that is not whole rows) one call on this thread. Every row lies in one share, so a
/// kernel that computes each row of `out` from that row's inputs alone gives the same bits
/// on any thread count. A task runs on a pool thread: `work` must enter
/// [`vectorized`](super::fast_math::vectorized) itself to run its loops at AVX2 width.
pub(crate) fn rows_in_shares<T: Send>(
    threads: usize,
    out: &mut [T],
    row_len: usize,
    work: impl Fn(Range<usize>, &mut [T]) + Sync,
) {
    let rows = out.len().checked_div(row_len).unwrap_or(0);
    let shares = row_shares(threads, out.len(), row_len);
    if shares <= 1 {
        work(0..rows, out);
        return;
    }
    join_row_shares(0..shares, (rows, row_len), shares, out, &work);
}

/// Runs `work` on each of the shares `of` of `rows` rows (of `row_len` elements) cut into
/// `shares`, with the part of `out` holding those rows, halving the shares over
/// `rayon::join`, whose tasks live on the stack: a firing allocates nothing
/// (`rayon::scope`'s `spawn` boxes every task).
fn join_row_shares<T: Send>(
    of: Range<usize>,
    (rows, row_len): (usize, usize),
    shares: usize,
    out: &mut [T],
    work: &(impl Fn(Range<usize>, &mut [T]) + Sync),
) {
    let start = share_start(of.start, rows, shares);
    if of.len() == 1 {
        work(start..share_start(of.end, rows, shares), out);
        return;
    }
    let mid = of.start + of.len() / 2;
    let (left, right) = out.split_at_mut((share_start(mid, rows, shares) - start) * row_len);
    rayon::join(
        || join_row_shares(of.start..mid, (rows, row_len), shares, left, work),
        || join_row_shares(mid..of.end, (rows, row_len), shares, right, work),
    );
}

/// The base pointers of a product's operands and output, shared by the threads that
/// compute disjoint parts of its output (batch elements, blocks of rows or columns).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Operands<T> {
    /// The left operand.
    pub a: *const T,
    /// The right operand.
    pub b: *const T,
    /// The output.
    pub out: *mut T,
}

// SAFETY: the pointers address tensors that outlive the scope the threads run in; the
// threads only read `a` and `b` and write disjoint output elements.
unsafe impl<T> Send for Operands<T> {}
// SAFETY: as for `Send`: shared, the pointers are only copied out.
unsafe impl<T> Sync for Operands<T> {}
