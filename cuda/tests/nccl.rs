//! NCCL through the backend: a one-rank communicator on GPU 0 (what a one-GPU machine can
//! run) and one rank per GPU where a machine has several. Skips without a GPU or libnccl.

use regflow_cuda::nccl::{self, Call, Communicator, Element};
use regflow_cuda::{probe, Device};
use regflow_memory::{Arena, MemoryKind};

/// `values` in managed memory of `device`, and a zeroed output beside them.
fn buffers(device: &Device, values: &[f32]) -> (Arena, u64, u64) {
    let bytes = (values.len() * 4) as u64;
    let arena = Arena::new("nccl test", MemoryKind::Host, device.managed("nccl test", 2 * bytes.max(256)).unwrap());
    let input = arena.view(0, bytes).unwrap();
    let output = arena.view(bytes.max(256), bytes).unwrap();
    // SAFETY: host-accessible managed memory nobody else uses.
    unsafe { input.as_mut_slice() }.copy_from_slice(&values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>());
    (arena, input.addr() as u64, output.addr() as u64)
}

fn read(arena: &Arena, at: u64, n: usize) -> Vec<f32> {
    let base = arena.view(0, 1).unwrap().addr() as u64;
    let view = arena.view(at - base, (n * 4) as u64).unwrap();
    // SAFETY: the stream that wrote it has drained.
    unsafe { view.as_slice() }.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn gpus_or_skip() -> Option<usize> {
    match probe().and_then(|d| nccl::available().map(|()| d.len())) {
        Ok(count) => Some(count),
        Err(e) => {
            eprintln!("skipped: {e}");
            None
        }
    }
}

#[test]
fn a_one_rank_all_reduce_returns_its_input() {
    let Some(_) = gpus_or_skip() else { return };
    let device = Device::open(0).unwrap();
    let stream = device.stream().unwrap();
    let comms = Communicator::for_devices(&[0]).unwrap();
    let values: Vec<f32> = (0..1023).map(|i| i as f32 * 0.5 - 7.0).collect();
    let (arena, input, output) = buffers(&device, &values);
    comms[0].queue(&[Call::AllReduce { input, output, count: values.len() }], Element::F32, stream.handle()).unwrap();
    stream.synchronize().unwrap();
    comms[0].async_error().unwrap();
    assert_eq!(read(&arena, output, values.len()), values);
}

#[test]
fn one_rank_per_gpu_sums_every_ranks_input() {
    let Some(count) = gpus_or_skip() else { return };
    if count < 2 {
        eprintln!("skipped: this machine has one GPU");
        return;
    }
    let ordinals: Vec<usize> = (0..count).collect();
    let comms = Communicator::for_devices(&ordinals).unwrap();
    let n = 70_001;
    let mut held = Vec::new();
    for (rank, comm) in comms.iter().enumerate() {
        let device = Device::open(rank).unwrap();
        let stream = device.stream().unwrap();
        let values: Vec<f32> = (0..n).map(|i| (i % 13) as f32 + rank as f32).collect();
        let (arena, input, output) = buffers(&device, &values);
        held.push((device, stream, arena, input, output, comm));
    }
    // One NCCL group call per rank, issued from one thread, as NCCL requires for a
    // single-process communicator set.
    let all: Vec<_> = held.iter().map(|(_, s, _, i, o, c)| (s.handle(), *i, *o, *c)).collect();
    nccl::group(|| {
        for (stream, input, output, comm) in &all {
            comm.queue(&[Call::AllReduce { input: *input, output: *output, count: n }], Element::F32, *stream)?;
        }
        Ok(())
    })
    .unwrap();
    for (device, stream, arena, _, output, _) in &held {
        device.bind().unwrap();
        stream.synchronize().unwrap();
        let ranks = count as f32;
        let want: Vec<f32> = (0..n).map(|i| (i % 13) as f32 * ranks + (0..count).sum::<usize>() as f32).collect();
        assert_eq!(read(arena, *output, n), want);
    }
}
