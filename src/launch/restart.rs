//! After a failed attempt: whether the job starts again, with how many nodes, and what the
//! launcher says about it.

use super::{AttemptOutcome, LaunchOptions};
use std::sync::atomic::Ordering;

/// What follows an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Next {
    /// The attempt succeeded, was interrupted, or was the last one allowed.
    Finish,
    /// The launcher was asked to stop after the attempt had ended, before the restart.
    Interrupted,
    /// An elastic job lost so many nodes that only `remaining` are left, fewer than its
    /// minimum.
    TooFewNodes {
        /// The nodes that would be left.
        remaining: u32,
    },
    /// Start every rank again, this many of them.
    Restart {
        /// The next attempt's `WORLD_SIZE`.
        world_size: u32,
    },
}

/// Decides what follows `attempt` and, unless the output is captured, says so on stderr.
pub(super) fn next(options: &LaunchOptions, attempt: &AttemptOutcome) -> Next {
    let report = |message: String| {
        if !options.capture {
            eprintln!("regflow launch: {message}");
        }
    };
    if attempt.success() || attempt.interrupted {
        return Next::Finish;
    }
    let total = u64::from(options.max_restarts) + 1;
    let number = u64::from(attempt.attempt) + 1;
    let cause = match attempt.failure() {
        Some(rank) => format!("rank {} {}", rank.rank, rank.status),
        // Not reached: ranks are only stopped after one failed or on request.
        None => "the job failed".to_string(),
    };
    if attempt.attempt >= options.max_restarts {
        // Without restarts the failure was reported as it happened, as it always was.
        if options.max_restarts > 0 {
            report(format!("giving up after {number} attempts: in the last one, {cause}"));
        }
        return Next::Finish;
    }
    if options.stop.as_ref().is_some_and(|flag| flag.load(Ordering::Relaxed)) {
        report("asked to stop; not restarting the job".to_string());
        return Next::Interrupted;
    }
    let mut world_size = attempt.world_size;
    let mut resized = String::new();
    if let Some(min_nodes) = options.min_nodes {
        let lost = attempt.lost_ranks();
        let remaining = attempt.world_size.saturating_sub(u32::try_from(lost.len()).unwrap_or(u32::MAX));
        if remaining < min_nodes {
            let (ranks, verb) = if lost.len() == 1 {
                ("rank", "was killed by a signal and counts as a lost node")
            } else {
                ("ranks", "were killed by signals and count as lost nodes")
            };
            report(format!(
                "giving up after attempt {number} of {total}: {ranks} {} {verb}, which leaves {remaining} of {} \
                 nodes, fewer than the minimum of {min_nodes}",
                list(&lost),
                attempt.world_size
            ));
            return Next::TooFewNodes { remaining };
        }
        if remaining != world_size {
            let ranks = if lost.len() == 1 { "rank" } else { "ranks" };
            resized = format!(", with {remaining} nodes instead of {world_size} (lost: {ranks} {})", list(&lost));
            world_size = remaining;
        }
    }
    report(format!("restarting the job (attempt {} of {total}) after {cause}{resized}", number + 1));
    Next::Restart { world_size }
}

/// `1`, `1 and 2`, `1, 2 and 3`.
fn list(ranks: &[u32]) -> String {
    match ranks {
        [] => String::new(),
        [one] => one.to_string(),
        [init @ .., last] => {
            let init: Vec<String> = init.iter().map(u32::to_string).collect();
            format!("{} and {last}", init.join(", "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{RankOutcome, RankStatus};
    use super::*;

    fn attempt(attempt: u32, statuses: &[RankStatus], first_failure: Option<u32>) -> AttemptOutcome {
        let ranks = statuses
            .iter()
            .enumerate()
            .map(|(rank, &status)| RankOutcome {
                rank: rank as u32,
                status,
                stdout: String::new(),
                stderr: String::new(),
            })
            .collect();
        AttemptOutcome {
            attempt,
            world_size: statuses.len() as u32,
            master_port: 1,
            ranks,
            first_failure,
            interrupted: false,
        }
    }

    fn options(max_restarts: u32, min_nodes: Option<u32>) -> LaunchOptions {
        let mut options = LaunchOptions::new(4, "true");
        options.capture = true;
        options.max_restarts = max_restarts;
        options.min_nodes = min_nodes;
        options
    }

    const OK: RankStatus = RankStatus::Exited(0);
    const KILLED: RankStatus = RankStatus::Signaled(9);
    const STOPPED: RankStatus = RankStatus::Stopped;

    #[test]
    fn a_successful_or_last_attempt_finishes() {
        assert_eq!(next(&options(2, None), &attempt(0, &[OK, OK], None)), Next::Finish);
        assert_eq!(next(&options(2, None), &attempt(2, &[OK, RankStatus::Exited(1)], Some(1))), Next::Finish);
        assert_eq!(next(&options(0, Some(1)), &attempt(0, &[OK, KILLED], Some(1))), Next::Finish);
    }

    #[test]
    fn a_fixed_size_job_restarts_with_the_same_size_whatever_ended_it() {
        let failed = attempt(0, &[STOPPED, KILLED, KILLED], Some(1));
        assert_eq!(next(&options(1, None), &failed), Next::Restart { world_size: 3 });
    }

    #[test]
    fn an_elastic_job_loses_one_node_per_killed_rank_but_not_for_stopped_or_exited_ones() {
        let failed = attempt(0, &[STOPPED, KILLED, RankStatus::Exited(3), KILLED], Some(1));
        assert_eq!(next(&options(1, Some(2)), &failed), Next::Restart { world_size: 2 });
        let exited = attempt(0, &[STOPPED, RankStatus::Exited(3), OK], Some(1));
        assert_eq!(next(&options(1, Some(3)), &exited), Next::Restart { world_size: 3 });
        assert_eq!(next(&options(1, Some(3)), &failed), Next::TooFewNodes { remaining: 2 });
    }

    #[test]
    fn ranks_are_listed_as_a_sentence_says_them() {
        assert_eq!(list(&[2]), "2");
        assert_eq!(list(&[1, 2]), "1 and 2");
        assert_eq!(list(&[0, 1, 3]), "0, 1 and 3");
    }
}
