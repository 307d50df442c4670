//! regflow patch: a left-hand operand packed once and reused by later calls
//! (see `REGFLOW.md`, section 4).
//!
//! A weight multiplied by every micro-batch of a step (gradient accumulation, pipeline
//! stages) is the same matrix for several calls in a row, and `gemm_basic_generic` packs it
//! into panels on every call. A caller that knows when its left-hand operand's values
//! change lends a [`PackedLhs`] for the call with [`with_packed_lhs`], naming the operand's
//! current contents by a `stamp`: the first call with a stamp packs every panel into the
//! cache's buffer (the same panels, in the same order, as it would pack into its scratch),
//! and later calls with the same stamp, operand address, sizes, strides and blocking use
//! those panels instead of packing again. Packing only moves values, so results are
//! bitwise the same either way.
//!
//! Only single-threaded calls (`Parallelism::None`) use the cache; other calls, and calls
//! that take another path than the packed one (small products, matrix-vector products),
//! leave it untouched.

use core::any::TypeId;
use core::cell::Cell;

/// Bytes the cache's panels are aligned to (as gemm's own packing buffers).
const ALIGN: usize = 128;

/// What a cache's panels were packed from, and with which blocking: a call finds its
/// panels only if every field matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Key {
    pub(crate) element: TypeId,
    pub(crate) lhs: usize,
    pub(crate) m: usize,
    pub(crate) k: usize,
    pub(crate) lhs_cs: isize,
    pub(crate) lhs_rs: isize,
    pub(crate) conj: bool,
    pub(crate) kc: usize,
    pub(crate) mc: usize,
    pub(crate) mr: usize,
    pub(crate) n: usize,
    pub(crate) prepacked: bool,
    pub(crate) stamp: u64,
}

/// A left-hand operand's panels, kept between calls. See the module documentation.
#[derive(Default)]
pub struct PackedLhs {
    /// Bytes of the panels, plus room to align their start.
    buffer: Vec<u8>,
    /// What the buffer holds; `None` until a call has packed all of it.
    key: Option<Key>,
    reused: u64,
    packed: u64,
}

impl core::fmt::Debug for PackedLhs {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("PackedLhs")
            .field("bytes", &self.buffer.len())
            .field("reused", &self.reused)
            .field("packed", &self.packed)
            .finish()
    }
}

impl PackedLhs {
    /// An empty cache: the first call packs.
    pub fn new() -> Self {
        Self::default()
    }

    /// Calls that found their panels here.
    pub fn reused(&self) -> u64 {
        self.reused
    }

    /// Calls that packed their panels here.
    pub fn packed(&self) -> u64 {
        self.packed
    }

    /// Bytes the cache holds.
    pub fn bytes(&self) -> usize {
        self.buffer.len()
    }

    /// Forgets the panels (the next call packs again), keeping the buffer.
    pub fn clear(&mut self) {
        self.key = None;
    }
}

/// The panels a call uses: where they start, and whether they are packed already.
pub(crate) struct Panels {
    pub(crate) base: *mut u8,
    pub(crate) ready: bool,
    cache: *mut PackedLhs,
    key: Key,
}

impl Panels {
    /// Records that the call has packed every panel (it found none ready).
    pub(crate) fn commit(self) {
        // SAFETY: the cache outlives the call (`with_packed_lhs` holds it borrowed).
        let cache = unsafe { &mut *self.cache };
        if self.ready {
            cache.reused += 1;
        } else {
            cache.key = Some(self.key);
            cache.packed += 1;
        }
    }
}

std::thread_local! {
    /// The cache lent to this thread's calls, and the stamp of the operand's contents.
    static LENT: Cell<Option<(*mut PackedLhs, u64)>> = const { Cell::new(None) };
}

/// Runs `f` with `cache` lent to this thread's single-threaded products, for a left-hand
/// operand whose contents `stamp` names: a call whose operand, sizes, strides, blocking
/// and stamp match what the cache holds uses its panels; any other packs its panels into
/// the cache, replacing what it held.
///
/// The caller promises that the values of every left-hand operand multiplied in `f` with
/// a stamp a cache has seen are those they were when it was packed with that stamp. One
/// operand per cache: a second product in `f` with another operand repacks.
pub fn with_packed_lhs<R>(cache: &mut PackedLhs, stamp: u64, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<(*mut PackedLhs, u64)>);
    impl Drop for Restore {
        fn drop(&mut self) {
            LENT.with(|lent| lent.set(self.0));
        }
    }
    let _restore = Restore(LENT.with(|lent| lent.replace(Some((cache as *mut PackedLhs, stamp)))));
    f()
}

/// The panels for a call of `key` (its stamp filled in here) needing `bytes`, if a cache
/// is lent to this thread: ready if the cache holds them, else room to pack them into.
pub(crate) fn panels(mut key: Key, bytes: usize) -> Option<Panels> {
    let (cache, stamp) = LENT.with(|lent| lent.get())?;
    key.stamp = stamp;
    // SAFETY: lent by `with_packed_lhs`, which holds the cache borrowed for the call.
    let held = unsafe { &mut *cache };
    let ready = held.key == Some(key);
    if !ready {
        held.key = None;
        if held.buffer.len() < bytes + ALIGN {
            held.buffer = vec![0u8; bytes + ALIGN];
        }
    }
    let start = held.buffer.as_mut_ptr();
    let base = start.wrapping_add(start.align_offset(ALIGN));
    Some(Panels { base, ready, cache, key })
}
