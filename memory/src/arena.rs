//! Aligned host buffers, arenas and the views that register slots are made of.

use crate::{ArenaAllocator, ArenaMemory, HostAllocator, MemoryError, MemoryKind, ALIGNMENT};
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

/// A zeroed, [`ALIGNMENT`]-aligned block of host memory, freed on drop.
#[derive(Debug)]
pub struct HostBuffer {
    /// The first aligned byte.
    ptr: NonNull<u8>,
    len: usize,
    /// The allocation itself (`len + ALIGNMENT` bytes, 16-byte aligned), for `dealloc`.
    raw: NonNull<u8>,
}

// SAFETY: the buffer owns its memory exclusively; sharing it across threads is sound because
// all access goes through `BufferView`, whose users uphold the register protocol.
unsafe impl Send for HostBuffer {}
// SAFETY: see above; `&HostBuffer` only hands out raw views.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Allocates `len` zeroed bytes aligned to [`ALIGNMENT`]. A length of 0 allocates nothing.
    pub fn zeroed(label: &str, len: usize) -> Result<Self, MemoryError> {
        if len == 0 {
            // A well-aligned dangling pointer: never dereferenced for a non-empty slice.
            let ptr = NonNull::new(ALIGNMENT as *mut u8).unwrap_or(NonNull::dangling());
            return Ok(Self { ptr, len, raw: ptr });
        }
        let failed = || MemoryError::AllocationFailed { arena: label.to_string(), kind: MemoryKind::Host, bytes: len };
        // Allocated with the system allocator's own alignment and aligned by hand: a zeroed
        // allocation of that alignment is `calloc`, whose large blocks are fresh pages the
        // kernel zeroes on first touch, so a plan's arenas (gigabytes for a big model) cost
        // nothing until used. An over-aligned `alloc_zeroed` would write every byte now.
        let layout = Self::raw_layout(len).ok_or_else(failed)?;
        // SAFETY: the layout has a non-zero size.
        let raw = NonNull::new(unsafe { alloc_zeroed(layout) }).ok_or_else(failed)?;
        let offset = raw.as_ptr().align_offset(ALIGNMENT);
        if offset >= ALIGNMENT {
            // SAFETY: allocated just above with this layout.
            unsafe { dealloc(raw.as_ptr(), layout) };
            return Err(failed());
        }
        // SAFETY: `offset < ALIGNMENT`, and the allocation has `len + ALIGNMENT` bytes.
        let ptr = unsafe { NonNull::new_unchecked(raw.as_ptr().add(offset)) };
        // Before the first touch, which is when the kernel picks a page's size.
        crate::huge_pages::advise(ptr.as_ptr(), len);
        Ok(Self { ptr, len, raw })
    }

    /// The layout actually allocated for `len` bytes.
    fn raw_layout(len: usize) -> Option<Layout> {
        Layout::from_size_align(len.checked_add(ALIGNMENT)?, 16).ok()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Base address, for views.
    pub(crate) fn base(&self) -> NonNull<u8> {
        self.ptr
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        if let Some(layout) = Self::raw_layout(self.len) {
            // SAFETY: allocated in `zeroed` at `raw` with exactly this layout.
            unsafe { dealloc(self.raw.as_ptr(), layout) }
        }
    }
}

/// One device's memory for one plan: a single allocation that every register of that
/// device is a view into. Allocated when the plan is loaded, freed when the job ends.
#[derive(Debug)]
pub struct Arena {
    label: String,
    kind: MemoryKind,
    memory: Box<dyn ArenaMemory>,
}

impl Arena {
    /// The arena of the device named `label` over `memory` of `kind`, as an
    /// [`ArenaAllocator`] handed it out.
    pub fn new(label: &str, kind: MemoryKind, memory: Box<dyn ArenaMemory>) -> Self {
        Self { label: label.to_string(), kind, memory }
    }

    /// Allocates an arena of `bytes` bytes of `kind` memory for the device named `label`
    /// from `allocator`.
    pub fn allocate_with(
        allocator: &dyn ArenaAllocator,
        label: &str,
        kind: MemoryKind,
        bytes: u64,
    ) -> Result<Self, MemoryError> {
        Ok(Self::new(label, kind, allocator.allocate(label, kind, bytes)?))
    }

    /// Allocates an arena of `bytes` bytes of `kind` memory for the device named `label`
    /// from the [`HostAllocator`]: device memory belongs to a device backend and is refused
    /// with [`MemoryError::UnsupportedKind`].
    pub fn allocate(label: &str, kind: MemoryKind, bytes: u64) -> Result<Self, MemoryError> {
        Self::allocate_with(&HostAllocator, label, kind, bytes)
    }

    /// The device label this arena was allocated for.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The memory kind.
    pub fn kind(&self) -> MemoryKind {
        self.kind
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.memory.len()
    }

    /// Whether the arena holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.memory.is_empty()
    }

    /// A view of `len` bytes at `offset`, checked against the arena's bounds.
    pub fn view(&self, offset: u64, len: u64) -> Result<BufferView, MemoryError> {
        let arena_len = self.memory.len() as u64;
        let out_of_range = || MemoryError::OutOfRange { arena: self.label.clone(), offset, len, arena_len };
        let end = offset.checked_add(len).ok_or_else(out_of_range)?;
        if end > arena_len {
            return Err(out_of_range());
        }
        // Both fit in usize: they are bounded by the allocation's length.
        let (offset, len) = (offset as usize, len as usize);
        // Within the allocation (checked above). Wrapping arithmetic: a device address is
        // not a host allocation, and is only offset here, never dereferenced.
        let ptr = NonNull::new(self.memory.base().as_ptr().wrapping_add(offset)).ok_or_else(out_of_range)?;
        Ok(BufferView { ptr, len })
    }
}

/// A view of bytes inside an [`Arena`]: a register slot.
///
/// Views are plain addresses: whoever dereferences one must know that nobody writes the
/// same bytes meanwhile. In regflow the register protocol guarantees it: a producer writes a
/// slot only while every consumer has acknowledged it, consumers read it only between its
/// `Ready` and their `Ack`. A view must not outlive its arena.
#[derive(Debug, Clone, Copy)]
pub struct BufferView {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a view is an address; data races are excluded by the register protocol (see above).
unsafe impl Send for BufferView {}
// SAFETY: as above.
unsafe impl Sync for BufferView {}

impl BufferView {
    /// A view of no bytes (a placeholder in arrays of views filled per firing).
    pub const fn empty() -> Self {
        Self { ptr: NonNull::dangling(), len: 0 }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Reads the bytes.
    ///
    /// # Safety
    /// The arena must be host memory (not [`MemoryKind::Device`]) alive for `'a`, and
    /// nobody may write these bytes during `'a`.
    pub unsafe fn as_slice<'a>(&self) -> &'a [u8] {
        // SAFETY: upheld by the caller; ptr/len come from a bounds-checked arena view.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// Writes the bytes.
    ///
    /// # Safety
    /// The arena must be host memory (not [`MemoryKind::Device`]) alive for `'a`, and
    /// nobody else may read or write these bytes during `'a`.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice<'a>(&self) -> &'a mut [u8] {
        // SAFETY: upheld by the caller; ptr/len come from a bounds-checked arena view.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The `len` bytes from `offset` of this view, or `None` where they do not lie inside it.
    pub fn window(&self, offset: usize, len: usize) -> Option<BufferView> {
        if offset.checked_add(len)? > self.len {
            return None;
        }
        // SAFETY: `offset` is at most `self.len`, so the address stays inside (or one past
        // the end of) the same allocation.
        let ptr = unsafe { NonNull::new_unchecked(self.ptr.as_ptr().add(offset)) };
        Some(BufferView { ptr, len })
    }

    /// The first byte, for code that must not hold a reference to all the bytes at once
    /// (an all-gather's input that lies inside its output). Dereferencing it is under
    /// [`BufferView::as_slice`]'s and [`BufferView::as_mut_slice`]'s rules, byte by byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Address of the first byte (for alignment checks and diagnostics).
    pub fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_and_zeroed() {
        for len in [1usize, 63, 64, 65, 4096, 1 << 20] {
            let buf = HostBuffer::zeroed("t", len).unwrap();
            assert_eq!(buf.base().as_ptr() as usize % ALIGNMENT, 0, "len {len}");
            let arena_view = BufferView { ptr: buf.base(), len };
            // SAFETY: the buffer is alive and unshared.
            assert!(unsafe { arena_view.as_slice() }.iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn windows_stay_inside_their_view() {
        let arena = Arena::allocate("cpu:0", MemoryKind::Host, 256).unwrap();
        let view = arena.view(64, 128).unwrap();
        let window = view.window(64, 64).unwrap();
        assert_eq!((window.addr() - view.addr(), window.len()), (64, 64));
        assert_eq!(view.window(128, 0).map(|w| w.len()), Some(0));
        assert!(view.window(65, 64).is_none());
        assert!(view.window(usize::MAX, 2).is_none());
    }

    #[test]
    fn views_outside_the_arena_are_errors() {
        let arena = Arena::allocate("cpu:0", MemoryKind::Host, 128).unwrap();
        assert!(arena.view(64, 64).is_ok());
        let err = arena.view(100, 29).unwrap_err();
        assert_eq!(err.to_string(), "view [100, 100+29) is outside arena cpu:0 of 128 bytes");
        assert!(arena.view(u64::MAX, 2).is_err());
    }

    #[test]
    fn device_memory_is_refused_by_the_host_allocator() {
        let err = Arena::allocate("cuda:0", MemoryKind::Device, 8).unwrap_err();
        assert!(err.to_string().contains("needs a device backend"), "{err}");
    }

    /// A stand-in device allocator: counts its allocations and hands out host memory.
    #[derive(Debug, Default)]
    struct Counting(std::sync::atomic::AtomicUsize);

    impl ArenaAllocator for Counting {
        fn allocate(&self, label: &str, kind: MemoryKind, bytes: u64) -> Result<Box<dyn ArenaMemory>, MemoryError> {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            HostAllocator.allocate(label, MemoryKind::Host, bytes).map_err(|_| MemoryError::AllocationFailed {
                arena: label.to_string(),
                kind,
                bytes: bytes as usize,
            })
        }
    }

    #[test]
    fn an_arena_takes_its_memory_from_the_allocator_it_is_given() {
        let allocator = Counting::default();
        let arena = Arena::allocate_with(&allocator, "sim:0", MemoryKind::Device, 192).unwrap();
        assert_eq!(allocator.0.load(std::sync::atomic::Ordering::Relaxed), 1);
        assert_eq!((arena.label(), arena.kind(), arena.len()), ("sim:0", MemoryKind::Device, 192));
        let view = arena.view(128, 64).unwrap();
        assert_eq!(view.len(), 64);
        assert!(arena.view(129, 64).is_err());
    }

    #[test]
    fn empty_arena_gives_empty_views() {
        let arena = Arena::allocate("cpu:0", MemoryKind::Host, 0).unwrap();
        let view = arena.view(0, 0).unwrap();
        // SAFETY: empty slice.
        assert!(unsafe { view.as_slice() }.is_empty());
    }
}
