//! The row and elementwise kernels run compiled for the widest vectors the processor has
//! (AVX-512 over AVX2, `fast_math::vectorized`); the width changes no bit of their results.
//! One test, because the cap (`force_isa`) is process-wide; it skips (and says so) on a
//! processor without AVX-512.

use regflow_kernels::cpu::isa::{force_isa, isa_in_use, Isa};
use regflow_kernels::{HostCompute, HostContext};
use regflow_plan::ops::{
    BiasGelu, LayerNorm, MaskedSoftmax, MaskedSoftmaxGrad, Softmax, SoftmaxGrad, Unary, UnaryKind,
};
use regflow_plan::{DType, HostArray, SplitMix64, TensorMeta};

fn random(dims: &[usize], seed: u64) -> HostArray {
    let mut rng = SplitMix64::new(seed);
    let len = dims.iter().product();
    HostArray::f32(dims.to_vec(), (0..len).map(|_| (rng.next_f64() * 8.0 - 4.0) as f32).collect()).unwrap()
}

/// The bits of `op`'s first output on `inputs`.
fn bits(op: &dyn HostCompute, inputs: &[&HostArray], out: &[usize]) -> Vec<u32> {
    let mut y = HostArray::zeros(&TensorMeta::new(out.to_vec(), DType::F32));
    let views: Vec<_> = inputs.iter().map(|a| a.view()).collect();
    op.compute(&HostContext { threads: 1 }, &views, &mut [y.view_mut()]).unwrap();
    y.to_f64_vec().iter().map(|&v| (v as f32).to_bits()).collect()
}

#[test]
fn vector_width_changes_no_bit() {
    if isa_in_use() != Ok(Isa::Avx512) {
        eprintln!("skipped: no AVX-512 here, so both runs would take the AVX2 path");
        return;
    }
    let (rows, len) = (37, 203);
    let x = random(&[rows, len], 1);
    let mask = random(&[rows, len], 2);
    let dy = random(&[rows, len], 3);
    let bias = random(&[len], 4);
    let (gamma, beta) = (random(&[len], 5), random(&[len], 6));
    let run = || {
        let y = bits(&MaskedSoftmax { scale: 0.3 }, &[&x, &mask], &[rows, len]);
        let probabilities = HostArray::f32([rows, len], y.iter().map(|&b| f32::from_bits(b)).collect()).unwrap();
        vec![
            y,
            bits(&MaskedSoftmaxGrad { scale: 0.3 }, &[&probabilities, &dy], &[rows, len]),
            bits(&Softmax { axis: -1 }, &[&x], &[rows, len]),
            bits(&Softmax { axis: 0 }, &[&x], &[rows, len]),
            bits(&SoftmaxGrad { axis: -1, log: true }, &[&probabilities, &dy], &[rows, len]),
            bits(&BiasGelu, &[&x, &bias], &[rows, len]),
            bits(&LayerNorm::new(1e-5), &[&x, &gamma, &beta], &[rows, len]),
            bits(&Unary(UnaryKind::Exp), &[&x], &[rows, len]),
            bits(&Unary(UnaryKind::Tanh), &[&x], &[rows, len]),
        ]
    };
    force_isa(None);
    let widest = run();
    force_isa(Some(Isa::Avx2));
    let avx2 = run();
    force_isa(None);
    for (i, (a, b)) in widest.iter().zip(&avx2).enumerate() {
        let differing = a.iter().zip(b).filter(|(x, y)| x != y).count();
        assert_eq!(
            differing,
            0,
            "kernel {i}: {differing} of {} values differ between the widest vectors and AVX2",
            a.len()
        );
    }
}
