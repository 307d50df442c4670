//! Ops are data in the plan and kernels come from a registry keyed by (op type, device
//! kind, dtype): a plan naming an op no device has, a dtype its op has no kernel for, or a
//! device this build cannot run is refused when the job is built, naming the actor, the op,
//! the device and the dtype; a program can bring kernels of its own for an op type.

use regflow::graph::plan::ops::{Binary, BinaryKind, MatMul};
use regflow::graph::plan::{OpAttrs, OpConf};
use regflow::graph::{DType, TensorMeta};
use regflow::prelude::*;

/// `x -> op -> sink` on one stream of a `kind` device, the op reading `inputs` copies of x.
fn one_op(kind: DeviceKind, op: OpConf) -> Plan {
    let mut b = PlanBuilder::new();
    let device = b.device(0, kind, 0);
    let s = b.stream(device, StreamKind::Compute);
    let src = b.actor("input:x", s, ActorKind::Source { pieces: SourcePieces::Fed });
    let x = b.regst("x", src, op.inputs[0].bytes() as u64, 2);
    let bytes = op.outputs[0].bytes() as u64;
    let f = b.actor("f", s, ActorKind::Compute { kernel: KernelConf::Op(op) });
    b.consume(f, x);
    let y = b.regst("y", f, bytes, 1);
    let sink = b.actor("fetch:0", s, ActorKind::Sink);
    b.consume(sink, y);
    b.build().unwrap()
}

fn add(dtype: DType) -> OpConf {
    let meta = TensorMeta::new([4], dtype);
    OpConf::new(&Binary(BinaryKind::Add), vec![meta.clone(), meta.clone()], vec![0, 0], vec![meta])
}

fn build_error(plan: Plan) -> String {
    Job::builder(plan).build().unwrap_err().to_string()
}

#[test]
fn an_op_kernel_runs_from_the_plan_alone() {
    let plan = Plan::from_json(&one_op(DeviceKind::Cpu, add(DType::F32)).to_json()).unwrap();
    let mut job = Job::builder(plan).build().unwrap();
    let mut feeder = job.feeder("input:x").unwrap();
    let fetcher = job.fetcher("fetch:0").unwrap();
    feeder.push(&[1f32, 2.0, 3.0, 4.5].iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    feeder.close().unwrap();
    let out: Vec<f32> =
        fetcher.recv().unwrap().bytes().chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(out, [2.0, 4.0, 6.0, 9.0]);
    job.wait().unwrap();
}

#[test]
fn an_unknown_op_type_is_refused_at_build_with_the_nearest_known_one() {
    let mut op = add(DType::F32);
    op.op_type = "binnary".into();
    assert_eq!(
        build_error(one_op(DeviceKind::Cpu, op)),
        "cannot make the kernel of actor 'f': no kernel is registered for op 'binnary' on device kind \
         cpu with dtype f32; no device has op type 'binnary' (did you mean 'binary'?)"
    );
}

#[test]
fn a_dtype_without_a_kernel_is_refused_naming_the_kernels_the_op_has() {
    assert_eq!(
        build_error(one_op(DeviceKind::Cpu, add(DType::I64))),
        "cannot make the kernel of actor 'f': no kernel is registered for op 'binary' on device kind \
         cpu with dtype i64; 'binary' has kernels for: cpu bf16, cpu f16, cpu f32, cpu f64, cuda bf16, cuda f16, \
         cuda f32, cuda f64, sim bf16, sim f16, sim f32, sim f64"
    );
}

#[test]
fn attributes_that_do_not_parse_are_refused_naming_the_actor() {
    let mut op = add(DType::F32);
    op.attrs = serde_json::json!("Pow");
    let message = build_error(one_op(DeviceKind::Cpu, op));
    assert!(
        message.starts_with("cannot make the kernel of actor 'f': the attributes of op 'binary' do not parse: "),
        "{message}"
    );
    assert!(message.contains("Pow"), "{message}");
}

#[test]
fn metas_that_contradict_the_registers_are_refused() {
    let mut op = add(DType::F32);
    op.outputs[0] = TensorMeta::new([5], DType::F32);
    let mut plan = one_op(DeviceKind::Cpu, op);
    plan.regst_descs[1].bytes = 16;
    assert_eq!(
        build_error(plan),
        "cannot make the kernel of actor 'f': op 'binary': output 0 is f32[5] (20 bytes), but its \
         register has 16 bytes"
    );
}

#[test]
fn a_device_this_build_cannot_run_is_refused_not_run_on_the_cpu() {
    let Err(missing) = regflow::cuda::probe() else {
        eprintln!("skipped the refusal: this machine runs cuda devices");
        return;
    };
    let message = build_error(one_op(DeviceKind::Cuda, add(DType::F32)));
    assert_eq!(message, format!("device node0/cuda:0 cannot run here: {missing}; its actors would not run"));
    // Built without the backend, the message says how to get it; built with it, it names
    // the driver library it could not load.
    let expected = if regflow::cuda::BUILT { "libcuda" } else { "--features cuda" };
    assert!(message.contains(expected), "{message}");
    // An unknown kind in a plan file does not even parse.
    let json = one_op(DeviceKind::Cpu, add(DType::F32)).to_json().replace("\"cpu\"", "\"tpu\"");
    let error = Plan::from_json(&json).unwrap_err().to_string();
    assert!(error.contains("tpu"), "{error}");
}

#[test]
fn a_program_brings_its_own_kernel_for_an_op_type() {
    struct Negate;
    impl Kernel for Negate {
        fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
            let x: Vec<u8> = io.input(0).to_vec();
            for (o, c) in io.output(0).chunks_mut(4).zip(x.chunks(4)) {
                o.copy_from_slice(&(-f32::from_le_bytes(c.try_into().unwrap())).to_le_bytes());
            }
            Ok(())
        }
    }
    let meta = TensorMeta::new([2], DType::F32);
    let op = OpConf {
        op_type: "negate".into(),
        attrs: serde_json::Value::Null,
        inputs: vec![meta.clone()],
        input_map: vec![0],
        outputs: vec![meta],
    };
    let mut job = Job::builder(one_op(DeviceKind::Cpu, op))
        .op_kernel("negate", DeviceKind::Cpu, DType::F32, |spec| {
            assert_eq!(spec.op.map(|o| o.op_type.as_str()), Some("negate"));
            Ok(Box::new(Negate))
        })
        .build()
        .unwrap();
    let mut feeder = job.feeder("input:x").unwrap();
    let fetcher = job.fetcher("fetch:0").unwrap();
    feeder.push(&[1f32, -2.0].iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    feeder.close().unwrap();
    assert_eq!(fetcher.recv().unwrap().bytes(), [-1f32, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>());
    job.wait().unwrap();
    // The op's identity is data: its type and attributes serialize into the plan.
    assert_eq!(MatMul { transpose_a: true, transpose_b: false }.op_type(), "matmul");
    assert_eq!(
        MatMul { transpose_a: true, transpose_b: false }.attrs(),
        serde_json::json!({"transpose_a": true, "transpose_b": false})
    );
}

/// A stream lends its kernels one scratch, as large as the most any of them asks
/// (`Kernel::scratch_bytes`): every kernel of a stream sees the same memory, each stream its
/// own, and `Job::kernel_memory` counts one scratch per stream, not one per kernel.
#[test]
fn a_stream_lends_its_kernels_one_scratch_as_large_as_the_most_one_asks() {
    use std::sync::{Arc, Mutex};
    /// Asks for `bytes` of scratch, fills them with the piece number and reads them back.
    struct UsesScratch {
        bytes: u64,
        seen: Arc<Mutex<Vec<(String, u64, u64)>>>,
        name: String,
    }
    impl Kernel for UsesScratch {
        fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
            let address = io.scratch(self.bytes)?;
            // SAFETY: the stream lends at least `bytes` of host memory at `address` (a cpu
            // device), which only this firing uses while it runs.
            let scratch = unsafe { std::slice::from_raw_parts_mut(address as *mut u8, self.bytes as usize) };
            scratch.fill(io.piece() as u8);
            assert!(scratch.iter().all(|&b| b == io.piece() as u8));
            let x = io.input(0).to_vec();
            io.output(0).copy_from_slice(&x);
            self.seen.lock().unwrap().push((self.name.clone(), address, io.context().scratch.bytes));
            Ok(())
        }
        fn scratch_bytes(&self) -> u64 {
            self.bytes
        }
    }
    // Three kernels on stream 0 asking 64, 200 and 16 bytes, two on stream 1 asking 8 and 40.
    let asks: [(&str, usize, u64); 5] = [("a", 0, 64), ("b", 0, 200), ("c", 0, 16), ("d", 1, 8), ("e", 1, 40)];
    let mut b = PlanBuilder::new();
    let device = b.device(0, DeviceKind::Cpu, 0);
    let streams = [b.stream(device, StreamKind::Compute), b.stream(device, StreamKind::Compute)];
    let src = b.actor("input:x", streams[0], ActorKind::Source { pieces: SourcePieces::Fed });
    let mut last = b.regst("x", src, 4, 2);
    for (name, stream, _) in asks {
        let k = b.actor(name, streams[stream], ActorKind::Compute { kernel: KernelConf::Custom { name: name.into() } });
        b.consume(k, last);
        last = b.regst(&format!("{name}:out"), k, 4, 1);
    }
    let sink = b.actor("fetch:0", streams[1], ActorKind::Sink);
    b.consume(sink, last);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut builder = Job::builder(b.build().unwrap());
    for (name, _, bytes) in asks {
        let seen = seen.clone();
        builder = builder.kernel(name, move |_| {
            Ok(Box::new(UsesScratch { bytes, seen: seen.clone(), name: name.to_string() }) as Box<dyn Kernel>)
        });
    }
    let mut job = builder.build().unwrap();
    assert_eq!(job.kernel_memory().bytes_of("node0/cpu:0"), Some(200 + 40), "{:?}", job.kernel_memory());
    let mut feeder = job.feeder("input:x").unwrap();
    let fetcher = job.fetcher("fetch:0").unwrap();
    for piece in 0..3u32 {
        feeder.push(&piece.to_le_bytes()).unwrap();
    }
    feeder.close().unwrap();
    for piece in 0..3u32 {
        assert_eq!(fetcher.recv().unwrap().bytes(), piece.to_le_bytes());
    }
    job.wait().unwrap();
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 15, "every kernel fired once per piece");
    let of = |names: &str| {
        let mut lent: Vec<(u64, u64)> =
            seen.iter().filter(|(n, _, _)| names.contains(n.as_str())).map(|(_, a, b)| (*a, *b)).collect();
        lent.dedup();
        lent
    };
    let (first, second) = (of("abc"), of("de"));
    assert_eq!(first.len(), 1, "one scratch on stream 0: {first:?}");
    assert_eq!(second.len(), 1, "one scratch on stream 1: {second:?}");
    assert_eq!((first[0].1, second[0].1), (200, 40));
    assert_ne!(first[0].0, second[0].0, "each stream its own scratch");
}
