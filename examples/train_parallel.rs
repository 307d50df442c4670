//! Trains the digits MLP or the tiny GPT on a mesh of `cpu` devices, with the parallelism
//! stated only as layouts, and checks it against one device.
//!
//! ```text
//! cargo run --release --example train_parallel -- \
//!     --layout dp4|dp2|tp2|zero1|zero2|dp2xtp2|pp2|pp4|dp2xtp2xpp2 [--model mlp|gpt] \
//!     [--steps N] [--micro-batches M] [--trace timeline.json] [--no-compare] [--nodes N] \
//!     [--collective-streams auto|comm|compute] [--copy-streams auto|copy|compute]
//! ```
//!
//! Layouts (`S(d)`: split along dim d over the mesh axis, `B`: whole on every device):
//! - `dpN`: inputs `S(0)` over `dp`, weights `B`; gradients come out `Partial` and their
//!   conversion back to the weights' `B` is the all-reduce.
//! - `tp2`: Megatron: the first matrix of each pair column-split `S(1)` (attention: the
//!   Q/K/V projections, so heads are split), the second row-split `S(0)`; its product is
//!   `Partial` and is all-reduced before the next LayerNorm / loss.
//! - `zero1`: inputs `S(0)`, weights `B`, every AdamW moment `S(0)` (sharded optimizer
//!   state): gradients are reduce-scattered to the rows each device updates, and the
//!   updated rows all-gathered into the weights.
//! - `zero2`: inputs `S(0)` and every weight and its AdamW state `S(0)`: weights are
//!   all-gathered before use and gradients reduce-scattered.
//! - `dp2xtp2`: a 2 × 2 mesh `[dp, tp]` combining the two.
//! - `pp2`, `pp4`: pipeline stages of one device each (the GPT's blocks spread over them,
//!   embeddings on the first, the tied projection on the last); each step is fed as
//!   `--micro-batches` pieces (default 4), and register counts give the 1F1B schedule.
//! - `dp2xtp2xpp2`: two stages of 2 × 2 devices: 8 devices.
//!
//! After training on the mesh, the same graph is trained on one device (unless
//! `--no-compare`) and the largest relative difference of the per-step losses is printed.
//!
//! `--nodes N` spreads the layout's devices over N nodes (processes joined over loopback
//! TCP): the example starts N copies of itself with `regflow::launch` (as `regflow launch`
//! would), each joins the others and runs its node's actors; the node that receives the
//! loss reports it, and the comparison with one device is made as before. Under a launcher
//! (`RANK`, `WORLD_SIZE`, ... set) it runs as that one node.
//!
//! `--collective-streams` says where each cpu device's collectives run
//! (`ParallelOptions::collective_streams`): `comm` on comm streams of their own, `compute`
//! on its compute stream (one micro-batch only: fewer threads, which pays where the machine
//! has fewer cores than the mesh has devices), `auto` (the default) whichever of the two
//! suits this machine's cores. `--copy-streams` says the same of the copies a device
//! receives from another (`ParallelOptions::copy_streams`, pipeline stages' activations):
//! `copy` on a copy stream of its own, `compute` on its compute stream, `auto` (the
//! default) as suits the cores.
//!
//! `REGFLOW_JOBS=n` trains n copies of the layout at once, as n jobs of this process
//! (without the comparison), and prints each one's time per step: several jobs sharing
//! the cores, as in a service that runs several models.

#[path = "common/gpt.rs"]
mod gpt;

use flate2::read::GzDecoder;
use gpt::{Gpt, GptConfig};
use regflow::graph::plan::DeviceKind;
use regflow::graph::sbp::{Mesh, MeshDevice, NdSbp, Sbp};
use regflow::graph::{
    CollectiveStreams, CopyStreams, DType, Graph, GraphError, HostArray, Init, Optimizer, ParallelOptions, SplitMix64,
    Tensor, TrainStep,
};
use regflow::prelude::Job;
use regflow::runtime::{Cluster, ClusterEnv, ClusterOptions};
use std::io::Read;
use std::time::Instant;

use Sbp::{Broadcast as B, Split as S};

const MLP_BATCH: usize = 64;
const GPT: GptConfig = GptConfig {
    d_model: 64,
    heads: 4,
    layers: 2,
    context: 32,
    mlp_width: 256,
    fused_attention: false,
    apart_qkv: false,
};
const GPT_BATCH: usize = 8;

#[derive(Clone, Copy, PartialEq)]
enum Model {
    Mlp,
    Gpt,
}

struct Options {
    model: Model,
    layout: String,
    steps: usize,
    trace: Option<String>,
    compare: bool,
    micro_batches: usize,
    /// Nodes (processes) the layout's devices are spread over.
    nodes: u16,
    /// Where each cpu device's collectives run.
    collective_streams: CollectiveStreams,
    /// Where each cpu device runs the copies it receives.
    copy_streams: CopyStreams,
}

/// The values of `--collective-streams`.
const COLLECTIVE_STREAMS: [(&str, CollectiveStreams); 3] = [
    ("auto", CollectiveStreams::Auto),
    ("comm", CollectiveStreams::CommStreams),
    ("compute", CollectiveStreams::ComputeStreams),
];

/// The values of `--copy-streams`.
const COPY_STREAMS: [(&str, CopyStreams); 3] =
    [("auto", CopyStreams::Auto), ("copy", CopyStreams::CopyStreams), ("compute", CopyStreams::ComputeStreams)];

/// The choice `value` of `flag` names in `table`, or an error listing the names.
fn flag_value<T: Copy>(flag: &str, table: &[(&str, T)], value: &str) -> Result<T, String> {
    table.iter().find(|(name, _)| *name == value).map(|(_, choice)| *choice).ok_or_else(|| {
        let names: Vec<&str> = table.iter().map(|(name, _)| *name).collect();
        format!("{flag} {value}: expected one of {}", names.join(", "))
    })
}

/// The name `table` gives `choice`.
fn flag_name<T: PartialEq>(table: &[(&'static str, T)], choice: T) -> &'static str {
    table.iter().find(|(_, c)| *c == choice).map_or("auto", |(name, _)| *name)
}

fn options() -> Result<Options, String> {
    let mut o = Options {
        model: Model::Mlp,
        layout: "dp2".into(),
        steps: 60,
        trace: None,
        compare: true,
        micro_batches: 4,
        nodes: 1,
        collective_streams: CollectiveStreams::Auto,
        copy_streams: CopyStreams::Auto,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--model" => {
                o.model = match value()?.as_str() {
                    "mlp" => Model::Mlp,
                    "gpt" => Model::Gpt,
                    other => return Err(format!("--model {other}: expected mlp or gpt")),
                }
            }
            "--layout" => o.layout = value()?,
            "--steps" => o.steps = value()?.parse().map_err(|e| format!("--steps: {e}"))?,
            "--trace" => o.trace = Some(value()?),
            "--no-compare" => o.compare = false,
            "--collective-streams" => o.collective_streams = flag_value(&arg, &COLLECTIVE_STREAMS, &value()?)?,
            "--copy-streams" => o.copy_streams = flag_value(&arg, &COPY_STREAMS, &value()?)?,
            "--nodes" => {
                o.nodes = value()?.parse().map_err(|e| format!("--nodes: {e}"))?;
                if o.nodes == 0 {
                    return Err("--nodes must be at least 1".into());
                }
            }
            "--micro-batches" => {
                o.micro_batches = value()?.parse().map_err(|e| format!("--micro-batches: {e}"))?;
                if !(o.micro_batches == 1 || o.micro_batches == 2 || o.micro_batches == 4 || o.micro_batches == 8) {
                    return Err("--micro-batches must divide the batch: 1, 2, 4 or 8".into());
                }
            }
            other => return Err(format!("unknown argument {other}; see the example's documentation")),
        }
    }
    if o.steps == 0 {
        return Err("--steps must be at least 1".into());
    }
    Ok(o)
}

/// Stage meshes (one unless pipelined) and the layout of each named tensor on its stage.
struct Spec {
    stages: Vec<Mesh>,
    pins: Vec<(String, Vec<Sbp>)>,
    /// Every parameter `S(0)` over `dp` (ZeRO: its AdamW state follows).
    zero: bool,
    /// Every optimizer state `S(0)` over `dp`, the parameters as pinned (ZeRO stage 1).
    shard_states: bool,
}

/// The stage a named input or parameter lives on.
fn stage_of(name: &str, model: Model, stages: usize) -> usize {
    let last = stages - 1;
    match model {
        Model::Mlp => match name {
            "y" | "w2" | "b2" => last,
            _ => 0,
        },
        Model::Gpt => {
            if name == "targets" || name.starts_with("ln_final") {
                last
            } else if let Some(l) = name.strip_prefix("block").and_then(|r| r.split('.').next()?.parse::<usize>().ok())
            {
                Gpt::stage_of_block(l, GPT.layers, stages)
            } else {
                0
            }
        }
    }
}

/// The stage meshes and, for each parameter or input name, its layout. `tp` says which
/// weights are split by columns (`S(1)`) or rows (`S(0)`) on the tensor-parallel axis.
fn layout(name: &str, model: Model) -> Result<Spec, String> {
    let (stages, shape, axes): (usize, Vec<usize>, Vec<&str>) = match name {
        "dp2" => (1, vec![2], vec!["dp"]),
        "dp4" => (1, vec![4], vec!["dp"]),
        "tp2" => (1, vec![2], vec!["tp"]),
        "zero1" | "zero2" => (1, vec![2], vec!["dp"]),
        "dp2xtp2" => (1, vec![2, 2], vec!["dp", "tp"]),
        "pp2" => (2, vec![1], vec!["pp"]),
        "pp4" => (4, vec![1], vec!["pp"]),
        "dp2xtp2xpp2" => (2, vec![2, 2], vec!["dp", "tp"]),
        other => {
            return Err(format!(
                "--layout {other}: expected dp2, dp4, tp2, zero1, zero2, dp2xtp2, pp2, pp4 or dp2xtp2xpp2"
            ))
        }
    };
    if model == Model::Mlp && stages > 2 {
        return Err(format!("--layout {name}: the MLP has 2 layers, too few for {stages} stages (try --model gpt)"));
    }
    let size: usize = shape.iter().product();
    let stages: Vec<Mesh> = (0..stages)
        .map(|s| {
            let devices = (0..size)
                .map(|i| MeshDevice { node: 0, kind: DeviceKind::Cpu, index: (s * size + i) as u16 })
                .collect();
            Mesh::new(devices, &shape, &axes)
        })
        .collect::<Result<_, _>>()?;
    let dp = axes.iter().position(|a| *a == "dp");
    let tp = axes.iter().position(|a| *a == "tp");
    let on = |axis: Option<usize>, sbp: Sbp| -> Option<Vec<Sbp>> {
        axis.map(|a| {
            let mut v = vec![B; shape.len()];
            v[a] = sbp;
            v
        })
    };
    let mut pins: Vec<(String, Vec<Sbp>)> = Vec::new();
    let inputs: &[&str] = if model == Model::Mlp { &["x", "y"] } else { &["ids", "targets"] };
    for input in inputs {
        if let Some(l) = on(dp, S(0)) {
            pins.push((input.to_string(), l));
        }
    }
    // Megatron: column-split then row-split.
    let (columns, rows): (Vec<String>, Vec<String>) = match model {
        Model::Mlp => (vec!["w1".into()], vec!["w2".into()]),
        Model::Gpt => {
            let mut c = Vec::new();
            let mut r = Vec::new();
            for l in 0..GPT.layers {
                for p in ["attn.query", "attn.key", "attn.value", "mlp.in"] {
                    c.push(format!("block{l}.{p}"));
                }
                r.push(format!("block{l}.attn.out.weight"));
                r.push(format!("block{l}.mlp.out.weight"));
            }
            (c, r)
        }
    };
    if let Some(tp) = tp {
        let mut with = |name: String, sbp: Sbp| {
            let mut v = pins.iter().find(|(n, _)| *n == name).map(|(_, v)| v.clone()).unwrap_or(vec![B; shape.len()]);
            v[tp] = sbp;
            pins.retain(|(n, _)| *n != name);
            pins.push((name, v));
        };
        for c in columns {
            let (weight, bias) = match model {
                Model::Mlp => (c.clone(), "b1".to_string()),
                Model::Gpt => (format!("{c}.weight"), format!("{c}.bias")),
            };
            with(weight, S(1));
            with(bias, S(0));
        }
        for r in rows {
            with(r, S(0));
        }
    }
    Ok(Spec { stages, pins, zero: name == "zero2", shard_states: name == "zero1" })
}

struct Task {
    /// Per step: (input name, value).
    batches: Vec<Vec<(&'static str, HostArray)>>,
}

fn digits(steps: usize) -> Result<Task, Box<dyn std::error::Error>> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/data/digits.csv.gz");
    let mut text = String::new();
    GzDecoder::new(std::fs::File::open(path)?).read_to_string(&mut text)?;
    let mut rows: Vec<(Vec<f32>, i64)> = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let v: Vec<&str> = line.split(',').collect();
        if v.len() != 65 {
            return Err(format!("{path}:{}: {} fields, expected 65", n + 1, v.len()).into());
        }
        let pixels = v[..64].iter().map(|p| p.trim().parse::<f32>().map(|p| p / 16.0)).collect::<Result<_, _>>()?;
        rows.push((pixels, v[64].trim().parse()?));
    }
    let mut rng = SplitMix64::new(3);
    let batches = (0..steps)
        .map(|_| {
            let picks: Vec<usize> = (0..MLP_BATCH).map(|_| (rng.next_u64() % rows.len() as u64) as usize).collect();
            let x: Vec<f32> = picks.iter().flat_map(|&r| rows[r].0.clone()).collect();
            let y: Vec<i64> = picks.iter().map(|&r| rows[r].1).collect();
            Ok(vec![("x", HostArray::f32([MLP_BATCH, 64], x)?), ("y", HostArray::i64([MLP_BATCH], y)?)])
        })
        .collect::<Result<_, regflow::graph::plan::ArrayError>>()?;
    Ok(Task { batches })
}

fn text(steps: usize) -> Result<(Task, usize), Box<dyn std::error::Error>> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/data/tiny_text.txt");
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    let mut vocab: Vec<char> = text.chars().collect();
    vocab.sort_unstable();
    vocab.dedup();
    let ids: Vec<i64> = text.chars().map(|c| vocab.binary_search(&c).map_or(0, |i| i as i64)).collect();
    let t = GPT.context;
    if ids.len() <= t + 1 {
        return Err(format!("{path}: too short").into());
    }
    let mask: Vec<f32> = (0..t * t).map(|i| if i % t <= i / t { 0.0 } else { -1e9 }).collect();
    let mut rng = SplitMix64::new(42);
    let batches = (0..steps)
        .map(|_| {
            let (mut x, mut y) = (Vec::new(), Vec::new());
            for _ in 0..GPT_BATCH {
                let s = (rng.next_u64() % (ids.len() - t - 1) as u64) as usize;
                x.extend_from_slice(&ids[s..s + t]);
                y.extend_from_slice(&ids[s + 1..s + t + 1]);
            }
            Ok(vec![
                ("causal_mask", HostArray::f32([t, t], mask.clone())?),
                ("ids", HostArray::i64([GPT_BATCH, t], x)?),
                ("targets", HostArray::i64([GPT_BATCH * t], y)?),
            ])
        })
        .collect::<Result<_, regflow::graph::plan::ArrayError>>()?;
    Ok((Task { batches }, vocab.len()))
}

/// Builds the model's training step, pinning the layouts first when given.
fn build<'g>(
    g: &'g Graph,
    model: Model,
    vocab: usize,
    layout: Option<&Spec>,
    micro: usize,
) -> Result<TrainStep<'g>, Box<dyn std::error::Error>> {
    // Every input and parameter goes on its stage, in its pinned layout (or Broadcast).
    let pin = |t: Tensor<'g>| -> Result<(), GraphError> {
        let Some(spec) = layout else { return Ok(()) };
        let name = t.name();
        let mesh = &spec.stages[stage_of(&name, model, spec.stages.len())];
        let sbp = match spec.pins.iter().find(|(n, _)| *n == name) {
            Some((_, sbp)) => sbp.clone(),
            None if spec.zero && g.trainable_variables().iter().any(|v| v.id() == t.id()) => vec![S(0)],
            None => vec![B; mesh.ndim()],
        };
        g.set_layout(t, mesh, NdSbp(sbp))
    };
    let stages: &[Mesh] = layout.map_or(&[], |s| &s.stages);
    let loss = match model {
        Model::Mlp => {
            let x = g.input("x", [MLP_BATCH / micro, 64], DType::F32)?;
            let y = g.input("y", [MLP_BATCH / micro], DType::I64)?;
            let w1 = g.variable("w1", [64, 128], DType::F32, Init::Kaiming { seed: 1 })?;
            let b1 = g.variable("b1", [128], DType::F32, Init::Zeros)?;
            let w2 = g.variable("w2", [128, 10], DType::F32, Init::Xavier { seed: 2 })?;
            let b2 = g.variable("b2", [10], DType::F32, Init::Zeros)?;
            for t in [x, y, w1, b1, w2, b2] {
                pin(t)?;
            }
            let mut h = x.matmul(&w1)?.add(&b1)?.relu()?;
            if let Some(last) = stages.get(1) {
                h = h.to_placement(last)?;
            }
            h.matmul(&w2)?.add(&b2)?.sparse_cross_entropy(&y)?
        }
        Model::Gpt => {
            let model = Gpt::new(g, GPT, vocab)?;
            let mask = g.input("causal_mask", [GPT.context, GPT.context], DType::F32)?;
            let ids = g.input("ids", [GPT_BATCH / micro, GPT.context], DType::I64)?;
            let targets = g.input("targets", [GPT_BATCH / micro * GPT.context], DType::I64)?;
            for t in [mask, ids, targets].into_iter().chain(g.trainable_variables()) {
                pin(t)?;
            }
            let logits =
                if stages.len() > 1 { model.logits_staged(&ids, &mask, stages)? } else { model.logits(&ids, &mask)? };
            model.loss(&logits, &targets)?
        }
    };
    let step = g.minimize(loss, &Optimizer::adamw(3e-3, 1e-4).with_clip_norm(1.0))?;
    if let Some(spec) = layout.filter(|s| s.shard_states) {
        for (state, param) in &step.states {
            let mesh = &spec.stages[stage_of(&param.name(), model, spec.stages.len())];
            g.set_layout(*state, mesh, NdSbp(vec![S(0)]))?;
        }
    }
    Ok(step)
}

/// What a training run reports: the loss of every step, the seconds it took, the plan's
/// actor count.
type Trained = (Vec<f64>, f64, usize);

/// Trains on `mesh` (one device when `None`); returns the losses and the seconds taken.
fn train(
    o: &Options,
    task: &Task,
    vocab: usize,
    layout: Option<&Spec>,
    trace: Option<&str>,
) -> Result<Trained, Box<dyn std::error::Error>> {
    let g = Graph::new();
    // Pipelines take each step as micro-batches (pieces); one device takes the whole batch.
    let micro = if layout.is_some_and(|s| s.stages.len() > 1) { o.micro_batches } else { 1 };
    let step = build(&g, o.model, vocab, layout, micro)?;
    let mesh = layout.map(|s| s.stages[0].clone()).unwrap_or(Mesh::cpu(&[1], &["one"])?);
    let mut options = ParallelOptions::new(mesh).train(&step);
    if micro > 1 {
        options = options.micro_batches(&step, micro as u32);
    }
    options.collective_streams = o.collective_streams;
    options.copy_streams = o.copy_streams;
    let compiled = g.compile_parallel(&[step.loss], &step.updates, &options)?;
    if let (Some(_), Some(info)) = (layout, &compiled.parallel) {
        let on = if info.collectives_on_compute_streams { "the compute streams" } else { "comm streams" };
        println!("collectives on {on} (--collective-streams {})", flag_name(&COLLECTIVE_STREAMS, o.collective_streams));
        if layout.is_some_and(|s| s.stages.len() > 1) {
            let on = if info.copies_on_compute_streams { "the compute streams" } else { "copy streams" };
            println!("stage copies on {on} (--copy-streams {})", flag_name(&COPY_STREAMS, o.copy_streams));
        }
    }
    let actors = compiled.plan.actors.len();
    if let (Some(path), Some(_)) = (std::env::var_os("REGFLOW_PLAN_JSON"), layout) {
        std::fs::write(path, compiled.plan.to_json())?;
    }
    let mut builder = Job::builder(compiled.plan.clone());
    if let Some(path) = trace {
        builder = builder.trace(path);
    }
    // Under a launcher with a layout: this process runs one node of it.
    if let (Some(env), Some(_)) = (ClusterEnv::from_env()?, layout) {
        let options = ClusterOptions { timeout: std::time::Duration::from_secs(60), ..ClusterOptions::default() };
        builder = builder.cluster(Cluster::join(&env, &compiled.plan, &options)?);
    }
    let mut job = builder.build()?;
    // Every node pushes every batch (each keeps its own parts); one receives the loss.
    let mut feeds = job.graph_feeds()?;
    let fetcher = match job.has_output(&compiled.fetches[0]) {
        true => Some(job.fetcher(&compiled.fetches[0])?),
        false => None,
    };
    let started = Instant::now();
    let batches = task.batches.clone();
    let pusher = std::thread::spawn(move || -> Result<(), regflow::prelude::RuntimeError> {
        for batch in batches {
            for k in 0..micro {
                for (name, value) in &batch {
                    feeds.push(name, &micro_batch(value, name, k, micro))?;
                }
            }
        }
        feeds.close()
    });
    let mut micro_losses = Vec::with_capacity(task.batches.len() * micro);
    while let Some(piece) = fetcher.as_ref().and_then(|f| f.recv()) {
        micro_losses.push(f64::from(f32::from_le_bytes(piece.bytes().try_into()?)));
    }
    // A step's loss is the mean over its (equal) micro-batches.
    let losses: Vec<f64> = micro_losses.chunks(micro).map(|c| c.iter().sum::<f64>() / c.len() as f64).collect();
    let elapsed = started.elapsed().as_secs_f64();
    pusher.join().map_err(|_| "the feeding thread panicked")??;
    job.wait()?;
    Ok((losses, elapsed, actors))
}

/// Trains `jobs` copies of the layout at once, each a job of its own on a thread of its
/// own, and prints each one's time per step.
fn train_at_once(o: &Options, task: &Task, vocab: usize, spec: &Spec, jobs: usize) -> Result<(), String> {
    let results: Vec<Result<Trained, String>> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..jobs)
            .map(|_| scope.spawn(|| train(o, task, vocab, Some(spec), None).map_err(|e| e.to_string())))
            .collect();
        threads.into_iter().map(|t| t.join().unwrap_or_else(|_| Err("a training thread panicked".into()))).collect()
    });
    for (j, result) in results.into_iter().enumerate() {
        let (losses, seconds, actors) = result?;
        println!(
            "job {j}: {} steps in {seconds:.2}s ({:.1} ms/step, {actors} actors)",
            losses.len(),
            1e3 * seconds / o.steps as f64
        );
    }
    Ok(())
}

/// Micro-batch `k` of `m` of a batched input (rows along dim 0); the mask is not batched.
fn micro_batch(value: &HostArray, name: &str, k: usize, m: usize) -> HostArray {
    if m == 1 || name == "causal_mask" {
        return value.clone();
    }
    let rows = value.shape.dims()[0] / m;
    let ranges: Vec<std::ops::Range<usize>> = value
        .shape
        .dims()
        .iter()
        .enumerate()
        .map(|(d, &n)| if d == 0 { k * rows..(k + 1) * rows } else { 0..n })
        .collect();
    value.region(&ranges)
}

fn main() -> Result<(), regflow::Report> {
    let o = options()?;
    let (task, vocab) = match o.model {
        Model::Mlp => (digits(o.steps)?, 0),
        Model::Gpt => text(o.steps)?,
    };
    let mut spec = layout(&o.layout, o.model)?;
    if o.nodes > 1 {
        let devices: usize = spec.stages.iter().map(Mesh::size).sum();
        if !devices.is_multiple_of(usize::from(o.nodes)) {
            return Err(format!(
                "layout {} has {devices} devices, which {} nodes cannot share evenly",
                o.layout, o.nodes
            )
            .into());
        }
        let per_node = devices / usize::from(o.nodes);
        spec.stages = spec.stages.iter().map(|m| m.place_on_nodes(per_node)).collect::<Result<_, _>>()?;
        if ClusterEnv::from_env()?.is_none() {
            return Ok(launch_nodes(&o, &task, vocab)?);
        }
    }
    let model = if o.model == Model::Mlp { "digits MLP 64-128-10" } else { "tiny GPT" };
    let stages: Vec<String> = spec.stages.iter().map(ToString::to_string).collect();
    println!("{model}, layout {} on {}", o.layout, stages.join(" | "));
    if spec.stages.len() > 1 {
        println!("  {} pipeline stages, {} micro-batches per step", spec.stages.len(), o.micro_batches);
    }
    for (name, sbp) in &spec.pins {
        println!("  {name:<28} {}", NdSbp(sbp.clone()).describe(&spec.stages[0]));
    }
    if let Some(jobs) = std::env::var("REGFLOW_JOBS").ok().and_then(|n| n.parse::<usize>().ok()).filter(|&n| n > 1) {
        return Ok(train_at_once(&o, &task, vocab, &spec, jobs)?);
    }
    let (losses, seconds, actors) = train(&o, &task, vocab, Some(&spec), o.trace.as_deref())?;
    if o.nodes > 1 {
        // One rank of a multi-node run: the rank with the loss reports it to the launcher.
        if !losses.is_empty() {
            let bits: Vec<String> = losses.iter().map(|l| l.to_bits().to_string()).collect();
            println!("LOSSES {seconds} {}", bits.join(","));
        }
        return Ok(());
    }
    print_losses(&losses);
    println!(
        "{} steps in {seconds:.2}s ({:.1} ms/step, {actors} actors)",
        losses.len(),
        1e3 * seconds / o.steps as f64
    );
    if let Some(path) = &o.trace {
        println!("timeline written to {path} (open in https://ui.perfetto.dev)");
    }
    if o.compare {
        compare_with_one_device(&o, &task, vocab, &losses)?;
    }
    Ok(())
}

/// Prints the first step's loss, every tenth and the last.
fn print_losses(losses: &[f64]) {
    for (step, loss) in losses.iter().enumerate() {
        if step == 0 || (step + 1) % 10 == 0 || step + 1 == losses.len() {
            println!("step {:>4}: loss {loss:.5}", step + 1);
        }
    }
}

/// Trains the same graph on one device and prints the largest relative loss difference.
fn compare_with_one_device(
    o: &Options,
    task: &Task,
    vocab: usize,
    losses: &[f64],
) -> Result<(), Box<dyn std::error::Error>> {
    let (single, single_seconds, _) = train(o, task, vocab, None, None)?;
    let worst = losses.iter().zip(&single).map(|(a, b)| (a - b).abs() / b.abs().max(1e-12)).fold(0.0f64, f64::max);
    println!(
        "one device: {:.2}s ({:.1} ms/step); largest relative loss difference over {} steps: {worst:.2e}",
        single_seconds,
        1e3 * single_seconds / o.steps as f64,
        single.len()
    );
    Ok(())
}

/// Starts `o.nodes` copies of this program, one per node, and reports like one process:
/// the losses come from the rank that received them, the comparison from one device here.
fn launch_nodes(o: &Options, task: &Task, vocab: usize) -> Result<(), Box<dyn std::error::Error>> {
    let mut launch = regflow::launch::LaunchOptions::new(u32::from(o.nodes), std::env::current_exe()?);
    launch.args = std::env::args_os().skip(1).collect();
    launch.args.push("--no-compare".into());
    launch.capture = true;
    println!("{} nodes on loopback, started by regflow::launch", o.nodes);
    let outcome = regflow::launch::launch(&launch)?;
    let mut report = None;
    for rank in &outcome.ranks {
        for line in rank.stdout.lines() {
            match line.strip_prefix("LOSSES ") {
                Some(rest) => report = Some(rest.to_string()),
                None => println!("[rank {}] {line}", rank.rank),
            }
        }
        if !rank.status.success() {
            eprint!("{}", rank.stderr);
            return Err(format!("rank {} {}", rank.rank, rank.status).into());
        }
    }
    let report = report.ok_or("no rank reported the losses")?;
    let (seconds, bits) = report.split_once(' ').ok_or("a malformed LOSSES line")?;
    let seconds: f64 = seconds.parse()?;
    let losses: Vec<f64> = bits.split(',').map(|b| b.parse::<u64>().map(f64::from_bits)).collect::<Result<_, _>>()?;
    print_losses(&losses);
    println!(
        "{} steps in {seconds:.2}s ({:.1} ms/step) on {} nodes",
        losses.len(),
        1e3 * seconds / o.steps as f64,
        o.nodes
    );
    if o.compare {
        compare_with_one_device(o, task, vocab, &losses)?;
    }
    Ok(())
}
