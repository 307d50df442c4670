//! Helpers shared by the root tests: a scratch directory per test, runs of the `regflow`
//! binary that must succeed or fail cleanly (exit code 1, an `error:` sentence, no panic),
//! and the smallest fed plan.
#![allow(dead_code)] // each test file uses some of them

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

/// The arguments that make this test binary run only test `function` of the module at
/// `module_path` (its `module_path!()`), ignored or not, as one rank of a job a test starts:
/// libtest names it by the path without the crate's name, so `--exact` finds it whichever
/// binary holds the module.
pub(crate) fn rank_args(module_path: &str, function: &str) -> Vec<String> {
    let name = match module_path.split_once("::") {
        Some((_crate, module)) => format!("{module}::{function}"),
        None => function.to_string(),
    };
    [name.as_str(), "--exact", "--ignored", "--nocapture", "--test-threads=1"].map(String::from).to_vec()
}

/// A fresh directory under target/tmp for the files of test `test` of file `group`.
pub(crate) fn temp_dir(group: &str, test: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(group).join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `regflow` with these arguments and, if given, this stdin.
pub(crate) fn regflow(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_regflow"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    input.write_all(stdin.unwrap_or("").as_bytes()).unwrap();
    drop(input);
    child.wait_with_output().unwrap()
}

/// Stdout of a run that must succeed.
pub(crate) fn success(args: &[&str]) -> String {
    let out = regflow(args, None);
    assert!(out.status.success(), "regflow {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// Stderr of a run that must fail with exit code 1, not by a panic.
pub(crate) fn failure(args: &[&str], stdin: Option<&str>) -> String {
    let out = regflow(args, stdin);
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(1), "regflow {args:?} should exit with 1: {stderr}");
    assert!(out.stdout.is_empty(), "{}", String::from_utf8_lossy(&out.stdout));
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    stderr
}

/// `src (fed, 8 bytes) -> f (copy) -> sink` on one cpu stream, every register of
/// `register_num` slots.
pub(crate) fn fed_chain(register_num: u32) -> regflow::prelude::Plan {
    use regflow::prelude::*;
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s = b.stream(cpu, StreamKind::Compute);
    let src = b.actor("src", s, ActorKind::Source { pieces: SourcePieces::Fed });
    let x = b.regst("x", src, 8, register_num);
    let f = b.actor("f", s, ActorKind::Compute { kernel: KernelConf::Copy });
    b.consume(f, x);
    let y = b.regst("y", f, 8, register_num);
    let sink = b.actor("sink", s, ActorKind::Sink);
    b.consume(sink, y);
    b.build().unwrap()
}

/// The losses of a job training on graph feeds: pushes every step's `(input, value)` pairs
/// from a thread, closes the feeds, collects each fetched scalar of `fetch` (f32 or f64, as
/// `dtype` says) until the job ends, and waits for it.
pub(crate) fn fed_losses(
    mut job: regflow::prelude::Job,
    fetch: &str,
    steps: Vec<Vec<(&'static str, regflow::graph::HostArray)>>,
    dtype: regflow::graph::DType,
) -> Vec<f64> {
    let mut feeds = job.graph_feeds().unwrap();
    let fetcher = job.fetcher(fetch).unwrap();
    let pusher = std::thread::spawn(move || {
        for step in steps {
            for (name, value) in step {
                feeds.push(name, &value).unwrap();
            }
        }
        feeds.close().unwrap();
    });
    let losses: Vec<f64> = std::iter::from_fn(|| fetcher.recv())
        .map(|piece| match dtype {
            regflow::graph::DType::F64 => f64::from_le_bytes(piece.bytes().try_into().unwrap()),
            _ => f64::from(f32::from_le_bytes(piece.bytes().try_into().unwrap())),
        })
        .collect();
    pusher.join().unwrap();
    let report = job.wait().unwrap();
    assert_eq!(report.lane_waits, 0, "a message between stream threads found its lane full");
    losses
}

/// The loss of the two-layer MLP several tests train, all f32: inputs `x [batch,
/// features]` and `y [batch]`, then `x·w1 + b1` (Kaiming seed 1, zero bias), ReLU,
/// `·w2 + b2` (Xavier seed 2, zero bias) and sparse cross-entropy against `y`.
pub(crate) fn relu_mlp_loss(
    g: &regflow::graph::Graph,
    (batch, features, hidden, classes): (usize, usize, usize, usize),
) -> regflow::graph::Tensor<'_> {
    use regflow::graph::{DType, Init};
    let x = g.input("x", [batch, features], DType::F32).unwrap();
    let y = g.input("y", [batch], DType::I64).unwrap();
    let w1 = g.variable("w1", [features, hidden], DType::F32, Init::Kaiming { seed: 1 }).unwrap();
    let b1 = g.variable("b1", [hidden], DType::F32, Init::Zeros).unwrap();
    let w2 = g.variable("w2", [hidden, classes], DType::F32, Init::Xavier { seed: 2 }).unwrap();
    let b2 = g.variable("b2", [classes], DType::F32, Init::Zeros).unwrap();
    let h = x.matmul(&w1).unwrap().add(&b1).unwrap().relu().unwrap();
    h.matmul(&w2).unwrap().add(&b2).unwrap().sparse_cross_entropy(&y).unwrap()
}

/// The op of every compute actor of `plan` running `op_type`, with the actor's name.
pub(crate) fn ops<'p>(
    plan: &'p regflow::graph::plan::Plan,
    op_type: &str,
) -> Vec<(&'p str, &'p regflow::graph::plan::OpConf)> {
    use regflow::graph::plan::{ActorKind, KernelConf};
    plan.actors
        .iter()
        .filter_map(|a| match &a.kind {
            ActorKind::Compute { kernel: KernelConf::Op(conf) } if conf.op_type == op_type => {
                Some((a.name.as_str(), conf))
            }
            _ => None,
        })
        .collect()
}

/// `Some(true)` on a machine with a GPU, `Some(false)` where NVRTC makes this process's cuda
/// devices dry runs (launches checked, nothing computed), `None` (said why) otherwise: the
/// test then skips.
pub(crate) fn gpu_or_dry_run() -> Option<bool> {
    if regflow::cuda::probe().is_ok() {
        return Some(true);
    }
    match regflow::cuda::enable_dry_run("compute_80") {
        Ok(()) => Some(false),
        Err(e) => {
            eprintln!("skipped (no GPU and no NVRTC for a dry run): {e}");
            None
        }
    }
}
