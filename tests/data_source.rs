//! A dataset source actor reads a file of records and serves shuffled batches: every epoch
//! covers each record once, fields stay together, the order is reproducible by seed; on a
//! `cuda` device the same batches arrive through page-locked staging on its copy stream.

use crate::common;

use regflow::prelude::*;
use regflow::runtime::RecordFile;
use std::collections::BTreeSet;

/// Records of 12 bytes: a u32 "feature" then an i64 "label", both the record's index.
fn records(n: u32) -> Vec<u8> {
    (0..n).flat_map(|i| [i.to_le_bytes().to_vec(), (i as i64).to_le_bytes().to_vec()].concat()).collect()
}

fn run(file: &RecordFile, batch: usize, seed: u64, epochs: u64) -> Vec<(Vec<u32>, Vec<i64>)> {
    run_on(DeviceKind::Cpu, file, batch, seed, epochs)
}

/// [`run`] with the source and the sink on a device of `kind` (a `cuda` device's copy
/// stream).
fn run_on(kind: DeviceKind, file: &RecordFile, batch: usize, seed: u64, epochs: u64) -> Vec<(Vec<u32>, Vec<i64>)> {
    let batches = file.batches(&[4, 8], batch, seed).unwrap();
    let pieces = batches.pieces(epochs);
    let mut b = PlanBuilder::new();
    let device = b.device(0, kind, 0);
    let s = b.stream(device, if kind == DeviceKind::Cuda { StreamKind::Copy } else { StreamKind::Compute });
    let src = b.actor(
        "data",
        s,
        ActorKind::Source { pieces: SourcePieces::Custom { count: pieces, kernel: "digits".into() } },
    );
    let features = b.regst("features", src, 4 * batch as u64, 2);
    let labels = b.regst("labels", src, 8 * batch as u64, 2);
    let sink = b.actor("sink", s, ActorKind::Sink);
    b.consume(sink, features).consume(sink, labels);
    let mut job = Job::builder(b.build().unwrap()).dataset("digits", batches).build().unwrap();
    let fetcher = job.fetcher("sink").unwrap();
    let out = std::iter::from_fn(|| fetcher.recv())
        .map(|p| {
            let f = p.part(0).unwrap().chunks(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
            let l = p.part(1).unwrap().chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
            (f, l)
        })
        .collect();
    drop(fetcher);
    job.wait().unwrap();
    out
}

#[test]
fn every_epoch_serves_each_record_once_in_a_seeded_order() {
    let file = RecordFile::from_bytes(records(10), 12).unwrap();
    let batches = run(&file, 3, 7, 2);
    assert_eq!(batches.len(), 6, "3 full batches of 3 per epoch (the 10th record waits for a later epoch)");
    let mut epochs = Vec::new();
    for epoch in batches.chunks(3) {
        let ids: Vec<u32> = epoch
            .iter()
            .flat_map(|(f, l)| {
                assert_eq!(f.iter().map(|&x| x as i64).collect::<Vec<_>>(), *l, "fields of one record stay together");
                f.clone()
            })
            .collect();
        assert_eq!(ids.iter().collect::<BTreeSet<_>>().len(), 9, "no record twice in an epoch: {ids:?}");
        epochs.push(ids);
    }
    assert_ne!(epochs[0], epochs[1], "each epoch is reshuffled");
    assert_eq!(run(&file, 3, 7, 2), batches, "same seed, same order");
    assert_ne!(run(&file, 3, 8, 2), batches, "another seed, another order");
}

#[test]
fn record_files_are_read_from_disk_and_bad_shapes_are_refused() {
    let path = std::env::temp_dir().join(format!("regflow-records-{}.bin", std::process::id()));
    std::fs::write(&path, records(4)).unwrap();
    let file = RecordFile::open(&path, 12).unwrap();
    assert_eq!(file.len(), 4);
    assert_eq!(run(&file, 4, 1, 1)[0].0.iter().collect::<BTreeSet<_>>().len(), 4);
    let err = RecordFile::open(&path, 10).unwrap_err().to_string();
    assert_eq!(err, format!("dataset: {}: 48 bytes is not a whole number of 10-byte records", path.display()));
    std::fs::remove_file(&path).unwrap();
    assert!(RecordFile::open(&path, 12).unwrap_err().to_string().starts_with("dataset: reading"));
    assert_eq!(
        file.batches(&[4, 4], 2, 0).unwrap_err().to_string(),
        "dataset: fields [4, 4] add up to 8 bytes, but a record has 12"
    );
    assert_eq!(
        file.batches(&[4, 8], 5, 0).unwrap_err().to_string(),
        "dataset: batch 5 must be between 1 and the 4 records"
    );
    // Registers of the wrong size are refused before anything runs.
    let batches = file.batches(&[4, 8], 2, 0).unwrap();
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s = b.stream(cpu, StreamKind::Compute);
    let src = b.actor("data", s, ActorKind::Source { pieces: SourcePieces::Custom { count: 2, kernel: "d".into() } });
    let x = b.regst("x", src, 8, 1);
    let sink = b.actor("sink", s, ActorKind::Sink);
    b.consume(sink, x);
    let err = Job::builder(b.build().unwrap()).dataset("d", batches).build().unwrap_err().to_string();
    assert_eq!(
        err,
        "cannot make the kernel of actor 'data': dataset source 'data' writes batches of [8, 16] bytes per output, but its registers hold [8]"
    );
}

/// A dataset source on a `cuda` device writes each batch into page-locked staging (one set
/// per register slot) that its copy stream copies into the registers, and its sink copies
/// them out the same way: the batches are the CPU's, in the CPU's order. On a GPU, or dry
/// (the copies are then host copies, through the same staging).
#[test]
fn a_cuda_device_gets_the_cpus_batches_through_page_locked_staging() {
    if common::gpu_or_dry_run().is_none() {
        return;
    }
    let file = RecordFile::from_bytes(records(50), 12).unwrap();
    let on_cpu = run(&file, 7, 3, 3);
    assert_eq!(on_cpu.len(), 21);
    assert_eq!(run_on(DeviceKind::Cuda, &file, 7, 3, 3), on_cpu);
}
