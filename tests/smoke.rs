//! Quick end-to-end checks of the runtime on cpu and sim streams.

use regflow::prelude::*;
use std::time::Duration;

fn chain(kind: DeviceKind, stages: usize, register_num: u32, pieces: u64, streams: usize) -> Plan {
    let mut b = PlanBuilder::new();
    let dev = b.device(0, kind, 0);
    let ss: Vec<_> = (0..streams).map(|_| b.stream(dev, StreamKind::Compute)).collect();
    let src = b.actor("src", ss[0], ActorKind::Source { pieces: SourcePieces::Count(pieces) });
    let mut prev = b.regst("src.out", src, 64, register_num);
    for i in 0..stages {
        let a = b.actor(&format!("stage{i}"), ss[(i + 1) % streams], ActorKind::Compute { kernel: KernelConf::Copy });
        b.sim_nanos(a, 200_000);
        b.consume(a, prev);
        prev = b.regst(&format!("stage{i}.out"), a, 64, register_num);
    }
    let sink = b.actor("sink", ss[0], ActorKind::Sink);
    b.consume(sink, prev);
    b.build().unwrap()
}

#[test]
fn chains_deliver_every_piece_in_order() {
    for kind in [DeviceKind::Cpu, DeviceKind::Sim] {
        for streams in [1, 2, 3] {
            for register_num in [1, 2] {
                let plan = chain(kind, 4, register_num, 20, streams);
                let mut job = Job::builder(plan).watchdog(Duration::from_secs(20)).build().unwrap();
                let fetcher = job.fetcher("sink").unwrap();
                let mut got = Vec::new();
                while let Some(p) = fetcher.recv() {
                    let tag = u64::from_le_bytes(p.bytes()[..8].try_into().unwrap());
                    got.push((p.piece(), tag));
                }
                let report = job.wait().unwrap();
                let expected: Vec<(u64, u64)> = (0..20).map(|i| (i, i)).collect();
                assert_eq!(got, expected, "{kind:?} streams {streams} regs {register_num}");
                assert!(report.actors.iter().all(|a| a.finished));
                assert_eq!(report.actor("stage3").unwrap().fires, 20);
            }
        }
    }
}
