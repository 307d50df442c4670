//! Loom model of the two-step all-reduce's middle barrier: a member reads a peer's output
//! part only after the peer wrote it, and never after the peer's round ended (when its
//! consumer may rewrite it).

use super::{PeerInput, Rendezvous};
use crate::sync::Arc;
use loom::cell::UnsafeCell;

/// Each member's output, as two loom cells (part 0, part 1).
struct Outputs([[UnsafeCell<u64>; 2]; 2]);

// SAFETY: the claim under test: through the rendezvous's barriers, no cell is read while
// its owner writes it. Loom's cells check every access against that claim.
unsafe impl Sync for Outputs {}

/// Two members, two rounds: each writes its own part of its output, passes the middle
/// barrier, copies the peer's part of the peer's output into its own, and after the round
/// its "consumer" rewrites the whole output (what happens after the ack).
#[test]
fn loom_two_step_members_read_finished_parts_only() {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(3);
    builder.check(|| {
        let rendezvous = Arc::new(Rendezvous::new("g", 2));
        let outputs = std::sync::Arc::new(Outputs([
            [UnsafeCell::new(0), UnsafeCell::new(0)],
            [UnsafeCell::new(0), UnsafeCell::new(0)],
        ]));
        let member = |rank: usize| {
            let (rendezvous, outputs) = (rendezvous.clone(), outputs.clone());
            move || {
                let (mut peers, mut peer_outputs) = ([PeerInput::empty(); 2], [PeerInput::empty(); 2]);
                for round in 1..=2u64 {
                    let got = rendezvous
                        .round_with_outputs(
                            rank,
                            PeerInput::empty(),
                            PeerInput::empty(),
                            &mut peers,
                            &mut peer_outputs,
                            |peers| {
                                let own = &outputs.0[rank];
                                // Step 1: this member's part (part `rank`) of its own output.
                                own[rank].with_mut(|v| unsafe { *v = 10 * round + rank as u64 });
                                peers.barrier();
                                // Step 2: the other part, from its owner's output.
                                let other = 1 - rank;
                                let value = outputs.0[other][other].with(|v| unsafe { *v });
                                own[other].with_mut(|v| unsafe { *v = value });
                                value
                            },
                        )
                        .unwrap();
                    assert_eq!(got, 10 * round + (1 - rank) as u64, "rank {rank}, round {round}");
                    // The consumer rewrites the output once the round is over.
                    for part in &outputs.0[rank] {
                        part.with_mut(|v| unsafe { *v = 0 });
                    }
                }
            }
        };
        let other = loom::thread::spawn(member(1));
        member(0)();
        other.join().unwrap();
    });
}
