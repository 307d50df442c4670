//! regflow patch (not in upstream gemm-common 0.19.0): the two buffers
//! `gemm::gemm_basic_generic` allocated on every call — the packed-operand buffer and the
//! "left-hand block packed" flags — are taken from a per-thread pool and given back after
//! the call, so a thread that keeps multiplying matrices of sizes it has seen allocates
//! nothing. A buffer only grows. A call nested on the same thread (rayon work stealing)
//! finds the pool empty and allocates its own, as upstream does; so does a call without
//! `std`. The arithmetic is untouched.

use alloc::vec::Vec;
use dyn_stack::{MemBuffer, StackReq};

#[cfg(feature = "std")]
std::thread_local! {
    /// The packing buffer, with the alignment it was allocated with.
    static PACKING: core::cell::RefCell<Option<(MemBuffer, usize)>> = const { core::cell::RefCell::new(None) };
    static FLAGS: core::cell::RefCell<Option<Vec<bool>>> = const { core::cell::RefCell::new(None) };
}

/// A buffer for `req`: this thread's pooled one if it is large and aligned enough.
pub(crate) fn take_buffer(req: StackReq) -> MemBuffer {
    #[cfg(feature = "std")]
    let pooled = PACKING.try_with(|slot| slot.borrow_mut().take()).ok().flatten();
    #[cfg(not(feature = "std"))]
    let pooled: Option<(MemBuffer, usize)> = None;
    match pooled {
        Some((buffer, align)) if buffer.len() >= req.size_bytes() && align >= req.align_bytes() => buffer,
        // Grow to what both the old buffer and this call need, so that two alternating
        // sizes settle on one buffer, and by half as much again: regflow cuts a two-thread
        // product where the threads' speeds put it, anywhere from 0.3 to 0.7 of its
        // length, so a thread's blocks wander by up to 1.4 times the middle's, and would
        // otherwise grow the buffer a step at a time long after the first products.
        pooled => {
            let size = pooled.map_or(0, |(buffer, _)| buffer.len()).max(req.size_bytes());
            let size = size.saturating_add(size / 2);
            MemBuffer::new(StackReq::new_aligned::<u8>(size, req.align_bytes()))
        }
    }
}

/// Gives back a buffer from [`take_buffer`] for `req`; the pool keeps the larger one.
pub(crate) fn give_buffer(buffer: MemBuffer, req: StackReq) {
    #[cfg(feature = "std")]
    let _ = PACKING.try_with(|slot| {
        let mut slot = slot.borrow_mut();
        if slot.as_ref().map_or(true, |(pooled, _)| pooled.len() < buffer.len()) {
            *slot = Some((buffer, req.align_bytes()));
        }
    });
    #[cfg(not(feature = "std"))]
    let _ = (buffer, req);
}

/// `len` flags, all `false`.
pub(crate) fn take_flags(len: usize) -> Vec<bool> {
    #[cfg(feature = "std")]
    let pooled = FLAGS.try_with(|slot| slot.borrow_mut().take()).ok().flatten();
    #[cfg(not(feature = "std"))]
    let pooled: Option<Vec<bool>> = None;
    let mut flags = pooled.unwrap_or_default();
    flags.clear();
    flags.resize(len, false);
    flags
}

/// Gives back flags from [`take_flags`]; the pool keeps the larger allocation.
pub(crate) fn give_flags(flags: Vec<bool>) {
    #[cfg(feature = "std")]
    let _ = FLAGS.try_with(|slot| {
        let mut slot = slot.borrow_mut();
        if slot.as_ref().map_or(true, |pooled| pooled.capacity() < flags.capacity()) {
            *slot = Some(flags);
        }
    });
    #[cfg(not(feature = "std"))]
    let _ = flags;
}

/// regflow patch: flags from [`take_flags`] that go back to this thread's pool when dropped,
/// on every way out of the function that holds them (a helper thread's share of a
/// multi-threaded product returns early when its jobs are done).
pub(crate) struct PooledFlags(pub(crate) Vec<bool>);

impl PooledFlags {
    /// `len` flags, all `false`, from this thread's pool.
    pub(crate) fn take(len: usize) -> Self {
        Self(take_flags(len))
    }
}

impl Drop for PooledFlags {
    fn drop(&mut self) {
        give_flags(core::mem::take(&mut self.0));
    }
}
