//! Kernel variants that must not change a bit: the layer-norm gradient that loads a warp's
//! next row while it computes this one (`rows.cu`, `LN_PIPELINE`), the layer norm that reads
//! a bf16 summand and its bias in runs (`LN_SUMMAND_RUNS`), the gradient norm's
//! loads in flight (`optim.cu`, `NORM_LOADS_AHEAD`) and the bf16 rounding by the
//! conversion instruction (`prelude.cu`, `BF16_CVT`). This process runs them as compiled by
//! default; a child process of this test binary runs the same ops compiled as before them
//! (`REGFLOW_CUDA_DEFINES`, read once per process); the values must be identical. A test
//! binary of its own: the child recompiles every source it uses.

mod common;

use regflow_plan::ops::{Cast, LayerNorm, LayerNormGrad, SumSquaresGroup};
use regflow_plan::{DType, HostArray, Shape, TensorMeta};

/// The variants the child compiles.
const BEFORE: &str = "LN_PIPELINE=0,LN_SUMMAND_RUNS=0,NORM_LOADS_AHEAD=0,BF16_CVT=0";

fn meta(dims: &[usize], dtype: DType) -> TensorMeta {
    TensorMeta::new(Shape::new(dims.to_vec()), dtype)
}

/// f32 values that test a rounding to bf16: NaNs with payloads and signs, infinities,
/// zeros, subnormals, ties to even either way, the largest finite values and those that
/// round to infinity, then random ones.
fn rounding_cases() -> HostArray {
    let bits: [u32; 20] = [
        0x7fc0_0001, // quiet NaN with a payload
        0x7f80_0001, // signalling NaN
        0xffc1_2345, // negative NaN
        0x7f80_0000, // +inf
        0xff80_0000, // -inf
        0x0000_0000,
        0x8000_0000,
        0x0000_0001, // the smallest subnormal
        0x807f_ffff, // the largest negative subnormal
        0x3f80_8000, // 1 + 2^-8: a tie, to the even 1
        0x3f81_8000, // a tie to the even above
        0x3f80_8001, // just past a tie
        0x3f80_7fff, // just below a tie
        0x7f7f_ffff, // the largest finite: rounds to inf
        0x7f7f_7fff, // stays finite
        0xff7f_8000, // a tie at the top: to -inf
        0x0080_0000, // the smallest normal
        0x0000_8000, // a subnormal tie
        0x0001_8000, // a subnormal tie to the even above
        0x4049_0fdb, // pi
    ];
    let mut values: Vec<f64> = bits.iter().map(|&b| f64::from(f32::from_bits(b))).collect();
    let random = common::array(&[4096], DType::F32, 77).to_f64_vec();
    values.extend(random.iter().map(|v| v * 1e3));
    // NaN payloads survive f64 only loosely: the array is made from the bits.
    let mut bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
    for v in &values[bits.len()..] {
        bytes.extend((*v as f32).to_le_bytes());
    }
    HostArray::from_le_bytes(&meta(&[values.len()], DType::F32), &bytes).expect("an f32 array")
}

/// Every output of the ops the variants touch, as bytes.
fn outputs(gpu: (&regflow_cuda::Device, &regflow_cuda::Stream)) -> Vec<Vec<u8>> {
    let mut all = Vec::new();
    // Layer-norm gradients over more rows than the launch has warps (1024), so warps take
    // several rows and the pipeline loads ahead: rows of 768 (pipelined) and 512 (not),
    // with an f32 or a bf16 dy, a base and a bf16 copy, and without.
    for (rows, len) in [(2500, 768), (2100, 512)] {
        let dims = [rows, len];
        let (x, gamma) = (common::array(&dims, DType::F32, 1), common::array(&[len], DType::F32, 2));
        let base = common::array(&dims, DType::F32, 3);
        for dy_dtype in [None, Some(DType::Bf16)] {
            let dy = common::array(&dims, dy_dtype.unwrap_or(DType::F32), 4);
            let plain = LayerNormGrad { dy: dy_dtype, ..LayerNormGrad::new(1e-5) };
            let outputs = [meta(&dims, DType::F32), meta(&[len], DType::F32), meta(&[len], DType::F32)];
            let conf = common::conf(&plain, &[&x, &gamma, &dy], &outputs);
            all.extend(common::run(&conf, &[&x, &gamma, &dy], Some(gpu)).iter().map(HostArray::to_le_bytes));
            let folded = LayerNormGrad { base: true, dx_narrow: Some(DType::Bf16), ..plain };
            let mut with_copy = outputs.to_vec();
            with_copy.push(meta(&dims, DType::Bf16));
            let inputs = [&x, &gamma, &dy, &base];
            let conf = common::conf(&folded, &inputs, &with_copy);
            all.extend(common::run(&conf, &inputs, Some(gpu)).iter().map(HostArray::to_le_bytes));
        }
        // A layer norm with a bf16 output (every element rounded), alone and with a bf16
        // summand, with and without its bias (the summand and bias read in runs).
        let beta = common::array(&[len], DType::F32, 5);
        let norm = LayerNorm { out: Some(DType::Bf16), ..LayerNorm::new(1e-5) };
        let conf = common::conf(&norm, &[&x, &gamma, &beta], &[meta(&dims, DType::Bf16)]);
        all.extend(common::run(&conf, &[&x, &gamma, &beta], Some(gpu)).iter().map(HostArray::to_le_bytes));
        let (summand, bias) = (common::array(&dims, DType::Bf16, 6), common::array(&[len], DType::Bf16, 7));
        let sum_and_y = [meta(&dims, DType::F32), meta(&dims, DType::Bf16)];
        let residual = LayerNorm { residual: Some(DType::Bf16), ..norm };
        let inputs = [&x, &gamma, &beta, &summand];
        let conf = common::conf(&residual, &inputs, &sum_and_y);
        all.extend(common::run(&conf, &inputs, Some(gpu)).iter().map(HostArray::to_le_bytes));
        let biased = LayerNorm { summand_bias: true, ..residual };
        let inputs = [&x, &gamma, &beta, &summand, &bias];
        let conf = common::conf(&biased, &inputs, &sum_and_y);
        all.extend(common::run(&conf, &inputs, Some(gpu)).iter().map(HostArray::to_le_bytes));
    }
    // The gradient norm's chain over tensors of one chunk, several, and a remainder.
    let members: Vec<HostArray> = [70_001, 8193, 3, 1 << 20]
        .iter()
        .enumerate()
        .map(|(i, &n)| common::array(&[n], DType::F32, 10 + i as u64))
        .collect();
    let refs: Vec<&HostArray> = members.iter().collect();
    let conf = common::conf(&SumSquaresGroup { carried: false }, &refs, &[meta(&[1], DType::F32)]);
    all.extend(common::run(&conf, &refs, Some(gpu)).iter().map(HostArray::to_le_bytes));
    // f32 to bf16 over the rounding's hard cases.
    let cases = rounding_cases();
    let conf = common::conf(&Cast { to: DType::Bf16 }, &[&cases], &[meta(&[cases.meta().shape.numel()], DType::Bf16)]);
    all.extend(common::run(&conf, &[&cases], Some(gpu)).iter().map(HostArray::to_le_bytes));
    all
}

#[test]
fn the_variants_give_the_bits_the_kernels_gave_before_them() {
    let Some((device, stream)) = common::gpu_or_skip() else { return };
    let now = outputs((&device, &stream));
    if device.is_dry() {
        eprintln!("dry run: the launches are checked, the child with the kernels as before is not started");
        return;
    }
    let own: Vec<u8> = now.iter().flat_map(|o| (o.len() as u64).to_le_bytes().into_iter().chain(o.clone())).collect();
    let Some(bytes) = common::child_bytes("the_variants_give_the_bits_the_kernels_gave_before_them", BEFORE, &own)
    else {
        return;
    };
    let mut before = Vec::new();
    let mut rest = &bytes[..];
    while rest.len() >= 8 {
        let (len, tail) = rest.split_at(8);
        let len = u64::from_le_bytes(len.try_into().expect("8 bytes")) as usize;
        let (output, tail) = tail.split_at(len);
        before.push(output.to_vec());
        rest = tail;
    }
    assert_eq!(before.len(), now.len(), "as many outputs from the child");
    for (o, (now, before)) in now.iter().zip(&before).enumerate() {
        if let Some(at) = now.iter().zip(before).position(|(a, b)| a != b) {
            panic!("output {o} differs from the kernels before the variants at byte {at} of {}", now.len());
        }
        assert_eq!(now.len(), before.len(), "output {o}'s length");
    }
}
