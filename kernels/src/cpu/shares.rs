//! Contiguous shares of an index range over a kernel's threads.

use std::ops::Range;

/// Runs `work` on `0..len` split into `min(threads, len)` contiguous shares, on this
/// (stream) thread and its helpers ([`team`](super::team): the stream thread claims shares
/// too), or on the whole range on this thread when that is one share. Each index lies in
/// exactly one share, so work that writes only its own indices gives the same result on
/// any thread count.
pub(crate) fn in_shares(threads: usize, len: usize, work: impl Fn(Range<usize>) + Sync) {
    let shares = threads.min(len);
    if shares <= 1 {
        work(0..len);
        return;
    }
    super::team::for_each_share(threads, shares, &|share| {
        work(share_start(share, len, shares)..share_start(share + 1, len, shares));
    });
}

/// The first index of share `share` of `len` indices cut into `shares` contiguous shares.
pub(crate) fn share_start(share: usize, len: usize, shares: usize) -> usize {
    share * len / shares
}

/// Elements below which a row-wise kernel stays on one thread whatever the device's thread
/// count: handing out shares to spinning helpers ([`team`](super::team)) costs a few
/// microseconds, which a share must outweigh; 2^15 f32 of layer norm are half the 2^16
/// that took 45 µs on one AVX-512 core. (Under rayon, which woke its pool for each kernel,
/// this was 2^17: two shares of 2^16 took 84 µs against 45 on one thread.) The character GPT's step on two
/// threads went from 9.37 / 9.69 / 9.49 to 8.55 / 9.46 / 8.67 ms with 2^15 instead of 2^17
/// (`bench_gpt 30 2`, alternating; its layer norms and their gradients are 2^16).
pub(crate) const ROWS_PARALLEL_MIN_ELEMENTS: usize = 1 << 15;

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
/// the slice of `out` holding `rows`. Up to `threads` contiguous shares of rows, on this
/// thread and its helpers ([`team`](super::team)), when `out` has
/// [`ROWS_PARALLEL_MIN_ELEMENTS`] elements or more; else (or for an `out` that is not whole
/// rows) one call on this thread. Every row lies in one share, so a kernel that computes
/// each row of `out` from that row's inputs alone gives the same bits on any thread count.
/// A share may run on a helper thread: `work` must enter
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
    let out = DisjointParts::new(out);
    super::team::for_each_share(threads, shares, &|share| {
        let (first, end) = (share_start(share, rows, shares), share_start(share + 1, rows, shares));
        // SAFETY: shares are disjoint ranges of whole rows.
        work(first..end, unsafe { out.part(first * row_len..end * row_len) });
    });
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

/// A mutable slice whose disjoint ranges the shares of one kernel write, each share its
/// own: what `split_at_mut` gives one thread, for shares that run on several.
pub(crate) struct DisjointParts<'a, T> {
    start: *mut T,
    len: usize,
    slice: std::marker::PhantomData<&'a mut [T]>,
}

// SAFETY: the parts handed out are disjoint (the caller of `part` promises it), so sharing
// the wrapper between threads shares no element; `T: Send` moves the elements' writes.
unsafe impl<T: Send> Sync for DisjointParts<'_, T> {}
// SAFETY: as for `Sync`.
unsafe impl<T: Send> Send for DisjointParts<'_, T> {}

impl<'a, T> DisjointParts<'a, T> {
    /// `slice`, borrowed mutably for as long as the parts live.
    pub(crate) fn new(slice: &'a mut [T]) -> Self {
        Self { start: slice.as_mut_ptr(), len: slice.len(), slice: std::marker::PhantomData }
    }

    /// Elements `range` (within the slice: checked).
    ///
    /// # Safety
    /// No other part given out and still in use overlaps `range`.
    #[allow(clippy::mut_from_ref)] // the point: disjoint parts through a shared wrapper
    pub(crate) unsafe fn part(&self, range: Range<usize>) -> &mut [T] {
        assert!(range.start <= range.end && range.end <= self.len, "part {range:?} of {} elements", self.len);
        // SAFETY: in bounds (checked); not aliased, by the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.start.add(range.start), range.end - range.start) }
    }
}
