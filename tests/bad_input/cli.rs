//! The `regflow` binary on bad arguments and files: every failure exits with code 1 and
//! one `error: ` sentence naming the file and the thing at fault, never a panic.

use crate::checkpoints::safetensors_bytes;
use crate::common::{regflow, temp_dir};
use crate::without_gpu;
use crate::Catalogue;
use regflow::graph::checkpoint;
use regflow::graph::{CompileOptions, DType, Graph, HostArray, Init};
use regflow::prelude::*;
use std::path::Path;

/// The stderr of a `regflow` run that failed cleanly (exit code 1, `error: `, nothing on
/// stdout); its kind is `CliFailure`.
#[derive(Debug)]
pub(crate) struct CliFailure(String);

impl std::fmt::Display for CliFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0.trim_end())
    }
}

/// Runs `regflow args`; `Ok` if it succeeded, `Err` with its stderr if it failed cleanly;
/// panics (a failed case) on any other exit.
pub(crate) fn run(args: &[&str], stdin: Option<&str>) -> Result<(), CliFailure> {
    let out = regflow(args, stdin);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    if out.status.success() {
        return Ok(());
    }
    assert_eq!(out.status.code(), Some(1), "regflow {args:?} should exit with 1: {stderr}");
    assert!(out.stdout.is_empty(), "regflow {args:?} printed {}", String::from_utf8_lossy(&out.stdout));
    assert!(stderr.starts_with("error: ") && stderr.lines().count() == 1, "not one error line: {stderr}");
    Err(CliFailure(stderr))
}

/// A compiled step with fed inputs `x` f32[2, 3] and `y` i64[2]; its loss is fetched.
fn fed_plan_json() -> String {
    let g = Graph::new();
    let x = g.input("x", [2, 3], DType::F32).expect("input");
    let y = g.input("y", [2], DType::I64).expect("input");
    let w = g.variable("w", [3, 2], DType::F32, Init::Zeros).expect("variable");
    let loss = x.matmul(&w).expect("matmul").sparse_cross_entropy(&y).expect("loss");
    g.compile(&[loss], &[], &CompileOptions::default()).expect("compiles").plan.to_json()
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> String {
    let path = dir.join(name);
    std::fs::write(&path, bytes).expect("writes the file");
    path.to_str().expect("utf-8 path").to_string()
}

fn save(dir: &Path, name: &str, tensors: Vec<(&str, HostArray)>) -> String {
    let path = dir.join(name);
    let tensors: Vec<(String, HostArray)> = tensors.into_iter().map(|(n, a)| (n.to_string(), a)).collect();
    checkpoint::save(&path, &tensors).expect("saves");
    path.to_str().expect("utf-8 path").to_string()
}

#[test]
fn command_line() {
    let mut c = Catalogue::new("cli");
    let dir = temp_dir("bad_input", "cli");
    let plan = write(&dir, "plan.json", fed_plan_json().as_bytes());
    let missing = dir.join("missing.json");
    let missing = missing.to_str().expect("utf-8 path");
    const KIND: &str = "CliFailure";
    c.case(
        "run of a plan file that does not exist",
        || run(&["run", missing], None),
        KIND,
        &["cannot read plan file", missing],
    );
    c.case(
        "show of a plan file that does not exist",
        || run(&["plan", "show", missing], None),
        KIND,
        &["cannot read plan file", missing],
    );
    let broken = write(&dir, "broken.json", b"{\"schema_version\": 2, \"devices\": [");
    c.case(
        "run of a plan file cut short",
        || run(&["run", &broken], None),
        KIND,
        &[&broken, "is not a valid plan", "not valid JSON"],
    );
    c.case(
        "run of a plan from stdin that is not JSON",
        || run(&["run", "-"], Some("not json")),
        KIND,
        &["<stdin> is not a valid plan"],
    );
    c.case(
        "dot of a plan from an empty stdin",
        || run(&["plan", "dot", "-"], Some("")),
        KIND,
        &["<stdin> is not a valid plan", "schema_version"],
    );
    let binary = write(&dir, "binary.json", &[0xff, 0xfe, 0x00, 0x01]);
    c.case("run of a binary file", || run(&["run", &binary], None), KIND, &[&binary]);
    let directory = dir.to_str().expect("utf-8 path");
    c.case("run of a directory", || run(&["run", directory], None), KIND, &["cannot read plan file", directory]);
    c.case(
        "a plan with fed inputs and no --feeds",
        || run(&["run", &plan], None),
        KIND,
        &["cannot run", "fed inputs (x, y)", "--feeds"],
    );
    let feeds_missing = dir.join("nope.safetensors");
    let feeds_missing = feeds_missing.to_str().expect("utf-8 path");
    c.case(
        "--feeds naming a file that does not exist",
        || run(&["run", &plan, "--feeds", feeds_missing], None),
        KIND,
        &["feeds file", feeds_missing, "cannot read it"],
    );
    let not_st = write(&dir, "text.safetensors", b"hello");
    c.case(
        "--feeds naming a file that is not safetensors",
        || run(&["run", &plan, "--feeds", &not_st], None),
        KIND,
        &[&not_st, "not a safetensors file"],
    );
    let x = || HostArray::f32([3, 2, 3], vec![0.0; 18]).expect("value");
    let y = || HostArray::i64([3, 2], vec![0; 6]).expect("value");
    let typo = save(&dir, "typo.safetensors", vec![("x", x()), ("yy", y())]);
    c.case(
        "feeds with a tensor named after no input",
        || run(&["run", &plan, "--feeds", &typo], None),
        KIND,
        &["tensor 'yy'", "not an input", "did you mean 'y'"],
    );
    let only_x = save(&dir, "only_x.safetensors", vec![("x", x())]);
    c.case(
        "feeds without a tensor for an input",
        || run(&["run", &plan, "--feeds", &only_x], None),
        KIND,
        &["no tensor 'y'", "i64[2]"],
    );
    let dtype =
        save(&dir, "dtype.safetensors", vec![("x", x()), ("y", HostArray::f32([3, 2], vec![0.0; 6]).expect("value"))]);
    c.case(
        "feeds of the wrong dtype",
        || run(&["run", &plan, "--feeds", &dtype], None),
        KIND,
        &["tensor 'y'", "f32", "i64[2]"],
    );
    let shape = save(
        &dir,
        "shape.safetensors",
        vec![("x", HostArray::f32([3, 3, 2], vec![0.0; 18]).expect("value")), ("y", y())],
    );
    c.case(
        "feeds of the wrong shape",
        || run(&["run", &plan, "--feeds", &shape], None),
        KIND,
        &["tensor 'x'", "[3, 3, 2]", "[steps, 2, 3]"],
    );
    let unstepped = save(
        &dir,
        "unstepped.safetensors",
        vec![("x", HostArray::f32([2, 3], vec![0.0; 6]).expect("value")), ("y", y())],
    );
    c.case(
        "feeds without a steps dimension",
        || run(&["run", &plan, "--feeds", &unstepped], None),
        KIND,
        &["tensor 'x'", "[2, 3]", "[steps, 2, 3]"],
    );
    let steps =
        save(&dir, "steps.safetensors", vec![("x", x()), ("y", HostArray::i64([4, 2], vec![0; 8]).expect("value"))]);
    c.case(
        "feeds with different step counts",
        || run(&["run", &plan, "--feeds", &steps], None),
        KIND,
        &["tensor 'y' has 4 steps", "tensor 'x' has 3"],
    );
    let good = save(&dir, "good.safetensors", vec![("x", x()), ("y", y())]);
    c.case(
        "--steps past the feeds",
        || run(&["run", &plan, "--feeds", &good, "--steps", "5"], None),
        KIND,
        &["holds 3 steps", "5"],
    );
    let bf16 = write(
        &dir,
        "bf16.safetensors",
        &safetensors_bytes(r#"{"dtype":"BF16","shape":[3,2],"data_offsets":[0,12]}"#, &[0; 12]),
    );
    c.case(
        "feeds of a dtype plans do not have",
        || run(&["run", &plan, "--feeds", &bf16], None),
        KIND,
        &["tensor 't'", "not an input"],
    );
    let huge = write(
        &dir,
        "huge.safetensors",
        &safetensors_bytes(r#"{"dtype":"F32","shape":[1073741824,1073741824],"data_offsets":[0,16]}"#, &[0; 16]),
    );
    c.case("feeds claiming 2^60 elements", || run(&["run", &plan, "--feeds", &huge], None), KIND, &[&huge]);
    let hand = {
        let mut b = PlanBuilder::new();
        let cpu = b.device(0, DeviceKind::Cpu, 0);
        let s = b.stream(cpu, StreamKind::Compute);
        let src = b.actor("src", s, ActorKind::Source { pieces: SourcePieces::Count(2) });
        let x = b.regst("x", src, 8, 1);
        let sink = b.actor("sink", s, ActorKind::Sink);
        b.consume(sink, x);
        b.build().expect("the plan validates").to_json()
    };
    let hand = write(&dir, "hand.json", hand.as_bytes());
    c.case("a plan without outputs", || run(&["run", &hand], None), KIND, &["cannot run", "no outputs"]);
    let invalid = write(
        &dir,
        "invalid.json",
        fed_plan_json().replacen("\"register_num\": 2", "\"register_num\": 0", 1).as_bytes(),
    );
    c.case(
        "a plan that does not validate",
        || run(&["run", &invalid], None),
        KIND,
        &["is not a valid plan", "register_num 0"],
    );
    let cuda = write(&dir, "cuda.json", fed_plan_json().replace("\"kind\": \"cpu\"", "\"kind\": \"cuda\"").as_bytes());
    // Refused only where no GPU can run it (CI); a GPU machine runs it.
    if without_gpu() {
        c.case(
            "a plan for cuda devices",
            || run(&["run", &cuda, "--feeds", &good], None),
            KIND,
            &["cannot run", "node0/cuda:0", "CUDA"],
        );
    }
    c.finish();
}

#[test]
fn usage_errors_are_clap_errors_not_panics() {
    // clap reports usage errors with exit code 2 and its own text.
    for args in [
        &["run"][..],
        &["run", "plan.json", "--steps", "0"],
        &["run", "plan.json", "--threads", "0"],
        &["run", "plan.json", "--steps", "-1"],
        &["run", "plan.json", "--bogus"],
        &["plan", "explode", "x.json"],
        &[],
    ] {
        let out = regflow(args, None);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "regflow {args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

/// A plan file whose register claims `register_num` slots of 0 bytes (a counted source
/// read by a sink that delivers `fetch:0`), for `regflow run`.
fn many_slots_plan(register_num: u32) -> String {
    use regflow::graph::plan::{OutputSignature, TensorMeta};
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s = b.stream(cpu, StreamKind::Compute);
    let src = b.actor("src", s, ActorKind::Source { pieces: SourcePieces::Count(1) });
    let x = b.regst("x", src, 0, 1);
    let sink = b.actor("sink", s, ActorKind::Sink);
    b.consume(sink, x);
    let meta = TensorMeta::new([0], DType::F32);
    b.plan_mut().signature.outputs.push(OutputSignature { name: "fetch:0".into(), meta, actor: sink });
    let mut plan = b.build().expect("the plan validates");
    // Past what the builder accepts: the file claims it.
    plan.regst_descs[x.index()].register_num = register_num;
    plan.to_json()
}

#[test]
fn a_plan_claiming_millions_of_slots_is_refused_not_aborted() {
    let mut c = Catalogue::new("cli");
    let dir = temp_dir("bad_input", "many_slots");
    let plan = write(&dir, "plan.json", many_slots_plan(1 << 26).as_bytes());
    c.case("a register of 2^26 slots", || run(&["run", &plan], None), "CliFailure", &["'x'", "67108864"]);
    c.finish();
}

#[test]
fn a_variable_claiming_a_huge_logical_shape_is_refused_not_aborted() {
    let mut c = Catalogue::new("cli");
    let dir = temp_dir("bad_input", "huge_variable");
    let json = fed_plan_json();
    // The variable `w` is f32[3, 2]; its logical shape now claims 2^34 x 2 elements while
    // its part (the region) still fills its 24-byte register.
    let mut plan = Plan::from_json(&json).expect("the plan loads");
    plan.variables[0].meta = regflow::graph::plan::TensorMeta::new([1usize << 34, 2], DType::F32);
    let plan = write(&dir, "plan.json", plan.to_json().as_bytes());
    let x = HostArray::f32([1, 2, 3], vec![0.0; 6]).expect("value");
    let feeds =
        save(&dir, "feeds.safetensors", vec![("x", x), ("y", HostArray::i64([1, 2], vec![0; 2]).expect("value"))]);
    c.case("a variable of 2^35 elements", || run(&["run", &plan, "--feeds", &feeds], None), "CliFailure", &["'w'"]);
    c.finish();
}
