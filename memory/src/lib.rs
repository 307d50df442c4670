//! Memory for regflow plans: memory kinds, 64-byte-aligned host buffers, one arena per
//! device per plan (allocated through an [`ArenaAllocator`], the host one for `cpu` and
//! `sim` devices), register layouts inside it, and a report of bytes per device.
//!
//! A plan's memory is allocated once, when the plan is loaded: every register slot is a
//! [`BufferView`] into its device's [`Arena`], so steady-state execution allocates nothing.
//!
//! ```
//! use regflow_memory::{Arena, ArenaLayout, MemoryKind};
//!
//! // Two register descriptors: 3 slots of 100 bytes, 1 slot of 8 bytes.
//! let layout = ArenaLayout::pack(&[(100, 3), (8, 1)]).unwrap();
//! assert_eq!(layout.slot_offset(0, 1), 128); // every slot starts on a 64-byte boundary
//! let arena = Arena::allocate("cpu:0", MemoryKind::Host, layout.total_bytes()).unwrap();
//! let view = arena.view(layout.slot_offset(1, 0), 8).unwrap();
//! assert_eq!(view.len(), 8);
//! ```
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

mod allocator;
mod arena;
mod huge_pages;
mod layout;
mod reuse;

pub use allocator::{host_memory_bytes, ArenaAllocator, ArenaMemory, HostAllocator};
pub use arena::{Arena, BufferView, HostBuffer};
pub use huge_pages::{huge_page_mode, set_huge_pages, HUGE_PAGE_MIN_BYTES};
pub use layout::{ArenaLayout, MemoryReport};
pub use reuse::ReusedLayout;

use serde::{Deserialize, Serialize};

/// Alignment of every allocation and of every register slot inside an arena, in bytes.
///
/// 64 bytes is a cache line on x86-64 and a multiple of every SIMD width the CPU kernels use,
/// and it keeps two registers written by different threads off one cache line.
pub const ALIGNMENT: usize = 64;

/// Where a register's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryKind {
    /// Ordinary host memory.
    Host,
    /// Page-locked host memory (for device copies; plain host memory until a device backend pins it).
    HostPinned,
    /// Memory on an accelerator.
    Device,
}

impl std::fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            MemoryKind::Host => "host",
            MemoryKind::HostPinned => "host_pinned",
            MemoryKind::Device => "device",
        })
    }
}

/// Errors of the memory crate.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MemoryError {
    /// The allocator could not provide the bytes.
    #[error("allocating {bytes} bytes of {kind} memory for {arena} failed")]
    AllocationFailed {
        /// Label of the arena being allocated.
        arena: String,
        /// Memory kind requested.
        kind: MemoryKind,
        /// Bytes requested.
        bytes: usize,
    },
    /// A memory kind this build cannot allocate.
    #[error("{arena}: {kind} memory needs a device backend; this allocator serves host memory only")]
    UnsupportedKind {
        /// Label of the arena being allocated.
        arena: String,
        /// Memory kind requested.
        kind: MemoryKind,
    },
    /// A size computation overflowed.
    #[error("size of {what} overflows: {bytes} bytes x {count}")]
    SizeOverflow {
        /// What was being sized.
        what: String,
        /// Bytes per item.
        bytes: u64,
        /// Number of items.
        count: u64,
    },
    /// A block's lifetime range is empty or inverted, so it is never live.
    #[error(
        "block {block} has lifetime [{start}, {end}), which is empty: a block must be live for at least one step (start < end)"
    )]
    EmptyLifetime {
        /// Index of the block in the planner's input.
        block: usize,
        /// First step of the range.
        start: u32,
        /// Step past the last of the range.
        end: u32,
    },
    /// Blocks laid out one after another would end past `u64::MAX` bytes.
    #[error("block {block} of {bytes} bytes at offset {offset} would end past the largest 64-bit arena")]
    ArenaOverflow {
        /// Index of the block in the planner's input.
        block: usize,
        /// Where the block would start.
        offset: u64,
        /// Aligned size of the block.
        bytes: u64,
    },
    /// A view outside its arena.
    #[error("view [{offset}, {offset}+{len}) is outside arena {arena} of {arena_len} bytes")]
    OutOfRange {
        /// Label of the arena.
        arena: String,
        /// Requested offset.
        offset: u64,
        /// Requested length.
        len: u64,
        /// Length of the arena.
        arena_len: u64,
    },
}
