//! Where arenas come from: an [`ArenaAllocator`] per device kind hands out [`ArenaMemory`],
//! the single allocation an [`Arena`](crate::Arena) is made of. The host allocator serves
//! `cpu` and `sim` devices; a CUDA backend implements the same trait for device memory.

use crate::arena::HostBuffer;
use crate::{MemoryError, MemoryKind};
use std::fmt;
use std::ptr::NonNull;

/// One allocation an arena is carved from: `len` bytes at `base`, freed on drop.
///
/// # Safety
///
/// Implementers guarantee that `base()..base() + len()` stays allocated, at the same
/// address, until the value is dropped, and that nothing else uses those bytes. For host
/// memory kinds the bytes must be readable and writable from the host (register views are
/// dereferenced there); for [`MemoryKind::Device`] the address is the device's, which only
/// that device's kernels dereference.
pub unsafe trait ArenaMemory: Send + Sync + fmt::Debug {
    /// Address of the first byte.
    fn base(&self) -> NonNull<u8>;

    /// Length in bytes.
    fn len(&self) -> usize;

    /// Whether the allocation holds no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Allocates arena memory for the devices of one kind. Small on purpose: the runtime asks
/// for one allocation per device per plan, when the plan is loaded, and carves every
/// register slot out of it.
///
/// ```
/// use regflow_memory::{Arena, ArenaAllocator, HostAllocator, MemoryKind};
///
/// let memory = HostAllocator.allocate("cpu:0", MemoryKind::Host, 256).unwrap();
/// assert_eq!(memory.len(), 256);
/// let arena = Arena::new("cpu:0", MemoryKind::Host, memory);
/// assert_eq!(arena.view(64, 8).unwrap().len(), 8);
/// assert!(HostAllocator.allocate("cuda:0", MemoryKind::Device, 8).is_err());
/// ```
pub trait ArenaAllocator: Send + Sync + fmt::Debug {
    /// Allocates `bytes` bytes of `kind` memory for the device labelled `label` (the label
    /// names it in errors), or says why not: [`MemoryError::UnsupportedKind`] for a kind
    /// this allocator does not serve, [`MemoryError::AllocationFailed`] when the bytes are
    /// not there.
    fn allocate(&self, label: &str, kind: MemoryKind, bytes: u64) -> Result<Box<dyn ArenaMemory>, MemoryError>;
}

/// The host allocator: zeroed, [`ALIGNMENT`](crate::ALIGNMENT)-aligned host memory for
/// [`MemoryKind::Host`] and [`MemoryKind::HostPinned`] (plain host memory until a device
/// backend pins it); refuses [`MemoryKind::Device`].
#[derive(Debug, Clone, Copy, Default)]
pub struct HostAllocator;

impl ArenaAllocator for HostAllocator {
    fn allocate(&self, label: &str, kind: MemoryKind, bytes: u64) -> Result<Box<dyn ArenaMemory>, MemoryError> {
        if kind == MemoryKind::Device {
            return Err(MemoryError::UnsupportedKind { arena: label.to_string(), kind });
        }
        let len = usize::try_from(bytes).map_err(|_| MemoryError::AllocationFailed {
            arena: label.to_string(),
            kind,
            bytes: usize::MAX,
        })?;
        Ok(Box::new(HostBuffer::zeroed(label, len)?))
    }
}

// SAFETY: a `HostBuffer` owns its `len` bytes of host memory at a fixed address until it
// is dropped, and hands them out only through views.
unsafe impl ArenaMemory for HostBuffer {
    fn base(&self) -> NonNull<u8> {
        self.base()
    }

    fn len(&self) -> usize {
        self.len()
    }
}

/// The machine's physical memory in bytes, where the platform says (Linux: `MemTotal` of
/// `/proc/meminfo`); `None` elsewhere. Host arenas are `calloc`ed and cost nothing until
/// touched, so an arena larger than this would be granted and fail later (the process
/// killed when its pages are written): a runtime compares the arenas it needs with this
/// before allocating them.
pub fn host_memory_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut words = line.split_whitespace().skip(1);
    let amount: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => amount.checked_mul(1024),
        None => Some(amount),
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    #[cfg(target_os = "linux")]
    fn host_memory_is_known_on_linux() {
        let bytes = super::host_memory_bytes().expect("/proc/meminfo has MemTotal");
        assert!(bytes > 1 << 20, "{bytes}");
    }
}
