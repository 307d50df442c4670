//! A firing's short lists (the slots it reads and writes), kept inside the actor up to a
//! few items: reading them touches no heap memory of their own.

/// Up to `N` items inline; an actor with more inputs or outputs uses a vector allocated
/// once, with room for all of them. Never allocates after [`Scratch::with_capacity`].
#[derive(Debug)]
pub(crate) struct Scratch<T: Copy, const N: usize> {
    inline: [T; N],
    len: usize,
    spilled: Vec<T>,
}

impl<T: Copy, const N: usize> Scratch<T, N> {
    /// Room for `capacity` items; `fill` is a placeholder for the unused inline ones.
    pub(crate) fn with_capacity(capacity: usize, fill: T) -> Self {
        let spilled = if capacity > N { Vec::with_capacity(capacity) } else { Vec::new() };
        Self { inline: [fill; N], len: 0, spilled }
    }

    fn is_spilled(&self) -> bool {
        self.spilled.capacity() > 0
    }

    #[inline]
    pub(crate) fn clear(&mut self) {
        self.len = 0;
        self.spilled.clear();
    }

    #[inline]
    pub(crate) fn push(&mut self, item: T) {
        if self.is_spilled() {
            self.spilled.push(item);
        } else {
            // More than `N` here would be a broken invariant: the capacity is the arity.
            self.inline[self.len] = item;
            self.len += 1;
        }
    }
}

impl<T: Copy, const N: usize> std::ops::Deref for Scratch<T, N> {
    type Target = [T];

    #[inline]
    fn deref(&self) -> &[T] {
        if self.is_spilled() {
            &self.spilled
        } else {
            &self.inline[..self.len]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Scratch;

    #[test]
    fn short_lists_stay_inline_and_long_ones_spill_without_growing() {
        let mut short: Scratch<u32, 4> = Scratch::with_capacity(2, 0);
        short.push(7);
        short.push(9);
        assert_eq!(&*short, &[7, 9]);
        short.clear();
        assert!(short.is_empty());
        let mut long: Scratch<u32, 4> = Scratch::with_capacity(6, 0);
        for i in 0..6 {
            long.push(i);
        }
        assert_eq!(&*long, &[0, 1, 2, 3, 4, 5]);
        assert_eq!(long.spilled.capacity(), 6);
    }
}
