//! A product whose weight a repeat hands to several micro-batches (`KernelSpec::input_repeats`)
//! packs the weight once for all of them (gemm's panels kept by the kernel): over pieces whose
//! activations differ and a weight that changes only where a new step starts, every output
//! is bitwise the plain kernel's, for both orientations of the weight, sizes off gemm's
//! tiles and blocks, f32 and f64, and one or two threads. That the panels are really
//! reused shows where the contract is broken on purpose: a weight changed within a step's
//! pieces is not seen until the next step.

mod operands;

use operands::random;
use regflow_kernels::cpu::gemm_backend::{force_backend, GemmBackend};
use regflow_kernels::{Kernel, KernelIo, KernelRegistry, KernelSpec, StreamContext};
use regflow_memory::{Arena, MemoryKind};
use regflow_plan::ops::MatMul;
use regflow_plan::{DType, DeviceKind, GroupPosition, HostArray, KernelConf, OpConf, TensorMeta};

/// Bytes rounded up to a 64-byte slot.
fn slot(bytes: usize) -> usize {
    bytes.next_multiple_of(64)
}

/// A `matmul` kernel of `op` over `metas` (`a`, `b`, out) from the CPU registry, with `b`
/// held for `repeats` pieces.
fn kernel(op: &MatMul, metas: &[TensorMeta; 3], repeats: u64) -> Box<dyn Kernel> {
    let mut registry = KernelRegistry::new();
    regflow_kernels::cpu::register(&mut registry, DeviceKind::Cpu);
    let conf = OpConf::new(op, vec![metas[0].clone(), metas[1].clone()], vec![0, 1], vec![metas[2].clone()]);
    let bytes = |m: &TensorMeta| m.bytes() as u64;
    let spec = KernelSpec {
        actor: "matmul:7",
        device: DeviceKind::Cpu,
        device_index: 0,
        op: None,
        input_bytes: &[bytes(&metas[0]), bytes(&metas[1])],
        output_bytes: &[bytes(&metas[2])],
        input_repeats: &[1, repeats],
    };
    registry.make(&KernelConf::Op(conf), &spec).unwrap()
}

/// Runs `kernel` on pieces `0..a.len()`, piece `p` multiplying `a[p]` by `b[p]` (written
/// into `b`'s one slot before the piece when it differs from the last piece's), on
/// `threads`; returns each piece's output bytes.
fn run(kernel: &mut dyn Kernel, a: &[HostArray], b: &[HostArray], out: &TensorMeta, threads: usize) -> Vec<Vec<u8>> {
    let (a_bytes, b_bytes, out_bytes) = (slot(a[0].meta().bytes()), slot(b[0].meta().bytes()), out.bytes());
    let arena = Arena::allocate("test", MemoryKind::Host, (a_bytes + b_bytes + slot(out_bytes)) as u64).unwrap();
    let views = [
        arena.view(0, a[0].meta().bytes() as u64).unwrap(),
        arena.view(a_bytes as u64, b[0].meta().bytes() as u64).unwrap(),
        arena.view((a_bytes + b_bytes) as u64, out_bytes as u64).unwrap(),
    ];
    let context = StreamContext { threads, ..StreamContext::default() };
    let mut outputs = Vec::new();
    for piece in 0..a.len() {
        // SAFETY: the views are disjoint, and nothing else touches the arena.
        unsafe {
            views[0].as_mut_slice().copy_from_slice(&a[piece].to_le_bytes());
            if piece == 0 || b[piece] != b[piece - 1] {
                views[1].as_mut_slice().copy_from_slice(&b[piece].to_le_bytes());
            }
        }
        let mut io =
            KernelIo::new(piece as u64, GroupPosition { index: 0, count: 1 }, &views[..2], &views[2..], &context);
        kernel.run(&mut io).unwrap();
        // SAFETY: the kernel has finished with the output.
        outputs.push(unsafe { views[2].as_slice() }.to_vec());
    }
    outputs
}

/// `[rows, depth] x [depth, width]` (or the weight stored `[width, depth]` and read
/// transposed), over 6 pieces in steps of 3: the held kernel's outputs are the plain
/// kernel's, bit for bit.
#[test]
fn a_weight_packed_once_per_step_gives_the_bits_of_packing_it_every_piece() {
    force_backend(Some(GemmBackend::Gemm)).unwrap();
    // The MLP's micro-batch products, sizes off the tiles, a depth over two of gemm's depth
    // blocks, more rows than one column block of the transposed problem, one column.
    let shapes = [(64, 784, 1024), (64, 1024, 1024), (37, 130, 99), (9, 1100, 70), (800, 96, 200), (5, 40, 1)];
    for dtype in [DType::F32, DType::F64] {
        for (rows, depth, width) in shapes {
            for transpose_b in [false, true] {
                let op = MatMul { transpose_a: false, transpose_b };
                let b_shape = if transpose_b { [width, depth] } else { [depth, width] };
                let metas = [
                    TensorMeta::new([rows, depth], dtype),
                    TensorMeta::new(b_shape, dtype),
                    TensorMeta::new([rows, width], dtype),
                ];
                let a: Vec<HostArray> = (0..6).map(|p| random([rows, depth], 10 + p, dtype)).collect();
                // A new weight at each step's first piece, as an update writes it.
                let b: Vec<HostArray> = (0..6).map(|p| random(b_shape, 100 + p / 3, dtype)).collect();
                let mut plain = kernel(&op, &metas, 1);
                let want = run(&mut *plain, &a, &b, &metas[2], 1);
                assert!(want.iter().all(|o| o.iter().any(|&byte| byte != 0)));
                assert_eq!(plain.held_bytes(), 0, "the plain kernel keeps nothing between firings");
                for threads in [1, 2] {
                    let mut held = kernel(&op, &metas, 3);
                    assert_eq!(held.held_bytes(), 0, "nothing is packed before the first firing");
                    let got = run(&mut *held, &a, &b, &metas[2], threads);
                    let case = format!("{dtype} {rows}x{depth}x{width}, b transposed {transpose_b}, {threads} threads");
                    assert!(got == want, "{case}: the held kernel's outputs differ");
                    // The panels it keeps hold the whole weight (its blocks' shares together),
                    // but for a one-column output, which gets no cache.
                    let weight = (depth * width * dtype.size()) as u64;
                    if width > 1 {
                        assert!(held.held_bytes() >= weight, "{case}: {} bytes held", held.held_bytes());
                    } else {
                        assert_eq!(held.held_bytes(), 0, "{case}");
                    }
                }
            }
        }
    }
}

/// The panels are kept: a weight written within a step's pieces (which no plan does: the
/// repeat holds it) is not seen until the next step, while the plain kernel sees it at once.
#[test]
fn a_held_weight_is_not_read_again_within_its_step() {
    force_backend(Some(GemmBackend::Gemm)).unwrap();
    let (rows, depth, width) = (64, 256, 192);
    let metas = [
        TensorMeta::new([rows, depth], DType::F32),
        TensorMeta::new([depth, width], DType::F32),
        TensorMeta::new([rows, width], DType::F32),
    ];
    let op = MatMul::default();
    let a: Vec<HostArray> = (0..4).map(|_| random([rows, depth], 1, DType::F32)).collect();
    // Pieces 0 and 1 are step 0, pieces 2 and 3 step 1; the weight changes at piece 1.
    let b: Vec<HostArray> = [5, 6, 6, 6].iter().map(|&seed| random([depth, width], seed, DType::F32)).collect();
    let plain = run(&mut *kernel(&op, &metas, 1), &a, &b, &metas[2], 1);
    let held = run(&mut *kernel(&op, &metas, 2), &a, &b, &metas[2], 1);
    assert_ne!(plain[0], plain[1], "the plain kernel sees the new weight at piece 1");
    assert_eq!(held[1], plain[0], "piece 1 is step 0's: the panels packed at piece 0");
    assert_eq!(held[2], plain[2], "piece 2 starts step 1 and packs the weight again");
    assert_eq!(held[3], plain[3]);
}
