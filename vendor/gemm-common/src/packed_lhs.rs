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

/// A call's left-hand operand and the blocking it is packed with: with the element type
/// and the stamp, what a call must match to use the panels a cache holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Operand {
    pub(crate) lhs: usize,
    pub(crate) m: usize,
    pub(crate) k: usize,
    pub(crate) lhs_cs: isize,
    pub(crate) lhs_rs: isize,
    pub(crate) conj: bool,
    pub(crate) kc: usize,
    pub(crate) mc: usize,
    pub(crate) mr: usize,
    /// SIMD lanes (`N`): row chunks past one are cut to a multiple of it.
    pub(crate) lanes: usize,
    /// Whether the call packs the whole operand per depth block up front.
    pub(crate) prepacked: bool,
}

impl Operand {
    /// Panels per depth block, numbered as `gemm_basic_generic`'s loops visit them: by row
    /// chunk (`mc` rows, cut to a multiple of the lanes unless prepacked), then by `mr` rows.
    fn panels_per_depth(&self) -> usize {
        let (mut panels, mut row) = (0, 0);
        while row != self.m {
            let mut chunk = self.mc.min(self.m - row);
            if chunk > self.lanes && !self.prepacked {
                chunk = chunk / self.lanes * self.lanes;
            }
            panels += chunk.div_ceil(self.mr);
            row += chunk;
        }
        panels
    }
}

/// What a cache's panels were packed from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Key {
    operand: Operand,
    element: TypeId,
    stamp: u64,
}

/// A left-hand operand's panels, kept between calls. See the module documentation.
#[derive(Default)]
pub struct PackedLhs {
    /// Bytes of the panels, plus room to align their start.
    buffer: Vec<u8>,
    /// What the buffer holds; `None` until a call has packed all of it.
    key: Option<Key>,
}

impl core::fmt::Debug for PackedLhs {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("PackedLhs").field("bytes", &self.buffer.len()).field("key", &self.key).finish()
    }
}

impl PackedLhs {
    /// An empty cache: the first call packs.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes the cache holds (its panels, with the room to align them): 0 until a call
    /// packs into it.
    pub fn bytes(&self) -> usize {
        self.buffer.capacity()
    }
}

/// The panels a call uses: ready (packed by an earlier call), or room to pack them into.
pub(crate) struct Panels {
    base: *mut u8,
    /// Packed already: the call packs nothing.
    pub(crate) ready: bool,
    per_depth: usize,
    /// Bytes of one panel.
    panel_bytes: usize,
    cache: *mut PackedLhs,
    key: Key,
}

impl Panels {
    /// The first panel of depth block `block`, as elements of the operand's type.
    pub(crate) fn depth_block<T>(&self, block: usize) -> *mut T {
        self.base.wrapping_add(block * self.per_depth * self.panel_bytes) as *mut T
    }

    /// Records that the call has packed every panel (if it found none ready).
    pub(crate) fn commit(self) {
        if !self.ready {
            // SAFETY: the cache outlives the call (`with_packed_lhs` holds it borrowed).
            unsafe { (*self.cache).key = Some(self.key) };
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

/// The panels of a single-threaded call packing `operand` of `T` into panels of
/// `panel_elements`, if a cache is lent to this thread: ready if the cache holds them,
/// else room to pack them into. `None` for other calls.
pub(crate) fn lend<T: 'static>(operand: Operand, panel_elements: usize, single_threaded: bool) -> Option<Panels> {
    let (cache, stamp) = LENT.with(|lent| lent.get()).filter(|_| single_threaded)?;
    let key = Key { operand, element: TypeId::of::<T>(), stamp };
    let (per_depth, panel_bytes) = (operand.panels_per_depth(), panel_elements * core::mem::size_of::<T>());
    let bytes = operand.k.div_ceil(operand.kc) * per_depth * panel_bytes;
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
    Some(Panels { base, ready, per_depth, panel_bytes, cache, key })
}
