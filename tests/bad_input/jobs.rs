//! Building a job: kernels that are not registered, op confs that contradict their op,
//! devices without a backend, callbacks and preloads naming the wrong thing.

use crate::{quick, without_gpu, Catalogue};
use regflow::graph::plan::ops::{Binary, BinaryKind, MatMul};
use regflow::graph::plan::{CollectiveConf, CollectiveOp, DType, DatasetConf, OpConf, TensorMeta};
use regflow::prelude::*;

/// Fed `a` and `b` -> `op` (this conf) -> `sink`, registers sized by the conf's metas.
pub(crate) fn one_op(conf: OpConf, device: DeviceKind) -> Plan {
    let mut b = PlanBuilder::new();
    let dev = b.device(0, device, 0);
    let s = b.stream(dev, StreamKind::Compute);
    let mut regs = Vec::new();
    for (k, meta) in conf.inputs.iter().enumerate() {
        let name = format!("in{k}");
        let src = b.actor(&name, s, ActorKind::Source { pieces: SourcePieces::Fed });
        regs.push(b.regst(&name, src, meta.bytes() as u64, 1));
    }
    let out_bytes = conf.outputs.first().map_or(8, |m| m.bytes() as u64);
    let actor = b.actor("op", s, ActorKind::Compute { kernel: KernelConf::Op(conf) });
    for r in regs {
        b.consume(actor, r);
    }
    let y = b.regst("y", actor, out_bytes, 1);
    let sink = b.actor("sink", s, ActorKind::Sink);
    b.consume(sink, y);
    b.build().expect("the plan validates")
}

fn f32s(shape: &[usize]) -> TensorMeta {
    TensorMeta::new(shape.to_vec(), DType::F32)
}

fn matmul(a: &[usize], b: &[usize], out: &[usize]) -> OpConf {
    OpConf::new(&MatMul::default(), vec![f32s(a), f32s(b)], vec![0, 1], vec![f32s(out)])
}

/// `src` (4 counted pieces) -> `f` (this kernel) -> `sink`.
fn with_kernel(kernel: KernelConf, device: DeviceKind) -> Plan {
    let mut b = PlanBuilder::new();
    let dev = b.device(0, device, 0);
    let s = b.stream(dev, StreamKind::Compute);
    let src = b.actor("src", s, ActorKind::Source { pieces: SourcePieces::Count(4) });
    let x = b.regst("x", src, 16, 1);
    let f = b.actor("f", s, ActorKind::Compute { kernel });
    b.consume(f, x);
    let y = b.regst("y", f, 16, 1);
    let sink = b.actor("sink", s, ActorKind::Sink);
    b.consume(sink, y);
    b.build().expect("the plan validates")
}

#[test]
fn job_building() {
    let mut c = Catalogue::new("jobs");
    let custom = |name: &str| KernelConf::Custom { name: name.into() };
    c.case(
        "a custom kernel nobody registered",
        || quick(with_kernel(custom("mine"), DeviceKind::Cpu)).build(),
        "RuntimeError::KernelSetup",
        &["actor 'f'", "kernel 'mine'", "not registered", "registers no kernels by name"],
    );
    c.case(
        "zero threads for a cpu device's kernels",
        || quick(with_kernel(KernelConf::Copy, DeviceKind::Cpu)).cpu_threads(0).build(),
        "RuntimeError::Setting",
        &["cpu_threads is 0", "1 to 1024 threads", "this machine has"],
    );
    c.case(
        "a thread count that is a typo",
        || quick(with_kernel(KernelConf::Copy, DeviceKind::Cpu)).cpu_threads(20_000).build(),
        "RuntimeError::Setting",
        &["cpu_threads is 20000", "1 to 1024 threads"],
    );
    c.case(
        "a custom kernel name with a typo",
        || {
            quick(with_kernel(custom("mine"), DeviceKind::Cpu))
                .kernel("mien", |_| Err(regflow::kernels::KernelError("unused".into())))
                .build()
        },
        "RuntimeError::KernelSetup",
        &["actor 'f'", "kernel 'mine'", "registered: mien", "did you mean 'mien'"],
    );
    c.case(
        "a custom source kernel nobody registered",
        || {
            let mut plan = with_kernel(KernelConf::Copy, DeviceKind::Cpu);
            plan.actors[0].kind =
                ActorKind::Source { pieces: SourcePieces::Custom { count: 2, kernel: "reader".into() } };
            quick(plan).build()
        },
        "RuntimeError::KernelSetup",
        &["'src'", "'reader'"],
    );
    // Refused only where no GPU can run it (CI); a GPU machine runs it.
    if without_gpu() {
        c.case(
            "a cuda device without a cuda backend",
            || quick(with_kernel(KernelConf::Copy, DeviceKind::Cuda)).build(),
            "RuntimeError::UnsupportedDevice",
            &["node0/cuda:0", "cannot run here", "CUDA"],
        );
    }
    c.case(
        "an op type no device has",
        || {
            let mut conf = matmul(&[4, 3], &[3, 2], &[4, 2]);
            conf.op_type = "matmull".into();
            quick(one_op(conf, DeviceKind::Cpu)).build()
        },
        "RuntimeError::KernelSetup",
        &["actor 'op'", "'matmull'", "did you mean 'matmul'"],
    );
    c.case(
        "an op of a dtype its kernel does not take",
        || {
            let i64s = |shape: &[usize]| TensorMeta::new(shape.to_vec(), DType::I64);
            let conf =
                OpConf::new(&MatMul::default(), vec![i64s(&[4, 3]), i64s(&[3, 2])], vec![0, 1], vec![i64s(&[4, 2])]);
            quick(one_op(conf, DeviceKind::Cpu)).build()
        },
        "RuntimeError::KernelSetup",
        &["actor 'op'", "matmul", "i64"],
    );
    c.case(
        "op attributes of the wrong type",
        || {
            let mut conf = matmul(&[4, 3], &[3, 2], &[4, 2]);
            conf.attrs = serde_json::json!({"transpose_a": "yes"});
            quick(one_op(conf, DeviceKind::Cpu)).build()
        },
        "RuntimeError::KernelSetup",
        &["actor 'op'", "transpose_a"],
    );
    c.case(
        "op attributes that are not an object",
        || {
            let mut conf = matmul(&[4, 3], &[3, 2], &[4, 2]);
            conf.attrs = serde_json::json!([1, 2]);
            quick(one_op(conf, DeviceKind::Cpu)).build()
        },
        "RuntimeError::KernelSetup",
        &["actor 'op'", "matmul"],
    );
    c.case(
        "matmul metas with mismatched inner dims",
        || quick(one_op(matmul(&[4, 3], &[5, 2], &[4, 2]), DeviceKind::Cpu)).build(),
        "RuntimeError::KernelSetup",
        &["actor 'op'", "matmul", "[4, 3] x [5, 2]", "3 vs 5"],
    );
    c.case(
        "matmul metas with the wrong output",
        || quick(one_op(matmul(&[4, 3], &[3, 2], &[2, 4]), DeviceKind::Cpu)).build(),
        "RuntimeError::KernelSetup",
        &["actor 'op'", "[4, 2]", "[2, 4]"],
    );
    c.case(
        "binary metas that do not broadcast",
        || {
            let conf =
                OpConf::new(&Binary(BinaryKind::Add), vec![f32s(&[4]), f32s(&[3])], vec![0, 1], vec![f32s(&[4])]);
            quick(one_op(conf, DeviceKind::Cpu)).build()
        },
        "RuntimeError::KernelSetup",
        &["actor 'op'", "binary", "[4] and [3]"],
    );
    c.case(
        "an op input mapped to an actor input that does not exist",
        || {
            let mut conf = matmul(&[4, 3], &[3, 2], &[4, 2]);
            conf.input_map = vec![0, 5];
            quick(one_op(conf, DeviceKind::Cpu)).build()
        },
        "RuntimeError::KernelSetup",
        &["actor 'op'", "input 1", "actor input 5"],
    );
    c.case(
        "an op with one input map entry for two inputs",
        || {
            let mut conf = matmul(&[4, 3], &[3, 2], &[4, 2]);
            conf.input_map = vec![0];
            quick(one_op(conf, DeviceKind::Cpu)).build()
        },
        "RuntimeError::KernelSetup",
        &["actor 'op'", "matmul"],
    );
    c.case(
        "matmul with one input",
        || {
            let conf = OpConf::new(&MatMul::default(), vec![f32s(&[4, 3])], vec![0], vec![f32s(&[4, 2])]);
            quick(one_op(conf, DeviceKind::Cpu)).build()
        },
        "RuntimeError::KernelSetup",
        &["actor 'op'", "matmul", "1"],
    );
    c.case(
        "an op whose metas do not fit its registers",
        || {
            let mut plan = one_op(matmul(&[4, 3], &[3, 2], &[4, 2]), DeviceKind::Cpu);
            plan.regst_descs[0].bytes = 40;
            quick(plan).build()
        },
        "RuntimeError::KernelSetup",
        &["actor 'op'", "40"],
    );
    c.case(
        "an op meta whose bytes overflow",
        || {
            let mut plan = one_op(matmul(&[4, 3], &[3, 2], &[4, 2]), DeviceKind::Cpu);
            if let ActorKind::Compute { kernel: KernelConf::Op(conf) } = &mut plan.actors[2].kind {
                conf.inputs[0] = f32s(&[1 << 40, 1 << 40]);
            }
            quick(plan).build()
        },
        "RuntimeError::KernelSetup",
        &["actor 'op'", "input 0", "f32[1099511627776, 1099511627776]", "more bytes than fit in 64 bits"],
    );
    c.case(
        "a collective whose shape does not fit its registers",
        || {
            let conf = CollectiveConf {
                group: "g".into(),
                rank: 0,
                size: 1,
                op: CollectiveOp::AllReduce,
                dtype: DType::F32,
                shape: vec![8],
            };
            quick(with_kernel(KernelConf::Collective(conf), DeviceKind::Cpu)).build()
        },
        "RuntimeError::KernelSetup",
        &["actor 'f'", "collective 'g'", "16 bytes", "[8]", "32"],
    );
    c.case(
        "an on_sink callback for an actor that is not a sink",
        || quick(with_kernel(KernelConf::Copy, DeviceKind::Cpu)).on_sink("f", |_| {}).build(),
        "RuntimeError::WrongKind",
        &["'f'", "compute", "on_sink needs a sink"],
    );
    c.case(
        "an on_sink callback for an unknown actor",
        || quick(with_kernel(KernelConf::Copy, DeviceKind::Cpu)).on_sink("snk", |_| {}).build(),
        "RuntimeError::UnknownActor",
        &["'snk'"],
    );
    c.case(
        "a preload of an unknown register",
        || quick(with_kernel(KernelConf::Copy, DeviceKind::Cpu)).preload("w", vec![0; 16]).build(),
        "RuntimeError::Preload",
        &["'w'"],
    );
    c.case(
        "a preload of a register without preloaded slots",
        || quick(with_kernel(KernelConf::Copy, DeviceKind::Cpu)).preload("x", vec![0; 16]).build(),
        "RuntimeError::Preload",
        &["'x'"],
    );
    c.case(
        "a preload of the wrong size",
        || {
            let mut plan = with_kernel(KernelConf::Copy, DeviceKind::Cpu);
            plan.regst_descs[1].register_num = 2;
            plan.regst_descs[1].preloaded = 1;
            plan.actors[1].inputs.push(regflow::graph::plan::RegstDescId(1));
            plan.regst_descs[1].consumers.push(regflow::graph::plan::ActorIndex(1));
            quick(plan).preload("y", vec![0; 3]).build()
        },
        "RuntimeError::Preload",
        &["'y'", "3", "16"],
    );
    c.case(
        "a dataset source whose file does not exist",
        || {
            let mut plan = with_kernel(KernelConf::Copy, DeviceKind::Cpu);
            let conf = DatasetConf { path: "missing.records".into(), fields: vec![16], batch: 1, seed: 0, pieces: 2 };
            plan.actors[0].kind = ActorKind::Source { pieces: SourcePieces::Dataset(conf) };
            quick(plan).data_dir(std::env::temp_dir()).build()
        },
        "RuntimeError::KernelSetup",
        &["actor 'src'", "dataset", "missing.records"],
    );
    c.case(
        "a dataset whose fields do not fill the register",
        || {
            let dir = crate::common::temp_dir("bad_input", "dataset_fields");
            std::fs::write(dir.join("records.bin"), [0u8; 64]).expect("writes the records");
            let mut plan = with_kernel(KernelConf::Copy, DeviceKind::Cpu);
            let conf = DatasetConf { path: "records.bin".into(), fields: vec![4], batch: 2, seed: 0, pieces: 2 };
            plan.actors[0].kind = ActorKind::Source { pieces: SourcePieces::Dataset(conf) };
            quick(plan).data_dir(dir).build()
        },
        "RuntimeError",
        &["'src'"],
    );
    c.case(
        "a join whose fed input is never pushed",
        stalled_join,
        "RuntimeError::Stalled",
        &[
            "job stalled: no actor fired for",
            "wait-for graph",
            "'fed' (",
            "waits for the user to push a piece",
            "waits on input 'fed.out': empty, produced by 'fed'",
        ],
    );
    c.finish();
}

/// `src` (counted) -> `a` -> `join` <- `fed` (never pushed): the watchdog reports who
/// waits on whom. The wait runs on a thread so that a regression that hangs fails the case.
fn stalled_join() -> Result<(), RuntimeError> {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s0 = b.stream(cpu, StreamKind::Compute);
    let s1 = b.stream(cpu, StreamKind::Compute);
    let src = b.actor("src", s0, ActorKind::Source { pieces: SourcePieces::Count(100) });
    let x = b.regst("src.out", src, 8, 1);
    let fed = b.actor("fed", s0, ActorKind::Source { pieces: SourcePieces::Fed });
    let y = b.regst("fed.out", fed, 8, 1);
    let a = b.actor("a", s1, ActorKind::Compute { kernel: KernelConf::Copy });
    b.consume(a, x);
    let z = b.regst("a.out", a, 8, 1);
    let join = b.actor("join", s1, ActorKind::Sink);
    b.consume(join, z).consume(join, y);
    let mut job = quick(b.build().expect("the plan validates")).build()?;
    let feeder = job.feeder("fed")?;
    let (done, waited) = std::sync::mpsc::channel();
    std::thread::spawn(move || done.send(job.wait().map(drop)));
    let result = waited.recv_timeout(crate::WATCHDOG * 20).expect("the watchdog ends a stalled job");
    drop(feeder);
    result
}
