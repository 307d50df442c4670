//! The runtime's invariants on a GPU, with a kernel slow on purpose: a queued kernel's
//! consumer on another stream never reads its output before the kernel finished (so no
//! slot is read, or handed back, before its completion), and the producer never holds more
//! pieces than its register count; pieces fed ahead of a slow step through the copy
//! stream's page-locked staging arrive whole, each in its own step. Skips without a GPU
//! (the copy-stream placement and the feed-to-fetch copies also run dry, with NVRTC).

use crate::common;

use regflow::cuda::{args, launch, Device, Grid, StreamHandle};
use regflow::graph::sbp::Mesh;
use regflow::graph::{DType, Graph, HostArray, ParallelOptions};
use regflow::kernels::Execution;
use regflow::prelude::*;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

const PIECES: u64 = 24;
const SLOTS: u32 = 2;
/// About 2 ms on a current GPU: far longer than a message between stream threads.
const SPIN_CYCLES: i64 = 3_000_000;

/// GPU 0, or `None` (said why) on a machine without one. Probed first: another test of
/// this file may have made the process's devices dry runs, which compute nothing.
fn gpu() -> Option<Device> {
    match regflow::cuda::probe().and_then(|_| Device::open(0)) {
        Ok(device) => Some(device),
        Err(e) => {
            eprintln!("skipped (no GPU): {e}");
            None
        }
    }
}

#[derive(Default)]
struct Record {
    /// Pieces the slow kernel launched minus pieces the check consumed.
    in_flight: AtomicI64,
    most_in_flight: AtomicI64,
    /// What the check read, in order.
    read: Mutex<Vec<i64>>,
    launched: AtomicUsize,
}

struct Slow {
    record: Arc<Record>,
    function: regflow::cuda::Function,
    next: i64,
}

impl Kernel for Slow {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let now = self.record.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.record.most_in_flight.fetch_max(now, Ordering::SeqCst);
        self.record.launched.fetch_add(1, Ordering::SeqCst);
        let (out, value) = (io.output_addr(0), self.next);
        self.next += 1;
        let grid = Grid { blocks: (1, 1, 1), threads: (32, 1, 1), shared_bytes: 0 };
        // SAFETY: `out` is the 8-byte output slot; the kernel takes (i64*, i64, i64).
        unsafe { launch(StreamHandle(io.context().native), self.function, grid, &mut args![out, value, SPIN_CYCLES]) }?;
        Ok(())
    }

    fn execution(&self) -> Execution {
        Execution::Queued
    }
}

struct Check(Arc<Record>);

impl Kernel for Check {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let value = i64::from_le_bytes(io.input(0).try_into().map_err(|_| KernelError("8 bytes".into()))?);
        self.0.read.lock().unwrap().push(value);
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
        io.output(0).copy_from_slice(&value.to_le_bytes());
        Ok(())
    }
}

#[test]
fn a_slow_kernel_is_read_only_after_it_completes_and_never_runs_ahead_of_its_slots() {
    let Some(device) = gpu() else { return };
    let function = device.function("regflow_debug_spin_write_i64").unwrap();
    let mut b = PlanBuilder::new();
    let gpu = b.device(0, DeviceKind::Cuda, 0);
    let s0 = b.stream(gpu, StreamKind::Compute);
    let s1 = b.stream(gpu, StreamKind::Compute);
    let src = b.actor("src", s0, ActorKind::Source { pieces: SourcePieces::Count(PIECES) });
    // Room for the slow kernel to queue up to its output slots before the first completes.
    let x = b.regst("src.out", src, 8, SLOTS + 1);
    let slow = b.actor("slow", s0, ActorKind::Compute { kernel: KernelConf::Custom { name: "slow".into() } });
    b.consume(slow, x);
    let y = b.regst("slow.out", slow, 8, SLOTS);
    let check = b.actor("check", s1, ActorKind::Compute { kernel: KernelConf::Custom { name: "check".into() } });
    b.consume(check, y);
    let z = b.regst("check.out", check, 8, 1);
    let sink = b.actor("sink", s0, ActorKind::Sink);
    b.consume(sink, z);
    let plan = b.build().unwrap();
    let record = Arc::new(Record::default());
    let (for_slow, for_check) = (record.clone(), record.clone());
    Job::builder(plan)
        .kernel("slow", move |_| Ok(Box::new(Slow { record: for_slow.clone(), function, next: 0 })))
        .kernel("check", move |_| Ok(Box::new(Check(for_check.clone()))))
        .build()
        .unwrap()
        .wait()
        .unwrap();
    let read = record.read.lock().unwrap().clone();
    assert_eq!(read, (0..PIECES as i64).collect::<Vec<_>>(), "the check read an output before its kernel finished");
    assert_eq!(record.launched.load(Ordering::SeqCst), PIECES as usize);
    let most = record.most_in_flight.load(Ordering::SeqCst);
    assert!(most <= i64::from(SLOTS), "the slow producer held {most} pieces with {SLOTS} slots");
    eprintln!("the slow producer ran up to {most} piece(s) ahead of its consumer ({SLOTS} slots)");
}

/// A kernel that spins, then copies its 8-byte input to its output, on the GPU.
struct SlowCopy(regflow::cuda::Function);

impl Kernel for SlowCopy {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let (out, input) = (io.output_addr(0), io.input_addr(0));
        let grid = Grid { blocks: (1, 1, 1), threads: (32, 1, 1), shared_bytes: 0 };
        // SAFETY: 8-byte slots; the kernel takes (i64*, const i64*, i64).
        unsafe { launch(StreamHandle(io.context().native), self.0, grid, &mut args![out, input, SPIN_CYCLES]) }?;
        Ok(())
    }

    fn execution(&self) -> Execution {
        Execution::Queued
    }
}

/// A fed source on the copy stream writes its register slots from page-locked staging by
/// queued copies, and its firing completes only when they ran. With every piece pushed at
/// once and a slow consumer on the compute stream, the feed runs ahead as far as its two
/// slots allow: a staging buffer reused before its copy ran, or a consumer told before the
/// copy landed, would show as a wrong or repeated value at the sink.
#[test]
fn pieces_fed_ahead_of_a_slow_consumer_arrive_whole_and_in_order() {
    let Some(device) = gpu() else { return };
    let function = device.function("regflow_debug_spin_copy_i64").unwrap();
    let mut b = PlanBuilder::new();
    let gpu = b.device(0, DeviceKind::Cuda, 0);
    let (compute, copy) = (b.stream(gpu, StreamKind::Compute), b.stream(gpu, StreamKind::Copy));
    let src = b.actor("input:x", copy, ActorKind::Source { pieces: SourcePieces::Fed });
    let x = b.regst("x", src, 8, SLOTS);
    let slow = b.actor("slow", compute, ActorKind::Compute { kernel: KernelConf::Custom { name: "slow".into() } });
    b.consume(slow, x);
    let y = b.regst("slow.out", slow, 8, SLOTS);
    let sink = b.actor("fetch:0", copy, ActorKind::Sink);
    b.consume(sink, y);
    let plan = b.build().unwrap();
    let mut job = Job::builder(plan).kernel("slow", move |_| Ok(Box::new(SlowCopy(function)))).build().unwrap();
    let mut feeder = job.feeder("input:x").unwrap();
    let fetcher = job.fetcher("fetch:0").unwrap();
    let values: Vec<i64> = (0..PIECES as i64).map(|k| 1_000_003 * k + 17).collect();
    let pushed = values.clone();
    let pusher = std::thread::spawn(move || {
        for v in &pushed {
            feeder.push(&v.to_le_bytes()).unwrap();
        }
        feeder.close().unwrap();
    });
    let got: Vec<i64> = (0..PIECES)
        .map(|_| {
            let piece = fetcher.recv().expect("a piece per push");
            i64::from_le_bytes(piece.bytes().try_into().unwrap())
        })
        .collect();
    pusher.join().unwrap();
    job.wait().unwrap();
    assert_eq!(got, values, "a fed piece was overwritten or read before its copy ran");
}

/// On a `cuda` device the compiler puts fed sources and fetch sinks on the device's copy
/// stream (the compute stream never waits for a feed's copy or a fetch's read), the ops on
/// its compute stream; on a CPU device everything stays on the compute stream. Pieces
/// pushed ahead arrive whole, each in its own step, at a fetcher and at a sink callback (on
/// a GPU the computed value is checked too; dry, the copies through staging alone).
#[test]
fn feeds_and_fetches_cross_on_the_copy_stream() {
    let Some(on_gpu) = common::gpu_or_dry_run() else { return };
    const LEN: usize = 1031;
    const STEPS: usize = 12;
    let compile = |kind: DeviceKind| {
        let g = Graph::new();
        let mesh = Mesh::of_kind(kind, &[1], &["d"]).unwrap();
        let x = g.input("x", vec![LEN], DType::F32).unwrap();
        let y = x.mul_scalar(3.0).unwrap();
        g.compile_parallel(&[x, y], &[], &ParallelOptions::new(mesh)).unwrap()
    };
    for kind in [DeviceKind::Cpu, DeviceKind::Cuda] {
        let plan = &compile(kind).plan;
        for actor in &plan.actors {
            let stream = plan.streams[actor.stream.index()].kind;
            let io = matches!(actor.kind, ActorKind::Source { .. } | ActorKind::Sink);
            let expected = if io && kind == DeviceKind::Cuda { StreamKind::Copy } else { StreamKind::Compute };
            assert_eq!(stream, expected, "{kind:?}: actor '{}'", actor.name);
        }
    }
    let compiled = compile(DeviceKind::Cuda);
    let mut job = Job::builder(compiled.plan.clone()).build().unwrap();
    let mut feeds = job.graph_feeds().unwrap();
    let (fetch_x, fetch_y) = (job.fetcher(&compiled.fetches[0]).unwrap(), job.fetcher(&compiled.fetches[1]).unwrap());
    let value = |step: usize| -> Vec<f32> { (0..LEN).map(|i| (step * 10_000 + i) as f32).collect() };
    let pusher = std::thread::spawn(move || {
        for step in 0..STEPS {
            let piece = HostArray::from_f64(
                vec![LEN],
                DType::F32,
                &value(step).iter().map(|&v| f64::from(v)).collect::<Vec<_>>(),
            );
            feeds.push("x", &piece.unwrap()).unwrap();
        }
        feeds.close().unwrap();
    });
    fn floats(bytes: &[u8]) -> Vec<f32> {
        bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
    }
    for step in 0..STEPS {
        let x = fetch_x.recv().expect("x each step");
        assert_eq!(floats(x.bytes()), value(step), "step {step}: x");
        drop(x);
        let y = fetch_y.recv().expect("y each step");
        if on_gpu {
            let expected: Vec<f32> = value(step).iter().map(|v| v * 3.0).collect();
            assert_eq!(floats(y.bytes()), expected, "step {step}: 3x");
        }
    }
    pusher.join().unwrap();
    job.wait().unwrap();
    // A program's callback on the sink of x reads the same values, through the same
    // page-locked copies.
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    let mut job = Job::builder(compiled.plan.clone())
        .on_sink(&compiled.fetches[0], move |io| record.lock().unwrap().push(floats(io.input(0))))
        .build()
        .unwrap();
    let mut feeds = job.graph_feeds().unwrap();
    let ys = job.fetcher(&compiled.fetches[1]).unwrap();
    for step in 0..STEPS {
        let piece =
            HostArray::from_f64(vec![LEN], DType::F32, &value(step).iter().map(|&v| f64::from(v)).collect::<Vec<_>>());
        feeds.push("x", &piece.unwrap()).unwrap();
        drop(ys.recv().expect("y each step"));
    }
    feeds.close().unwrap();
    drop((feeds, ys));
    job.wait().unwrap();
    assert_eq!(*seen.lock().unwrap(), (0..STEPS).map(value).collect::<Vec<_>>());
}
