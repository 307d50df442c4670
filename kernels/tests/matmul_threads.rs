//! Matrix products split their output tiles over threads; every output element is one
//! thread's sum in a fixed order, so the thread count never changes a result.

use regflow_kernels::{HostCompute, HostContext};
use regflow_plan::ops::MatMul;
use regflow_plan::{DType, HostArray, SplitMix64, TensorMeta};

fn random(shape: [usize; 2], seed: u64, dtype: DType) -> HostArray {
    let mut rng = SplitMix64::new(seed);
    let values: Vec<f64> = (0..shape[0] * shape[1]).map(|_| rng.next_f64() * 2.0 - 1.0).collect();
    match dtype {
        DType::F32 => HostArray::f32(shape, values.iter().map(|&v| v as f32).collect()),
        _ => HostArray::f64(shape, values),
    }
    .unwrap()
}

fn product(threads: usize, dtype: DType) -> Vec<f64> {
    let (a, b) = (random([96, 200], 1, dtype), random([200, 130], 2, dtype));
    let mut out = HostArray::zeros(&TensorMeta::new([96, 130], dtype));
    MatMul::default().compute(&HostContext { threads }, &[a.view(), b.view()], &mut [out.view_mut()]).unwrap();
    out.to_f64_vec()
}

#[test]
fn matmul_results_do_not_depend_on_the_thread_count() {
    for dtype in [DType::F32, DType::F64] {
        let one = product(1, dtype);
        assert_eq!(one, product(2, dtype));
        assert_eq!(one, product(3, dtype));
        assert!(one.iter().any(|&v| v != 0.0));
    }
}
