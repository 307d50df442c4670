//! The runtime's invariants on a GPU, with a kernel slow on purpose: a queued kernel's
//! consumer on another stream never reads its output before the kernel finished (so no
//! slot is read, or handed back, before its completion), and the producer never holds more
//! pieces than its register count. Skips without a GPU.

use regflow::cuda::{args, launch, Device, Grid, StreamHandle};
use regflow::kernels::Execution;
use regflow::prelude::*;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

const PIECES: u64 = 24;
const SLOTS: u32 = 2;
/// About 2 ms on a current GPU: far longer than a message between stream threads.
const SPIN_CYCLES: i64 = 3_000_000;

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
    let device = match Device::open(0) {
        Ok(device) => device,
        Err(e) => {
            eprintln!("skipped (no GPU): {e}");
            return;
        }
    };
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
