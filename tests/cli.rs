//! The `regflow` command-line tool: `plan show` and `plan dot` on hand-built and compiled
//! plans, and clear errors (naming the file, exit code non-zero) on bad input.

use regflow::graph::plan::{CollectiveConf, CollectiveOp};
use regflow::graph::sbp::{Mesh, NdSbp, Sbp};
use regflow::graph::{DType, Graph, Init, Optimizer, ParallelOptions};
use regflow::prelude::*;
use std::process::Command;

use crate::common;
use common::{failure, regflow, success, temp_dir};

/// Two cpu devices with a compute and a comm stream each. Per rank `r`: `src@r` makes a
/// 64-byte gradient (×2) and a zero-byte tick; `allreduce@r` sums the gradients over both
/// devices on the comm stream; `box_slice@r` (a local boxing copy) keeps 32 bytes (×2);
/// `sink@r` reads the slice and the tick. `sink@0` also reads `box_slice@1`'s slice (a
/// register crossing devices) and `step@0` carries an 8-byte state in a loop (preloaded).
fn two_device_plan() -> Plan {
    let mut b = PlanBuilder::new();
    let mut slices = Vec::new();
    let mut sinks = Vec::new();
    for rank in 0..2u16 {
        let device = b.device(0, DeviceKind::Cpu, rank);
        let compute = b.stream(device, StreamKind::Compute);
        let comm = b.stream(device, StreamKind::Comm);
        let src = b.actor(&format!("src@{rank}"), compute, ActorKind::Source { pieces: SourcePieces::Count(4) });
        let grad = b.regst(&format!("grad@{rank}"), src, 64, 2);
        let tick = b.regst(&format!("tick@{rank}"), src, 0, 1);
        let conf = CollectiveConf {
            group: "grad".into(),
            rank: u32::from(rank),
            size: 2,
            op: CollectiveOp::AllReduce,
            dtype: DType::F32,
            shape: vec![16],
        };
        let reduce =
            b.actor(&format!("allreduce@{rank}"), comm, ActorKind::Compute { kernel: KernelConf::Collective(conf) });
        b.consume(reduce, grad);
        let summed = b.regst(&format!("summed@{rank}"), reduce, 64, 1);
        let slice = b.actor(&format!("box_slice@{rank}"), compute, ActorKind::Compute { kernel: KernelConf::Copy });
        b.consume(slice, summed);
        slices.push(b.regst(&format!("slice@{rank}"), slice, 32, 2));
        let sink = b.actor(&format!("sink@{rank}"), compute, ActorKind::Sink);
        b.consume(sink, tick);
        sinks.push(sink);
        if rank == 0 {
            let step =
                b.actor("step@0", compute, ActorKind::Compute { kernel: KernelConf::Custom { name: "step".into() } });
            b.consume(step, tick);
            let state = b.regst("state@0", step, 8, 2);
            b.preload(state, 1);
            b.consume(step, state);
        }
    }
    b.consume(sinks[0], slices[0]);
    b.consume(sinks[0], slices[1]);
    b.consume(sinks[1], slices[1]);
    b.build().unwrap()
}

/// Writes a plan (or any text) to `dir/name` and returns the path.
fn write(dir: &std::path::Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_string()
}

#[test]
fn show_prints_per_device_streams_actors_collectives_and_peak_memory() {
    let plan = two_device_plan();
    // Slots are 64-byte aligned: device 0 holds grad 2×64, summed 64, slice 2×64 and
    // state 2×64; device 1 the same without the state.
    let report = plan.memory().unwrap().report();
    assert_eq!(report.bytes_of("node0/cpu:0"), Some(448));
    assert_eq!(report.bytes_of("node0/cpu:1"), Some(320));
    let dir = temp_dir("cli", "show");
    let path = write(&dir, "plan.json", &plan.to_json());
    let text = success(&["plan", "show", &path]);
    let expected = format!(
        "plan {path} (schema 2): 2 devices, 4 streams, 9 actors, 9 registers

device node0/cpu:0
  peak memory  448 bytes: own slots 448, shared region 0
  registers    5 (8 slots)
  streams      #0   compute    4 actors
               #1   comm       1 actor
  actors       source        1
               compute       1
               copy          1
               collective    1
               sink          1
  collectives  allreduce@0  all_reduce  group grad  rank 0/2  f32[16]

device node0/cpu:1
  peak memory  320 bytes: own slots 320, shared region 0
  registers    4 (6 slots)
  streams      #2   compute    3 actors
               #3   comm       1 actor
  actors       source        1
               copy          1
               collective    1
               sink          1
  collectives  allreduce@1  all_reduce  group grad  rank 1/2  f32[16]

total
  peak memory  768 bytes over 2 devices
  registers    9 (14 slots)
  streams      4 (compute 2, comm 2)
  actors       9 (source 2, compute 1, copy 2, collective 2, sink 2)
"
    );
    assert_eq!(text, expected);
}

#[test]
fn show_actors_lists_every_input_and_output_with_its_register_count() {
    let dir = temp_dir("cli", "show_actors");
    let path = write(&dir, "plan.json", &two_device_plan().to_json());
    let text = success(&["plan", "show", "--actors", &path]);
    let lines: Vec<&str> = text.lines().map(str::trim_end).collect();
    let has = |line: &str| lines.iter().any(|l| l.trim_start() == line);
    assert!(has("src@0        source (4 pieces)  stream #0 compute"), "{text}");
    assert!(has("out grad@0    2 x 64 bytes  to allreduce@0"), "{text}");
    assert!(has("out tick@0    1 x  0 bytes  to sink@0, step@0"), "{text}");
    assert!(has("allreduce@0  all_reduce         stream #1 comm"), "{text}");
    assert!(has("in  slice@1   2 x 32 bytes  from box_slice@1"), "{text}");
    assert!(has("step@0       compute (step)     stream #0 compute"), "{text}");
    assert!(has("out state@0   2 x  8 bytes  to step@0 (preloaded 1)"), "{text}");
    assert_eq!(lines.iter().filter(|l| l.trim_start().starts_with("in ")).count(), 11);
    assert_eq!(lines.iter().filter(|l| l.trim_start().starts_with("out ")).count(), 9);
}

#[test]
fn dot_draws_devices_as_clusters_with_register_counts_and_boxing_highlighted() {
    let dir = temp_dir("cli", "dot");
    let path = write(&dir, "plan.json", &two_device_plan().to_json());
    let dot = success(&["plan", "dot", &path]);
    assert!(dot.starts_with("digraph plan {\n") && dot.ends_with("}\n"), "{dot}");
    assert_eq!(dot.matches('{').count(), dot.matches('}').count());
    assert_eq!(dot.matches("subgraph cluster_").count(), 2);
    for (cluster, label) in [
        ("cluster_node0_cpu_0", "node0/cpu:0\\npeak 448 bytes"),
        ("cluster_node0_cpu_1", "node0/cpu:1\\npeak 320 bytes"),
    ] {
        assert!(dot.contains(&format!("  subgraph {cluster} {{\n    label=\"{label}\";")), "{dot}");
    }
    let line = |needle: &str| {
        dot.lines().find(|l| l.contains(needle)).unwrap_or_else(|| panic!("no line with {needle} in {dot}")).to_string()
    };
    // Actors a0.. in plan order: src@0 a0, allreduce@0 a1, box_slice@0 a2, sink@0 a3, step@0 a4.
    let collective = line("a1 [label=\"allreduce@0\\nall_reduce rank 0/2\"");
    assert!(collective.contains("fillcolor=\"#f4a261\""), "{collective}");
    assert!(line("a2 [label=\"box_slice@0\\ncopy\"").contains("fillcolor=\"#fde2c6\""));
    let gradient = line("a0 -> a1 ");
    assert!(gradient.contains("label=\"×2 · 64 B\"") && !gradient.contains("dashed"), "{gradient}");
    let tick = line("a0 -> a3 ");
    assert!(tick.contains("label=\"×1\"") && tick.contains("style=dashed"), "{tick}");
    assert!(tick.contains("color=\"#9a9a9a\""), "{tick}");
    let state = line("a4 -> a4 ");
    assert!(state.contains("label=\"×2 · 8 B · preloaded 1\"") && state.contains("arrowhead=empty"), "{state}");
    // slice@1 (produced by box_slice@1, a7) crosses to sink@0 (a3) but not to sink@1 (a8).
    let cross = line("a7 -> a3 ");
    assert!(cross.contains("penwidth=2.5") && cross.contains("color=\"#c1121f\""), "{cross}");
    assert!(!line("a7 -> a8 ").contains("#c1121f"));
    // One edge per (register, consumer).
    assert_eq!(dot.matches(" -> ").count(), 11);
}

#[test]
fn dot_output_file_and_stdin_give_the_same_graph() {
    let dir = temp_dir("cli", "dot_output");
    let json = two_device_plan().to_json();
    let path = write(&dir, "plan.json", &json);
    let out = dir.join("plan.dot");
    let printed = success(&["plan", "dot", &path, "-o", out.to_str().unwrap()]);
    assert!(printed.is_empty());
    let from_file = std::fs::read_to_string(&out).unwrap();
    let from_stdin = regflow(&["plan", "dot", "-"], Some(&json));
    assert!(from_stdin.status.success());
    assert_eq!(String::from_utf8(from_stdin.stdout).unwrap(), from_file);
    // A file graphviz accepts, where graphviz is installed.
    if Command::new("dot").arg("-V").output().is_ok_and(|o| o.status.success()) {
        let svg = Command::new("dot").args(["-Tsvg", out.to_str().unwrap()]).output().unwrap();
        assert!(svg.status.success(), "{}", String::from_utf8_lossy(&svg.stderr));
    }
}

#[test]
fn dot_escapes_quotes_and_backslashes_in_names() {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s = b.stream(cpu, StreamKind::Compute);
    let src = b.actor("say \"hi\"", s, ActorKind::Source { pieces: SourcePieces::Fed });
    let x = b.regst("x\\y", src, 4, 1);
    let sink = b.actor("sink", s, ActorKind::Sink);
    b.consume(sink, x);
    let dir = temp_dir("cli", "dot_escape");
    let path = write(&dir, "plan.json", &b.build().unwrap().to_json());
    let dot = success(&["plan", "dot", &path]);
    assert!(dot.contains(r#"a0 [label="say \"hi\"\nsource (fed)""#), "{dot}");
    assert!(dot.contains(r#"tooltip="x\\y""#), "{dot}");
}

#[test]
fn missing_file_is_an_error_naming_the_file() {
    let dir = temp_dir("cli", "missing");
    let path = dir.join("nope.json");
    let path = path.to_str().unwrap();
    for command in ["show", "dot"] {
        let stderr = failure(&["plan", command, path], None);
        assert!(stderr.contains(&format!("cannot read plan file {path}: ")), "{stderr}");
    }
}

#[test]
fn invalid_json_is_an_error_naming_the_file() {
    let dir = temp_dir("cli", "bad_json");
    let path = write(&dir, "broken.json", "{ \"schema_version\": 1, ");
    let stderr = failure(&["plan", "show", &path], None);
    assert!(stderr.contains(&format!("{path} is not a valid plan: plan file is not valid JSON")), "{stderr}");
    let stderr = failure(&["plan", "dot", "-"], Some("not json"));
    assert!(stderr.starts_with("error: <stdin> is not a valid plan: plan file is not valid JSON"), "{stderr}");
}

#[test]
fn plan_that_fails_validation_is_an_error_naming_the_problem() {
    let dir = temp_dir("cli", "invalid_plan");
    // A collective group with a rank nobody issues.
    let mut plan = two_device_plan();
    if let ActorKind::Compute { kernel: KernelConf::Collective(conf) } = &mut plan.actors[6].kind {
        conf.rank = 0;
    } else {
        panic!("actor 6 should be allreduce@1");
    }
    let path = write(&dir, "ranks.json", &plan.to_json());
    let stderr = failure(&["plan", "show", &path], None);
    assert!(
        stderr.contains(&format!(
            "{path} is not a valid plan: collective 'grad': members 'allreduce@0' and 'allreduce@1' both have rank 0"
        )),
        "{stderr}"
    );
    // A register without slots.
    let mut plan = two_device_plan();
    plan.regst_descs[0].register_num = 0;
    let path = write(&dir, "slots.json", &plan.to_json());
    let stderr = failure(&["plan", "dot", &path], None);
    assert!(stderr.contains("register 'grad@0' of actor 'src@0' has register_num 0"), "{stderr}");
}

#[test]
fn usage_errors_exit_non_zero_without_panicking() {
    let out = regflow(&["plan", "explode", "x.json"], None);
    assert!(!out.status.success());
    assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"));
}

/// A one-layer classifier (`w` of `[features, classes]`, batch 8) trained data parallel on
/// two cpu devices with AdamW, its moments split by rows where `shard_states`.
fn compiled_dp2(features: usize, classes: usize, shard_states: bool) -> regflow::graph::CompiledGraph {
    let g = Graph::new();
    let mesh = Mesh::cpu(&[2], &["dp"]).unwrap();
    let x = g.input("x", [8, features], DType::F32).unwrap();
    let y = g.input("y", [8], DType::I64).unwrap();
    g.set_layout(x, &mesh, NdSbp(vec![Sbp::Split(0)])).unwrap();
    g.set_layout(y, &mesh, NdSbp(vec![Sbp::Split(0)])).unwrap();
    let w = g.variable("w", [features, classes], DType::F32, Init::Xavier { seed: 0 }).unwrap();
    let loss = x.matmul(&w).unwrap().sparse_cross_entropy(&y).unwrap();
    let step = g.minimize(loss, &Optimizer::adamw(1e-2, 0.0)).unwrap();
    if shard_states {
        for (state, _) in &step.states {
            g.set_layout(*state, &mesh, NdSbp(vec![Sbp::Split(0)])).unwrap();
        }
    }
    g.compile_parallel(&[step.loss], &step.updates, &ParallelOptions::new(mesh).train(&step)).unwrap()
}

#[test]
fn compiled_data_parallel_plan_shows_both_devices_and_their_all_reduces() {
    let compiled = compiled_dp2(3, 2, false);
    let report = compiled.plan.memory().unwrap().report();
    let dir = temp_dir("cli", "compiled");
    let path = write(&dir, "dp2.json", &compiled.plan.to_json());

    let text = success(&["plan", "show", &path]);
    for device in ["node0/cpu:0", "node0/cpu:1"] {
        assert!(text.contains(&format!("\ndevice {device}\n")), "{text}");
        let bytes = report.bytes_of(device).unwrap();
        assert!(text.contains(&format!("  peak memory  {bytes} bytes")), "{text}");
    }
    for rank in 0..2 {
        let rank = format!("rank {rank}/2");
        assert!(text.lines().any(|l| l.contains("all_reduce  group box") && l.contains(&rank)), "{text}");
    }
    let collectives = compiled
        .plan
        .actors
        .iter()
        .filter(|a| matches!(a.kind, ActorKind::Compute { kernel: KernelConf::Collective(_) }))
        .count();
    assert!(collectives >= 2);
    assert!(text.contains(&format!("collective {collectives}")), "{text}");

    let dot = success(&["plan", "dot", &path]);
    assert!(dot.contains("subgraph cluster_node0_cpu_0 {") && dot.contains("subgraph cluster_node0_cpu_1 {"));
    assert_eq!(dot.matches("all_reduce rank").count(), collectives, "{dot}");
    assert_eq!(dot.matches("fillcolor=\"#f4a261\"").count(), collectives);
}

/// With sharded optimizer state each device updates its rows of the replicated weight,
/// read in place: `plan show` counts those windows per device, `plan dot` labels them, and
/// `plan show --actors` names the buffer the weight is held in once for the process.
#[test]
fn a_sharded_state_plan_shows_the_rows_it_reads_in_place() {
    let compiled = compiled_dp2(32, 16, true);
    let dir = temp_dir("cli", "windows");
    let path = write(&dir, "zero1.json", &compiled.plan.to_json());
    let text = success(&["plan", "show", &path]);
    // Each device reads its 16 of w's 32 rows (16 x 16 f32) in place.
    assert_eq!(
        text.matches("  windows      1 input read in place, 1024 bytes (1.0 KiB) not copied per piece").count(),
        2,
        "{text}"
    );
    // The gathered weight is held once for the process: device 1's register is device
    // 0's buffer, and `--actors` says so beside each of device 1's actors that touch it.
    let w = |d: usize| compiled.plan.variables.iter().find(|v| v.name == format!("w@{d}")).unwrap().regst;
    let home = &compiled.plan.regst_descs[w(0).index()].name;
    assert_eq!(compiled.plan.regst_descs[w(1).index()].home, Some(w(0)));
    let actors = success(&["plan", "show", "--actors", &path]);
    let held = format!("(one buffer: held in '{home}', once for the process)");
    assert!(
        actors.lines().any(|l| l.contains(&compiled.plan.regst_descs[w(1).index()].name) && l.contains(&held)),
        "{actors}"
    );
    let dot = success(&["plan", "dot", &path]);
    assert_eq!(dot.matches("reads 1.0 KiB at +").count(), 2, "{dot}");
    assert!(dot.contains("reads 1.0 KiB at +0 B") && dot.contains("reads 1.0 KiB at +1.0 KiB"), "{dot}");
}

/// `regflow env` reports the products' backend and instruction set, the CUDA backend and the
/// kernel cache (its folder, entries and bytes), and when a setting is refused it still
/// prints the whole report, then fails naming the variable and its value.
#[test]
fn env_reports_the_machine_and_fails_after_the_report_on_a_refused_setting() {
    let cache = temp_dir("cli", "env_cache");
    std::fs::write(cache.join("rows-compute_90-0123456789abcdef.ptx"), b"12345").unwrap();
    let env = |vars: &[(&str, &str)]| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_regflow"));
        command.arg("env");
        for name in ["REGFLOW_CPU_GEMM", "REGFLOW_CPU_ISA", "REGFLOW_KERNEL_CACHE", "REGFLOW_OPENBLAS"] {
            command.env_remove(name);
        }
        command.envs(vars.iter().copied());
        command.output().unwrap()
    };
    let cache_path = cache.to_str().unwrap();
    let out = env(&[("REGFLOW_CPU_ISA", "scalar"), ("REGFLOW_CPU_GEMM", "gemm"), ("REGFLOW_KERNEL_CACHE", cache_path)]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.starts_with(&format!("regflow: {}\n", env!("CARGO_PKG_VERSION"))), "{stdout}");
    assert!(stdout.contains("cpu products: backend gemm, instruction set scalar;"), "{stdout}");
    assert!(stdout.contains(&format!("kernel cache: {cache_path} (1 entry, 5 bytes)\n")), "{stdout}");
    assert!(stdout.contains("host arenas: "), "{stdout}");
    assert!(stdout.contains("cuda backend: "), "{stdout}");

    let off = String::from_utf8(env(&[("REGFLOW_KERNEL_CACHE", "off")]).stdout).unwrap();
    assert!(off.contains("kernel cache: off ("), "{off}");

    let out = env(&[("REGFLOW_CPU_GEMM", "mkl"), ("REGFLOW_KERNEL_CACHE", cache_path)]);
    let (stdout, stderr) = (String::from_utf8(out.stdout).unwrap(), String::from_utf8(out.stderr).unwrap());
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stdout.contains("kernel cache: "), "the whole report first: {stdout}");
    assert!(stderr.starts_with("error: refused settings: REGFLOW_CPU_GEMM=\"mkl\""), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");

    // A process asking for OpenBLAS where it is missing is refused with the way to get it.
    let out = env(&[("REGFLOW_CPU_GEMM", "blas"), ("REGFLOW_OPENBLAS", "/nonexistent/libopenblas.so.0")]);
    let (stdout, stderr) = (String::from_utf8(out.stdout).unwrap(), String::from_utf8(out.stderr).unwrap());
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stdout.contains("OpenBLAS not found (REGFLOW_OPENBLAS=\"/nonexistent/libopenblas.so.0\" could not be loaded ("),
        "{stdout}"
    );
    assert!(
        stderr.starts_with("error: refused settings: REGFLOW_CPU_GEMM=blas: the CPU matrix product backend `blas` was asked for, but REGFLOW_OPENBLAS=\"/nonexistent/libopenblas.so.0\" could not be loaded (/nonexistent/libopenblas.so.0: "),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");

    // Where OpenBLAS loads, `regflow env` names it and says where it takes no product
    // (AVX-512: `prefers_blas`).
    if let Ok(library) = regflow::kernels::cpu::gemm_backend::openblas_library() {
        let found = String::from_utf8(env(&[("REGFLOW_CPU_GEMM", "blas")]).stdout).unwrap();
        assert!(found.contains(&format!("OpenBLAS found ({library})")), "{found}");
        let note = "cpu products: at avx512 gemm computes every product (faster there than OpenBLAS)";
        let capped =
            String::from_utf8(env(&[("REGFLOW_CPU_GEMM", "blas"), ("REGFLOW_CPU_ISA", "avx2")]).stdout).unwrap();
        assert!(!capped.contains("gemm computes every product"), "{capped}");
        let widest = String::from_utf8(env(&[("REGFLOW_CPU_GEMM", "blas")]).stdout).unwrap();
        assert_eq!(widest.contains(note), widest.contains("instruction set avx512;"), "{widest}");
    }
}
