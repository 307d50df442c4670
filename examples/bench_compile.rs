//! Compile time, plan size and job build time of a 24-layer GPT training step (forward,
//! backward, AdamW with clipping) on one device and on a 64-device mesh: four pipeline
//! stages of a `[dp4, tp4]` mesh each (Megatron tensor parallelism inside a stage, data
//! parallelism across, 1F1B over 4 micro-batches); and on a `[dp8, tp2]` mesh with the AdamW
//! state split over `dp` (ZeRO stage 1: an update per weight and device, each weight
//! gathered in place, which the in-place checks must prove for every one); and on 16
//! devices of one axis with only the batch pinned, collectives on comm streams (the state
//! sharded in process and each weight held once, whose readers on every device the
//! in-place checks must prove done before each device's update writes its part).
//!
//! ```text
//! cargo run --release --example bench_compile [-- --layers 24 --repeats 3 --no-job]
//! ```
//!
//! Prints, per layout, the best and worst of `--repeats` runs of: building the graph
//! (DSL, autodiff, optimizer), compiling it to a plan (of which: the progress proof, run
//! again alone and reported as `progress`), writing the plan as JSON, reading it
//! back, and building a job from it (validation, memory, kernels, threads; the job is then
//! closed without running a step; `--no-job` skips it). Target (issue 11): compile under
//! 2 s on one core.

#[path = "common/gpt.rs"]
mod gpt;

use gpt::{Gpt, GptConfig};
use regflow::graph::plan::{DeviceKind, Plan};
use regflow::graph::sbp::{Mesh, MeshDevice, NdSbp, Sbp};
use regflow::graph::{CollectiveStreams, DType, Graph, Optimizer, ParallelOptions, TrainStep};
use regflow::prelude::Job;
use std::time::Instant;

use Sbp::{Broadcast as B, Split as S};

const BATCH: usize = 16;
const VOCAB: usize = 256;

/// `stages` meshes of `dp × tp` cpu devices (an empty list: one device).
fn stages(count: usize, dp: usize, tp: usize) -> Result<Vec<Mesh>, String> {
    (0..count)
        .map(|s| {
            let devices = (0..dp * tp)
                .map(|i| MeshDevice { node: 0, kind: DeviceKind::Cpu, index: (s * dp * tp + i) as u16 })
                .collect();
            Mesh::new(devices, &[dp, tp], &["dp", "tp"])
        })
        .collect()
}

/// The GPT's training step; on `meshes`, every input and parameter pinned on its stage:
/// inputs `S(0)` over dp, Megatron column/row splits over tp, the rest `B`.
fn step<'g>(
    g: &'g Graph,
    config: GptConfig,
    meshes: &[Mesh],
    micro: usize,
    sharded_state: bool,
) -> Result<TrainStep<'g>, String> {
    let e = |e: regflow::graph::GraphError| e.to_string();
    let model = Gpt::new(g, config, VOCAB).map_err(e)?;
    let mask = g.input("causal_mask", [config.context, config.context], DType::F32).map_err(e)?;
    let ids = g.input("ids", [BATCH / micro, config.context], DType::I64).map_err(e)?;
    let targets = g.input("targets", [BATCH / micro * config.context], DType::I64).map_err(e)?;
    if let [mesh] = meshes {
        if mesh.ndim() == 1 {
            // Data parallel with everything else left to the compiler: the AdamW state is
            // sharded in process and each weight held once, which the in-place checks
            // must prove across devices for every part.
            for t in [ids, targets] {
                g.set_layout(t, mesh, NdSbp(vec![S(0)])).map_err(e)?;
            }
        }
    }
    if !meshes.is_empty() && meshes[0].ndim() == 2 {
        let last = meshes.len() - 1;
        for t in [mask, ids, targets].into_iter().chain(g.trainable_variables()) {
            let name = t.name();
            let block = name.strip_prefix("block").and_then(|r| r.split('.').next()?.parse::<usize>().ok());
            let stage = match block {
                Some(l) => Gpt::stage_of_block(l, config.layers, meshes.len()),
                None if name == "targets" || name.starts_with("ln_final") => last,
                None => 0,
            };
            let column =
                ["attn.qkv", "attn.query", "attn.key", "attn.value", "mlp.in"].iter().any(|p| name.contains(p));
            let row = name.ends_with("attn.out.weight") || name.ends_with("mlp.out.weight");
            let layout = match () {
                _ if name == "ids" || name == "targets" => vec![S(0), B],
                _ if column && name.ends_with(".weight") => vec![B, S(1)],
                _ if column => vec![B, S(0)],
                _ if row => vec![B, S(0)],
                _ => vec![B, B],
            };
            g.set_layout(t, &meshes[stage], NdSbp(layout)).map_err(e)?;
        }
    }
    let logits = if meshes.len() > 1 { model.logits_staged(&ids, &mask, meshes) } else { model.logits(&ids, &mask) }
        .map_err(e)?;
    let loss = model.loss(&logits, &targets).map_err(e)?;
    let step = g.minimize(loss, &Optimizer::adamw(3e-3, 1e-4).with_clip_norm(1.0)).map_err(e)?;
    if sharded_state {
        // ZeRO stage 1 over `dp`: every AdamW moment split by rows across the replicas.
        for (state, _) in &step.states {
            g.set_layout(*state, &meshes[0], NdSbp(vec![S(0), B])).map_err(e)?;
        }
    }
    Ok(step)
}

/// Seconds taken by each phase of one run, and the plan's size.
struct Run {
    graph: f64,
    compile: f64,
    progress: f64,
    write: f64,
    read: f64,
    build: f64,
    json_bytes: usize,
    actors: usize,
    registers: usize,
    devices: usize,
    memory_bytes: u64,
    /// Registers held in another device's buffer ([`regflow::graph::plan::RegstDesc::home`]).
    held_once: usize,
}

fn run(
    config: GptConfig,
    meshes: &[Mesh],
    micro: usize,
    sharded_state: bool,
    build: bool,
) -> Result<Run, Box<dyn std::error::Error>> {
    let t0 = Instant::now();
    let g = Graph::new();
    let train = step(&g, config, meshes, micro, sharded_state)?;
    let t1 = Instant::now();
    let mesh = meshes.first().cloned().unwrap_or(Mesh::cpu(&[1], &["one"])?);
    let one_axis = mesh.ndim() == 1 && !meshes.is_empty();
    let mut options = ParallelOptions::new(mesh).train(&train);
    if one_axis {
        // Comm streams, as a host with enough cores gets: the order of a weight's readers
        // and its updates across devices is then proved through the collectives.
        options.collective_streams = CollectiveStreams::CommStreams;
    }
    if micro > 1 {
        options = options.micro_batches(&train, micro as u32);
    }
    let compiled = g.compile_parallel(&[train.loss], &train.updates, &options)?;
    let t2 = Instant::now();
    let json = compiled.plan.to_json();
    let t3 = Instant::now();
    let plan = Plan::from_json(&json)?;
    let t4 = Instant::now();
    let mut run = summary(&compiled.plan, json.len(), [t0, t1, t2, t3, t4]);
    let start = Instant::now();
    regflow::actors::check_progress(&plan, 2)?;
    run.progress = start.elapsed().as_secs_f64();
    if build {
        let start = Instant::now();
        let mut job = Job::builder(plan).build()?;
        run.build = start.elapsed().as_secs_f64();
        job.graph_feeds()?.close()?;
        job.wait()?;
    }
    Ok(run)
}

/// The phases' seconds from their start times (job build not measured: 0).
fn summary(plan: &Plan, json_bytes: usize, [t0, t1, t2, t3, t4]: [Instant; 5]) -> Run {
    let secs = |a: Instant, b: Instant| (b - a).as_secs_f64();
    Run {
        graph: secs(t0, t1),
        compile: secs(t1, t2),
        progress: 0.0,
        write: secs(t2, t3),
        read: secs(t3, t4),
        build: 0.0,
        json_bytes,
        actors: plan.actors.len(),
        registers: plan.regst_descs.len(),
        devices: plan.devices.len(),
        memory_bytes: plan.memory().map_or(0, |m| m.report().total_bytes()),
        held_once: plan.regst_descs.iter().filter(|r| r.home.is_some()).count(),
    }
}

fn main() -> Result<(), regflow::Report> {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str, default: usize| -> Result<usize, String> {
        match args.iter().position(|a| a == name) {
            Some(i) => args.get(i + 1).and_then(|v| v.parse().ok()).ok_or(format!("{name} takes a number")),
            None => Ok(default),
        }
    };
    let layers = flag("--layers", 24)?;
    let repeats = flag("--repeats", 3)?.max(1);
    let build = !args.iter().any(|a| a == "--no-job");
    let config = GptConfig {
        d_model: 128,
        heads: 4,
        layers,
        context: 64,
        mlp_width: 512,
        fused_attention: false,
        apart_qkv: false,
    };
    println!("GPT: {layers} layers, d_model 128, 4 heads, context 64, batch {BATCH}, vocab {VOCAB}; AdamW + clipping");
    let layouts = [
        ("1 device", Vec::new(), 1, false),
        ("dp4 x tp4 x pp4", stages(4, 4, 4)?, 4, false),
        ("dp8 x tp2, sharded AdamW state", stages(1, 8, 2)?, 1, true),
        ("dp16 (d_model 256), the compiler's layouts, comm streams", vec![Mesh::cpu(&[16], &["dp"])?], 1, false),
    ];
    for (label, meshes, micro, sharded) in layouts {
        // Weights of d_model 128 travel in buckets, which are not held once: the one-axis
        // layout takes wider ones, whose every part the in-place checks must order.
        let config = match meshes.as_slice() {
            [mesh] if mesh.ndim() == 1 => GptConfig { d_model: 256, mlp_width: 1024, ..config },
            _ => config,
        };
        let runs: Vec<Run> =
            (0..repeats).map(|_| run(config, &meshes, micro, sharded, build)).collect::<Result<_, _>>()?;
        let range = |f: fn(&Run) -> f64| {
            let v: Vec<f64> = runs.iter().map(f).collect();
            let (lo, hi) = v.iter().fold((f64::MAX, 0f64), |(lo, hi), &x| (lo.min(x), hi.max(x)));
            format!("{:.3}-{:.3} s", lo, hi)
        };
        let r = &runs[0];
        println!(
            "{label}: {} devices, {} actors, {} registers ({} held once), plan JSON {:.1} MiB, registers {:.2} GiB in all",
            r.devices,
            r.actors,
            r.registers,
            r.held_once,
            r.json_bytes as f64 / (1024.0 * 1024.0),
            r.memory_bytes as f64 / (1024.0 * 1024.0 * 1024.0)
        );
        println!(
            "  graph {}  compile {} (progress proof {})  write JSON {}  read JSON {}  job build {}",
            range(|r| r.graph),
            range(|r| r.compile),
            range(|r| r.progress),
            range(|r| r.write),
            range(|r| r.read),
            range(|r| r.build)
        );
    }
    Ok(())
}
