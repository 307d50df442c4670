//! Lanes between stream threads under sleep and wake-up: a chain alternating over two cpu
//! streams, fed one piece at a time with kernels longer than a receiver's spin, so that
//! the other stream sleeps while each stage runs and every hop goes through the doorbell
//! handshake (`runtime/src/lane.rs`; with both streams on the cores, the asymmetric one
//! with `membarrier`, which loom cannot model); and the same chain pipelined, where the
//! streams mostly catch each other awake. Every piece must arrive, in order, with the
//! bytes each stage wrote, and the job must end.

use regflow_plan::{ActorKind, DeviceKind, KernelConf, Plan, PlanBuilder, SourcePieces, StreamKind};
use regflow_runtime::{Job, Kernel, KernelError, KernelIo};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Stages of the chain; stage `i` runs on stream `i % 2`.
const STAGES: usize = 6;

/// Writes the piece number into its output after checking that its input holds it (but
/// for the first stage, whose input is the source's), and busy-waits `hold` first: longer
/// than a receiver's spin, so the other stream goes to sleep meanwhile.
struct Stamp {
    first: bool,
    hold: Duration,
}

impl Kernel for Stamp {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let piece = io.piece();
        if !self.first {
            let got = u64::from_le_bytes(io.input(0)[..8].try_into().map_err(|_| KernelError("short input".into()))?);
            if got != piece {
                return Err(KernelError(format!("piece {piece} read the bytes of piece {got}")));
            }
        }
        let start = Instant::now();
        while start.elapsed() < self.hold {
            std::hint::spin_loop();
        }
        io.output(0)[..8].copy_from_slice(&piece.to_le_bytes());
        Ok(())
    }
}

/// The chain, its source `src` producing `pieces`.
fn chain(pieces: SourcePieces, register_num: u32) -> Plan {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let streams = [b.stream(cpu, StreamKind::Compute), b.stream(cpu, StreamKind::Compute)];
    let src = b.actor("src", streams[1], ActorKind::Source { pieces });
    let mut prev = b.regst("src.out", src, 8, register_num);
    for i in 0..STAGES {
        let kernel = KernelConf::Custom { name: if i == 0 { "first".into() } else { "stamp".into() } };
        let stage = b.actor(&format!("stage{i}"), streams[i % 2], ActorKind::Compute { kernel });
        b.consume(stage, prev);
        prev = b.regst(&format!("stage{i}.out"), stage, 8, register_num);
    }
    let sink = b.actor("sink", streams[STAGES % 2], ActorKind::Sink);
    b.consume(sink, prev);
    b.build().expect("the chain is a valid plan")
}

/// How the chain's source gets its pieces.
#[derive(Clone, Copy)]
enum Feed {
    /// `Count` pieces as fast as the chain takes them (pipelined).
    Counted,
    /// Pushed by the test one at a time, each after the previous one reached the sink:
    /// only one stage runs at a time, and the other stream waits longer than its spin.
    OneAtATime,
}

/// Runs the chain on a thread of its own; a hang fails the test after `limit` instead of
/// stalling the suite.
fn run(pieces: u64, register_num: u32, hold: Duration, feed: Feed, limit: Duration) {
    let seen = Arc::new(AtomicU64::new(0));
    let counter = seen.clone();
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let (arrived, arrivals) = std::sync::mpsc::channel();
        let source = match feed {
            Feed::Counted => SourcePieces::Count(pieces),
            Feed::OneAtATime => SourcePieces::Fed,
        };
        let job = Job::builder(chain(source, register_num))
            .kernel("first", move |_| Ok(Box::new(Stamp { first: true, hold })))
            .kernel("stamp", move |_| Ok(Box::new(Stamp { first: false, hold })))
            .on_sink("sink", move |io| {
                let expected = counter.load(Ordering::Relaxed);
                assert_eq!(io.piece(), expected, "pieces reach the sink in order");
                assert_eq!(io.input(0)[..8], expected.to_le_bytes(), "the last stage's bytes of piece {expected}");
                counter.store(expected + 1, Ordering::Relaxed);
                let _ = arrived.send(expected);
            })
            .build();
        let result = job.and_then(|mut job| {
            if let Feed::OneAtATime = feed {
                let mut feeder = job.feeder("src")?;
                for piece in 0..pieces {
                    feeder.push(&piece.to_le_bytes())?;
                    if arrivals.recv_timeout(limit) != Ok(piece) {
                        break;
                    }
                }
            }
            job.wait()
        });
        let _ = done.send(result.map(|report| report.lane_waits));
    });
    match finished.recv_timeout(limit) {
        Ok(result) => {
            let waits = result.expect("the chain runs to its end");
            assert_eq!(waits, 0, "messages between the streams found their lane full");
        }
        Err(_) => panic!(
            "the chain over two streams hung: {} of {pieces} pieces reached the sink after {limit:?}",
            seen.load(Ordering::Relaxed)
        ),
    }
    assert_eq!(seen.load(Ordering::Relaxed), pieces, "every piece reached the sink");
}

#[test]
fn a_chain_whose_streams_sleep_at_every_hop_delivers_every_piece_in_order() {
    // One piece at a time, 150 µs per kernel: while a stage runs, the other stream spins
    // its 50 µs (`inbox::SPIN_TIME`) and sleeps, so every hop wakes it. (Counted with
    // `perf stat -e syscalls:sys_enter_membarrier`: about one heavy barrier per hop.)
    for register_num in [1, 2] {
        run(200, register_num, Duration::from_micros(150), Feed::OneAtATime, Duration::from_secs(120));
    }
}

#[test]
fn a_chain_of_quick_kernels_delivers_every_piece_in_order() {
    // No hold: the streams mostly catch each other spinning, and now and then sleep.
    for register_num in [1, 2, 3] {
        run(20_000, register_num, Duration::ZERO, Feed::Counted, Duration::from_secs(120));
    }
}
