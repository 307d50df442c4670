//! Containers moved into memory the calling thread allocates itself ([`StreamWorker::reallocate`](crate::stream::StreamWorker::reallocate)).

use std::collections::VecDeque;

/// The items of `items`, moved into a vector the calling thread allocates now, with the
/// same capacity. Not `into_iter().collect()`, which may reuse the old allocation.
pub(crate) fn vec<T>(items: &mut Vec<T>) -> Vec<T> {
    let mut moved = Vec::with_capacity(items.capacity());
    moved.append(items);
    moved
}

/// The items of `queue`, moved into a queue the calling thread allocates now, with the
/// same capacity.
pub(crate) fn queue<T>(queue: &mut VecDeque<T>) -> VecDeque<T> {
    let mut moved = VecDeque::with_capacity(queue.capacity());
    moved.append(queue);
    moved
}
