//! The message bus: one `send` for every tier. Same-stream messages never reach it (the
//! stream thread keeps a local queue); other streams of hosted nodes get the message in
//! their inbox; other nodes go through the writer of their connection (`crate::net`).

use crate::inbox::{Envelope, InboxSender};
use crate::net::NetOut;
use crate::sync::Arc;
use regflow_actors::{EnvError, Message};

/// Routes messages by decoding the recipient's [`regflow_actors::ActorId`].
#[derive(Debug, Clone)]
pub(crate) struct Router {
    /// The node this job runs, or `None` when it runs every node in-process.
    hosted_node: Option<u16>,
    /// `stream_of[device][position]`: the plan stream index.
    stream_of: Vec<Vec<u32>>,
    /// Inbox of each plan stream; `None` for streams of nodes this job does not run.
    inboxes: Vec<Option<InboxSender>>,
    /// The writers of the other nodes, in a job that runs one node of several.
    remote: Option<Arc<NetOut>>,
}

impl Router {
    pub(crate) fn new(
        hosted_node: Option<u16>,
        stream_of: Vec<Vec<u32>>,
        inboxes: Vec<Option<InboxSender>>,
        remote: Option<Arc<NetOut>>,
    ) -> Self {
        Self { hosted_node, stream_of, inboxes, remote }
    }

    /// The node this job runs, if it runs one node of several.
    pub(crate) fn hosted_node(&self) -> Option<u16> {
        self.hosted_node
    }

    /// Tells the other nodes this job failed.
    pub(crate) fn abort_peers(&self, error: &crate::RuntimeError) {
        if let Some(remote) = &self.remote {
            remote.abort_peers(error);
        }
    }

    /// Whether this job runs `node`.
    pub(crate) fn hosts(&self, node: u16) -> bool {
        self.hosted_node.is_none_or(|n| n == node)
    }

    /// The plan stream that runs `dst`.
    #[inline]
    pub(crate) fn stream_index(&self, dst: regflow_actors::ActorId) -> Option<usize> {
        Some(*self.stream_of.get(dst.device() as usize)?.get(dst.stream() as usize)? as usize)
    }

    /// Whether this job runs plan stream `s`.
    fn hosts_stream(&self, s: usize) -> bool {
        self.inboxes.get(s).is_some_and(Option::is_some)
    }

    /// The inbox of the stream that runs `dst`, if this job runs it.
    pub(crate) fn inbox_of(&self, dst: regflow_actors::ActorId) -> Option<&InboxSender> {
        self.inboxes.get(self.stream_index(dst)?)?.as_ref()
    }

    /// Delivers to another stream thread, or fails with the reason.
    pub(crate) fn send(&self, msg: Message) -> Result<(), EnvError> {
        let node = msg.dst.node();
        if !self.hosts(node) {
            return match &self.remote {
                // The sender's stream, if this job runs it: an actor's thread.
                Some(remote) => remote.send_actor(msg, self.stream_index(msg.src).filter(|&s| self.hosts_stream(s))),
                None => Err(EnvError::NotConnected { dst: msg.dst, node }),
            };
        }
        let inbox = self.inbox_of(msg.dst).ok_or(EnvError::NotConnected { dst: msg.dst, node })?;
        inbox.send(Envelope::Actor(msg)).map_err(|_| EnvError::Disconnected { dst: msg.dst })
    }

    /// Delivers two messages for actors of one other hosted stream in one envelope, `a`
    /// first.
    pub(crate) fn send_pair(&self, a: Message, b: Message) -> Result<(), EnvError> {
        let node = a.dst.node();
        let inbox = self.inbox_of(a.dst).ok_or(EnvError::NotConnected { dst: a.dst, node })?;
        inbox.send(Envelope::Pair(a, b)).map_err(|_| EnvError::Disconnected { dst: a.dst })
    }

    /// Sends an envelope to every hosted stream, ignoring streams that already ended.
    pub(crate) fn broadcast(&self, envelope: Envelope) {
        for inbox in self.inboxes.iter().flatten() {
            let _ = inbox.send(envelope);
        }
    }
}
