//! Restarts and elastic runs end to end: `regflow launch --max-restarts` restarts a job
//! whose rank was killed from its latest complete sharded checkpoint, on as many nodes as
//! before or, with `--nodes MIN:MAX`, on the nodes still alive (the program recompiles its
//! layout for the new world size and the checkpoint is resharded into it). The losses after
//! the restart equal those of a run that never stopped: bitwise on the same layout, within
//! f32 tolerance on another.
//!
//! Each rank is this test binary again (`rank_of_a_restartable_job`): it trains a small
//! MLP data-parallel over WORLD_SIZE nodes in jobs of [`CHUNK`] steps, saves a sharded
//! checkpoint after each, and on a restart resumes from the latest one.

use crate::common::rank_args;
use crate::small_mlp;

use regflow::graph::sbp::{Mesh, NdSbp, Sbp};
use regflow::graph::{DType, Graph, HostArray, Init, Optimizer, ParallelOptions};
use regflow::prelude::*;
use regflow::runtime::{ClusterEnv, ClusterOptions, ClusterSession};
use regflow::train::sharded::{checkpoint_dir, latest_complete, load_sharded, save_sharded};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

const BATCH: usize = 12;
const STEPS: u64 = 20;
/// Steps per job: a checkpoint after each.
const CHUNK: u64 = 10;

const DIR_VAR: &str = "REGFLOW_TEST_CHECKPOINTS";
/// `rank:steps`: on the first attempt, that rank kills itself (SIGKILL) after pushing
/// that many steps of its second job.
const KILL_VAR: &str = "REGFLOW_TEST_KILL";

fn batches() -> Vec<(HostArray, HostArray)> {
    small_mlp::batches(STEPS as usize, BATCH, 9)
}

/// The MLP data-parallel over `nodes` nodes of one cpu device each (the rows of a batch
/// split over them); its plan and the loss's sink.
fn compile(nodes: usize) -> (regflow::graph::plan::Plan, String) {
    use Sbp::{Broadcast as B, Split as S};
    let mesh = Mesh::cpu(&[nodes], &["dp"]).unwrap().place_on_nodes(1).unwrap();
    let g = Graph::new();
    let x = g.input("x", [BATCH, 6], DType::F32).unwrap();
    let y = g.input("y", [BATCH], DType::I64).unwrap();
    let w1 = g.variable("w1", [6, 16], DType::F32, Init::Kaiming { seed: 1 }).unwrap();
    let b1 = g.variable("b1", [16], DType::F32, Init::Zeros).unwrap();
    let w2 = g.variable("w2", [16, 3], DType::F32, Init::Xavier { seed: 2 }).unwrap();
    for (t, sbp) in [(x, S(0)), (y, S(0)), (w1, B), (b1, B), (w2, B)] {
        g.set_layout(t, &mesh, NdSbp(vec![sbp])).unwrap();
    }
    let loss = x.matmul(&w1).unwrap().add(&b1).unwrap().relu().unwrap().matmul(&w2).unwrap();
    let train = g.minimize(loss.sparse_cross_entropy(&y).unwrap(), &Optimizer::adamw(1e-2, 1e-3)).unwrap();
    let compiled =
        g.compile_parallel(&[train.loss], &train.updates, &ParallelOptions::new(mesh).train(&train)).unwrap();
    (compiled.plan, compiled.fetches[0].clone())
}

/// Runs steps `from..to` as one job (joined to the other nodes through `session` when
/// given), from `state`; returns the losses where delivered here and the job's report.
fn run_steps(
    session: Option<&mut ClusterSession>,
    nodes: usize,
    state: Option<&StateDict>,
    from: u64,
    to: u64,
    kill_after: Option<u64>,
) -> (Option<Vec<f32>>, JobReport) {
    let (plan, loss) = compile(nodes);
    let mut builder = Job::builder(plan.clone()).watchdog(Duration::from_secs(60)).keep_state();
    if let Some(state) = state {
        builder = builder.load_state_dict(state, true).unwrap().0;
    }
    if let Some(session) = session {
        builder = builder.cluster(session.join(&plan).unwrap());
    }
    let mut job = builder.build().unwrap();
    let mut feeds = job.graph_feeds().unwrap();
    let fetcher = job.has_output(&loss).then(|| job.fetcher(&loss).unwrap());
    let pusher = std::thread::spawn(move || {
        for (pushed, (xs, ys)) in batches().into_iter().take(to as usize).skip(from as usize).enumerate() {
            if kill_after == Some(pushed as u64) {
                // SAFETY: kill(2) on this very process; nothing is left to clean up.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            }
            if feeds.push("x", &xs).is_err() || feeds.push("y", &ys).is_err() {
                return;
            }
        }
        let _ = feeds.close();
    });
    let losses = fetcher
        .as_ref()
        .map(|f| std::iter::from_fn(|| f.recv()).map(|p| f32::from_le_bytes(p.bytes().try_into().unwrap())).collect());
    drop(fetcher);
    let _ = pusher.join();
    match job.wait() {
        Ok(report) => (losses, report),
        Err(e) => {
            println!("RANK ERROR {e}");
            std::process::exit(3);
        }
    }
}

/// One rank: resumes from the latest complete checkpoint (if any), then trains to the end
/// in jobs of `CHUNK` steps, checkpointing after each. The rank that receives the loss
/// prints `LOSS attempt step bits` per step.
#[test]
#[ignore = "a rank of the restart tests, which start it"]
fn rank_of_a_restartable_job() {
    let (Some(env), Ok(root)) = (ClusterEnv::from_env().unwrap(), std::env::var(DIR_VAR)) else { return };
    let root = Path::new(&root);
    let attempt: u32 = std::env::var("REGFLOW_RESTART").ok().and_then(|a| a.parse().ok()).unwrap_or(0);
    let kill: Option<(u32, u64)> = std::env::var(KILL_VAR).ok().and_then(|k| {
        let (rank, steps) = k.split_once(':')?;
        Some((rank.parse().ok()?, steps.parse().ok()?))
    });
    let (mut step, mut state) = match latest_complete(root) {
        Some(dir) => {
            let checkpoint = load_sharded(&dir).unwrap();
            (checkpoint.step, Some(checkpoint.into_state_dict()))
        }
        None => (0, None),
    };
    // One control plane for the attempt; each chunk is a job of its own.
    let options = ClusterOptions { timeout: Duration::from_secs(60), ..ClusterOptions::default() };
    let mut session = ClusterSession::connect(&env, &options).unwrap();
    let mut job_index = 0u16;
    while step < STEPS {
        let to = (step + CHUNK).min(STEPS);
        let kill_after = kill.filter(|&(rank, _)| attempt == 0 && job_index == 1 && rank == env.rank).map(|(_, s)| s);
        let (losses, report) = run_steps(Some(&mut session), env.world as usize, state.as_ref(), step, to, kill_after);
        for (k, loss) in losses.iter().flatten().enumerate() {
            println!("LOSS {attempt} {} {}", step + k as u64 + 1, loss.to_bits());
        }
        let parts = report.state_parts.expect("keep_state");
        let dir = checkpoint_dir(root, to);
        save_sharded(&dir, env.rank, env.world, to, &parts, &serde_json::json!({})).unwrap();
        // Rank 0 completes the checkpoint (its index) once every rank's parts are written.
        let saved = std::time::Instant::now();
        while latest_complete(root).as_deref() != Some(dir.as_path()) {
            assert!(saved.elapsed() < Duration::from_secs(60), "rank 0 never completed {}", dir.display());
            std::thread::sleep(Duration::from_millis(5));
        }
        state = Some(load_sharded(&dir).unwrap().into_state_dict());
        step = to;
        job_index += 1;
    }
}

/// The losses of steps `11..=20` of one process that never stopped, on `nodes` devices.
fn uninterrupted(nodes: usize) -> Vec<f32> {
    let (losses, report) = run_steps(None, nodes, None, 0, CHUNK, None);
    let state = StateDict::from_report(&report).unwrap();
    let (rest, _) = run_steps(None, nodes, Some(&state), CHUNK, STEPS, None);
    let first = losses.unwrap();
    assert_eq!(first.len(), CHUNK as usize);
    rest.unwrap()
}

/// Runs the ranks under `regflow launch` with `args`; returns (attempt, step, loss) lines.
fn launch(name: &str, args: &[&str], kill: &str) -> (Vec<(u32, u64, f32)>, String) {
    let root = std::env::temp_dir().join(format!("regflow-restart-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_regflow"));
    command.arg("launch").args(args).arg("--").arg(std::env::current_exe().unwrap());
    command.args(rank_args(module_path!(), "rank_of_a_restartable_job"));
    let child =
        command.env(DIR_VAR, &root).env(KILL_VAR, kill).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let output = wait_bounded(child, Duration::from_secs(180));
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "the launch failed:\n{text}");
    let losses = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| {
            let rest = l.split_once("LOSS ")?.1;
            let mut words = rest.split(' ');
            let attempt = words.next()?.parse().ok()?;
            let step = words.next()?.parse().ok()?;
            let bits: u32 = words.next()?.parse().ok()?;
            Some((attempt, step, f32::from_bits(bits)))
        })
        .collect();
    let _ = std::fs::remove_dir_all(&root);
    (losses, text)
}

fn wait_bounded(mut child: std::process::Child, limit: Duration) -> std::process::Output {
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("the launch hung: {}", String::from_utf8_lossy(&child.wait_with_output().unwrap().stdout));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// The losses of steps 11..=20 the last attempt printed.
fn resumed(losses: &[(u32, u64, f32)], text: &str) -> Vec<f32> {
    let last = losses.iter().map(|(a, _, _)| *a).max().unwrap_or_else(|| panic!("no losses:\n{text}"));
    assert_eq!(last, 1, "one restart:\n{text}");
    let steps: Vec<(u64, f32)> = losses.iter().filter(|(a, _, _)| *a == last).map(|(_, s, l)| (*s, *l)).collect();
    assert_eq!(steps.iter().map(|(s, _)| *s).collect::<Vec<_>>(), (CHUNK + 1..=STEPS).collect::<Vec<_>>(), "{text}");
    steps.into_iter().map(|(_, l)| l).collect()
}

#[test]
fn a_killed_rank_restarts_the_job_from_its_checkpoint_with_the_same_losses() {
    let (losses, text) = launch("same", &["--nodes", "2", "--max-restarts", "1"], "1:3");
    // The first attempt ended because rank 1 was killed (the others then failed naming it).
    assert!(text.contains("rank 1 was killed by signal 9"), "{text}");
    assert!(text.contains("restarting the job (attempt 2 of 2)"), "{text}");
    assert_eq!(resumed(&losses, &text), uninterrupted(2), "{text}");
}

#[test]
fn an_elastic_job_goes_on_with_the_nodes_left_from_its_checkpoint() {
    // Four nodes; one is killed in steps 11–20; the job goes on with three, the
    // checkpoint of step 10 resharded from dp4 into dp3.
    let (losses, text) = launch("elastic", &["--nodes", "3:4", "--max-restarts", "1"], "2:3");
    assert!(text.contains("rank 2 was killed by signal 9"), "{text}");
    assert!(text.contains("with 3 nodes instead of 4 (lost: rank 2)"), "{text}");
    let got = resumed(&losses, &text);
    let want = uninterrupted(4);
    for (step, (a, b)) in got.iter().zip(&want).enumerate() {
        let relative = (a - b).abs() / b.abs().max(1e-12);
        assert!(relative <= 1e-5, "step {}: {a} on 3 nodes after the restart, {b} on 4 uninterrupted", step + 11);
    }
}
