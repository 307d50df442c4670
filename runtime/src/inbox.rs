//! A stream thread's inbox: many senders, one receiver, FIFO per sender, blocking receive.
//!
//! Normal builds use a crossbeam channel. Under `--cfg loom` it is a mutex-and-condvar
//! queue made of loom primitives with the same semantics, so loom explores every
//! interleaving of the threads that use it (crossbeam's internals have their own tests).

use regflow_actors::Message;

/// What travels to a stream thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Envelope {
    /// A message for one of its actors.
    Actor(Message),
    /// The watchdog asks for a snapshot of its actors.
    Snapshot,
    /// Abort: stop at once.
    Stop,
}

/// The receiver has gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Disconnected;

#[cfg(not(loom))]
mod imp {
    use super::{Disconnected, Envelope};

    /// Sending half.
    #[derive(Debug, Clone)]
    pub(crate) struct InboxSender(crossbeam_channel::Sender<Envelope>);

    /// Receiving half.
    #[derive(Debug)]
    pub(crate) struct InboxReceiver(crossbeam_channel::Receiver<Envelope>);

    /// An inbox with room for `capacity` envelopes, allocated now. The job sizes it from
    /// the register counts, which bound the messages in flight to one stream, so a send
    /// never waits and never allocates.
    pub(crate) fn inbox(capacity: usize) -> (InboxSender, InboxReceiver) {
        let (tx, rx) = crossbeam_channel::bounded(capacity.max(1));
        (InboxSender(tx), InboxReceiver(rx))
    }

    impl InboxSender {
        pub(crate) fn send(&self, envelope: Envelope) -> Result<(), Disconnected> {
            self.0.send(envelope).map_err(|_| Disconnected)
        }
    }

    impl InboxReceiver {
        pub(crate) fn try_recv(&self) -> Option<Envelope> {
            self.0.try_recv().ok()
        }

        /// Blocks until an envelope arrives; `None` once every sender is gone.
        pub(crate) fn recv(&self) -> Option<Envelope> {
            self.0.recv().ok()
        }
    }
}

#[cfg(loom)]
mod imp {
    use super::{Disconnected, Envelope};
    use loom::sync::{Arc, Condvar, Mutex};
    use std::collections::VecDeque;

    #[derive(Debug)]
    struct Queue {
        items: Mutex<(VecDeque<Envelope>, usize)>,
        ready: Condvar,
    }

    /// Sending half.
    #[derive(Debug)]
    pub(crate) struct InboxSender(Arc<Queue>);

    /// Receiving half.
    #[derive(Debug)]
    pub(crate) struct InboxReceiver(Arc<Queue>);

    pub(crate) fn inbox(_capacity: usize) -> (InboxSender, InboxReceiver) {
        let queue = Arc::new(Queue { items: Mutex::new((VecDeque::new(), 1)), ready: Condvar::new() });
        (InboxSender(queue.clone()), InboxReceiver(queue))
    }

    impl Clone for InboxSender {
        fn clone(&self) -> Self {
            crate::sync::lock(&self.0.items).1 += 1;
            InboxSender(self.0.clone())
        }
    }

    impl Drop for InboxSender {
        fn drop(&mut self) {
            crate::sync::lock(&self.0.items).1 -= 1;
            self.0.ready.notify_one();
        }
    }

    impl InboxSender {
        pub(crate) fn send(&self, envelope: Envelope) -> Result<(), Disconnected> {
            crate::sync::lock(&self.0.items).0.push_back(envelope);
            self.0.ready.notify_one();
            Ok(())
        }
    }

    impl InboxReceiver {
        pub(crate) fn try_recv(&self) -> Option<Envelope> {
            crate::sync::lock(&self.0.items).0.pop_front()
        }

        pub(crate) fn recv(&self) -> Option<Envelope> {
            let mut items = crate::sync::lock(&self.0.items);
            loop {
                if let Some(envelope) = items.0.pop_front() {
                    return Some(envelope);
                }
                if items.1 == 0 {
                    return None;
                }
                items = self.0.ready.wait(items).unwrap_or_else(|p| p.into_inner());
            }
        }
    }
}

pub(crate) use imp::{inbox, InboxReceiver, InboxSender};
