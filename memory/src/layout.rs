//! Offsets of register slots inside one arena, and the per-device memory report.

use crate::{MemoryError, ALIGNMENT};
use std::fmt;

/// Where each slot of each register descriptor sits inside one device's arena.
///
/// This planner packs slots back to back (each on an [`ALIGNMENT`] boundary);
/// lifetime-based reuse is a later pass that produces the same type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArenaLayout {
    /// For block `i`: offset of its slot 0 and the stride between its slots.
    blocks: Vec<(u64, u64)>,
    total_bytes: u64,
}

fn align_up(bytes: u64) -> Option<u64> {
    let align = ALIGNMENT as u64;
    bytes.checked_add(align - 1).map(|b| b / align * align)
}

impl ArenaLayout {
    /// Packs blocks given as `(bytes per slot, slot count)`, in order.
    pub fn pack(blocks: &[(u64, u32)]) -> Result<Self, MemoryError> {
        let mut offset = 0u64;
        let mut out = Vec::with_capacity(blocks.len());
        for (index, &(bytes, count)) in blocks.iter().enumerate() {
            let overflow =
                || MemoryError::SizeOverflow { what: format!("block {index}"), bytes, count: u64::from(count) };
            let stride = align_up(bytes).ok_or_else(overflow)?;
            let size = stride.checked_mul(u64::from(count)).ok_or_else(overflow)?;
            out.push((offset, stride));
            offset = offset.checked_add(size).ok_or_else(overflow)?;
        }
        Ok(Self { blocks: out, total_bytes: offset })
    }

    /// Offset of slot `slot` of block `block`. Panics if the block does not exist, which
    /// would be a broken invariant of the caller (blocks are the plan's own descriptors).
    pub fn slot_offset(&self, block: usize, slot: u32) -> u64 {
        let (base, stride) = self.blocks[block];
        base + stride * u64::from(slot)
    }

    /// Bytes the arena needs.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }
}

/// Bytes per device of a plan, known before anything runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoryReport {
    /// `(device label, bytes)`, in plan order.
    pub devices: Vec<(String, u64)>,
}

impl MemoryReport {
    /// Total bytes over all devices.
    pub fn total_bytes(&self) -> u64 {
        self.devices.iter().map(|(_, b)| b).sum()
    }

    /// Bytes of the device with this label, if it is in the report.
    pub fn bytes_of(&self, label: &str) -> Option<u64> {
        self.devices.iter().find(|(l, _)| l == label).map(|(_, b)| *b)
    }
}

impl fmt::Display for MemoryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (label, bytes) in &self.devices {
            writeln!(f, "{label:>12}: {bytes:>14} bytes")?;
        }
        write!(f, "{:>12}: {:>14} bytes", "total", self.total_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_aligned_and_do_not_overlap() {
        let layout = ArenaLayout::pack(&[(1, 2), (64, 3), (65, 1), (0, 4)]).unwrap();
        assert_eq!(layout.slot_offset(0, 0), 0);
        assert_eq!(layout.slot_offset(0, 1), 64);
        assert_eq!(layout.slot_offset(1, 0), 128);
        assert_eq!(layout.slot_offset(1, 2), 256);
        assert_eq!(layout.slot_offset(2, 0), 320);
        assert_eq!(layout.total_bytes(), 320 + 128);
    }

    #[test]
    fn overflow_is_an_error() {
        let err = ArenaLayout::pack(&[(u64::MAX - 3, 2)]).unwrap_err();
        assert!(matches!(err, MemoryError::SizeOverflow { .. }));
    }

    #[test]
    fn report_sums_devices() {
        let report = MemoryReport { devices: vec![("cpu:0".into(), 100), ("sim:0".into(), 28)] };
        assert_eq!(report.total_bytes(), 128);
        assert_eq!(report.bytes_of("sim:0"), Some(28));
        assert!(report.to_string().contains("total"));
    }
}
