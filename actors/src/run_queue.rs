//! The actors of one stream waiting for their turn to fire, each at most once, oldest first.

use crate::ring::Ring;

/// Actors (by index on their stream) that a message taken straight in
/// ([`crate::Actor::accept`]) made runnable, oldest first, each at most once.
///
/// A stream hands a `Ready` or `Ack` between two of its actors to the recipient's `accept`
/// while the sender is still firing, and queues only the recipient's index here when it
/// can now fire. A message through a queue costs two 48-byte copies and a dispatch, and an
/// `Ack` usually leaves its recipient with nothing to do (its input is not ready yet), so
/// most of them cost no turn at all: B1 in `examples/bench_actors.rs` went from 848 to 798
/// instructions per firing, and from 41 to 34.5 ns with 2 registers (BENCHMARKS.md).
#[derive(Debug, Clone)]
pub struct RunQueue {
    /// A [`Ring`], not a `VecDeque`: this is on the path of every firing, and it never
    /// holds more than one entry per actor.
    order: Ring<u32>,
    /// Per actor: whether it is in `order`.
    queued: Box<[bool]>,
}

impl RunQueue {
    /// An empty queue for a stream of `actors` actors, allocated once.
    pub fn new(actors: usize) -> Self {
        Self { order: Ring::new(actors, 0), queued: vec![false; actors].into_boxed_slice() }
    }

    /// Queues actor `index` unless it already waits.
    #[inline(always)]
    pub fn push(&mut self, index: usize) {
        if !self.queued[index] {
            self.queued[index] = true;
            self.order.push_back(index as u32);
        }
    }

    /// Whether no actor waits for its turn.
    #[inline(always)]
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// The actor whose turn is next.
    #[inline(always)]
    pub fn pop(&mut self) -> Option<usize> {
        let index = self.order.pop_front()? as usize;
        self.queued[index] = false;
        Some(index)
    }
}

#[cfg(test)]
mod tests {
    use super::RunQueue;

    #[test]
    fn an_actor_waits_once_and_turns_come_in_order() {
        let mut queue = RunQueue::new(3);
        for index in [2, 0, 2, 1, 0] {
            queue.push(index);
        }
        assert_eq!([queue.pop(), queue.pop(), queue.pop(), queue.pop()], [Some(2), Some(0), Some(1), None]);
        queue.push(2);
        assert_eq!(queue.pop(), Some(2));
    }
}
