//! Plan files (`Plan::from_json`): text that is not JSON, JSON that is not a plan, schema
//! versions this build does not read, fields of the wrong type or name, values out of
//! range, and well-formed files describing a bad plan or an op no device has.

use crate::{quick, Catalogue};
use regflow::graph::plan::ops::MatMul;
use regflow::graph::plan::{DType, OpConf, TensorMeta};
use regflow::prelude::*;

/// `src -> f -> sink`, as plan JSON.
fn chain_json() -> String {
    crate::plans::chain(|_, _, _| {}).expect("the plan validates").to_json()
}

/// The JSON of a plan with one matmul op actor.
fn op_json() -> String {
    let meta = |shape: &[usize]| TensorMeta::new(shape.to_vec(), DType::F32);
    let conf = OpConf::new(&MatMul::default(), vec![meta(&[4, 3]), meta(&[3, 2])], vec![0, 1], vec![meta(&[4, 2])]);
    crate::jobs::one_op(conf, DeviceKind::Cpu).to_json()
}

/// `json` with the first `from` replaced by `to`, which must be there.
fn edit(json: &str, from: &str, to: &str) -> String {
    assert!(json.contains(from), "{from} is not in the plan file:\n{json}");
    json.replacen(from, to, 1)
}

#[test]
fn plan_files() {
    let mut c = Catalogue::new("plan_files");
    let json = chain_json();
    let load = |text: String| move || Plan::from_json(&text);
    c.case("an empty file", load(String::new()), "PlanError::Parse", &["not a JSON object", "schema_version"]);
    c.case("a file of spaces", load("   \n".into()), "PlanError::Parse", &["schema_version"]);
    c.case("a JSON array", load("[]".into()), "PlanError::Parse", &["schema_version"]);
    c.case("JSON null", load("null".into()), "PlanError::Parse", &["schema_version"]);
    c.case("an empty object", load("{}".into()), "PlanError::Parse", &["missing field `schema_version`"]);
    c.case("a file cut in half", load(json[..json.len() / 2].to_string()), "PlanError::Parse", &["not valid JSON"]);
    c.case(
        "a file cut before its last brace",
        load(json.trim_end().trim_end_matches('}').into()),
        "PlanError::Parse",
        &["EOF"],
    );
    c.case("trailing text after the plan", load(format!("{json} extra")), "PlanError::Parse", &["trailing"]);
    c.case("two plans back to back", load(format!("{json}{json}")), "PlanError::Parse", &["trailing"]);
    c.case(
        "schema version 0",
        load(edit(&json, "\"schema_version\": 2", "\"schema_version\": 0")),
        "PlanError::SchemaVersion",
        &["version 0", "reads version 2"],
    );
    c.case(
        "schema version 3",
        load(edit(&json, "\"schema_version\": 2", "\"schema_version\": 3")),
        "PlanError::SchemaVersion",
        &["version 3"],
    );
    c.case(
        "schema version past u32",
        load(edit(&json, "\"schema_version\": 2", "\"schema_version\": 4294967298")),
        "PlanError::SchemaVersion",
        &["version 4294967298"],
    );
    c.case(
        "schema version as a string",
        load(edit(&json, "\"schema_version\": 2", "\"schema_version\": \"2\"")),
        "PlanError::Parse",
        &["`schema_version` must be a whole number", "string \"2\""],
    );
    c.case(
        "a negative schema version",
        load(edit(&json, "\"schema_version\": 2", "\"schema_version\": -2")),
        "PlanError::Parse",
        &["-2"],
    );
    c.case(
        "an unknown field in a register",
        load(edit(&json, "\"register_num\"", "\"registers\"")),
        "PlanError::Element",
        &["register 0 'src.out'", "unknown field `registers`", "line"],
    );
    c.case(
        "an unknown top-level field",
        load(edit(&json, "\"devices\"", "\"gpus\": [], \"devices\"")),
        "PlanError",
        &["unknown field `gpus`"],
    );
    c.case("a missing top-level field", load(edit(&json, "\"streams\"", "\"stream_list\"")), "PlanError", &["stream"]);
    c.case(
        "an unknown device kind",
        load(edit(&json, "\"kind\": \"cpu\"", "\"kind\": \"tpu\"")),
        "PlanError::Element",
        &["device 0", "unknown variant `tpu`", "cpu"],
    );
    c.case(
        "an unknown actor kind",
        load(edit(&json, "\"kind\": \"sink\"", "\"kind\": \"sinc\"")),
        "PlanError::Element",
        &["actor 2 'sink'", "unknown variant `sinc`"],
    );
    c.case(
        "an unknown kernel",
        load(edit(&json, "\"copy\"", "\"cpoy\"")),
        "PlanError::Element",
        &["actor 1 'f'", "`cpoy`"],
    );
    c.case(
        "register_num as a string",
        load(edit(&json, "\"register_num\": 2", "\"register_num\": \"two\"")),
        "PlanError::Element",
        &["register 0 'src.out'", "\"two\""],
    );
    c.case(
        "a negative register_num",
        load(edit(&json, "\"register_num\": 2", "\"register_num\": -1")),
        "PlanError::Element",
        &["register 0 'src.out'", "-1"],
    );
    c.case(
        "register_num past u32",
        load(edit(&json, "\"register_num\": 2", "\"register_num\": 4294967296")),
        "PlanError::Element",
        &["register 0 'src.out'", "4294967296"],
    );
    c.case(
        "register_num 0",
        load(edit(&json, "\"register_num\": 2", "\"register_num\": 0")),
        "PlanError::ZeroRegisterNum",
        &["'src.out'", "register_num 0"],
    );
    c.case(
        "bytes as a float",
        load(edit(&json, "\"bytes\": 64", "\"bytes\": 64.5")),
        "PlanError::Element",
        &["register 0 'src.out'", "64.5"],
    );
    c.case(
        "bytes past u64",
        load(edit(&json, "\"bytes\": 64", "\"bytes\": 18446744073709551616")),
        "PlanError::Element",
        &["register 0 'src.out'", "expected u64"],
    );
    c.case(
        "bytes near u64::MAX",
        load(edit(&json, "\"bytes\": 64", "\"bytes\": 18446744073709551615")),
        "PlanError::Memory",
        &["node0/cpu:0", "overflows"],
    );
    c.case(
        "a stream index out of range",
        load(edit(&json, "\"stream\": 0", "\"stream\": 7")),
        "PlanError::UnknownStream",
        &["'src'", "unknown stream 7"],
    );
    c.case(
        "a producer index out of range",
        load(edit(&json, "\"producer\": 0", "\"producer\": 99")),
        "PlanError::UnknownActor",
        &["register 'src.out'", "unknown actor 99"],
    );
    c.case(
        "a consumer list that disagrees with the actors",
        load(edit(&json, "\"consumers\": [\n        1\n      ]", "\"consumers\": [\n        2\n      ]")),
        "PlanError::InconsistentEdge",
        &["'src.out'"],
    );
    c.case(
        "a name that is not a string",
        load(edit(&json, "\"name\": \"f\"", "\"name\": 5")),
        "PlanError::Element",
        &["actor 1", "integer `5`"],
    );
    c.case("a NaN literal", load(edit(&json, "\"bytes\": 64", "\"bytes\": NaN")), "PlanError::Parse", &["line"]);
    let nested = format!("{{\"schema_version\": 2, \"devices\": {}{}}}", "[".repeat(10_000), "]".repeat(10_000));
    c.case("arrays nested 10,000 deep", load(nested), "PlanError::Parse", &["line 1"]);
    let ops = op_json();
    c.case(
        "an op type no device has",
        || quick(Plan::from_json(&edit(&ops, "\"op_type\": \"matmul\"", "\"op_type\": \"matmul2\""))?).build(),
        "RuntimeError::KernelSetup",
        &["actor 'op'", "'matmul2'", "did you mean 'matmul'"],
    );
    c.case(
        "op attributes with an unknown field",
        || quick(Plan::from_json(&edit(&ops, "\"transpose_a\"", "\"transpose_x\""))?).build(),
        "RuntimeError::KernelSetup",
        &["actor 'op'", "transpose_x"],
    );
    c.case(
        "an op input dtype the kernel does not take",
        || quick(Plan::from_json(&ops.replace("\"f32\"", "\"i64\""))?).build(),
        "RuntimeError::KernelSetup",
        &["actor 'op'", "i64"],
    );
    c.case("an unknown dtype", load(edit(&ops, "\"f32\"", "\"f8\"")), "PlanError::Element", &["actor 2 'op'", "`f8`"]);
    c.finish();
}
