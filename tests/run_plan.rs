//! A plan file runs by itself: `regflow run` on a digits MLP whose source reads a record
//! file the plan names, and on a dp2×tp2 GPT fed from a safetensors file, prints the same
//! losses, bit for bit, as the same plans run in this process. Bad plan files and feeds
//! that do not fit are errors naming the file and the actor, input or variable.

use crate::gpt;

use flate2::read::GzDecoder;
use gpt::{Gpt, GptConfig};
use regflow::graph::plan::{DatasetConf, Init, OpConf, Region};
use regflow::graph::sbp::{Mesh, NdSbp, Sbp};
use regflow::graph::{
    checkpoint, CompileOptions, CompiledGraph, DType, DatasetInputs, Graph, HostArray, Optimizer, ParallelOptions,
    SplitMix64,
};
use regflow::prelude::*;

use crate::common;
use common::{failure, regflow, temp_dir};
use std::io::Read;
use std::path::Path;

const FEATURES: usize = 64;
const BATCH: usize = 32;
const RECORDS: usize = 320;
const RECORD_FILE: &str = "digits.records";

const GPT: GptConfig =
    GptConfig { d_model: 16, heads: 2, layers: 1, context: 8, mlp_width: 32, fused_attention: false, apart_qkv: false };
const GPT_BATCH: usize = 4;
const VOCAB: usize = 13;

fn path_str(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// The first `RECORDS` rows of the digits data as records of 64 f32 pixels (0–1) and an
/// i64 label, as examples/train_digits.rs makes them.
fn digits_records() -> Vec<u8> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/data/digits.csv.gz");
    let mut text = String::new();
    GzDecoder::new(std::fs::File::open(path).unwrap()).read_to_string(&mut text).unwrap();
    let mut records = Vec::new();
    for line in text.lines().take(RECORDS) {
        let values: Vec<&str> = line.split(',').collect();
        assert_eq!(values.len(), FEATURES + 1);
        for v in &values[..FEATURES] {
            records.extend((v.trim().parse::<f32>().unwrap() / 16.0).to_le_bytes());
        }
        records.extend(values[FEATURES].trim().parse::<i64>().unwrap().to_le_bytes());
    }
    records
}

/// The digits MLP (64-128-10, AdamW) training step; its inputs come from a dataset source
/// reading `digits.records` (relative: resolved against the job's data directory) when
/// `pieces` is given, else they are fed.
fn digits_plan(pieces: Option<u64>) -> CompiledGraph {
    digits_plan_on(None, pieces)
}

/// The digits MLP, on one device or data-parallel over `mesh` (x and y split by rows;
/// each device's dataset source reads the same batches and keeps its rows), with its
/// dataset source when `pieces` is given.
fn digits_plan_on(mesh: Option<Mesh>, pieces: Option<u64>) -> CompiledGraph {
    let g = Graph::new();
    let w1 = g.variable("w1", [FEATURES, 128], DType::F32, Init::Kaiming { seed: 1 }).unwrap();
    let b1 = g.variable("b1", [128], DType::F32, Init::Zeros).unwrap();
    let w2 = g.variable("w2", [128, 10], DType::F32, Init::Xavier { seed: 2 }).unwrap();
    let b2 = g.variable("b2", [10], DType::F32, Init::Zeros).unwrap();
    let x = g.input("x", [BATCH, FEATURES], DType::F32).unwrap();
    let y = g.input("y", [BATCH], DType::I64).unwrap();
    if let Some(mesh) = &mesh {
        g.set_layout(x, mesh, NdSbp(vec![Sbp::Split(0)])).unwrap();
        g.set_layout(y, mesh, NdSbp(vec![Sbp::Split(0)])).unwrap();
    }
    let logits = x.matmul(&w1).unwrap().add(&b1).unwrap().relu().unwrap().matmul(&w2).unwrap().add(&b2).unwrap();
    let loss = logits.sparse_cross_entropy(&y).unwrap();
    let train = g.minimize(loss, &Optimizer::adamw(1e-2, 1e-4)).unwrap();
    let dataset = pieces.map(|pieces| DatasetInputs {
        source: SourcePieces::Dataset(DatasetConf {
            path: RECORD_FILE.into(),
            fields: vec![(FEATURES * 4) as u64, 8],
            batch: BATCH as u64,
            seed: 1,
            pieces,
        }),
        inputs: vec!["x".into(), "y".into()],
    });
    match mesh {
        None => g.compile(&[train.loss], &train.updates, &CompileOptions { dataset, ..CompileOptions::default() }),
        Some(mesh) => {
            let mut options = ParallelOptions::new(mesh).train(&train);
            options.dataset = dataset;
            g.compile_parallel(&[train.loss], &train.updates, &options)
        }
    }
    .unwrap()
}

/// The tiny GPT's training step on a 2 × 2 mesh `[dp, tp]`: ids and targets split over
/// `dp`, Megatron's column / row splits over `tp` (as examples/train_parallel.rs lays out
/// `dp2xtp2`), fed inputs `causal_mask`, `ids`, `targets`.
fn gpt_plan() -> CompiledGraph {
    gpt_plan_on(Mesh::cpu(&[2, 2], &["dp", "tp"]).unwrap())
}

fn gpt_plan_on(mesh: Mesh) -> CompiledGraph {
    use Sbp::{Broadcast as B, Split as S};
    let g = Graph::new();
    let model = Gpt::new(&g, GPT, VOCAB).unwrap();
    let mask = g.input("causal_mask", [GPT.context, GPT.context], DType::F32).unwrap();
    let ids = g.input("ids", [GPT_BATCH, GPT.context], DType::I64).unwrap();
    let targets = g.input("targets", [GPT_BATCH * GPT.context], DType::I64).unwrap();
    g.set_layout(mask, &mesh, NdSbp(vec![B, B])).unwrap();
    g.set_layout(ids, &mesh, NdSbp(vec![S(0), B])).unwrap();
    g.set_layout(targets, &mesh, NdSbp(vec![S(0), B])).unwrap();
    for variable in g.trainable_variables() {
        let name = variable.name();
        let column = ["attn.qkv", "attn.query", "attn.key", "attn.value", "mlp.in"].iter().any(|p| name.contains(p));
        let row = name.ends_with("attn.out.weight") || name.ends_with("mlp.out.weight");
        let sbp = match () {
            _ if column && name.ends_with(".weight") => vec![B, S(1)],
            _ if column || row => vec![B, S(0)],
            _ => vec![B, B],
        };
        g.set_layout(variable, &mesh, NdSbp(sbp)).unwrap();
    }
    let loss = model.loss(&model.logits(&ids, &mask).unwrap(), &targets).unwrap();
    let step = g.minimize(loss, &Optimizer::adamw(3e-3, 1e-4).with_clip_norm(1.0)).unwrap();
    g.compile_parallel(&[step.loss], &step.updates, &ParallelOptions::new(mesh).train(&step)).unwrap()
}

/// Per step, the GPT's inputs: the causal mask and random ids and targets.
fn gpt_steps(steps: usize) -> Vec<Vec<(String, HostArray)>> {
    let t = GPT.context;
    let mask: Vec<f32> = (0..t * t).map(|i| if i % t <= i / t { 0.0 } else { -1e9 }).collect();
    let mut rng = SplitMix64::new(7);
    let mut ids = |n: usize| (0..n).map(|_| (rng.next_u64() % VOCAB as u64) as i64).collect::<Vec<i64>>();
    (0..steps)
        .map(|_| {
            vec![
                ("causal_mask".to_string(), HostArray::f32([t, t], mask.clone()).unwrap()),
                ("ids".to_string(), HostArray::i64([GPT_BATCH, t], ids(GPT_BATCH * t)).unwrap()),
                ("targets".to_string(), HostArray::i64([GPT_BATCH * t], ids(GPT_BATCH * t)).unwrap()),
            ]
        })
        .collect()
}

/// Stacks each input's per-step values into one tensor `[steps, ...]` named after it.
fn stacked(steps: &[Vec<(String, HostArray)>]) -> Vec<(String, HostArray)> {
    steps[0]
        .iter()
        .enumerate()
        .map(|(i, (name, first))| {
            let mut dims = vec![steps.len()];
            dims.extend_from_slice(first.shape.dims());
            let values = steps.iter().map(|step| &step[i].1);
            let array = match first.dtype() {
                DType::I64 => HostArray::i64(
                    dims,
                    values
                        .flat_map(|v| {
                            v.to_le_bytes()
                                .chunks(8)
                                .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                                .collect::<Vec<_>>()
                        })
                        .collect(),
                ),
                _ => HostArray::f32(
                    dims,
                    values
                        .flat_map(|v| {
                            v.to_le_bytes()
                                .chunks(4)
                                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                                .collect::<Vec<_>>()
                        })
                        .collect(),
                ),
            };
            (name.clone(), array.unwrap())
        })
        .collect()
}

/// Runs `plan` in this process (relative dataset paths under `data_dir`, fed `steps` if
/// given) and returns the first output's values.
fn losses_in_process(plan: &Plan, data_dir: &Path, steps: Option<&[Vec<(String, HostArray)>]>) -> Vec<f32> {
    let mut job = Job::builder(plan.clone()).data_dir(data_dir).build().unwrap();
    let sink = plan.actors[plan.signature.outputs[0].actor.index()].name.clone();
    let fetcher = job.fetcher(&sink).unwrap();
    let pusher = steps.map(|steps| {
        let mut feeds = job.graph_feeds().unwrap();
        let steps = steps.to_vec();
        std::thread::spawn(move || {
            for step in &steps {
                for (name, value) in step {
                    feeds.push(name, value).unwrap();
                }
            }
            feeds.close().unwrap();
        })
    });
    let losses =
        std::iter::from_fn(|| fetcher.recv().map(|p| f32::from_le_bytes(p.bytes().try_into().unwrap()))).collect();
    drop(fetcher);
    if let Some(pusher) = pusher {
        pusher.join().unwrap();
    }
    job.wait().unwrap();
    losses
}

/// The losses `regflow run` prints: `step k loss v` per line, `k` counting from 0.
fn losses_from_cli(args: &[&str]) -> Vec<f32> {
    let out = regflow(args, None);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "regflow {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    stdout
        .lines()
        .enumerate()
        .map(|(k, line)| {
            let words: Vec<&str> = line.split(' ').collect();
            assert_eq!(words[..3], ["step", &k.to_string(), "loss"], "{stdout}");
            assert_eq!(words.len(), 4, "one scalar output: {stdout}");
            words[3].parse::<f32>().unwrap()
        })
        .collect()
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn dataset_plan_prints_the_losses_it_computes_in_process_bit_for_bit() {
    let dir = temp_dir("run_plan", "dataset");
    std::fs::write(dir.join(RECORD_FILE), digits_records()).unwrap();
    let compiled = digits_plan(Some(6));
    assert!(compiled.plan.signature.inputs.is_empty(), "the dataset source feeds x and y");
    let plan_path = dir.join("digits.json");
    std::fs::write(&plan_path, compiled.plan.to_json()).unwrap();
    let expected = losses_in_process(&compiled.plan, &dir, None);
    assert_eq!(expected.len(), 6);
    assert!(expected.iter().all(|l| l.is_finite()) && expected[5] < expected[0], "{expected:?}");

    // The record file's relative path resolves against the plan file's directory.
    assert_eq!(bits(&losses_from_cli(&["run", path_str(&plan_path)])), bits(&expected));

    // Elsewhere, with --data-dir; --steps runs the first batches; threads change no bits.
    let elsewhere = temp_dir("run_plan", "dataset_elsewhere");
    let moved = elsewhere.join("digits.json");
    std::fs::copy(&plan_path, &moved).unwrap();
    let stderr = failure(&["run", path_str(&moved)], None);
    assert!(stderr.contains("dataset") && stderr.contains(RECORD_FILE), "{stderr}");
    let args = ["run", path_str(&moved), "--data-dir", path_str(&dir), "--steps", "3", "--threads", "2"];
    assert_eq!(bits(&losses_from_cli(&args)), bits(&expected[..3]));
}

#[test]
fn parallel_gpt_fed_from_a_feeds_file_prints_the_losses_it_computes_in_process_bit_for_bit() {
    let dir = temp_dir("run_plan", "gpt");
    let compiled = gpt_plan();
    assert_eq!(compiled.plan.devices.len(), 4);
    let collectives = compiled
        .plan
        .actors
        .iter()
        .filter(|a| matches!(a.kind, ActorKind::Compute { kernel: KernelConf::Collective(_) }))
        .count();
    assert!(collectives >= 8, "dp and tp all-reduces: {collectives}");
    let names: Vec<&str> = compiled.plan.signature.inputs.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(names.len(), 3, "{names:?}");
    let steps = gpt_steps(4);
    let plan_path = dir.join("gpt_dp2xtp2.json");
    std::fs::write(&plan_path, compiled.plan.to_json()).unwrap();
    let feeds_path = dir.join("feeds.safetensors");
    checkpoint::save(&feeds_path, &stacked(&steps)).unwrap();

    let expected = losses_in_process(&compiled.plan, &dir, Some(&steps));
    assert_eq!(expected.len(), 4);
    assert!(expected.iter().all(|l| l.is_finite()), "{expected:?}");
    let printed = losses_from_cli(&["run", path_str(&plan_path), "--feeds", path_str(&feeds_path)]);
    assert_eq!(bits(&printed), bits(&expected), "cli {printed:?}, in-process {expected:?}");
    let printed = losses_from_cli(&["run", path_str(&plan_path), "--feeds", path_str(&feeds_path), "--steps", "2"]);
    assert_eq!(bits(&printed), bits(&expected[..2]));
}

#[test]
fn a_dataset_plan_across_two_nodes_reads_each_batch_once_per_node_and_equals_one_process() {
    let dir = temp_dir("run_plan", "dataset_nodes");
    std::fs::write(dir.join(RECORD_FILE), digits_records()).unwrap();
    let one = digits_plan_on(Some(Mesh::cpu(&[2], &["dp"]).unwrap()), Some(6));
    let expected = losses_in_process(&one.plan, &dir, None);
    assert_eq!(expected.len(), 6);
    let spread = digits_plan_on(Some(Mesh::cpu(&[2], &["dp"]).unwrap().place_on_nodes(1).unwrap()), Some(6));
    let plan_path = dir.join("digits_2_nodes.json");
    std::fs::write(&plan_path, spread.plan.to_json()).unwrap();
    // Each node's source reads the record file on its own node: nothing is fed, no batch
    // crosses the network, and the losses are those of one process, bit for bit.
    let args = ["launch", "--nodes", "2", "--", env!("CARGO_BIN_EXE_regflow"), "run", path_str(&plan_path)];
    let out = regflow(&args, None);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(bits(&launched_losses(&stdout)), bits(&expected), "{stdout}");
}

/// The step lines of the rank that printed them, from `regflow launch`'s prefixed output.
fn launched_losses(stdout: &str) -> Vec<f32> {
    let lines: Vec<(&str, &str)> = stdout.lines().filter_map(|l| l.split_once("] step ")).collect();
    let printer = lines.first().map(|(rank, _)| *rank).expect("a rank printed the steps");
    assert!(lines.iter().all(|(rank, _)| *rank == printer), "one rank prints the steps: {stdout}");
    lines.iter().map(|(_, rest)| rest.rsplit(' ').next().unwrap().parse::<f32>().unwrap()).collect()
}

#[test]
fn a_plan_across_two_nodes_runs_under_regflow_launch_and_as_run_plus_daemon() {
    let dir = temp_dir("run_plan", "gpt_nodes");
    let mesh = Mesh::cpu(&[2, 2], &["dp", "tp"]).unwrap().place_on_nodes(2).unwrap();
    let compiled = gpt_plan_on(mesh);
    let steps = gpt_steps(3);
    let plan_path = dir.join("gpt_2_nodes.json");
    std::fs::write(&plan_path, compiled.plan.to_json()).unwrap();
    let feeds_path = dir.join("feeds.safetensors");
    checkpoint::save(&feeds_path, &stacked(&steps)).unwrap();
    // The same layout on one node, in this process: the reference, bit for bit.
    let expected = losses_in_process(&gpt_plan().plan, &dir, Some(&steps));

    // Every rank runs the plan file; the rank with the loss prints.
    let (plan_arg, feeds_arg) = (path_str(&plan_path), path_str(&feeds_path));
    let out = regflow(
        &["launch", "--nodes", "2", "--", env!("CARGO_BIN_EXE_regflow"), "run", plan_arg, "--feeds", feeds_arg],
        None,
    );
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(bits(&launched_losses(&stdout)), bits(&expected), "{stdout}");

    // Rank 0 runs the file and shares it; rank 1 is a daemon that takes it from rank 0.
    let master =
        format!("127.0.0.1:{}", std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port());
    let node = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_regflow"))
            .args(args)
            .env_remove("RANK")
            .env_remove("WORLD_SIZE")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let rank0 = node(&["run", plan_arg, "--feeds", feeds_arg, "--rank", "0", "--world", "2", "--master", &master]);
    let rank1 = node(&["daemon", "--feeds", feeds_arg, "--rank", "1", "--world", "2", "--master", &master]);
    let (out0, out1) = (rank0.wait_with_output().unwrap(), rank1.wait_with_output().unwrap());
    let text = |o: &std::process::Output| {
        format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
    };
    assert!(out0.status.success() && out1.status.success(), "rank 0:\n{}\nrank 1:\n{}", text(&out0), text(&out1));
    let printed = format!("[0] {}[1] {}", String::from_utf8_lossy(&out0.stdout), String::from_utf8_lossy(&out1.stdout));
    let printed: String =
        printed.lines().map(|l| format!("[x] {}\n", l.trim_start_matches("[0] ").trim_start_matches("[1] "))).collect();
    assert_eq!(bits(&launched_losses(&printed)), bits(&expected), "{printed}");

    // A daemon alone, with no node flags and no launcher, is refused with the reason.
    let stderr = failure(&["daemon"], None);
    assert!(stderr.contains("--rank") && stderr.contains("launcher"), "{stderr}");
}

/// Writes `plan` as JSON into `dir` and returns its path.
fn write_plan(dir: &Path, name: &str, plan: &Plan) -> String {
    let path = dir.join(name);
    std::fs::write(&path, plan.to_json()).unwrap();
    path_str(&path).to_string()
}

/// The forward product `x·w1`: its actor and its op.
fn first_layer(plan: &mut Plan) -> (String, &mut OpConf) {
    plan.actors
        .iter_mut()
        .find_map(|a| match &mut a.kind {
            ActorKind::Compute { kernel: KernelConf::Op(op) }
                if op.op_type == "matmul"
                    && op.inputs.iter().map(|m| m.shape.dims()).eq([[BATCH, FEATURES], [FEATURES, 128]]) =>
            {
                Some((a.name.clone(), op))
            }
            _ => None,
        })
        .unwrap()
}

#[test]
fn bad_plan_files_are_errors_naming_the_actor() {
    let dir = temp_dir("run_plan", "bad_plans");
    std::fs::write(dir.join(RECORD_FILE), digits_records()).unwrap();
    let plan = digits_plan(Some(2)).plan;
    let json = plan.to_json();

    // Truncated JSON: where it ends.
    let path = dir.join("truncated.json");
    std::fs::write(&path, &json[..json.len() / 2]).unwrap();
    let stderr = failure(&["run", path_str(&path)], None);
    let head = format!(
        "error: {} is not a valid plan: plan file is not valid JSON for a plan: EOF while parsing",
        path_str(&path)
    );
    assert!(stderr.starts_with(&head) && stderr.contains(" at line "), "{stderr}");

    // Another schema version: the one found and the one expected.
    let path = dir.join("schema.json");
    std::fs::write(&path, json.replacen("\"schema_version\": 2", "\"schema_version\": 7", 1)).unwrap();
    let stderr = failure(&["run", path_str(&path)], None);
    assert!(stderr.contains("plan schema version 7 is not supported: this build reads version 2"), "{stderr}");

    // An unknown device kind: the device, the variant, and where.
    let path = dir.join("device.json");
    std::fs::write(&path, json.replacen("\"kind\": \"cpu\"", "\"kind\": \"tpu\"", 1)).unwrap();
    let stderr = failure(&["run", path_str(&path)], None);
    assert!(
        stderr.contains("is not a valid plan: plan file: device 0: unknown variant `tpu`, expected one of `cpu`, `sim`, `cuda` (line "),
        "{stderr}"
    );

    // An unknown op type: the actor, the op, and the nearest known type.
    let mut typo = plan.clone();
    let (actor, op) = first_layer(&mut typo);
    op.op_type = "mtamul".into();
    let stderr = failure(&["run", &write_plan(&dir, "typo.json", &typo)], None);
    assert!(
        stderr.contains(&format!(
            "actor '{actor}': no kernel is registered for op 'mtamul' on device kind cpu with dtype f32; no device \
             has op type 'mtamul' (did you mean 'matmul'?)"
        )),
        "{stderr}"
    );

    // Attributes that do not parse.
    let mut attrs = plan.clone();
    let (actor, op) = first_layer(&mut attrs);
    op.attrs = serde_json::json!({ "transpose_a": "yes", "transpose_b": false });
    let stderr = failure(&["run", &write_plan(&dir, "attrs.json", &attrs)], None);
    assert!(stderr.contains(&format!("actor '{actor}': the attributes of op 'matmul' do not parse")), "{stderr}");
    assert!(stderr.contains("\"transpose_a\":\"yes\""), "{stderr}");

    // Metas that contradict the op (the same bytes, so only the op can tell): x·w1 with
    // w1 read as [128, 64].
    let mut metas = plan.clone();
    let (actor, op) = first_layer(&mut metas);
    op.inputs[1].shape = [128, FEATURES].into();
    let stderr = failure(&["run", &write_plan(&dir, "metas.json", &metas)], None);
    assert!(
        stderr.contains(&format!(
            "actor '{actor}': op 'matmul': inner dimensions differ: [{BATCH}, 64] x [128, 64] (64 vs 128)"
        )),
        "{stderr}"
    );

    // A variable whose region does not fit its meta.
    let mut region = plan.clone();
    let variable = region.variables.iter_mut().find(|v| v.name == "w1").unwrap();
    variable.region = Region { offsets: vec![1, 0], shape: vec![64, 128], zeros: false };
    let name = variable.name.clone();
    let stderr = failure(&["run", &write_plan(&dir, "region.json", &region)], None);
    assert!(
        stderr.contains(&format!(
            "variable '{name}' has its part at offsets [1, 0] of shape [64, 128], which does not fit the variable's \
             shape [64, 128]"
        )),
        "{stderr}"
    );
}

#[test]
fn feeds_that_do_not_fit_the_signature_are_errors_naming_the_input_and_both_shapes() {
    let dir = temp_dir("run_plan", "bad_feeds");
    let compiled = digits_plan(None);
    let inputs: Vec<&str> = compiled.plan.signature.inputs.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(inputs, ["x", "y"]);
    let plan = write_plan(&dir, "fed.json", &compiled.plan);
    let x = |steps: usize, rows: usize| {
        HostArray::f32([steps, rows, FEATURES], vec![0.5; steps * rows * FEATURES]).unwrap()
    };
    let y = |steps: usize| HostArray::i64([steps, BATCH], vec![3; steps * BATCH]).unwrap();
    let feeds = |name: &str, tensors: Vec<(&str, HostArray)>| {
        let path = dir.join(name);
        let tensors: Vec<(String, HostArray)> = tensors.into_iter().map(|(n, a)| (n.to_string(), a)).collect();
        checkpoint::save(&path, &tensors).unwrap();
        path_str(&path).to_string()
    };

    // A good file runs.
    let good = feeds("good.safetensors", vec![("x", x(3, BATCH)), ("y", y(3))]);
    assert_eq!(losses_from_cli(&["run", &plan, "--feeds", &good]).len(), 3);

    let stderr = failure(&["run", &plan], None);
    assert!(
        stderr.contains(&format!("cannot run {plan}: it has fed inputs (x, y) and no --feeds file gives their values")),
        "{stderr}"
    );
    let path = feeds("missing.safetensors", vec![("x", x(3, BATCH))]);
    let stderr = failure(&["run", &plan, "--feeds", &path], None);
    assert!(
        stderr
            .contains(&format!("feeds file {path}: it has no tensor 'y' for input 'y' (i64[32]); it holds tensors x")),
        "{stderr}"
    );
    let path = feeds(
        "dtype.safetensors",
        vec![("x", x(3, BATCH)), ("y", HostArray::f32([3, BATCH], vec![1.0; 3 * BATCH]).unwrap())],
    );
    let stderr = failure(&["run", &plan, "--feeds", &path], None);
    assert!(
        stderr.contains(
            "tensor 'y' holds f32 values, but input 'y' is i64[32]: the tensor needs i64 values of shape [steps, 32]"
        ),
        "{stderr}"
    );
    let path = feeds("shape.safetensors", vec![("x", x(3, 16)), ("y", y(3))]);
    let stderr = failure(&["run", &plan, "--feeds", &path], None);
    assert!(
        stderr.contains(
            "tensor 'x' has shape [3, 16, 64], but input 'x' has shape [32, 64]: the tensor needs shape [steps, 32, 64]"
        ),
        "{stderr}"
    );
    let path = feeds("steps.safetensors", vec![("x", x(3, BATCH)), ("y", y(2))]);
    let stderr = failure(&["run", &plan, "--feeds", &path], None);
    assert!(
        stderr
            .contains("tensor 'y' has 2 steps (rows) but tensor 'x' has 3: every input needs the same number of steps"),
        "{stderr}"
    );
    let path = feeds("extra.safetensors", vec![("x", x(3, BATCH)), ("y", y(3)), ("yy", y(3))]);
    let stderr = failure(&["run", &plan, "--feeds", &path], None);
    assert!(
        stderr.contains("tensor 'yy' is not an input of the plan (its inputs: x, y; did you mean 'y'?)"),
        "{stderr}"
    );
    let stderr = failure(&["run", &plan, "--feeds", &good, "--steps", "5"], None);
    assert!(stderr.contains("it holds 3 steps, fewer than the 5 that --steps asks for"), "{stderr}");
    let path = dir.join("nope.safetensors");
    let stderr = failure(&["run", &plan, "--feeds", path_str(&path)], None);
    assert!(stderr.contains(&format!("feeds file {}: cannot read it: ", path_str(&path))), "{stderr}");

    // A signature input whose part names an actor that is not a fed source.
    let mut wrong = compiled.plan.clone();
    let sink = wrong.signature.outputs[0].actor;
    wrong.signature.inputs[1].parts[0].actor = sink;
    let path = write_plan(&dir, "signature.json", &wrong);
    let stderr = failure(&["run", &path, "--feeds", &good], None);
    assert!(
        stderr.contains(
            "input 'y' of the signature has part 0 fed to actor 'fetch:0', a sink actor; the parts of an input must \
             be fed sources"
        ),
        "{stderr}"
    );
}

#[test]
fn plans_that_only_their_program_can_run_are_refused_with_the_reason() {
    let dir = temp_dir("run_plan", "not_by_itself");
    std::fs::write(dir.join(RECORD_FILE), digits_records()).unwrap();
    let plan = digits_plan(Some(2)).plan;
    let path = write_plan(&dir, "digits.json", &plan);
    let stderr = failure(&["run", &path, "--feeds", "feeds.safetensors"], None);
    assert!(
        stderr.contains(&format!(
            "cannot run {path}: --feeds feeds.safetensors was given, but the plan has no fed inputs"
        )),
        "{stderr}"
    );

    let mut custom = plan.clone();
    let source = custom.actor_by_name("dataset").unwrap();
    custom.actors[source.index()].kind =
        ActorKind::Source { pieces: SourcePieces::Custom { count: 2, kernel: "digits".into() } };
    let stderr = failure(&["run", &write_plan(&dir, "custom.json", &custom)], None);
    assert!(
        stderr.contains("source 'dataset' gets its pieces from kernel 'digits', which only the program that built the plan registers"),
        "{stderr}"
    );

    let mut silent = plan.clone();
    silent.signature.outputs.clear();
    let stderr = failure(&["run", &write_plan(&dir, "silent.json", &silent)], None);
    assert!(stderr.contains("its signature has no outputs, so there is nothing to print"), "{stderr}");
}
