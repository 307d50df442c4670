//! A fixed-capacity FIFO of small `Copy` items: an actor's slot queues, whose lengths the
//! register counts bound, so they never grow.
//!
//! `VecDeque` would do, but its push keeps a grow path (a call) that the hot path pays for
//! on every message: the live values are spilled around it and its index arithmetic is
//! more general. A ring whose capacity is the bound has neither.

/// A FIFO of at most `capacity` items, allocated once.
///
/// The storage is rounded up to a power of two, so that an index wraps with a mask instead
/// of a comparison and a subtraction on every push and pop (`bench_actors b1`: 798 → 781
/// instructions per firing, counted by callgrind), while the bound stays the one asked for.
#[derive(Debug, Clone)]
pub(crate) struct Ring<T> {
    items: Box<[T]>,
    /// `items.len() - 1`.
    mask: u32,
    /// Index of the oldest item.
    head: u32,
    len: u32,
    /// Most items it may hold (at most `items.len()`).
    capacity: u32,
}

impl<T: Copy> Ring<T> {
    /// An empty ring with room for exactly `capacity` items (`fill` only initialises the
    /// storage; it is never read back).
    pub(crate) fn new(capacity: usize, fill: T) -> Self {
        let storage = capacity.max(1).next_power_of_two();
        let (Ok(bound), Ok(mask)) = (u32::try_from(capacity), u32::try_from(storage - 1)) else {
            panic!("a ring of {capacity} items is larger than a plan allows")
        };
        Self { items: vec![fill; storage].into_boxed_slice(), mask, head: 0, len: 0, capacity: bound }
    }

    /// Items queued.
    #[inline(always)]
    pub(crate) fn len(&self) -> usize {
        self.len as usize
    }

    /// Whether nothing is queued.
    #[inline(always)]
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Queues `item` last. The caller keeps the length within the capacity (the register
    /// count that sized it bounds it); pushing onto a full ring is a broken invariant.
    #[inline(always)]
    pub(crate) fn push_back(&mut self, item: T) {
        let capacity = self.capacity;
        assert!(self.len < capacity, "a slot queue of {capacity} overflowed (broken invariant)");
        let at = (self.head.wrapping_add(self.len) & self.mask) as usize;
        debug_assert!(at < self.items.len());
        // SAFETY: `items` has `mask + 1` entries (`new`; never resized), and `at` is masked.
        unsafe { *self.items.get_unchecked_mut(at) = item };
        self.len += 1;
    }

    /// Takes the oldest item.
    #[inline(always)]
    pub(crate) fn pop_front(&mut self) -> Option<T> {
        if self.len == 0 {
            return None;
        }
        debug_assert!((self.head as usize) < self.items.len());
        // SAFETY: `items` has `mask + 1` entries (`new`; never resized), and `head` is
        // always masked (here, and 0 at the start).
        let item = unsafe { *self.items.get_unchecked(self.head as usize) };
        self.head = (self.head + 1) & self.mask;
        self.len -= 1;
        Some(item)
    }
}

#[cfg(test)]
mod tests {
    use super::Ring;
    use std::collections::VecDeque;

    /// Any sequence of pushes (within the capacity) and pops matches a `VecDeque`.
    #[test]
    fn a_ring_is_a_bounded_fifo() {
        for capacity in 1..5usize {
            let mut ring = Ring::new(capacity, 0u32);
            let mut model = VecDeque::new();
            // A fixed pseudo-random walk of pushes and pops.
            let mut state = 0x9e37_79b9_u32.wrapping_mul(capacity as u32 + 1);
            for step in 0..500u32 {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                if state.is_multiple_of(2) && model.len() < capacity {
                    ring.push_back(step);
                    model.push_back(step);
                } else {
                    assert_eq!(ring.pop_front(), model.pop_front());
                }
                assert_eq!(ring.len(), model.len());
                assert_eq!(ring.is_empty(), model.is_empty());
            }
        }
    }

    #[test]
    #[should_panic(expected = "overflowed")]
    fn pushing_onto_a_full_ring_is_refused() {
        let mut ring = Ring::new(1, 0u8);
        ring.push_back(1);
        ring.push_back(2);
    }

    /// The storage of 3 items is rounded up to 4, but the ring still holds only 3.
    #[test]
    #[should_panic(expected = "a slot queue of 3 overflowed")]
    fn the_capacity_is_the_bound_asked_for_not_the_storage() {
        let mut ring = Ring::new(3, 0u8);
        for item in 0..4 {
            ring.push_back(item);
        }
    }
}
