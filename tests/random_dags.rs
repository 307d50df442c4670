//! Property tests over random DAG plans: every sink gets every piece once, in order, with intact bytes, and no producer ever has more pieces in flight than its register_num.

use proptest::prelude::*;
use proptest::sample::Index;
use regflow::graph::plan::StreamIndex;
use regflow::prelude::*;
use regflow::runtime::{ActorStats, Fetcher, JobReport};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A hang becomes a `Stalled` error with a wait-for graph instead of a stuck test.
const WATCHDOG: Duration = Duration::from_secs(20);

/// Repeat actors multiply piece counts; past this a repeat gets count 1 so cases stay fast.
const MAX_PIECES: u64 = 120;

fn proptest_config() -> ProptestConfig {
    let cases = std::env::var("REGFLOW_PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(256);
    // A case that stalls costs a whole watchdog timeout per shrinking step: bound shrinking
    // so that a failure is reported within minutes, not hours.
    ProptestConfig { max_shrink_time: 120_000, ..ProptestConfig::with_cases(cases) }
}

// ---------------------------------------------------------------------------------------
// Register contents: every register carries a tag derived from its piece number.
// ---------------------------------------------------------------------------------------

/// What the bytes of one register say about its pieces: the first 8 bytes hold
/// `piece / divisor` as u64 little-endian (a repeat hands one input piece to `divisor`
/// consecutive output pieces); when `patterned`, every later byte is `pattern_byte`.
/// Sources only write the first 8 bytes, so their registers are not patterned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Tagging {
    divisor: u64,
    patterned: bool,
}

impl Tagging {
    fn expected(self, piece: u64) -> u64 {
        piece / self.divisor
    }
}

fn pattern_byte(tag: u64, j: usize) -> u8 {
    (tag as u8).wrapping_mul(31).wrapping_add(j as u8)
}

fn read_tag(bytes: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?))
}

/// Writes `tag` and the pattern that goes with it over the whole register.
fn write_tag(out: &mut [u8], tag: u64) {
    out[..8].copy_from_slice(&tag.to_le_bytes());
    for (j, byte) in out.iter_mut().enumerate().skip(8) {
        *byte = pattern_byte(tag, j);
    }
}

/// Checks that a register holds piece `piece`'s bytes under `tagging`.
fn check_bytes(bytes: &[u8], piece: u64, tagging: Tagging) -> Result<(), String> {
    let expected = tagging.expected(piece);
    let got = read_tag(bytes).ok_or_else(|| format!("register of {} bytes has no tag", bytes.len()))?;
    if got != expected {
        return Err(format!("tag {got}, expected {expected} (piece {piece}, {tagging:?})"));
    }
    if tagging.patterned {
        if let Some(j) = (8..bytes.len()).find(|&j| bytes[j] != pattern_byte(expected, j)) {
            return Err(format!(
                "byte {j} is {}, expected {} for tag {expected}: the register was overwritten",
                bytes[j],
                pattern_byte(expected, j)
            ));
        }
    }
    Ok(())
}

/// What the `tag` and `acc_tag` kernels of one actor expect.
#[derive(Debug, Clone)]
enum KernelPlan {
    /// Checks every input against the piece number, then writes the piece number out.
    Tag { inputs: Vec<Tagging> },
    /// In an acc group of `count`: checks the input, writes the output piece number at the
    /// first position and checks it is still there at the later ones.
    Acc { input: Tagging, count: u32 },
}

struct TagKernel {
    actor: String,
    plan: KernelPlan,
}

impl Kernel for TagKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let piece = io.piece();
        let fail = |what: String| KernelError(format!("actor '{}' piece {piece}: {what}", self.actor));
        match &self.plan {
            KernelPlan::Tag { inputs } => {
                if io.input_count() != inputs.len() {
                    return Err(fail(format!("{} inputs, expected {}", io.input_count(), inputs.len())));
                }
                for (i, tagging) in inputs.iter().enumerate() {
                    check_bytes(io.input(i), piece, *tagging).map_err(|e| fail(format!("input {i}: {e}")))?;
                }
                for o in 0..io.output_count() {
                    write_tag(io.output(o), piece);
                }
            }
            KernelPlan::Acc { input, count } => {
                let group = io.group();
                if group.count != *count || u64::from(group.index) != piece % u64::from(*count) {
                    return Err(fail(format!("group position {group:?} in groups of {count}")));
                }
                check_bytes(io.input(0), piece, *input).map_err(|e| fail(format!("input: {e}")))?;
                let out_piece = piece / u64::from(*count);
                if group.index == 0 {
                    write_tag(io.output(0), out_piece);
                } else {
                    let held = Tagging { divisor: 1, patterned: true };
                    check_bytes(io.output(0), out_piece, held)
                        .map_err(|e| fail(format!("held acc output changed mid-group: {e}")))?;
                }
            }
        }
        Ok(())
    }
}

/// Registers `tag` and `acc_tag`, both looking up what to expect by actor name.
fn with_tag_kernels(builder: JobBuilder, kernels: &Arc<HashMap<String, KernelPlan>>) -> JobBuilder {
    let factory = |kernels: Arc<HashMap<String, KernelPlan>>| {
        move |spec: &regflow::runtime::KernelSpec<'_>| -> Result<Box<dyn Kernel>, KernelError> {
            let plan = kernels
                .get(spec.actor)
                .cloned()
                .ok_or_else(|| KernelError(format!("no kernel plan for actor '{}'", spec.actor)))?;
            Ok(Box::new(TagKernel { actor: spec.actor.to_string(), plan }))
        }
    };
    builder.kernel("tag", factory(kernels.clone())).kernel("acc_tag", factory(kernels.clone()))
}

// ---------------------------------------------------------------------------------------
// Random plan specs.
// ---------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct RegSpec {
    bytes: u64,
    register_num: u32,
}

#[derive(Debug, Clone)]
struct SourceSpec {
    stream: Index,
    sim_nanos: u64,
    outputs: Vec<RegSpec>,
}

#[derive(Debug, Clone, Copy)]
enum Op {
    Tag,
    Acc(u32),
    Repeat(u32),
}

#[derive(Debug, Clone)]
struct NodeSpec {
    op: Op,
    stream: Index,
    sim_nanos: u64,
    /// First picks any register; the others pick among registers with as many pieces.
    inputs: Vec<Index>,
    outputs: Vec<RegSpec>,
}

#[derive(Debug, Clone)]
struct SinkSpec {
    stream: Index,
    sim_nanos: u64,
    /// Deliver to a `Fetcher` drained on its own thread, rather than to an `on_sink` callback.
    fetch: bool,
}

#[derive(Debug, Clone)]
struct DagSpec {
    pieces: u64,
    devices: Vec<DeviceKind>,
    /// Per stream: which device, and whether it is a copy stream (else compute).
    streams: Vec<(Index, bool)>,
    sources: Vec<SourceSpec>,
    nodes: Vec<NodeSpec>,
    /// Sinks take these in turn.
    sinks: Vec<SinkSpec>,
    fetch_depth: Option<u64>,
}

fn reg_spec() -> impl Strategy<Value = RegSpec> {
    (8..=40u64, 1..=4u32).prop_map(|(bytes, register_num)| RegSpec { bytes, register_num })
}

fn sim_nanos() -> impl Strategy<Value = u64> {
    prop_oneof![Just(0u64), 0..=50_000u64]
}

fn dag_spec() -> impl Strategy<Value = DagSpec> {
    let device = prop_oneof![Just(DeviceKind::Cpu), Just(DeviceKind::Sim)];
    let source = (any::<Index>(), sim_nanos(), prop::collection::vec(reg_spec(), 1..=2))
        .prop_map(|(stream, sim_nanos, outputs)| SourceSpec { stream, sim_nanos, outputs });
    let op = prop_oneof![6 => Just(Op::Tag), 1 => (1..=4u32).prop_map(Op::Acc), 1 => (1..=3u32).prop_map(Op::Repeat)];
    let node = (
        op,
        any::<Index>(),
        sim_nanos(),
        prop::collection::vec(any::<Index>(), 1..=3),
        prop::collection::vec(reg_spec(), 1..=2),
    )
        .prop_map(|(op, stream, sim_nanos, inputs, outputs)| NodeSpec { op, stream, sim_nanos, inputs, outputs });
    let sink = (any::<Index>(), sim_nanos(), any::<bool>()).prop_map(|(stream, sim_nanos, fetch)| SinkSpec {
        stream,
        sim_nanos,
        fetch,
    });
    (
        0..=20u64,
        prop::collection::vec(device, 1..=2),
        prop::collection::vec((any::<Index>(), any::<bool>()), 1..=4),
        prop::collection::vec(source, 1..=3),
        prop::collection::vec(node, 0..=8),
        prop::collection::vec(sink, 1..=6),
        prop::option::of(1..=4u64),
    )
        .prop_map(|(pieces, devices, streams, sources, nodes, sinks, fetch_depth)| DagSpec {
            pieces,
            devices,
            streams,
            sources,
            nodes,
            sinks,
            fetch_depth,
        })
}

// ---------------------------------------------------------------------------------------
// From spec to plan, with what every actor and sink should see.
// ---------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct RegInfo {
    id: RegstDescId,
    /// Registers of one domain advance in lockstep, one piece in, one piece out: every
    /// source output is in domain 0, and each acc or repeat output starts a new domain.
    /// Only registers of one domain are joined: joining an acc's (or repeat's) output with
    /// a register that bypasses it needs that bypass to buffer a whole group, and a plan
    /// that does not is a deadlock of the plan, not of the runtime.
    domain: usize,
    pieces: u64,
    tagging: Tagging,
    bytes: u64,
    consumed: bool,
}

#[derive(Debug, Clone)]
struct SinkInfo {
    name: String,
    pieces: u64,
    tagging: Tagging,
    fetch: bool,
}

#[derive(Debug)]
struct Built {
    plan: Plan,
    kernels: Arc<HashMap<String, KernelPlan>>,
    sinks: Vec<SinkInfo>,
    /// Expected `fires` per actor name.
    fires: Vec<(String, u64)>,
}

fn build_plan(spec: &DagSpec) -> Built {
    let mut b = PlanBuilder::new();
    let mut devices = Vec::new();
    for (i, &kind) in spec.devices.iter().enumerate() {
        let index = spec.devices[..i].iter().filter(|&&k| k == kind).count() as u16;
        devices.push((b.device(0, kind, index), kind));
    }
    let streams: Vec<(StreamIndex, DeviceKind)> = spec
        .streams
        .iter()
        .map(|(device, copy)| {
            let (device, kind) = devices[device.index(devices.len())];
            (b.stream(device, if *copy { StreamKind::Copy } else { StreamKind::Compute }), kind)
        })
        .collect();
    let stream_of = |index: &Index| streams[index.index(streams.len())].0;

    let mut regs: Vec<RegInfo> = Vec::new();
    let mut kernels = HashMap::new();
    let mut fires = Vec::new();
    for (s, source) in spec.sources.iter().enumerate() {
        let name = format!("src{s}");
        let actor =
            b.actor(&name, stream_of(&source.stream), ActorKind::Source { pieces: SourcePieces::Count(spec.pieces) });
        b.sim_nanos(actor, source.sim_nanos);
        for (o, out) in source.outputs.iter().enumerate() {
            let id = b.regst(&format!("{name}.out{o}"), actor, out.bytes, out.register_num);
            let tagging = Tagging { divisor: 1, patterned: false };
            regs.push(RegInfo { id, domain: 0, pieces: spec.pieces, tagging, bytes: out.bytes, consumed: false });
        }
        fires.push((name, spec.pieces));
    }

    for (n, node) in spec.nodes.iter().enumerate() {
        let first = node.inputs[0].index(regs.len());
        let (domain, pieces) = (regs[first].domain, regs[first].pieces);
        let new_domain = n + 1;
        let stream = stream_of(&node.stream);
        let patterned = Tagging { divisor: 1, patterned: true };
        match node.op {
            Op::Tag => {
                let mut chosen = vec![first];
                for pick in &node.inputs[1..] {
                    let candidates: Vec<usize> =
                        (0..regs.len()).filter(|r| regs[*r].domain == domain && !chosen.contains(r)).collect();
                    if candidates.is_empty() {
                        break;
                    }
                    chosen.push(candidates[pick.index(candidates.len())]);
                }
                let name = format!("tag{n}");
                let actor =
                    b.actor(&name, stream, ActorKind::Compute { kernel: KernelConf::Custom { name: "tag".into() } });
                b.sim_nanos(actor, node.sim_nanos);
                for &r in &chosen {
                    b.consume(actor, regs[r].id);
                    regs[r].consumed = true;
                }
                let inputs = chosen.iter().map(|&r| regs[r].tagging).collect();
                kernels.insert(name.clone(), KernelPlan::Tag { inputs });
                for (o, out) in node.outputs.iter().enumerate() {
                    let id = b.regst(&format!("{name}.out{o}"), actor, out.bytes, out.register_num);
                    regs.push(RegInfo { id, domain, pieces, tagging: patterned, bytes: out.bytes, consumed: false });
                }
                fires.push((name, pieces));
            }
            Op::Acc(count) => {
                let name = format!("acc{n}");
                let kernel = KernelConf::Custom { name: "acc_tag".into() };
                let actor = b.actor(&name, stream, ActorKind::Acc { count, kernel });
                b.sim_nanos(actor, node.sim_nanos);
                b.consume(actor, regs[first].id);
                regs[first].consumed = true;
                kernels.insert(name.clone(), KernelPlan::Acc { input: regs[first].tagging, count });
                let out = &node.outputs[0];
                let id = b.regst(&format!("{name}.out"), actor, out.bytes, out.register_num);
                let out_pieces = pieces.div_ceil(u64::from(count));
                regs.push(RegInfo {
                    id,
                    domain: new_domain,
                    pieces: out_pieces,
                    tagging: patterned,
                    bytes: out.bytes,
                    consumed: false,
                });
                fires.push((name, pieces));
            }
            Op::Repeat(count) => {
                let count = if pieces * u64::from(count) > MAX_PIECES { 1 } else { count };
                let name = format!("repeat{n}");
                let actor = b.actor(&name, stream, ActorKind::Repeat { count });
                b.consume(actor, regs[first].id);
                regs[first].consumed = true;
                let input = regs[first].clone();
                // A repeat hands its input register on: same bytes, same tag for `count` pieces.
                let id = b.regst(&format!("{name}.out"), actor, input.bytes, node.outputs[0].register_num);
                let tagging =
                    Tagging { divisor: input.tagging.divisor * u64::from(count), patterned: input.tagging.patterned };
                let out_pieces = pieces * u64::from(count);
                regs.push(RegInfo {
                    id,
                    domain: new_domain,
                    pieces: out_pieces,
                    tagging,
                    bytes: input.bytes,
                    consumed: false,
                });
                fires.push((name, out_pieces));
            }
        }
    }

    let mut sinks = Vec::new();
    for (r, reg) in regs.iter_mut().enumerate().filter(|(_, reg)| !reg.consumed) {
        let sink = &spec.sinks[sinks.len() % spec.sinks.len()];
        let name = format!("sink{r}");
        let actor = b.actor(&name, stream_of(&sink.stream), ActorKind::Sink);
        b.sim_nanos(actor, sink.sim_nanos);
        b.consume(actor, reg.id);
        reg.consumed = true;
        sinks.push(SinkInfo { name: name.clone(), pieces: reg.pieces, tagging: reg.tagging, fetch: sink.fetch });
        fires.push((name, reg.pieces));
    }
    let plan = match b.build() {
        Ok(plan) => plan,
        Err(e) => panic!("the generator built an invalid plan: {e}\n{spec:#?}"),
    };
    Built { plan, kernels: Arc::new(kernels), sinks, fires }
}

/// What one sink got: (piece, problem with its bytes if any).
type Deliveries = Vec<(u64, Option<String>)>;

/// Runs a built plan; returns the report (or the job's error) and what each sink got.
fn run(built: &Built, fetch_depth: Option<u64>) -> (Result<JobReport, RuntimeError>, HashMap<String, Deliveries>) {
    let mut builder = with_tag_kernels(Job::builder(built.plan.clone()).watchdog(WATCHDOG), &built.kernels);
    if let Some(depth) = fetch_depth {
        builder = builder.fetch_depth(depth);
    }
    let mut collected: Vec<(String, Arc<Mutex<Deliveries>>)> = Vec::new();
    for sink in built.sinks.iter().filter(|s| !s.fetch) {
        let got = Arc::new(Mutex::new(Vec::new()));
        collected.push((sink.name.clone(), got.clone()));
        let tagging = sink.tagging;
        builder = builder.on_sink(&sink.name, move |io| {
            let problem = check_bytes(io.input(0), io.piece(), tagging).err();
            got.lock().unwrap().push((io.piece(), problem));
        });
    }
    let mut job = builder.build().unwrap_or_else(|e| panic!("job did not start: {e}"));
    let fetchers: Vec<(String, Tagging, Fetcher)> = built
        .sinks
        .iter()
        .filter(|s| s.fetch)
        .map(|s| (s.name.clone(), s.tagging, job.fetcher(&s.name).unwrap()))
        .collect();
    let (report, mut got) = std::thread::scope(|scope| {
        let threads: Vec<_> = fetchers
            .into_iter()
            .map(|(name, tagging, fetcher)| {
                scope.spawn(move || {
                    let mut got = Vec::new();
                    while let Some(fetched) = fetcher.recv() {
                        got.push((fetched.piece(), check_bytes(fetched.bytes(), fetched.piece(), tagging).err()));
                    }
                    (name, got)
                })
            })
            .collect();
        let report = job.wait();
        let got: HashMap<String, Deliveries> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        (report, got)
    });
    for (name, deliveries) in collected {
        got.insert(name, std::mem::take(&mut *deliveries.lock().unwrap()));
    }
    (report, got)
}

/// Checks the register bounds of every actor against the plan: no output ever had more
/// pieces in flight than its register_num, no input held more slots than its producer has.
fn check_register_bounds(plan: &Plan, stats: &ActorStats) -> Result<(), TestCaseError> {
    let index = plan.actor_by_name(&stats.name).unwrap();
    let outputs: Vec<RegstDescId> = plan.outputs_of(index).collect();
    prop_assert_eq!(stats.max_in_flight.len(), outputs.len(), "outputs of '{}'", stats.name);
    for (&(max, register_num), desc) in stats.max_in_flight.iter().zip(&outputs) {
        let desc = &plan.regst_descs[desc.index()];
        prop_assert_eq!(register_num, desc.register_num, "register_num of '{}'", desc.name);
        prop_assert!(
            max <= register_num,
            "'{}' had {} pieces in flight on '{}' of {} slots",
            stats.name,
            max,
            desc.name,
            register_num
        );
    }
    let inputs = &plan.actors[index.index()].inputs;
    prop_assert_eq!(stats.max_held.len(), inputs.len(), "inputs of '{}'", stats.name);
    for (&(max, register_num), desc) in stats.max_held.iter().zip(inputs) {
        let desc = &plan.regst_descs[desc.index()];
        prop_assert_eq!(
            register_num,
            desc.register_num as usize,
            "register_num of '{}' seen by '{}'",
            desc.name,
            stats.name
        );
        prop_assert!(
            max as usize <= register_num,
            "'{}' held {} slots of '{}', which has {}",
            stats.name,
            max,
            desc.name,
            register_num
        );
    }
    Ok(())
}

fn check_run(built: &Built, fetch_depth: Option<u64>) -> Result<(), TestCaseError> {
    let (report, got) = run(built, fetch_depth);
    let report = match report {
        Ok(report) => report,
        Err(e) => return Err(TestCaseError::fail(format!("job failed: {e}\nplan:\n{}", built.plan.to_json()))),
    };
    for sink in &built.sinks {
        let deliveries = &got[&sink.name];
        let pieces: Vec<u64> = deliveries.iter().map(|(p, _)| *p).collect();
        let expected: Vec<u64> = (0..sink.pieces).collect();
        prop_assert_eq!(pieces, expected, "pieces at '{}'", sink.name);
        for (piece, problem) in deliveries {
            prop_assert!(problem.is_none(), "'{}' piece {}: {}", sink.name, piece, problem.as_deref().unwrap_or(""));
        }
    }
    prop_assert_eq!(report.actors.len(), built.plan.actors.len());
    for stats in &report.actors {
        prop_assert!(stats.finished, "'{}' did not finish", stats.name);
        check_register_bounds(&built.plan, stats)?;
    }
    for (name, fires) in &built.fires {
        prop_assert_eq!(report.actor(name).map(|a| a.fires), Some(*fires), "fires of '{}'", name);
    }
    Ok(())
}

proptest! {
    #![proptest_config(proptest_config())]

    /// Random DAGs of sources, tag-checking compute actors, acc and repeat actors on cpu and
    /// sim streams: every sink gets every piece exactly once, in order, with the bytes its
    /// producer wrote (an overwritten register or pieces out of step fail a kernel), every
    /// actor finishes, and no register ever exceeds its register_num.
    #[test]
    fn random_dags_deliver_every_piece_once_in_order_within_register_num(spec in dag_spec()) {
        let built = build_plan(&spec);
        check_run(&built, spec.fetch_depth)?;
    }
}

// ---------------------------------------------------------------------------------------
// Acc and repeat chains with the built-in Copy kernel.
// ---------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy)]
enum ChainOp {
    /// `KernelConf::Copy` compute actor.
    Copy,
    /// Acc with `KernelConf::Copy`: its output ends up holding the last input of the group.
    AccCopy(u32),
    Repeat(u32),
}

fn chain_op() -> impl Strategy<Value = ChainOp> {
    prop_oneof![Just(ChainOp::Copy), (1..=5u32).prop_map(ChainOp::AccCopy), (1..=4u32).prop_map(ChainOp::Repeat)]
}

proptest! {
    #![proptest_config(proptest_config())]

    /// A chain of copy, acc (Copy kernel) and repeat actors: an acc of k emits ceil(n/k)
    /// pieces, the last one partial, each holding the last input of its group; a repeat of k
    /// emits n*k pieces, each input k times. The sink sees exactly that sequence.
    #[test]
    fn acc_and_repeat_chains_deliver_the_modelled_pieces(
        pieces in 0..=20u64,
        ops in prop::collection::vec((chain_op(), 1..=3u32, any::<Index>(), 0..=30_000u64), 1..=5),
        stream_count in 1..=3usize,
        sim in any::<bool>(),
        source_register_num in 1..=3u32,
    ) {
        let mut b = PlanBuilder::new();
        let device = b.device(0, if sim { DeviceKind::Sim } else { DeviceKind::Cpu }, 0);
        let streams: Vec<StreamIndex> = (0..stream_count).map(|_| b.stream(device, StreamKind::Compute)).collect();
        let src = b.actor("src", streams[0], ActorKind::Source { pieces: SourcePieces::Count(pieces) });
        let mut prev = b.regst("src.out", src, 16, source_register_num);
        // The model: the tag each piece of the current register carries.
        let mut tags: Vec<u64> = (0..pieces).collect();
        for (i, (op, register_num, stream, nanos)) in ops.iter().enumerate() {
            let stream = streams[stream.index(streams.len())];
            let (kind, next_tags): (ActorKind, Vec<u64>) = match *op {
                ChainOp::Copy => (ActorKind::Compute { kernel: KernelConf::Copy }, tags.clone()),
                ChainOp::AccCopy(count) => (
                    ActorKind::Acc { count, kernel: KernelConf::Copy },
                    tags.chunks(count as usize).map(|group| group[group.len() - 1]).collect(),
                ),
                ChainOp::Repeat(count) => {
                    let count = if tags.len() as u64 * u64::from(count) > MAX_PIECES { 1 } else { count };
                    (
                        ActorKind::Repeat { count },
                        tags.iter().flat_map(|&t| std::iter::repeat_n(t, count as usize)).collect(),
                    )
                }
            };
            let actor = b.actor(&format!("op{i}"), stream, kind);
            b.sim_nanos(actor, *nanos);
            b.consume(actor, prev);
            prev = b.regst(&format!("op{i}.out"), actor, 16, *register_num);
            tags = next_tags;
        }
        let sink = b.actor("sink", streams[streams.len() - 1], ActorKind::Sink);
        b.consume(sink, prev);
        let plan = b.build().unwrap();

        let got = Arc::new(Mutex::new(Vec::new()));
        let sink_got = got.clone();
        let job = Job::builder(plan.clone())
            .watchdog(WATCHDOG)
            .on_sink("sink", move |io| sink_got.lock().unwrap().push((io.piece(), read_tag(io.input(0)))))
            .build()
            .unwrap();
        let report = match job.wait() {
            Ok(report) => report,
            Err(e) => return Err(TestCaseError::fail(format!("job failed: {e}\nplan:\n{}", plan.to_json()))),
        };
        let got = std::mem::take(&mut *got.lock().unwrap());
        let expected: Vec<(u64, Option<u64>)> = tags.iter().enumerate().map(|(p, &t)| (p as u64, Some(t))).collect();
        prop_assert_eq!(got, expected);
        for stats in &report.actors {
            prop_assert!(stats.finished, "'{}' did not finish", stats.name);
            check_register_bounds(&plan, stats)?;
        }
        prop_assert_eq!(report.lane_waits, 0, "a message between stream threads found its lane full");
    }
}

// ---------------------------------------------------------------------------------------
// Register bounds are reached, never exceeded.
// ---------------------------------------------------------------------------------------

/// What a sink callback saw: (piece, tag).
type Tagged = Vec<(u64, Option<u64>)>;

/// Sleeps before copying, so its producers fill up behind it.
struct SlowCopy(Duration);

impl Kernel for SlowCopy {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        std::thread::sleep(self.0);
        let input = io.input(0);
        let out = io.output(0);
        let n = out.len().min(input.len());
        out[..n].copy_from_slice(&input[..n]);
        Ok(())
    }
}

/// A fan-out whose slow branch backs up: `src -> x(3) -> {fast -> sink_fast, mid -> z(2) ->
/// slow -> sink_slow}`, each stage on its own stream. `slow` takes 2 ms per piece (a sleep on
/// cpu, a modeled duration on sim), so `mid` fills `z` and then holds every slot of `x`,
/// and `src` fills `x`: both must reach their register_num exactly and never pass it.
#[test]
fn producer_never_holds_more_pieces_than_register_num() {
    const PIECES: u64 = 30;
    for kind in [DeviceKind::Cpu, DeviceKind::Sim] {
        let mut b = PlanBuilder::new();
        let device = b.device(0, kind, 0);
        let streams: Vec<StreamIndex> = (0..4).map(|_| b.stream(device, StreamKind::Compute)).collect();
        let src = b.actor("src", streams[0], ActorKind::Source { pieces: SourcePieces::Count(PIECES) });
        let x = b.regst("x", src, 16, 3);
        let fast = b.actor("fast", streams[1], ActorKind::Compute { kernel: KernelConf::Copy });
        b.consume(fast, x);
        let y = b.regst("y", fast, 16, 1);
        let sink_fast = b.actor("sink_fast", streams[1], ActorKind::Sink);
        b.consume(sink_fast, y);
        let mid = b.actor("mid", streams[2], ActorKind::Compute { kernel: KernelConf::Copy });
        b.consume(mid, x);
        let z = b.regst("z", mid, 16, 2);
        let slow_kernel = match kind {
            DeviceKind::Cpu => KernelConf::Custom { name: "slow".into() },
            _ => KernelConf::Copy,
        };
        let slow = b.actor("slow", streams[3], ActorKind::Compute { kernel: slow_kernel });
        b.sim_nanos(slow, 2_000_000);
        b.consume(slow, z);
        let w = b.regst("w", slow, 16, 1);
        let sink_slow = b.actor("sink_slow", streams[3], ActorKind::Sink);
        b.consume(sink_slow, w);
        let plan = b.build().unwrap();

        let delivered: Arc<Mutex<HashMap<&'static str, Tagged>>> = Arc::default();
        let mut builder = Job::builder(plan.clone())
            .watchdog(WATCHDOG)
            .kernel("slow", |_| Ok(Box::new(SlowCopy(Duration::from_millis(2)))));
        for name in ["sink_fast", "sink_slow"] {
            let delivered = delivered.clone();
            builder = builder.on_sink(name, move |io| {
                delivered.lock().unwrap().entry(name).or_default().push((io.piece(), read_tag(io.input(0))));
            });
        }
        let report = builder.build().unwrap().wait().unwrap_or_else(|e| panic!("{kind:?}: {e}"));
        assert_eq!(report.lane_waits, 0, "{kind:?}: a message between stream threads found its lane full");

        let expected: Vec<(u64, Option<u64>)> = (0..PIECES).map(|p| (p, Some(p))).collect();
        for name in ["sink_fast", "sink_slow"] {
            assert_eq!(delivered.lock().unwrap()[name], expected, "{kind:?}: {name}");
        }
        for stats in &report.actors {
            assert!(stats.finished, "{kind:?}: '{}' did not finish", stats.name);
            if let Err(e) = check_register_bounds(&plan, stats) {
                panic!("{kind:?}: {e}");
            }
        }
        let stats = |name: &str| report.actor(name).unwrap_or_else(|| panic!("no stats for '{name}'"));
        assert_eq!(stats("src").max_in_flight, [(3, 3)], "{kind:?}: src must fill x and stop there");
        assert_eq!(stats("mid").max_in_flight, [(2, 2)], "{kind:?}: mid must fill z and stop there");
        assert_eq!(stats("mid").max_held, [(3, 3)], "{kind:?}: mid must end up holding every slot of x");
        assert_eq!(stats("src").fires, PIECES);
        assert_eq!(stats("slow").fires, PIECES);
    }
}
