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

mod common;
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
