//! Loop-carried registers: a register that starts with preloaded slots closes a cycle, so
//! state such as a running sum or a variable and its update flows through the actors, and
//! the loop ends cleanly when its input ends.

use regflow::prelude::*;
use std::time::Duration;

fn f32s(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// `x (fed) -> acc = x + acc_prev -> sink`, with `acc.out` preloaded and read back by `acc`.
fn running_sum(kind: DeviceKind, streams: usize) -> Plan {
    let mut b = PlanBuilder::new();
    let dev = b.device(0, kind, 0);
    let ss: Vec<_> = (0..streams).map(|_| b.stream(dev, StreamKind::Compute)).collect();
    let src = b.actor("x", ss[0], ActorKind::Source { pieces: SourcePieces::Fed });
    let x = b.regst("x.out", src, 8, 2);
    let acc = b.actor("acc", ss[streams - 1], ActorKind::Compute { kernel: KernelConf::SumF32 });
    b.sim_nanos(acc, 20_000);
    let state = b.regst("acc.out", acc, 8, 2);
    b.preload(state, 1);
    b.consume(acc, x).consume(acc, state);
    let sink = b.actor("sink", ss[0], ActorKind::Sink);
    b.consume(sink, state);
    b.build().unwrap()
}

#[test]
fn a_running_sum_loop_delivers_the_initial_value_and_every_update_then_ends() {
    for (kind, streams) in [(DeviceKind::Cpu, 1), (DeviceKind::Cpu, 2), (DeviceKind::Sim, 2)] {
        let plan = running_sum(kind, streams);
        let mut job = Job::builder(plan)
            .preload("acc.out", f32s(&[10.0, 20.0]))
            .watchdog(Duration::from_secs(20))
            .build()
            .unwrap();
        let (mut feeder, fetcher) = (job.feeder("x").unwrap(), job.fetcher("sink").unwrap());
        for v in [1.0, 2.0, 3.0] {
            feeder.push(&f32s(&[v, v])).unwrap();
        }
        feeder.close().unwrap();
        let got: Vec<(u64, Vec<f32>)> =
            std::iter::from_fn(|| fetcher.recv()).map(|p| (p.piece(), floats(p.bytes()))).collect();
        assert_eq!(
            got,
            vec![(0, vec![10.0, 20.0]), (1, vec![11.0, 21.0]), (2, vec![13.0, 23.0]), (3, vec![16.0, 26.0])],
            "{kind:?} on {streams} stream(s)"
        );
        let report = job.wait().unwrap();
        assert_eq!(report.actor("acc").unwrap().fires, 3);
        assert!(report.actors.iter().all(|a| a.finished));
    }
}

struct Scale;
impl Kernel for Scale {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let (data, weight) = (floats(io.input(0)), floats(io.input(1)));
        let out: Vec<f32> = data.iter().zip(&weight).map(|(d, w)| d * w).collect();
        io.output(0).copy_from_slice(&f32s(&out));
        Ok(())
    }
}

struct Update;
impl Kernel for Update {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let (weight, data) = (floats(io.input(0)), floats(io.input(1)));
        let out: Vec<f32> = weight.iter().zip(&data).map(|(w, d)| w - 0.5 * d).collect();
        io.output(0).copy_from_slice(&f32s(&out));
        Ok(())
    }
}

#[test]
fn a_variable_and_its_update_form_a_loop_that_each_step_sees_the_latest_value() {
    // pred = data * w;  w' = w - 0.5 * pred  (the update reads what the forward pass made of w,
    // as an optimizer reads a gradient). `w` starts preloaded; a sink watches every value.
    for streams in [1, 2] {
        let mut b = PlanBuilder::new();
        let cpu = b.device(0, DeviceKind::Cpu, 0);
        let ss: Vec<_> = (0..streams).map(|_| b.stream(cpu, StreamKind::Compute)).collect();
        let data = b.actor("data", ss[0], ActorKind::Source { pieces: SourcePieces::Fed });
        let d = b.regst("data.out", data, 8, 2);
        let forward =
            b.actor("forward", ss[0], ActorKind::Compute { kernel: KernelConf::Custom { name: "scale".into() } });
        let update = b.actor(
            "update",
            ss[streams - 1],
            ActorKind::Compute { kernel: KernelConf::Custom { name: "update".into() } },
        );
        let w = b.regst("w", update, 8, 2);
        b.preload(w, 1);
        b.consume(forward, d).consume(forward, w);
        let pred = b.regst("pred", forward, 8, 2);
        b.consume(update, w).consume(update, pred);
        let sink = b.actor("pred_sink", ss[streams - 1], ActorKind::Sink);
        b.consume(sink, pred);
        let watch = b.actor("w_sink", ss[0], ActorKind::Sink);
        b.consume(watch, w);
        let plan = b.build().unwrap();
        assert_eq!(plan.loop_inputs(plan.actor_by_name("update").unwrap()), [true, false]);
        assert_eq!(plan.loop_inputs(plan.actor_by_name("forward").unwrap()), [false, true]);
        assert_eq!(plan.loop_inputs(plan.actor_by_name("w_sink").unwrap()), [false]);

        let mut job = Job::builder(plan)
            .kernel("scale", |_| Ok(Box::new(Scale)))
            .kernel("update", |_| Ok(Box::new(Update)))
            .preload("w", f32s(&[1.0, 2.0]))
            .watchdog(Duration::from_secs(20))
            .build()
            .unwrap();
        let (mut feeder, preds, weights) =
            (job.feeder("data").unwrap(), job.fetcher("pred_sink").unwrap(), job.fetcher("w_sink").unwrap());
        let steps = 4;
        for _ in 0..steps {
            feeder.push(&f32s(&[0.5, 0.5])).unwrap();
        }
        feeder.close().unwrap();
        let preds: Vec<Vec<f32>> = std::iter::from_fn(|| preds.recv()).map(|p| floats(p.bytes())).collect();
        let weights: Vec<Vec<f32>> = std::iter::from_fn(|| weights.recv()).map(|p| floats(p.bytes())).collect();
        // w_k = w_0 · 0.75^k; pred_k = 0.5 · w_k. The watch sink sees w_0 .. w_steps.
        let expected_w: Vec<Vec<f32>> = (0..=steps).map(|k| vec![0.75f32.powi(k), 2.0 * 0.75f32.powi(k)]).collect();
        assert_eq!(weights, expected_w, "{streams} stream(s)");
        let expected_pred: Vec<Vec<f32>> =
            expected_w[..steps as usize].iter().map(|w| vec![0.5 * w[0], 0.5 * w[1]]).collect();
        assert_eq!(preds, expected_pred);
        let report = job.wait().unwrap();
        assert_eq!(report.actor("update").unwrap().fires, steps as u64);
        assert_eq!(report.actor("forward").unwrap().fires, steps as u64);
    }
}

#[test]
fn loops_are_validated_and_preloads_checked() {
    // A loop with no input from outside would never end.
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s = b.stream(cpu, StreamKind::Compute);
    let spin = b.actor("spin", s, ActorKind::Compute { kernel: KernelConf::Copy });
    let r = b.regst("spin.out", spin, 8, 2);
    b.preload(r, 1).consume(spin, r);
    let sink = b.actor("sink", s, ActorKind::Sink);
    b.consume(sink, r);
    assert_eq!(
        b.build().unwrap_err().to_string(),
        "compute actor 'spin' reads only loop-carried (preloaded) registers: with no input from outside the loop it would never end"
    );
    let mut plan = running_sum(DeviceKind::Cpu, 1);
    plan.regst_descs[1].preloaded = 3;
    assert_eq!(plan.validate().unwrap_err().to_string(), "register 'acc.out' preloads 3 slots but has only 2");

    let preload = |name: &str, bytes: Vec<u8>| {
        Job::builder(running_sum(DeviceKind::Cpu, 1)).preload(name, bytes).build().unwrap_err().to_string()
    };
    assert_eq!(preload("acc.out", vec![0; 4]), "preload of register 'acc.out': got 4 bytes, its slots hold 8");
    assert_eq!(preload("x.out", vec![0; 8]), "preload of register 'x.out': has no preloaded slots");
    assert_eq!(preload("nope", vec![0; 8]), "preload of register 'nope': no single register has this name");
}
