//! Messages between actors: small `Copy` values with no heap and no pointers.

use crate::ActorId;
use regflow_plan::RegstDescId;

/// One slot of a register descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(C)]
pub struct RegstRef {
    /// The descriptor.
    pub desc: RegstDescId,
    /// The slot, `0..register_num`.
    pub slot: u32,
}

/// A command from the runtime or the user to an actor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Cmd {
    /// Begin: sources start producing.
    Start,
    /// Abort: the actor stops at once, without sending anything more.
    Stop,
    /// A fed source has one more piece available.
    Feed,
    /// A fed source will get no more pieces.
    CloseFeed,
    /// The user took one piece a sink delivered: the sink may deliver one more.
    Fetched,
}

/// What a message says.
///
/// `repr(C)`: a defined layout of aligned words. The default layout packs the tag and
/// payload so that moving a message through a queue becomes unaligned overlapping copies,
/// which stall store-to-load forwarding on every dispatch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub enum Body {
    /// Producer → consumer: slot `regst` holds piece `piece`; its bytes are those of `data`
    /// (the same slot, or the register a repeat actor hands on without copying).
    Ready {
        /// The slot being handed over.
        regst: RegstRef,
        /// Piece number: the n-th piece on this register descriptor.
        piece: u64,
        /// Whose memory holds the bytes.
        data: RegstRef,
    },
    /// Consumer → producer: done reading `regst`.
    Ack {
        /// The slot given back.
        regst: RegstRef,
    },
    /// Producer → consumer: no more pieces will come on `desc`.
    Eord {
        /// The finished descriptor.
        desc: RegstDescId,
    },
    /// Stream → actor: its oldest launched kernel has completed.
    ActDone,
    /// A command.
    Cmd(Cmd),
}

/// A routed message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub struct Message {
    /// Recipient.
    pub dst: ActorId,
    /// Sender (the recipient itself for `ActDone` and commands).
    pub src: ActorId,
    /// Content.
    pub body: Body,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_small_and_copy() {
        fn is_copy<T: Copy>() {}
        is_copy::<Message>();
        assert!(std::mem::size_of::<Message>() <= 48, "{}", std::mem::size_of::<Message>());
    }
}
