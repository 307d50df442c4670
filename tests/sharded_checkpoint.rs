//! Sharded checkpoints: a dp2 × tp2 job spread over 2 nodes (loopback threads) saves one
//! shard per node after 10 steps; resuming from it gives bitwise the losses of an unbroken
//! run on the same layout, and within f32 rounding of them on other layouts (a pipeline
//! of two single-device stages, one device, tp4 over 2 nodes). Sharded optimizer state
//! (ZeRO stage 1) over 2 nodes saves and resumes the same way. A save cut short leaves the
//! previous checkpoint as the latest complete one; bad files are refused, naming file and
//! tensor.

use crate::small_mlp;
use regflow::graph::sbp::{Mesh, MeshDevice, Sbp};
use regflow::graph::{DType, Graph, HostArray, ParallelOptions};

use regflow::prelude::*;
use regflow::runtime::{Cluster, StatePart};
use regflow::train::sharded::{checkpoint_dir, save_sharded_async, save_sharded_within, INDEX_FILE};
use serde_json::json;
use small_mlp::Layout;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use Sbp::{Broadcast as B, Split as S};

const BATCH: usize = 8;
const STEPS: usize = 20;
const SAVED_AT: usize = 10;

/// dp2 × tp2 with the tensor-parallel axis outermost, spread over 2 nodes of 2 devices:
/// node 0 holds the first tensor-parallel half of the weights, node 1 the second, so each
/// rank's shard holds parts the other's does not.
fn tp_dp_on_2_nodes() -> Layout {
    let pins = vec![
        ("x", vec![B, S(0)]),
        ("y", vec![B, S(0)]),
        ("w1", vec![S(1), B]),
        ("b1", vec![S(0), B]),
        ("w2", vec![S(0), B]),
    ];
    let mesh = Mesh::cpu(&[2, 2], &["tp", "dp"]).unwrap().place_on_nodes(2).unwrap();
    Layout::on(vec![mesh], pins)
}

fn device(index: u16) -> Mesh {
    Mesh::new(vec![MeshDevice { node: 0, kind: DeviceKind::Cpu, index }], &[1], &["pp"]).unwrap()
}

/// Two pipeline stages of one device each.
fn pp2() -> Layout {
    Layout::on(vec![device(0), device(1)], Vec::new())
}

/// Megatron over 4 devices (hidden 16 splits 4 ways), spread over 2 nodes of 2.
fn tp4_on_2_nodes() -> Layout {
    let pins = vec![("w1", vec![S(1)]), ("b1", vec![S(0)]), ("w2", vec![S(0)])];
    Layout::on(vec![Mesh::cpu(&[4], &["tp"]).unwrap().place_on_nodes(2).unwrap()], pins)
}

/// Sharded optimizer state (ZeRO stage 1) over 2 nodes: weights replicated, every AdamW
/// moment split, so each weight's register is written by the all-gather of its rows.
fn zero1_on_2_nodes() -> Layout {
    Layout::on(vec![Mesh::cpu(&[2], &["dp"]).unwrap().place_on_nodes(1).unwrap()], small_mlp::sharded_state_pins())
}

fn one_device() -> Layout {
    Layout::on(vec![device(0)], Vec::new())
}

/// The batches every run here trains on.
fn batches() -> Vec<(HostArray, HostArray)> {
    small_mlp::batches(STEPS, BATCH, 5)
}

fn compile_model(layout: &Layout, hidden: usize) -> (regflow::graph::plan::Plan, String) {
    let g = Graph::new();
    let train = small_mlp::model(&g, layout, BATCH, hidden);
    let options = ParallelOptions::new(layout.stages[0].clone()).train(&train);
    let compiled = g.compile_parallel(&[train.loss], &train.updates, &options).unwrap();
    (compiled.plan, compiled.fetches[0].clone())
}

fn compile(layout: &Layout) -> (regflow::graph::plan::Plan, String) {
    compile_model(layout, 16)
}

/// Feeds steps `steps` (only this node's parts go anywhere) and, where the loss is
/// delivered here, returns their losses; the report when the job ends.
fn train_node(mut job: Job, loss: &str, steps: Range<usize>) -> (Option<Vec<f32>>, JobReport) {
    let mut feeds = job.graph_feeds().unwrap();
    let fetcher = job.has_output(loss).then(|| job.fetcher(loss).unwrap());
    let pusher = std::thread::spawn(move || {
        for (xs, ys) in &batches()[steps] {
            feeds.push("x", xs).unwrap();
            feeds.push("y", ys).unwrap();
        }
        feeds.close().unwrap();
    });
    let losses = fetcher
        .as_ref()
        .map(|f| std::iter::from_fn(|| f.recv()).map(|p| f32::from_le_bytes(p.bytes().try_into().unwrap())).collect());
    drop(fetcher);
    pusher.join().unwrap();
    (losses, job.wait().unwrap())
}

/// A job of `plan` for this node, preloaded with `state` when there is one.
fn builder(plan: &regflow::graph::plan::Plan, state: Option<&StateDict>) -> JobBuilder {
    let builder = Job::builder(plan.clone()).watchdog(Duration::from_secs(30)).keep_state();
    match state {
        Some(state) => builder.load_state_dict(state, true).unwrap().0,
        None => builder,
    }
}

/// Runs `steps` of `layout` in one process; its losses and report.
fn one_process(layout: &Layout, state: Option<&StateDict>, steps: Range<usize>) -> (Vec<f32>, JobReport) {
    let (plan, loss) = compile(layout);
    let (losses, report) = train_node(builder(&plan, state).build().unwrap(), &loss, steps);
    (losses.unwrap(), report)
}

/// Runs `steps` of `layout` as one job per node; the losses, and each node's report.
fn across_nodes(layout: &Layout, state: Option<&StateDict>, steps: Range<usize>) -> (Vec<f32>, Vec<JobReport>) {
    let (plan, loss) = compile(layout);
    let threads: Vec<_> = Cluster::loopback(layout.nodes())
        .unwrap()
        .into_iter()
        .map(|cluster| {
            let (loss, steps) = (loss.clone(), steps.clone());
            let job = builder(&plan, state).cluster(cluster);
            std::thread::spawn(move || train_node(job.build().unwrap(), &loss, steps))
        })
        .collect();
    let mut losses = Vec::new();
    let mut reports = Vec::new();
    for thread in threads {
        let (found, report) = thread.join().unwrap();
        losses.extend(found);
        reports.push(report);
    }
    assert_eq!(losses.len(), 1, "exactly one node delivers the loss");
    (losses.remove(0), reports)
}

fn temp_root(name: &str) -> PathBuf {
    let root = std::env::temp_dir().join(format!("regflow-sharded-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    root
}

/// Trains the first 10 steps on 2 nodes and saves each node's parts as its rank's shard
/// into `root/step10`, as every rank of a real job would (rank 0 writing the index last);
/// the whole state an unsplit run of the same layout reached there.
fn save_after_10_steps(root: &Path) -> StateDict {
    let (_, reports) = across_nodes(&tp_dp_on_2_nodes(), None, 0..SAVED_AT);
    let dir = checkpoint_dir(root, SAVED_AT as u64);
    let saves: Vec<_> = reports
        .into_iter()
        .enumerate()
        .map(|(rank, report)| {
            let parts = report.state_parts.expect("kept state has its parts");
            let extra = json!({ "next_batch": SAVED_AT });
            save_sharded_async(dir.clone(), rank as u32, 2, SAVED_AT as u64, parts, extra)
        })
        .collect();
    for save in saves {
        save.wait().unwrap();
    }
    let (_, whole) = one_process(&tp_dp_on_2_nodes(), None, 0..SAVED_AT);
    whole.state_dict().unwrap()
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (step, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= 1e-5 * w.abs().max(1e-3), "{what}: step {}: {g} vs {w}", SAVED_AT + step + 1);
    }
}

#[test]
fn a_sharded_checkpoint_resumes_bitwise_on_its_layout_and_closely_on_any_other() {
    let root = temp_root("resume");
    let want_state = save_after_10_steps(&root);
    let (unbroken, _) = across_nodes(&tp_dp_on_2_nodes(), None, 0..STEPS);
    assert!(unbroken[STEPS - 1] < unbroken[0], "the loss went down: {unbroken:?}");

    let dir = latest_complete(&root).expect("the checkpoint is complete");
    assert_eq!(dir, checkpoint_dir(&root, SAVED_AT as u64));
    // Each rank wrote the tensor-parallel half it holds: neither shard is the whole model.
    let shard = |rank: u32| regflow::graph::checkpoint::load(&dir.join(format!("rank{rank}.safetensors"))).unwrap();
    let (rank0, rank1) = (shard(0), shard(1));
    assert!(rank0.iter().any(|(n, _)| n == "w1@0_0") && rank1.iter().any(|(n, _)| n == "w1@0_8"), "{rank1:?}");
    assert!(rank1.iter().all(|(n, _)| !n.starts_with("b2@")), "a replica is written once, by rank 0");

    let checkpoint = load_sharded(&dir).unwrap();
    assert_eq!((checkpoint.step, checkpoint.world), (SAVED_AT as u64, 2));
    assert_eq!(checkpoint.extra, json!({ "next_batch": SAVED_AT }));
    let state = checkpoint.state_dict();
    assert_eq!(state.len(), want_state.len());
    assert!(state.len() > 4, "weights and AdamW state: {:?}", state.names().collect::<Vec<_>>());
    for (name, value) in want_state.iter() {
        assert_eq!(state.get(name), Some(value), "{name}: the gathered shards are the whole state");
    }

    // (a) The same layout on 2 nodes: bitwise.
    let (same, _) = across_nodes(&tp_dp_on_2_nodes(), Some(&state), SAVED_AT..STEPS);
    assert_eq!(same, unbroken[SAVED_AT..], "resumed on the saving layout");
    // (b) Two pipeline stages of one device, (c) one device: resharded by the new plan.
    let (pipelined, _) = one_process(&pp2(), Some(&state), SAVED_AT..STEPS);
    assert_close(&pipelined, &unbroken[SAVED_AT..], "resumed on pp2");
    let (single, _) = one_process(&one_device(), Some(&state), SAVED_AT..STEPS);
    assert_close(&single, &unbroken[SAVED_AT..], "resumed on one device");
    // (d) Four-way tensor parallel on 2 nodes: every weight cut anew.
    let (tp4, _) = across_nodes(&tp4_on_2_nodes(), Some(&state), SAVED_AT..STEPS);
    assert_close(&tp4, &unbroken[SAVED_AT..], "resumed on tp4 over 2 nodes");
    std::fs::remove_dir_all(&root).unwrap();
}

/// Under sharded optimizer state each rank saves its half of every moment and rank 0 the
/// replicated weights (read from the registers their all-gathers write); the checkpoint
/// resumes bitwise on its layout and closely on one device.
#[test]
fn sharded_optimizer_state_saves_and_resumes() {
    let root = temp_root("zero1");
    let layout = zero1_on_2_nodes();
    let (unbroken, _) = across_nodes(&layout, None, 0..STEPS);
    let (_, reports) = across_nodes(&layout, None, 0..SAVED_AT);
    assert_eq!(reports.len(), 2, "one job per node");
    let dir = checkpoint_dir(&root, SAVED_AT as u64);
    let saves: Vec<_> = reports
        .into_iter()
        .enumerate()
        .map(|(rank, report)| {
            let parts = report.state_parts.expect("kept state has its parts");
            save_sharded_async(dir.clone(), rank as u32, 2, SAVED_AT as u64, parts, json!({}))
        })
        .collect();
    // Rank 1 first: a failure of its save surfaces at once, not when rank 0 gives up
    // waiting for its list.
    for save in saves.into_iter().rev() {
        save.wait().unwrap();
    }
    let shard = |rank: u32| regflow::graph::checkpoint::load(&dir.join(format!("rank{rank}.safetensors"))).unwrap();
    let names = |rank: u32| shard(rank).into_iter().map(|(n, _)| n).collect::<Vec<String>>();
    let (rank0, rank1) = (names(0), names(1));
    assert!(rank0.iter().any(|n| n.starts_with("w1@")) && !rank1.iter().any(|n| n.starts_with("w1@")), "{rank1:?}");
    assert!(rank1.iter().any(|n| n.starts_with("w1.adam_m@")), "each rank writes its half of a moment: {rank1:?}");
    let state = load_sharded(&dir).unwrap().state_dict();
    let (same, _) = across_nodes(&layout, Some(&state), SAVED_AT..STEPS);
    assert_eq!(same, unbroken[SAVED_AT..], "resumed on the saving layout");
    let (single, _) = one_process(&one_device(), Some(&state), SAVED_AT..STEPS);
    assert_close(&single, &unbroken[SAVED_AT..], "resumed on one device");
    std::fs::remove_dir_all(&root).unwrap();
}

/// A small checkpoint of 2 ranks written straight from parts: `w` (2 × 4) split by
/// columns, rank 1 holding columns 2..4, and a scalar `step` on rank 0.
fn small_parts() -> [Vec<StatePart>; 2] {
    let meta = regflow::graph::plan::TensorMeta::new([2, 4], DType::F32);
    let half = |values: Vec<f32>, column: usize| StatePart {
        variable: "w".into(),
        meta: meta.clone(),
        offsets: vec![0, column],
        value: HostArray::f32([2, 2], values).unwrap(),
    };
    let step = StatePart {
        variable: "step".into(),
        meta: regflow::graph::plan::TensorMeta::new(Vec::<usize>::new(), DType::I64),
        offsets: Vec::new(),
        value: HostArray::i64(Vec::<usize>::new(), vec![7]).unwrap(),
    };
    [vec![half(vec![1.0, 2.0, 5.0, 6.0], 0), step], vec![half(vec![3.0, 4.0, 7.0, 8.0], 2)]]
}

/// Saves the small checkpoint into `dir`: rank 1 on a thread, rank 0 here.
fn save_small(dir: &Path) {
    let [rank0, rank1] = small_parts();
    let other = save_sharded_async(dir.to_path_buf(), 1, 2, 3, rank1, json!(null));
    save_sharded(dir, 0, 2, 3, &rank0, &json!({ "epoch": 1 })).unwrap();
    other.wait().unwrap();
}

#[test]
fn parts_of_two_ranks_load_as_whole_tensors() {
    let root = temp_root("small");
    let dir = checkpoint_dir(&root, 3);
    save_small(&dir);
    let checkpoint = load_sharded(&dir).unwrap();
    assert_eq!(checkpoint.extra, json!({ "epoch": 1 }));
    let w = checkpoint.get("w").unwrap();
    assert_eq!(w, &HostArray::f32([2, 4], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]).unwrap());
    assert_eq!(checkpoint.get("step"), Some(&HostArray::i64(Vec::<usize>::new(), vec![7]).unwrap()));
    // Saving into a complete checkpoint again is refused.
    let err = save_sharded(&dir, 0, 2, 3, &small_parts()[0], &json!(null)).unwrap_err();
    assert!(err.to_string().contains("holds a complete checkpoint already"), "{err}");
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_save_cut_short_leaves_the_previous_checkpoint_the_latest() {
    let root = temp_root("crash");
    save_small(&checkpoint_dir(&root, 3));
    // Step 6: rank 1 wrote half its shard and died before its list; rank 0 gave up
    // waiting for it and wrote no index.
    let dir = checkpoint_dir(&root, 6);
    let [rank0, _] = small_parts();
    let err = save_sharded_within(&dir, 0, 2, 6, &rank0, &json!(null), Duration::from_millis(50)).unwrap_err();
    assert!(matches!(&err, TrainError::RanksMissing { missing, .. } if missing == &[1]), "{err}");
    assert!(err.to_string().contains("rank(s) [1]"), "{err}");
    std::fs::write(dir.join("rank1.safetensors.tmp"), b"half a shard").unwrap();
    assert!(!dir.join(INDEX_FILE).exists());
    assert_eq!(latest_complete(&root), Some(checkpoint_dir(&root, 3)));
    assert_eq!(load_sharded(&latest_complete(&root).unwrap()).unwrap().step, 3);
    // A complete step 6 becomes the latest.
    std::fs::remove_dir_all(&dir).unwrap();
    save_small(&dir);
    assert_eq!(latest_complete(&root), Some(dir));
    std::fs::remove_dir_all(&root).unwrap();
}

/// The small checkpoint in a fresh directory, `spoil`ed, then loaded: the error's text.
fn load_spoiled(name: &str, spoil: impl FnOnce(&Path)) -> String {
    let root = temp_root(name);
    let dir = checkpoint_dir(&root, 3);
    save_small(&dir);
    spoil(&dir);
    let err = load_sharded(&dir).unwrap_err().to_string();
    std::fs::remove_dir_all(&root).unwrap();
    err
}

fn edit_index(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join(INDEX_FILE);
    let mut index: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut index);
    std::fs::write(&path, serde_json::to_vec(&index).unwrap()).unwrap();
}

#[test]
fn bad_shards_and_indexes_are_refused_naming_the_file_and_the_tensor() {
    let truncated = load_spoiled("truncated", |dir| {
        let path = dir.join("rank1.safetensors");
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 5]).unwrap();
    });
    assert!(truncated.contains("rank1.safetensors") && truncated.contains("cut short"), "{truncated}");

    let corrupt = load_spoiled("corrupt", |dir| {
        let path = dir.join("rank1.safetensors");
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x40;
        std::fs::write(&path, &bytes).unwrap();
    });
    assert!(corrupt.contains("rank1.safetensors") && corrupt.contains("'w@0_2'"), "{corrupt}");
    assert!(corrupt.contains("corrupt"), "{corrupt}");

    let garbage = load_spoiled("garbage", |dir| {
        let path = dir.join("rank0.safetensors");
        let length = std::fs::metadata(&path).unwrap().len() as usize;
        std::fs::write(&path, vec![0xFF; length]).unwrap();
    });
    assert!(garbage.contains("rank0.safetensors") && garbage.contains("not a safetensors file"), "{garbage}");

    let missing = load_spoiled("missing", |dir| std::fs::remove_file(dir.join("rank1.safetensors")).unwrap());
    assert!(missing.contains("rank1.safetensors") && missing.contains("missing"), "{missing}");

    let no_index = load_spoiled("no-index", |dir| std::fs::remove_file(dir.join(INDEX_FILE)).unwrap());
    assert!(no_index.contains("index.json") && no_index.contains("cannot be read"), "{no_index}");

    let not_json = load_spoiled("not-json", |dir| std::fs::write(dir.join(INDEX_FILE), "{ step: 3").unwrap());
    assert!(not_json.contains("index.json") && not_json.contains("not the JSON"), "{not_json}");

    // The index names a tensor the file does not hold.
    let renamed = load_spoiled("renamed", |dir| {
        edit_index(dir, |index| index["variables"][0]["parts"][1]["tensor"] = json!("w@0_3"));
    });
    assert!(renamed.contains("rank1.safetensors") && renamed.contains("'w@0_3'"), "{renamed}");
    assert!(renamed.contains("no such tensor"), "{renamed}");

    let reshaped = load_spoiled("reshaped", |dir| {
        edit_index(dir, |index| index["variables"][0]["parts"][1]["shape"] = json!([1, 4]));
    });
    assert!(
        reshaped.contains("'w@0_2'") && reshaped.contains("its shape is [2, 2], the index says [1, 4]"),
        "{reshaped}"
    );

    let retyped = load_spoiled("retyped", |dir| edit_index(dir, |index| index["variables"][0]["dtype"] = json!("f64")));
    assert!(retyped.contains("'w@0_0'") && retyped.contains("holds f32 values, the index says f64"), "{retyped}");

    // A part dropped from the index: its columns are in no part.
    let uncovered = load_spoiled("uncovered", |dir| {
        edit_index(dir, |index| {
            index["variables"][0]["parts"].as_array_mut().unwrap().pop();
        });
    });
    assert_eq!(
        uncovered.split(": ").last().unwrap(),
        "no part holds elements [0..2, 2..4] of tensor 'w' (4 of its 8 elements)",
        "{uncovered}"
    );
}

#[test]
fn a_checkpoint_of_another_model_is_refused_by_the_strict_load() {
    let root = temp_root("other-model");
    save_after_10_steps(&root);
    let state = load_sharded(&latest_complete(&root).unwrap()).unwrap().state_dict();
    // The same names, another hidden width.
    let (plan, _) = compile_model(&one_device(), 32);
    let err = Job::builder(plan).load_state_dict(&state, true).map(|_| ()).unwrap_err();
    assert!(matches!(err, TrainError::Mismatch { .. }), "{err}");
    assert!(err.to_string().contains("variable 'w1' is f32[6, 32]"), "{err}");
    // Another model altogether: names the graph does not have.
    let mut renamed = StateDict::new();
    for (name, value) in state.iter() {
        renamed.insert(name.replace("w1", "w_in"), value.clone());
    }
    let (plan, _) = compile(&one_device());
    let err = Job::builder(plan).load_state_dict(&renamed, true).map(|_| ()).unwrap_err();
    assert!(matches!(err, TrainError::MissingVariables { .. }), "{err}");
    std::fs::remove_dir_all(&root).unwrap();
}
