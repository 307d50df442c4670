//! `regflow launch` and `regflow::launch`: every rank gets torchrun's variables, its output
//! arrives line by line under its prefix, and one failing rank (or a signal to the
//! launcher) stops all the others.

use regflow::launch::{launch, LaunchError, LaunchOptions, RankStatus};
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::AtomicBool;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use crate::common;
use common::temp_dir;

/// No launcher in these tests needs longer; past it the test fails instead of hanging.
const DEADLINE: Duration = Duration::from_secs(30);

/// `regflow launch ARGS`, its stdout read line by line into a channel.
struct Launcher {
    child: Child,
    stdout: mpsc::Receiver<String>,
    stderr: std::thread::JoinHandle<String>,
}

impl Launcher {
    fn start(args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut command = Command::new(env!("CARGO_BIN_EXE_regflow"));
        command.arg("launch").args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        command.env_remove("REGFLOW_SECRET").env_remove("REGFLOW_SECRET_FILE").envs(env.iter().copied());
        let mut child = command.spawn().unwrap();
        let (sender, stdout) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let _ = sender.send(line.unwrap());
            }
        });
        let mut err = child.stderr.take().unwrap();
        let stderr = std::thread::spawn(move || {
            let mut text = String::new();
            err.read_to_string(&mut text).unwrap();
            text
        });
        Launcher { child, stdout, stderr }
    }

    /// The next stdout line, within the deadline.
    fn line(&self) -> String {
        self.stdout.recv_timeout(DEADLINE).expect("the launcher printed no further line in time")
    }

    /// Waits (at most the deadline) for the launcher to exit; its status, stdout lines
    /// not yet read, and stderr.
    fn finish(mut self) -> (ExitStatus, Vec<String>, String) {
        let start = Instant::now();
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            if start.elapsed() > DEADLINE {
                self.child.kill().unwrap();
                panic!("regflow launch did not exit within {DEADLINE:?}");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let stdout = self.stdout.iter().collect();
        (status, stdout, self.stderr.join().unwrap())
    }
}

fn run(args: &[&str], env: &[(&str, &str)]) -> (ExitStatus, Vec<String>, String) {
    Launcher::start(args, env).finish()
}

/// Whether process `pid` still exists.
fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 }
}

const ECHO_VARIABLES: &str = "echo rank=$RANK world=$WORLD_SIZE local=$LOCAL_RANK local_world=$LOCAL_WORLD_SIZE \
                              master=$MASTER_ADDR:$MASTER_PORT dev=$REGFLOW_DEVICES_PER_NODE secret=$REGFLOW_SECRET";

#[test]
fn every_rank_sees_its_rank_one_port_and_one_fresh_secret() {
    let (status, lines, stderr) = run(&["--nodes", "3", "--", "sh", "-c", ECHO_VARIABLES], &[]);
    assert!(status.success(), "{stderr}");
    assert_eq!(lines.len(), 3, "{lines:?}");
    let mut masters = BTreeSet::new();
    let mut secrets = BTreeSet::new();
    for rank in 0..3 {
        let prefix = format!("[rank {rank}] rank={rank} world=3 local={rank} local_world=3 master=127.0.0.1:");
        let matching: Vec<&String> = lines.iter().filter(|l| l.starts_with(&prefix)).collect();
        assert_eq!(matching.len(), 1, "rank {rank} in {lines:?}");
        let rest = &matching[0][prefix.len()..];
        let (port, rest) = rest.split_once(' ').unwrap();
        assert!(port.parse::<u16>().unwrap() > 0);
        masters.insert(port.to_string());
        let secret = rest.strip_prefix("dev=1 secret=").unwrap();
        assert_eq!(secret.len(), 64, "{secret}");
        assert!(secret.chars().all(|c| c.is_ascii_hexdigit()), "{secret}");
        secrets.insert(secret.to_string());
    }
    assert_eq!(masters.len(), 1, "all ranks share one MASTER_PORT: {masters:?}");
    assert_eq!(secrets.len(), 1, "all ranks share one secret: {secrets:?}");
}

#[test]
fn given_port_devices_and_secret_reach_every_rank() {
    let args = ["--nodes", "2", "--devices-per-node", "4", "--master-port", "29517", "--", "sh", "-c", ECHO_VARIABLES];
    let (status, mut lines, stderr) = run(&args, &[("REGFLOW_SECRET", "caller-secret")]);
    assert!(status.success(), "{stderr}");
    lines.sort();
    let expected: Vec<String> = (0..2)
        .map(|r| {
            format!(
                "[rank {r}] rank={r} world=2 local={r} local_world=2 master=127.0.0.1:29517 dev=4 secret=caller-secret"
            )
        })
        .collect();
    assert_eq!(lines, expected);
}

#[test]
fn a_secret_file_means_no_generated_secret() {
    let (status, lines, stderr) = run(
        &["--nodes", "1", "--", "sh", "-c", "echo secret=${REGFLOW_SECRET-unset}"],
        &[("REGFLOW_SECRET_FILE", "/x")],
    );
    assert!(status.success(), "{stderr}");
    assert_eq!(lines, ["[rank 0] secret=unset"]);
}

#[test]
fn output_is_forwarded_per_line_on_its_own_stream_with_the_last_partial_line() {
    let script = r#"echo "one $RANK"; echo "err $RANK" >&2; printf "tail $RANK""#;
    let (status, mut lines, stderr) = run(&["--nodes", "2", "--", "sh", "-c", script], &[]);
    assert!(status.success(), "{stderr}");
    lines.sort();
    assert_eq!(lines, ["[rank 0] one 0", "[rank 0] tail 0", "[rank 1] one 1", "[rank 1] tail 1"]);
    let mut errors: Vec<&str> = stderr.lines().collect();
    errors.sort();
    assert_eq!(errors, ["[rank 0] err 0", "[rank 1] err 1"]);
}

#[test]
fn a_failing_rank_stops_the_others_after_the_grace_period() {
    let dir = temp_dir("launch", "failing_rank");
    // Ranks 0 and 2 say they are up, then sleep a minute; rank 1 fails once both are up.
    let script = r#"
        if [ "$RANK" = 1 ]; then
            while [ ! -e "$READY/0" ] || [ ! -e "$READY/2" ]; do sleep 0.02; done
            exit 3
        fi
        echo "pid $$"; touch "$READY/$RANK"; exec sleep 60"#;
    let ready = dir.to_str().unwrap();
    let (status, lines, stderr) = run(&["--nodes", "3", "--grace", "0", "--", "sh", "-c", script], &[("READY", ready)]);
    assert_eq!(status.code(), Some(1), "{stderr}");
    let messages: Vec<&str> = stderr.lines().collect();
    assert_eq!(messages[0], "regflow launch: rank 1 exited with status 3", "{stderr}");
    let mut stopped = messages[1..].to_vec();
    stopped.sort();
    assert_eq!(
        stopped,
        [
            "regflow launch: rank 0 was still running and was stopped",
            "regflow launch: rank 2 was still running and was stopped"
        ]
    );
    let pids: Vec<i32> = lines.iter().map(|l| l.rsplit(' ').next().unwrap().parse().unwrap()).collect();
    assert_eq!(pids.len(), 2, "{lines:?}");
    assert!(pids.iter().all(|&pid| !alive(pid)), "a sleeping rank outlived the launcher: {pids:?}");
}

#[test]
fn a_rank_killed_by_a_signal_is_named() {
    let (status, _, stderr) = run(&["--nodes", "2", "--", "sh", "-c", r#"[ "$RANK" = 1 ] && kill -9 $$; true"#], &[]);
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert_eq!(stderr, "regflow launch: rank 1 was killed by signal 9\n");
}

#[test]
fn sigterm_to_the_launcher_stops_every_rank() {
    let launcher = Launcher::start(&["--nodes", "2", "--", "sh", "-c", "echo pid $$; exec sleep 60"], &[]);
    let pids: Vec<i32> = (0..2).map(|_| launcher.line().rsplit(' ').next().unwrap().parse().unwrap()).collect();
    // SAFETY: sends a signal to the launcher this test started.
    assert_eq!(unsafe { libc::kill(launcher.child.id() as i32, libc::SIGTERM) }, 0);
    let (status, _, stderr) = launcher.finish();
    assert_eq!(status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("rank 0 was still running and was stopped"), "{stderr}");
    assert!(stderr.contains("rank 1 was still running and was stopped"), "{stderr}");
    assert!(pids.iter().all(|&pid| !alive(pid)), "a rank outlived the launcher: {pids:?}");
}

#[test]
fn a_program_that_cannot_start_is_named_with_the_os_error() {
    let (status, lines, stderr) = run(&["--nodes", "2", "--", "/nonexistent/trainer", "--flag"], &[]);
    assert_eq!(status.code(), Some(1));
    assert!(lines.is_empty());
    assert_eq!(stderr, "error: cannot start /nonexistent/trainer for rank 0: No such file or directory (os error 2)\n");
}

#[test]
fn zero_nodes_and_no_program_are_usage_errors() {
    let (status, _, stderr) = run(&["--nodes", "0", "--", "true"], &[]);
    assert_eq!(status.code(), Some(2));
    assert!(stderr.contains("invalid value '0' for '--nodes <N>'"), "{stderr}");
    let (status, _, stderr) = run(&["--nodes", "2"], &[]);
    assert_eq!(status.code(), Some(2));
    assert!(stderr.contains("required arguments were not provided") && stderr.contains("<PROGRAM>"), "{stderr}");
}

#[test]
fn the_library_captures_each_ranks_output_and_status() {
    let mut options = LaunchOptions::new(3, "sh");
    options.args = vec!["-c".into(), r#"echo "out $RANK $EXTRA"; printf "err $RANK" >&2; exit $RANK"#.into()];
    options.env = vec![("EXTRA".into(), "x".into())];
    options.capture = true;
    options.grace = Duration::from_secs(5);
    let outcome = launch(&options).unwrap();
    assert!(!outcome.success());
    assert!(!outcome.interrupted);
    let ranks: Vec<(u32, RankStatus, &str, &str)> =
        outcome.ranks.iter().map(|r| (r.rank, r.status, r.stdout.as_str(), r.stderr.as_str())).collect();
    assert_eq!(
        ranks,
        [
            (0, RankStatus::Exited(0), "out 0 x\n", "err 0"),
            (1, RankStatus::Exited(1), "out 1 x\n", "err 1"),
            (2, RankStatus::Exited(2), "out 2 x\n", "err 2"),
        ]
    );
    assert!(matches!(outcome.first_failure, Some(1 | 2)));
}

#[test]
fn the_library_stops_every_rank_when_its_stop_flag_is_set() {
    let mut options = LaunchOptions::new(2, "sleep");
    options.args = vec!["60".into()];
    options.capture = true;
    options.stop = Some(Arc::new(AtomicBool::new(true)));
    let outcome = launch(&options).unwrap();
    assert!(outcome.interrupted);
    assert!(outcome.ranks.iter().all(|r| r.status == RankStatus::Stopped), "{:?}", outcome.ranks);
}

#[test]
fn the_library_refuses_zero_nodes_and_names_a_program_it_cannot_start() {
    let error = launch(&LaunchOptions::new(0, "true")).unwrap_err();
    assert!(matches!(error, LaunchError::NoNodes));
    let error = launch(&LaunchOptions::new(2, "/nonexistent/trainer")).unwrap_err();
    assert!(matches!(error, LaunchError::Spawn { rank: 0, .. }), "{error}");
}

#[test]
fn the_distributed_guide_shows_its_example_files_as_they_are() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let guide = std::fs::read_to_string(root.join("docs/distributed.md")).unwrap();
    for (file, fence) in
        [("docs/examples/slurm_train.sbatch", "```bash\n"), ("docs/examples/k8s_train.yaml", "```yaml\n")]
    {
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        assert!(guide.contains(&format!("{fence}{text}```\n")), "docs/distributed.md does not show {file} as it is");
    }
}

/// Prints what a rank is told about the attempt; rank 1 of the first attempt fails with 3.
const FAIL_ONCE: &str = r#"echo "rank=$RANK attempt=$REGFLOW_RESTART torch=$TORCHELASTIC_RESTART_COUNT world=$WORLD_SIZE changed=$REGFLOW_WORLD_CHANGED port=$MASTER_PORT"
    if [ "$REGFLOW_RESTART" = 0 ] && [ "$RANK" = 1 ]; then exit 3; fi"#;

/// Prints its attempt and world size; rank 2 of the first attempt kills itself first.
const KILLED_ONCE: &str = r#"if [ "$REGFLOW_RESTART" = 0 ] && [ "$RANK" = 2 ]; then kill -9 $$; fi
    echo "rank=$RANK attempt=$REGFLOW_RESTART world=$WORLD_SIZE changed=$REGFLOW_WORLD_CHANGED""#;

#[test]
fn a_job_that_fails_once_is_restarted_with_the_next_attempt_number_and_a_fresh_port() {
    let (status, lines, stderr) = run(&["--nodes", "2", "--max-restarts", "2", "--", "sh", "-c", FAIL_ONCE], &[]);
    assert!(status.success(), "{stderr}");
    assert_eq!(
        stderr,
        "regflow launch: rank 1 exited with status 3\n\
         regflow launch: restarting the job (attempt 2 of 3) after rank 1 exited with status 3\n"
    );
    // Each attempt's output is complete before the next attempt starts.
    let (first, second) = lines.split_at(2);
    let port = |line: &String| line.rsplit_once("port=").unwrap().1.to_string();
    for (attempt, lines) in [(0, first), (1, second)] {
        let mut lines = lines.to_vec();
        lines.sort();
        let expected: Vec<String> = (0..2)
            .map(|r| format!("[rank {r}] rank={r} attempt={attempt} torch={attempt} world=2 changed=0 port="))
            .collect();
        for (line, expected) in lines.iter().zip(&expected) {
            assert!(line.starts_with(expected), "{line} is not {expected}…: {lines:?}");
        }
        assert_eq!(port(&lines[0]), port(&lines[1]), "one port per attempt: {lines:?}");
    }
    assert_ne!(port(&first[0]), port(&second[0]), "the restart has a fresh MASTER_PORT");
}

#[test]
fn a_job_that_always_fails_is_given_up_after_its_restarts_naming_the_rank() {
    let script = r#"echo "attempt $REGFLOW_RESTART"; if [ "$RANK" = 1 ]; then exit 3; fi"#;
    let (status, mut lines, stderr) = run(&["--nodes", "2", "--max-restarts", "2", "--", "sh", "-c", script], &[]);
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert_eq!(
        stderr,
        "regflow launch: rank 1 exited with status 3\n\
         regflow launch: restarting the job (attempt 2 of 3) after rank 1 exited with status 3\n\
         regflow launch: rank 1 exited with status 3\n\
         regflow launch: restarting the job (attempt 3 of 3) after rank 1 exited with status 3\n\
         regflow launch: rank 1 exited with status 3\n\
         regflow launch: giving up after 3 attempts: in the last one, rank 1 exited with status 3\n"
    );
    lines.sort();
    let expected: Vec<String> = (0..2).flat_map(|r| (0..3).map(move |a| format!("[rank {r}] attempt {a}"))).collect();
    assert_eq!(lines, expected);
}

#[test]
fn an_elastic_job_goes_on_without_a_rank_killed_by_a_signal() {
    let (status, mut lines, stderr) =
        run(&["--nodes", "2:3", "--max-restarts", "1", "--", "sh", "-c", KILLED_ONCE], &[]);
    assert!(status.success(), "{stderr}");
    assert_eq!(
        stderr,
        "regflow launch: rank 2 was killed by signal 9\n\
         regflow launch: restarting the job (attempt 2 of 2) after rank 2 was killed by signal 9, with 2 nodes \
         instead of 3 (lost: rank 2)\n"
    );
    lines.sort();
    assert_eq!(
        lines,
        [
            "[rank 0] rank=0 attempt=0 world=3 changed=0",
            "[rank 0] rank=0 attempt=1 world=2 changed=1",
            "[rank 1] rank=1 attempt=0 world=3 changed=0",
            "[rank 1] rank=1 attempt=1 world=2 changed=1",
        ]
    );
}

#[test]
fn an_elastic_job_below_its_minimum_is_given_up_naming_the_lost_rank() {
    let (status, mut lines, stderr) =
        run(&["--nodes", "3:3", "--max-restarts", "2", "--", "sh", "-c", KILLED_ONCE], &[]);
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert_eq!(
        stderr,
        "regflow launch: rank 2 was killed by signal 9\n\
         regflow launch: giving up after attempt 1 of 3: rank 2 was killed by a signal and counts as a lost node, \
         which leaves 2 of 3 nodes, fewer than the minimum of 3\n"
    );
    lines.sort();
    assert_eq!(lines, ["[rank 0] rank=0 attempt=0 world=3 changed=0", "[rank 1] rank=1 attempt=0 world=3 changed=0"]);
}

#[test]
fn an_elastic_range_needs_a_minimum_of_at_least_one_and_at_most_the_maximum() {
    let (status, _, stderr) = run(&["--nodes", "3:2", "--", "true"], &[]);
    assert_eq!(status.code(), Some(2));
    assert!(
        stderr.contains("invalid value '3:2' for '--nodes <N>': the minimum of 3 nodes is more than the maximum of 2"),
        "{stderr}"
    );
    let (status, _, stderr) = run(&["--nodes", "0:2", "--", "true"], &[]);
    assert_eq!(status.code(), Some(2));
    assert!(stderr.contains("invalid value '0:2' for '--nodes <N>': a job needs at least 1 node, not 0"), "{stderr}");
    let mut options = LaunchOptions::new(2, "true");
    options.min_nodes = Some(3);
    let error = launch(&options).unwrap_err();
    assert!(matches!(error, LaunchError::NodeRange { min_nodes: 3, nodes: 2 }), "{error}");
    assert_eq!(
        error.to_string(),
        "cannot launch an elastic job of at least 3 and at most 2 nodes: the minimum must be at least 1 and at most \
         the maximum"
    );
}

#[test]
fn the_library_reports_every_attempt_with_its_world_size() {
    let mut options = LaunchOptions::new(3, "sh");
    options.args = vec!["-c".into(), KILLED_ONCE.into()];
    options.capture = true;
    options.max_restarts = 3;
    options.min_nodes = Some(1);
    let outcome = launch(&options).unwrap();
    assert!(outcome.success());
    let attempts: Vec<(u32, u32, Vec<u32>, Option<u32>)> =
        outcome.attempts.iter().map(|a| (a.attempt, a.world_size, a.lost_ranks(), a.first_failure)).collect();
    assert_eq!(attempts, [(0, 3, vec![2], Some(2)), (1, 2, vec![], None)]);
    assert_eq!(outcome.attempts[0].failure().map(|r| r.status), Some(RankStatus::Signaled(9)));
    // The outcome's own fields describe the last attempt.
    assert_eq!(outcome.master_port, outcome.attempts[1].master_port);
    assert_eq!(outcome.ranks.len(), 2);
    assert_eq!(outcome.ranks[1].stdout, "rank=1 attempt=1 world=2 changed=1\n");
    assert_eq!(outcome.too_few_nodes, None);
}

#[test]
fn a_rank_the_launcher_stopped_is_neither_the_cause_nor_a_lost_node() {
    // Rank 0 sleeps through the first attempt until the launcher stops it; rank 1 fails.
    let script = r#"if [ "$REGFLOW_RESTART" = 0 ]; then
            if [ "$RANK" = 0 ]; then exec sleep 60; fi
            exit 3
        fi"#;
    let mut options = LaunchOptions::new(2, "sh");
    options.args = vec!["-c".into(), script.into()];
    options.capture = true;
    options.grace = Duration::ZERO;
    options.max_restarts = 1;
    options.min_nodes = Some(2);
    let outcome = launch(&options).unwrap();
    assert!(outcome.success(), "{:?}", outcome.attempts);
    let first = &outcome.attempts[0];
    let statuses: Vec<RankStatus> = first.ranks.iter().map(|r| r.status).collect();
    assert_eq!(statuses, [RankStatus::Stopped, RankStatus::Exited(3)]);
    assert_eq!(first.first_failure, Some(1));
    assert!(first.lost_ranks().is_empty());
    assert_eq!(outcome.attempts[1].world_size, 2);
}

#[test]
fn the_library_gives_up_an_elastic_job_below_its_minimum() {
    let mut options = LaunchOptions::new(3, "sh");
    options.args = vec!["-c".into(), KILLED_ONCE.into()];
    options.capture = true;
    options.max_restarts = 1;
    options.min_nodes = Some(3);
    let outcome = launch(&options).unwrap();
    assert!(!outcome.success());
    assert_eq!(outcome.attempts.len(), 1);
    assert_eq!(outcome.too_few_nodes, Some(2));
    assert_eq!(outcome.failure().map(|r| (r.rank, r.status)), Some((2, RankStatus::Signaled(9))));
}
