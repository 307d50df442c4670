//! Fused optimizer updates (`graph/src/compile/fuse_updates.rs`): a device's updates whose
//! gradients are ready together run as one `update_group` actor, one pass over all their
//! elements, and train to the same bits as one update per parameter, on one device and
//! two, with clipping, loss scaling and micro-batches, on one thread and two.

use regflow::graph::plan::{ActorKind, DeviceKind, KernelConf, OpConf, Plan};
use regflow::graph::sbp::{Mesh, NdSbp, Sbp};
use regflow::graph::{
    CollectiveStreams, CompileOptions, CompiledGraph, DType, Graph, HostArray, LossScale, Optimizer, ParallelOptions,
    TrainStep,
};
use regflow::prelude::*;

use crate::common;

use crate::tiny_mlp;

/// The MLP's train step (three parameters: `w0`, `b0`, `w1`).
fn model<'g>(g: &'g Graph, optimizer: &Optimizer) -> TrainStep<'g> {
    tiny_mlp::model(g, optimizer).0
}

/// Losses (as bits) and final state of `steps` steps of `compiled` on `threads` threads per
/// device, `pieces` fed pieces per step.
fn train(compiled: &CompiledGraph, threads: usize, steps: u64, pieces: u64) -> (Vec<u64>, Vec<(String, HostArray)>) {
    tiny_mlp::train(compiled, compiled.plan.clone(), threads, steps, pieces)
}

/// The `params` attribute of every `update_group`, sorted.
fn group_sizes(plan: &Plan) -> Vec<u64> {
    let mut sizes: Vec<u64> =
        common::ops(plan, "update_group").iter().map(|(_, c)| c.attrs["params"].as_u64().unwrap()).collect();
    sizes.sort();
    sizes
}

#[test]
fn one_device_updates_every_parameter_in_one_actor_with_the_bits_of_one_update_each() {
    let optimizers = [
        Optimizer::adamw(5e-2, 1e-2).with_clip_norm(0.5),
        Optimizer::sgd(0.1, 0.9, 1e-3),
        Optimizer::adamw(5e-2, 0.0).with_loss_scale(LossScale::fixed(256.0)),
    ];
    for optimizer in optimizers {
        for micro_batches in [1, 3] {
            let g = Graph::new();
            let step = model(&g, &optimizer);
            let compile = |fuse_updates| {
                let accumulate = (micro_batches > 1).then(|| step.accumulate(micro_batches));
                let options = CompileOptions { fuse_updates, accumulate, ..CompileOptions::default() };
                g.compile(&[step.loss], &step.updates, &options).unwrap()
            };
            let (fused, apart) = (compile(true), compile(false));
            let what = format!("{:?}, {micro_batches} micro-batch(es)", optimizer.kind);
            assert_eq!(group_sizes(&fused.plan), [3], "{what}");
            assert_eq!(common::ops(&fused.plan, "update").len(), 0, "{what}");
            assert_eq!((group_sizes(&apart.plan), common::ops(&apart.plan, "update").len()), (vec![], 3), "{what}");
            assert_eq!(fused.plan.actors.len() + 2, apart.plan.actors.len(), "{what}");
            let want = train(&apart, 1, 5, u64::from(micro_batches));
            for threads in [1, 2] {
                assert_eq!(train(&fused, threads, 5, u64::from(micro_batches)), want, "{what}, {threads} threads");
            }
        }
    }
}

#[test]
fn sim_and_cuda_devices_fuse_their_updates_too() {
    let g = Graph::new();
    let step = model(&g, &Optimizer::adamw(5e-2, 0.0));
    let plan = |device, fuse_updates| {
        let options = CompileOptions { device, fuse_updates, ..CompileOptions::default() };
        g.compile(&[step.loss], &step.updates, &options).unwrap().plan
    };
    for device in [DeviceKind::Sim, DeviceKind::Cuda] {
        let (fused, apart) = (plan(device, true), plan(device, false));
        assert_eq!((group_sizes(&fused), common::ops(&fused, "update").len()), (vec![3], 0), "{device:?}");
        assert_eq!((group_sizes(&apart), common::ops(&apart, "update").len()), (vec![], 3), "{device:?}");
    }
}

/// The MLP on two data-parallel cpu devices with replicated optimizer state, gradients
/// all-reduced in buckets of at most `bucket_bytes`.
fn data_parallel(g: &Graph, step: &TrainStep<'_>, bucket_bytes: u64, fuse_updates: bool) -> CompiledGraph {
    let mesh = Mesh::cpu(&[2], &["dp"]).unwrap();
    for name in ["x", "y"] {
        g.set_layout(g.by_name(name).unwrap(), &mesh, NdSbp(vec![Sbp::Split(0)])).unwrap();
    }
    // On comm streams: an all-reduce on the compute stream is made on the update's own
    // stream, so every update of a device would join one group whatever the buckets.
    let collective_streams = CollectiveStreams::CommStreams;
    // Replicated optimizer state (left to the compiler, it would be sharded in process).
    let options = ParallelOptions {
        bucket_bytes,
        fuse_updates,
        collective_streams,
        shard_states_in_process: false,
        ..ParallelOptions::new(mesh)
    }
    .train(step);
    g.compile_parallel(&[step.loss], &step.updates, &options).unwrap()
}

#[test]
fn data_parallel_updates_fuse_per_bucket_and_keep_one_per_gradient_that_lands_alone() {
    let optimizer = Optimizer::adamw(5e-2, 1e-2);
    let g = Graph::new();
    let step = model(&g, &optimizer);
    // All three gradients in one bucket: one group of three per device.
    let bucketed = data_parallel(&g, &step, 1 << 20, true);
    assert_eq!(group_sizes(&bucketed.plan), [3, 3]);
    // Each gradient its own all-reduce: each update runs as its gradient lands.
    let alone = data_parallel(&g, &step, 0, true);
    assert_eq!((group_sizes(&alone.plan), common::ops(&alone.plan, "update").len()), (vec![], 6));

    // The members of every group read gradients one actor made, on another stream. Its
    // name is the first member's, with how many more, before the device suffix.
    let plan = &bucketed.plan;
    for (name, conf) in common::ops(plan, "update_group") {
        let (base, device) = name.rsplit_once('@').unwrap();
        assert!(base.starts_with("adamw_update:") && base.ends_with("+2") && ["0", "1"].contains(&device), "{name}");
        let actor = &plan.actors[plan.actor_by_name(name).unwrap().index()];
        let producers: Vec<_> = (0..3)
            .map(|member| plan.regst_descs[actor.inputs[conf.input_map[member * 6 + 1]].index()].producer)
            .collect();
        assert!(producers.iter().all(|&p| p == producers[0]), "{name}: {producers:?}");
        assert_ne!(plan.actors[producers[0].index()].stream, actor.stream, "{name}");
    }

    let want = train(&data_parallel(&g, &step, 1 << 20, false), 1, 5, 1);
    assert_eq!(train(&bucketed, 1, 5, 1), want);
    assert_eq!(train(&alone, 2, 5, 1), want);

    // With clipping every update waits for the global norm, made from every gradient: a
    // device's updates fuse whatever all-reduce made their gradients.
    let g = Graph::new();
    let step = model(&g, &optimizer.with_clip_norm(0.5));
    let alone = data_parallel(&g, &step, 0, true);
    assert_eq!((group_sizes(&alone.plan), common::ops(&alone.plan, "update").len()), (vec![3, 3], 0));
    assert_eq!(train(&alone, 1, 5, 1), train(&data_parallel(&g, &step, 0, false), 1, 5, 1));
}

#[test]
fn a_plan_file_whose_update_group_does_not_fit_its_conf_is_refused_at_job_build() {
    let g = Graph::new();
    let step = model(&g, &Optimizer::adamw(5e-2, 0.0));
    let compiled = g.compile(&[step.loss], &step.updates, &CompileOptions::default()).unwrap();
    let (name, _) = common::ops(&compiled.plan, "update_group")[0];
    let name = name.to_string();
    let broken = |edit: &dyn Fn(&mut OpConf)| {
        let mut plan = compiled.plan.clone();
        // Two buffers per variable, so that validation's in-place rule does not speak first.
        plan.regst_descs.iter_mut().for_each(|d| d.aliased_slots = false);
        let index = plan.actor_by_name(&name).unwrap().index();
        let ActorKind::Compute { kernel: KernelConf::Op(conf) } = &mut plan.actors[index].kind else { unreachable!() };
        edit(conf);
        match Job::builder(plan).build() {
            Ok(_) => panic!("a broken update_group was accepted"),
            Err(e) => e.to_string(),
        }
    };
    let err = broken(&|conf| conf.attrs["params"] = 2.into());
    // (With aliased slots, plan validation refuses it first: its in-place pairs moved.)
    assert!(err.contains(&name) && err.contains("has 2 member(s) of 6 inputs and 3 outputs each"), "{err}");
    // Member 1 reads its learning rate where member 0 reads its step.
    let err = broken(&|conf| conf.input_map[6 + 2] = conf.input_map[3]);
    assert!(err.contains("member 1 reads input 2") && err.contains("a group shares them"), "{err}");
    // Member 1's gradient with its parameter's bytes (what the register checks) in another shape.
    let err =
        broken(&|conf| conf.inputs[7] = regflow::graph::TensorMeta::new([1, conf.inputs[6].shape.numel()], DType::F32));
    assert!(err.contains("member 1's gradient, states and outputs must match its parameter"), "{err}");
}
