//! Fuzzed loaders: arbitrary bytes and mutations of valid files (byte flips, truncation,
//! splices, deletions, number changes) given to `Plan::from_json` (then `validate` and a
//! job build), to the checkpoint loader and to `regflow run --feeds`. None may panic,
//! hang or allocate what a header merely claims; each must answer `Ok` or an error.
//!
//! Cases per property: `REGFLOW_FUZZ_CASES` (default 256; the CLI property runs a fiftieth
//! of that, at least 16, since every case starts a process). The figures of a long run are
//! in BENCHMARKS.md ("Issue 12: fuzzing").

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, TestRunner};
use regflow::graph::checkpoint;
use regflow::graph::plan::RegstDesc;
use regflow::graph::sbp::{Mesh, NdSbp, Sbp};
use regflow::graph::{CompileOptions, DType, Graph, HostArray, Init, Optimizer, ParallelOptions};
use regflow::prelude::*;
use std::cell::RefCell;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::common;
use common::{regflow, temp_dir};

fn cases() -> u32 {
    std::env::var("REGFLOW_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(256)
}

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() })
}

/// One edit of a file.
#[derive(Debug, Clone)]
enum Mutation {
    /// Byte at the index set to the value.
    Set(Index, u8),
    /// Bit of the byte at the index flipped.
    Flip(Index, u8),
    /// Cut at the index.
    Truncate(Index),
    /// Bytes from the first index on (up to the length) deleted.
    Delete(Index, usize),
    /// Bytes of the first index (up to the length) copied in at the second, from the same
    /// file or from another seed.
    Splice(Index, usize, Index, bool),
    /// The number at the index (the k-th run of digits) replaced.
    Number(Index, String),
}

/// Numbers that hit limits: 0, 1, negative, u32 and u64 edges, 2^53 + 1, floats, huge.
fn number() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("0".to_string()),
        Just("1".to_string()),
        Just("-1".to_string()),
        Just("4294967295".to_string()),
        Just("4294967296".to_string()),
        Just("18446744073709551615".to_string()),
        Just("18446744073709551616".to_string()),
        Just("9007199254740993".to_string()),
        Just("1152921504606846976".to_string()),
        Just("1099511627776".to_string()),
        Just("2.5".to_string()),
        Just("1e308".to_string()),
        Just("-0".to_string()),
        any::<u64>().prop_map(|n| n.to_string()),
        (0u64..100).prop_map(|n| n.to_string()),
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    // Number changes mostly keep a file well-formed, so they reach validation and job
    // building; the other edits mostly test the parsers.
    prop_oneof![
        1 => (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
        1 => (any::<Index>(), 0u8..8).prop_map(|(i, b)| Mutation::Flip(i, b)),
        1 => any::<Index>().prop_map(Mutation::Truncate),
        1 => (any::<Index>(), 1usize..64).prop_map(|(i, n)| Mutation::Delete(i, n)),
        1 => (any::<Index>(), 1usize..256, any::<Index>(), any::<bool>()).prop_map(|(a, n, b, o)| Mutation::Splice(a, n, b, o)),
        8 => (any::<Index>(), number()).prop_map(|(i, n)| Mutation::Number(i, n)),
    ]
}

/// Applies the edits in order; `other` is the file splices may copy from.
fn mutate(mut bytes: Vec<u8>, other: &[u8], edits: &[Mutation]) -> Vec<u8> {
    for edit in edits {
        let len = bytes.len();
        match edit {
            Mutation::Set(i, b) if len > 0 => bytes[i.index(len)] = *b,
            Mutation::Flip(i, bit) if len > 0 => bytes[i.index(len)] ^= 1 << bit,
            Mutation::Truncate(i) => bytes.truncate(i.index(len + 1)),
            Mutation::Delete(i, n) if len > 0 => {
                let at = i.index(len);
                bytes.drain(at..(at + n).min(len));
            }
            Mutation::Splice(from, n, to, from_other) => {
                let source: &[u8] = if *from_other { other } else { &bytes };
                if !source.is_empty() {
                    let at = from.index(source.len());
                    let piece = source[at..(at + n).min(source.len())].to_vec();
                    let to = to.index(len + 1);
                    bytes.splice(to..to, piece);
                }
            }
            Mutation::Number(k, value) => {
                let runs = digit_runs(&bytes);
                if !runs.is_empty() {
                    let (start, end) = runs[k.index(runs.len())];
                    bytes.splice(start..end, value.bytes());
                }
            }
            _ => {}
        }
    }
    bytes
}

/// `(start, end)` of every run of ASCII digits (with a leading `-`).
fn digit_runs(bytes: &[u8]) -> Vec<(usize, usize)> {
    let mut runs = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i].is_ascii_digit() {
            let start = if i > 0 && bytes[i - 1] == b'-' { i - 1 } else { i };
            let mut end = i;
            while end < bytes.len() && bytes[end].is_ascii_digit() {
                end += 1;
            }
            runs.push((start, end));
            i = end;
        } else {
            i += 1;
        }
    }
    runs
}

/// A safetensors file with its JSON header edited and its length prefix fixed up, so the
/// edit reaches the header's meaning (shapes, offsets, dtypes) instead of its framing.
fn edit_header(file: &[u8], edits: &[Mutation]) -> Vec<u8> {
    let length = file.get(..8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes).unwrap_or(0) as usize;
    let Some(header) = file.get(8..8 + length) else { return mutate(file.to_vec(), &[], edits) };
    let header = mutate(header.to_vec(), &[], edits);
    [(header.len() as u64).to_le_bytes().to_vec(), header, file[8 + length..].to_vec()].concat()
}

/// Valid plan files: a hand-built chain with a loop, a compiled training step (ops,
/// variables, a typed signature) and a data-parallel step on two devices (collectives).
fn plan_seeds() -> Vec<String> {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s = b.stream(cpu, StreamKind::Compute);
    let src = b.actor("src", s, ActorKind::Source { pieces: SourcePieces::Count(3) });
    let x = b.regst("src.out", src, 64, 2);
    let f = b.actor("f", s, ActorKind::Compute { kernel: KernelConf::Copy });
    let state = b.regst("f.state", f, 64, 2);
    b.preload(state, 1);
    b.consume(f, x).consume(f, state);
    let y = b.regst("f.out", f, 64, 1);
    let sink = b.actor("sink", s, ActorKind::Sink);
    b.consume(sink, y);
    let chain = b.build().expect("the chain validates").to_json();

    let g = Graph::new();
    let x = g.input("x", [4, 3], DType::F32).expect("input");
    let labels = g.input("y", [4], DType::I64).expect("input");
    let w = g.variable("w", [3, 2], DType::F32, Init::Xavier { seed: 1 }).expect("variable");
    let loss = x.matmul(&w).and_then(|h| h.relu()).and_then(|h| h.sparse_cross_entropy(&labels)).expect("loss");
    let step = g.minimize(loss, &Optimizer::adamw(1e-2, 0.0)).expect("minimize");
    let one = g.compile(&[step.loss], &step.updates, &CompileOptions::default()).expect("compiles");

    let g = Graph::new();
    let mesh = Mesh::cpu(&[2], &["dp"]).expect("mesh");
    let x = g.input("x", [4, 3], DType::F32).expect("input");
    let labels = g.input("y", [4], DType::I64).expect("input");
    g.set_layout(x, &mesh, NdSbp(vec![Sbp::Split(0)])).expect("layout");
    g.set_layout(labels, &mesh, NdSbp(vec![Sbp::Split(0)])).expect("layout");
    let w = g.variable("w", [3, 2], DType::F32, Init::Zeros).expect("variable");
    let loss = x.matmul(&w).and_then(|h| h.sparse_cross_entropy(&labels)).expect("loss");
    let step = g.minimize(loss, &Optimizer::sgd(0.1, 0.0, 0.0)).expect("minimize");
    let options = ParallelOptions::new(mesh.clone()).train(&step);
    let dp = g.compile_parallel(&[step.loss], &step.updates, &options).expect("compiles");

    // Sharded AdamW state: the weight is gathered in place (a register within another).
    let g = Graph::new();
    let x = g.input("x", [4, 8], DType::F32).expect("input");
    let labels = g.input("y", [4], DType::I64).expect("input");
    g.set_layout(x, &mesh, NdSbp(vec![Sbp::Split(0)])).expect("layout");
    g.set_layout(labels, &mesh, NdSbp(vec![Sbp::Split(0)])).expect("layout");
    let w = g.variable("w", [8, 16], DType::F32, Init::Xavier { seed: 2 }).expect("variable");
    let loss = x.matmul(&w).and_then(|h| h.sparse_cross_entropy(&labels)).expect("loss");
    let step = g.minimize(loss, &Optimizer::adamw(1e-2, 0.0)).expect("minimize");
    for (state, _) in &step.states {
        g.set_layout(*state, &mesh, NdSbp(vec![Sbp::Split(0)])).expect("layout");
    }
    let options = ParallelOptions::new(mesh).train(&step);
    let sharded = g.compile_parallel(&[step.loss], &step.updates, &options).expect("compiles");
    assert!(sharded.plan.regst_descs.iter().any(|r| r.within.is_some()), "the seed gathers in place");
    vec![chain, one.plan.to_json(), dp.plan.to_json(), sharded.plan.to_json()]
}

/// What the plan fuzzers saw.
#[derive(Debug, Default)]
struct PlanStats {
    cases: u64,
    parsed: u64,
    built: u64,
    build_errors: u64,
    skipped_big: u64,
}

/// Whether building a job of `plan` stays small. The runtime sizes its inboxes by
/// `register_num` (runtime/src/job/setup.rs `inbox_capacities`), so a plan file with 2^26
/// slots aborts the process and one with 2^32 exhausts memory; it draws every variable
/// whole on the host (`write_variables`, runtime/src/job/setup.rs:38, `Init::value`), so
/// a variable whose logical meta claims 2^36 bytes aborts it too, whatever its part.
/// Both are reported, not ours to fix: such plans are validated but not built here.
fn small_enough(plan: &Plan) -> bool {
    let slots: u64 = plan.regst_descs.iter().map(|r: &RegstDesc| u64::from(r.register_num)).sum();
    let bytes: u64 =
        plan.regst_descs.iter().map(|r| r.bytes.saturating_mul(u64::from(r.register_num))).fold(0, u64::saturating_add);
    let variables = plan
        .variables
        .iter()
        .map(|v| v.meta.shape.dims().iter().fold(v.meta.dtype.size() as u64, |n, &d| n.saturating_mul(d as u64)));
    let variable_bytes = variables.fold(0, u64::saturating_add);
    slots <= 4096 && bytes <= 64 << 20 && variable_bytes <= 64 << 20 && plan.streams.len() <= 64
}

/// Loads `text`; a plan that loads validates, and a job of it builds or fails cleanly.
fn load_plan(text: &str, data_dir: &Path, stats: &mut PlanStats) {
    stats.cases += 1;
    let Ok(plan) = Plan::from_json(text) else { return };
    stats.parsed += 1;
    assert_eq!(plan.validate(), Ok(()), "from_json returned a plan that does not validate");
    if !small_enough(&plan) {
        stats.skipped_big += 1;
        return;
    }
    match Job::builder(plan).watchdog(Duration::from_millis(300)).data_dir(data_dir).build() {
        // Dropping a job aborts it and joins its threads.
        Ok(job) => {
            stats.built += 1;
            drop(job);
        }
        Err(error) => {
            stats.build_errors += 1;
            let message = error.to_string();
            assert!(!message.is_empty() && !message.contains("panicked"), "{message}");
        }
    }
}

#[test]
fn plan_files_never_panic_when_mutated() {
    let seeds = plan_seeds();
    let dir = temp_dir("fuzz_loaders", "plans");
    let stats = RefCell::new(PlanStats::default());
    let started = Instant::now();
    let strategy = (0..seeds.len(), 0..seeds.len(), prop::collection::vec(mutation(), 1..3));
    runner(cases())
        .run(&strategy, |(seed, other, edits)| {
            let bytes = mutate(seeds[seed].clone().into_bytes(), seeds[other].as_bytes(), &edits);
            load_plan(&String::from_utf8_lossy(&bytes), &dir, &mut stats.borrow_mut());
            Ok(())
        })
        .unwrap();
    eprintln!("plan mutations: {:?} in {:.1?}", stats.borrow(), started.elapsed());
}

#[test]
fn arbitrary_bytes_are_never_a_plan_and_never_a_panic() {
    let dir = temp_dir("fuzz_loaders", "plan_bytes");
    let stats = RefCell::new(PlanStats::default());
    let bytes = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..512),
        // Text that starts like a plan, so the parser gets past the first byte.
        prop::collection::vec(any::<u8>(), 0..512)
            .prop_map(|tail| [b"{\"schema_version\": 2, ".to_vec(), tail].concat()),
    ];
    runner(cases())
        .run(&bytes, |bytes| {
            load_plan(&String::from_utf8_lossy(&bytes), &dir, &mut stats.borrow_mut());
            Ok(())
        })
        .unwrap();
    eprintln!("plan bytes: {:?}", stats.borrow());
}

/// A valid checkpoint of f32, f64 and i64 tensors.
fn checkpoint_seed(path: &Path) -> Vec<u8> {
    let tensors = vec![
        ("w".to_string(), HostArray::f32([2, 3], vec![0.5; 6]).expect("value")),
        ("m".to_string(), HostArray::f64([3], vec![1.5; 3]).expect("value")),
        ("step".to_string(), HostArray::i64([], vec![7]).expect("value")),
    ];
    checkpoint::save(path, &tensors).expect("saves");
    std::fs::read(path).expect("reads")
}

#[test]
fn checkpoints_never_panic_when_mutated_or_arbitrary() {
    let dir = temp_dir("fuzz_loaders", "checkpoints");
    let seed = checkpoint_seed(&dir.join("seed.safetensors"));
    let path = dir.join("case.safetensors");
    let loaded = RefCell::new((0u64, 0u64));
    let started = Instant::now();
    // Edits of the whole file, edits of the header alone (framing kept), arbitrary bytes.
    let strategy = prop_oneof![
        2 => prop::collection::vec(mutation(), 1..4).prop_map(|edits| (0, edits)),
        2 => prop::collection::vec(mutation(), 1..3).prop_map(|edits| (1, edits)),
        1 => Just((2, Vec::new())),
    ];
    let arbitrary = prop::collection::vec(any::<u8>(), 0..128);
    runner(cases())
        .run(&(strategy, arbitrary), |((how, edits), arbitrary)| {
            let bytes = match how {
                0 => mutate(seed.clone(), &arbitrary, &edits),
                1 => edit_header(&seed, &edits),
                _ => [(arbitrary.len() as u64).to_le_bytes().to_vec(), arbitrary].concat(),
            };
            std::fs::write(&path, &bytes).expect("writes the case");
            let mut counts = loaded.borrow_mut();
            counts.0 += 1;
            if let Ok(tensors) = checkpoint::load(&path) {
                counts.1 += 1;
                // Nothing is bigger than the file said and held.
                let held: usize = tensors.iter().map(|(_, t)| t.to_le_bytes().len()).sum();
                assert!(held <= bytes.len(), "{held} bytes loaded from a {}-byte file", bytes.len());
            }
            Ok(())
        })
        .unwrap();
    let (cases, ok) = *loaded.borrow();
    eprintln!("checkpoints: {cases} cases, {ok} loaded, in {:.1?}", started.elapsed());
}

/// A compiled plan with fed inputs `x` f32[2, 3] and `y` i64[2], and a feeds file of 2
/// steps for it.
fn cli_seed(dir: &Path) -> (String, Vec<u8>) {
    let g = Graph::new();
    let x = g.input("x", [2, 3], DType::F32).expect("input");
    let y = g.input("y", [2], DType::I64).expect("input");
    let w = g.variable("w", [3, 2], DType::F32, Init::Zeros).expect("variable");
    let loss = x.matmul(&w).and_then(|h| h.sparse_cross_entropy(&y)).expect("loss");
    let plan = g.compile(&[loss], &[], &CompileOptions::default()).expect("compiles").plan;
    let plan_path = dir.join("plan.json");
    std::fs::write(&plan_path, plan.to_json()).expect("writes the plan");
    let feeds = dir.join("seed.safetensors");
    let tensors = vec![
        ("x".to_string(), HostArray::f32([2, 2, 3], vec![0.25; 12]).expect("value")),
        ("y".to_string(), HostArray::i64([2, 2], vec![1, 0, 0, 1]).expect("value")),
    ];
    checkpoint::save(&feeds, &tensors).expect("saves");
    (plan_path.to_str().expect("utf-8 path").to_string(), std::fs::read(&feeds).expect("reads"))
}

#[test]
fn the_cli_feeds_reader_never_panics_on_mutated_feeds() {
    let dir = temp_dir("fuzz_loaders", "cli_feeds");
    let (plan, seed) = cli_seed(&dir);
    let feeds = dir.join("case.safetensors");
    let feeds_arg = feeds.to_str().expect("utf-8 path").to_string();
    let ran = RefCell::new((0u64, 0u64));
    let started = Instant::now();
    runner((cases() / 50).max(16))
        .run(&(any::<bool>(), prop::collection::vec(mutation(), 1..3)), |(header_only, edits)| {
            let bytes = if header_only { edit_header(&seed, &edits) } else { mutate(seed.clone(), &[], &edits) };
            std::fs::write(&feeds, bytes).expect("writes the case");
            let out = regflow(&["run", &plan, "--feeds", &feeds_arg], None);
            let stderr = String::from_utf8_lossy(&out.stderr);
            prop_assert!(matches!(out.status.code(), Some(0 | 1)), "exit {:?}: {stderr}", out.status);
            prop_assert!(!stderr.contains("panicked"), "{stderr}");
            let mut counts = ran.borrow_mut();
            counts.0 += 1;
            counts.1 += u64::from(out.status.success());
            if std::env::var_os("REGFLOW_FUZZ_VERBOSE").is_some() {
                eprintln!("{edits:?}: {stderr}");
            }
            Ok(())
        })
        .unwrap();
    let (cases, ok) = *ran.borrow();
    eprintln!("cli feeds: {cases} cases, {ok} ran, in {:.1?}", started.elapsed());
}
