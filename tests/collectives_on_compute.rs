//! Collectives on cpu devices' compute streams (`ParallelOptions::collective_streams`):
//! the same collectives, in the same order, run by the compute threads instead of comm
//! threads of their own, so a data-parallel step trains to the same bits; the compiler
//! chooses them by the host's cores where asked to, keeping comm streams for devices that
//! exchange copies (a tensor on one device of the mesh, which trains like one device either
//! way); and plan validation refuses a blocking collective where a blocked thread could
//! hold what another device waits for.

use regflow::graph::plan::{
    ActorKind, CollectiveConf, CollectiveOp, DeviceKind, KernelConf, Plan, PlanBuilder, PlanError, SourcePieces,
    StreamKind,
};
use regflow::graph::sbp::{Mesh, NdSbp};
use regflow::graph::{CollectiveStreams, CompiledGraph, DType, Graph, Optimizer, ParallelOptions};

use crate::tiny_mlp;
use tiny_mlp::model;

/// The tiny MLP data-parallel over two cpu devices, its AdamW state sharded where
/// `sharded`, memory shared where `reuse`, its collectives on compute streams where `inline`.
fn compile(sharded: bool, reuse: bool, inline: bool) -> CompiledGraph {
    let streams = if inline { CollectiveStreams::ComputeStreams } else { CollectiveStreams::CommStreams };
    try_compile(sharded, reuse, streams, 1).unwrap()
}

fn try_compile(
    sharded: bool,
    reuse: bool,
    collective_streams: CollectiveStreams,
    micro_batches: u32,
) -> Result<CompiledGraph, regflow::graph::GraphError> {
    let g = Graph::new();
    let (train_step, _) = model(&g, &Optimizer::adamw(5e-2, 1e-2));
    let mesh = tiny_mlp::two_devices(&g, &train_step, sharded);
    let mut options = ParallelOptions { collective_streams, reuse_memory: reuse, ..ParallelOptions::new(mesh) };
    if micro_batches > 1 {
        options = options.micro_batches(&train_step, micro_batches);
    }
    let options = options.train(&train_step);
    g.compile_parallel(&[train_step.loss], &train_step.updates, &options)
}

/// (collectives, of which on compute streams, comm streams with actors).
fn where_collectives_run(plan: &Plan) -> (usize, usize, usize) {
    let collectives: Vec<usize> = (0..plan.actors.len()).filter(|&a| plan.collective_conf(a).is_some()).collect();
    let on_compute = collectives
        .iter()
        .filter(|&&a| plan.streams[plan.actors[a].stream.index()].kind == StreamKind::Compute)
        .count();
    let busy_comm = plan
        .streams
        .iter()
        .enumerate()
        .filter(|(s, stream)| stream.kind == StreamKind::Comm && plan.actors.iter().any(|a| a.stream.index() == *s))
        .count();
    (collectives.len(), on_compute, busy_comm)
}

#[test]
fn collectives_on_compute_streams_train_to_the_same_bits() {
    for (sharded, reuse) in [(false, true), (true, true), (false, false), (true, false)] {
        let on_comm = compile(sharded, reuse, false);
        let inline = compile(sharded, reuse, true);
        let (count, on_compute, busy_comm) = where_collectives_run(&inline.plan);
        assert!(count >= 4, "{count} collectives");
        assert_eq!((on_compute, busy_comm), (count, 0), "sharded {sharded}, memory shared {reuse}");
        let (count_before, on_compute_before, _) = where_collectives_run(&on_comm.plan);
        assert_eq!((count_before, on_compute_before), (count, 0));
        // With memory shared, the compute stream's chain orders the collectives on it; a
        // chain of their own comes only without it (and on comm streams).
        let own_chain = inline.plan.regst_descs.iter().filter(|d| d.name.starts_with("comm_")).count();
        assert_eq!(own_chain == 0, reuse, "{own_chain} registers chain the collectives (memory shared {reuse})");
        if reuse {
            let on_chain = (0..inline.plan.actors.len())
                .filter(|&a| inline.plan.collective_conf(a).is_some())
                .filter(|&a| {
                    inline.plan.outputs_of(regflow::graph::plan::ActorIndex(a as u32)).any(|r| {
                        inline.plan.regst_descs[r.index()].name.starts_with("order:")
                            || inline.plan.regst_descs[r.index()].name.starts_with("step_token")
                    })
                })
                .count();
            assert_eq!(on_chain, count, "every collective is on its compute stream's chain");
        }

        let steps = 5;
        let want = tiny_mlp::train(&on_comm, on_comm.plan.clone(), 1, steps, 1);
        let got = tiny_mlp::train(&inline, inline.plan.clone(), 1, steps, 1);
        assert_eq!(got.0, want.0, "losses, bit for bit (sharded {sharded}, memory shared {reuse})");
        assert_eq!(got.1, want.1, "weights and optimizer state, bit for bit");
    }
    // Several micro-batches per step: refused by name (per-micro-batch collectives and those
    // of the averaged gradients would block one stream at different rates).
    let Err(err) = try_compile(false, true, CollectiveStreams::ComputeStreams, 2) else {
        panic!("compiled with 2 micro-batches")
    };
    assert!(
        err.to_string()
            .contains("option `collective_streams` is ComputeStreams with 2 micro-batches: one micro-batch per step"),
        "{err}"
    );
}

#[test]
fn the_compiler_chooses_the_streams_by_the_cores() {
    for sharded in [false, true] {
        let with = |streams| try_compile(sharded, true, streams, 1).unwrap();
        // Two cpu devices want four threads: on 2 or 3 cores the collectives run on the
        // compute streams, on 4 or more on comm streams of their own.
        for (cores, inline) in [(1, true), (2, true), (3, true), (4, false), (64, false)] {
            let compiled = with(CollectiveStreams::ForCores(cores));
            let info = compiled.parallel.as_ref().unwrap();
            assert_eq!(info.collectives_on_compute_streams, inline, "the choice, as the compiled graph tells it");
            let (count, on_compute, busy_comm) = where_collectives_run(&compiled.plan);
            let got = (on_compute == count, busy_comm > 0, on_compute > 0);
            let want = if inline { (true, false, true) } else { (false, true, false) };
            assert_eq!(got, want, "{cores} cores, sharded {sharded}: {on_compute} of {count} collectives on compute");
        }
        // The choice is the explicit option's plan, to the byte.
        assert_eq!(
            with(CollectiveStreams::ForCores(2)).plan.to_json(),
            with(CollectiveStreams::ComputeStreams).plan.to_json()
        );
        assert_eq!(
            with(CollectiveStreams::ForCores(8)).plan.to_json(),
            with(CollectiveStreams::CommStreams).plan.to_json()
        );
        // `Auto` is this host's cores (the default).
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let auto = with(CollectiveStreams::Auto).plan.to_json();
        assert_eq!(auto, with(CollectiveStreams::ForCores(cores)).plan.to_json(), "{cores} cores");
        assert_eq!(ParallelOptions::new(Mesh::cpu(&[2], &["dp"]).unwrap()).collective_streams, CollectiveStreams::Auto);
    }
    // Two micro-batches: comm streams, whatever the cores (the compute streams would be
    // refused).
    let micro = try_compile(false, true, CollectiveStreams::ForCores(1), 2).unwrap();
    assert_eq!(where_collectives_run(&micro.plan).1, 0);
    // A host of no cores is no host.
    let Err(err) = try_compile(false, true, CollectiveStreams::ForCores(0), 1) else { panic!("compiled for 0 cores") };
    assert!(err.to_string().contains("option `collective_streams` is ForCores(0)"), "{err}");
}

/// The tiny MLP over two cpu devices with its bias `b0` on the first alone: a mesh of the
/// same stage, so device 1 gets the bias from device 0 by a copy, not a collective.
fn bias_on_device_0(collective_streams: CollectiveStreams) -> Result<CompiledGraph, regflow::graph::GraphError> {
    let g = Graph::new();
    let (train_step, _) = model(&g, &Optimizer::adamw(5e-2, 1e-2));
    let mesh = tiny_mlp::two_devices(&g, &train_step, false);
    let first = Mesh::new(vec![mesh.devices()[0]], &[1], &["first"]).unwrap();
    g.set_layout(g.by_name("b0").unwrap(), &first, NdSbp(vec![regflow::graph::sbp::Sbp::Broadcast])).unwrap();
    let options = ParallelOptions { collective_streams, ..ParallelOptions::new(mesh) }.train(&train_step);
    g.compile_parallel(&[train_step.loss], &train_step.updates, &options)
}

#[test]
fn a_step_that_copies_between_devices_keeps_its_comm_streams() {
    // Asked outright, the compute streams are refused: device 0's thread, blocked in a
    // collective, could hold what device 1 waits for.
    let Err(err) = bias_on_device_0(CollectiveStreams::ComputeStreams) else { panic!("compiled") };
    assert!(err.to_string().contains("it blocks a compute stream, and register"), "{err}");
    // Chosen by the compiler, the plan keeps its comm streams instead, and trains.
    let chosen = bias_on_device_0(CollectiveStreams::ForCores(2)).unwrap();
    assert!(!chosen.parallel.as_ref().unwrap().collectives_on_compute_streams);
    let on_comm = bias_on_device_0(CollectiveStreams::CommStreams).unwrap();
    assert_eq!(chosen.plan.to_json(), on_comm.plan.to_json());
    let (count, on_compute, _) = where_collectives_run(&chosen.plan);
    assert!(count >= 2 && on_compute == 0, "{count} collectives, {on_compute} on compute streams");
    let (losses, _) = tiny_mlp::train(&chosen, chosen.plan.clone(), 1, 3, 1);
    assert_eq!(losses.len(), 3);
}

/// Two devices of one kind, each a source feeding an all-reduce member on the stream of
/// `kind`, read by a sink; with `cross`, device 0's source is also read on device 1.
fn hand_built(device: DeviceKind, kind: StreamKind, cross: bool) -> Plan {
    let mut b = PlanBuilder::new();
    let mut sources = Vec::new();
    let mut sinks = Vec::new();
    for rank in 0..2u16 {
        let d = b.device(0, device, rank);
        let s = b.stream(d, kind);
        let source = b.actor(&format!("source@{rank}"), s, ActorKind::Source { pieces: SourcePieces::Count(2) });
        let conf = CollectiveConf {
            group: "g".into(),
            rank: u32::from(rank),
            size: 2,
            op: CollectiveOp::AllReduce,
            dtype: DType::F32,
            shape: vec![4],
        };
        let member =
            b.actor(&format!("allreduce@{rank}"), s, ActorKind::Compute { kernel: KernelConf::Collective(conf) });
        let input = b.regst(&format!("source@{rank}.out"), source, 16, 1);
        b.consume(member, input);
        let output = b.regst(&format!("allreduce@{rank}.out"), member, 16, 1);
        let sink = b.actor(&format!("sink@{rank}"), s, ActorKind::Sink);
        b.consume(sink, output);
        sources.push((source, input));
        sinks.push(sink);
    }
    if cross {
        b.consume(sinks[1], sources[0].1);
    }
    b.plan_mut().clone()
}

#[test]
fn a_blocking_collective_outside_a_comm_stream_is_checked() {
    // On comm streams, and on cpu compute streams that exchange nothing else: valid.
    hand_built(DeviceKind::Cpu, StreamKind::Comm, true).validate().unwrap();
    hand_built(DeviceKind::Cpu, StreamKind::Compute, false).validate().unwrap();

    // A register from one device to the other: device 1's sink could wait for a piece
    // device 0's thread, blocked in the all-reduce, would hand out.
    let err = hand_built(DeviceKind::Cpu, StreamKind::Compute, true).validate().unwrap_err();
    assert!(matches!(err, PlanError::Collective { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        "collective 'g': it blocks a compute stream, and register 'source@0.out' goes from node0/cpu:0 to node0/cpu:1: \
         a device whose thread is blocked in a collective could hold what the other waits for, so such devices may \
         exchange nothing but collectives (run the collectives on comm streams)"
    );

    // Another kind of device.
    let err = hand_built(DeviceKind::Sim, StreamKind::Compute, false).validate().unwrap_err().to_string();
    assert!(
        err.starts_with("collective 'g': member 'allreduce@0' runs on a Compute stream of node0/sim:0: a collective blocks its stream"),
        "{err}"
    );
}

/// A tensor on the mesh's first device alone (a weight, a bias, the loss): the other device
/// copies it in, or hands it its part, by copy actors, and the step trains as on one device
/// (within f32 rounding: the gradient's sum runs in another order). A copied-in variable
/// used to end every job with a piece-order error (its copy was taken for a reader from
/// outside the loop, although its gradient part comes back through an all-reduce), and the
/// compiler refused the plan for it.
#[test]
fn a_tensor_on_one_device_of_the_mesh_trains_like_one_device() {
    let optimizer = Optimizer::adamw(5e-2, 1e-2);
    let g = Graph::new();
    let (step, _) = model(&g, &optimizer);
    let one = g.compile(&[step.loss], &step.updates, &regflow::graph::CompileOptions::default()).unwrap();
    let (want, _) = tiny_mlp::train(&one, one.plan.clone(), 1, 6, 1);
    for name in ["w0", "b0", "w1", "loss"] {
        for collective_streams in [CollectiveStreams::CommStreams, CollectiveStreams::ForCores(2)] {
            let g = Graph::new();
            let (step, _) = model(&g, &optimizer);
            let mesh = tiny_mlp::two_devices(&g, &step, false);
            let first = Mesh::new(vec![mesh.devices()[0]], &[1], &["first"]).unwrap();
            let t = if name == "loss" { step.loss } else { g.by_name(name).unwrap() };
            g.set_layout(t, &first, NdSbp(vec![regflow::graph::sbp::Sbp::Broadcast])).unwrap();
            let options = ParallelOptions { collective_streams, ..ParallelOptions::new(mesh) }.train(&step);
            let compiled = g
                .compile_parallel(&[step.loss], &step.updates, &options)
                .unwrap_or_else(|e| panic!("{name} on device 0: {e}"));
            let (got, _) = tiny_mlp::train(&compiled, compiled.plan.clone(), 1, 6, 1);
            assert_eq!(got.len(), want.len());
            for (k, (a, b)) in got.iter().zip(&want).enumerate() {
                let (a, b) = (f64::from_bits(*a), f64::from_bits(*b));
                assert!((a - b).abs() <= 1e-5 * b.abs(), "{name} on device 0, step {k}: loss {a} against {b}");
            }
        }
    }
}
