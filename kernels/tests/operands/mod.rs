//! Matrices the kernels' product tests multiply: values in [-1, 1) drawn from a seed.

use regflow_plan::{DType, HostArray, SplitMix64};

/// A matrix of `shape` in `dtype` (f32, else f64), its values drawn from `seed`.
pub(crate) fn random(shape: [usize; 2], seed: u64, dtype: DType) -> HostArray {
    let mut rng = SplitMix64::new(seed);
    let values: Vec<f64> = (0..shape[0] * shape[1]).map(|_| rng.next_f64() * 2.0 - 1.0).collect();
    match dtype {
        DType::F32 => HostArray::f32(shape, values.iter().map(|&v| v as f32).collect()),
        _ => HostArray::f64(shape, values),
    }
    .unwrap()
}
