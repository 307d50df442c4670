//! An op kernel run on registers (`HostOpKernel`) allocates nothing per firing, however
//! many tensors its op has: the views of a firing's registers go into room the kernel
//! keeps, for the op and for its 16-bit scratch. Ops of more than 8 tensors used to build
//! their views in an 8-element small vector that then spilled to the heap every firing.

use regflow_kernels::{HostOpKernel, Kernel, KernelIo, StreamContext};
use regflow_memory::{Arena, MemoryKind};
use regflow_plan::ops::{Binary, BinaryKind, Concat};
use regflow_plan::{DType, GroupPosition, OpConf, TensorMeta};

mod counting;

/// Fires `kernel` on registers of `inputs` then `outputs` metas, in one arena, `firings`
/// times; returns the allocations of the last `firings - 2` (the first two warm up).
fn allocations_of(kernel: &mut dyn Kernel, inputs: &[TensorMeta], outputs: &[TensorMeta], firings: usize) -> u64 {
    let bytes: Vec<u64> = inputs.iter().chain(outputs).map(|m| (m.shape.numel() * m.dtype.size()) as u64).collect();
    let slot = |b: u64| b.div_ceil(64) * 64;
    let arena = Arena::allocate("test", MemoryKind::Host, bytes.iter().map(|&b| slot(b)).sum()).unwrap();
    let mut offset = 0;
    let views: Vec<_> = bytes
        .iter()
        .map(|&b| {
            let view = arena.view(offset, b).unwrap();
            offset += slot(b);
            view
        })
        .collect();
    let context = StreamContext::default();
    let (ins, outs) = views.split_at(inputs.len());
    let mut before = 0;
    for piece in 0..firings {
        if piece == 2 {
            before = counting::allocations();
        }
        let mut io = KernelIo::new(piece as u64, GroupPosition { index: 0, count: 1 }, ins, outs, &context);
        kernel.run(&mut io).unwrap();
    }
    counting::allocations() - before
}

fn op_kernels_with_many_tensors_allocate_nothing_per_firing() {
    // A concat of 12 inputs, in f32 (views only) and in bf16 (views of the f32 scratch too).
    for dtype in [DType::F32, DType::Bf16] {
        let part = TensorMeta::new([3, 5], dtype);
        let inputs = vec![part.clone(); 12];
        let outputs = [TensorMeta::new([36, 5], dtype)];
        let op = Concat { axis: 0 };
        let conf = OpConf::new(&op, inputs.clone(), (0..12).collect(), outputs.to_vec());
        let mut kernel = HostOpKernel::new(op, &conf);
        let allocations = allocations_of(&mut kernel, &inputs, &outputs, 12);
        assert_eq!(allocations, 0, "concat of 12 {dtype} inputs: {allocations} allocations in 10 firings");
    }
    // And an op of two inputs, as before.
    let meta = TensorMeta::new([4, 4], DType::Bf16);
    let op = Binary(BinaryKind::Add);
    let conf = OpConf::new(&op, vec![meta.clone(), meta.clone()], vec![0, 1], vec![meta.clone()]);
    let mut kernel = HostOpKernel::new(op, &conf);
    let allocations = allocations_of(&mut kernel, &[meta.clone(), meta.clone()], &[meta], 12);
    assert_eq!(allocations, 0, "bf16 add: {allocations} allocations in 10 firings");
}

/// The one test, run without libtest's harness (`harness = false` in Cargo.toml), so that
/// no other thread of the process allocates while its allocations are counted.
fn main() {
    op_kernels_with_many_tensors_allocate_nothing_per_firing();
    println!("test op_kernels_with_many_tensors_allocate_nothing_per_firing ... ok");
}
