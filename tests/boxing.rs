//! Boxing equals the logical tensor: for a random tensor, a random mesh (1-D and 2-D, up to
//! 4 devices) and random source and target n-d layouts, the plan's per-device results,
//! gathered by the target layout, are the tensor itself; so is the whole fetch.

use proptest::prelude::*;
use regflow::graph::sbp::{gather, Mesh, NdSbp, Sbp};
use regflow::graph::{DType, Graph, HostArray, ParallelOptions};
use regflow::prelude::*;

fn cases() -> u32 {
    std::env::var("REGFLOW_PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(48)
}

fn sbp(rank: usize) -> impl Strategy<Value = Sbp> {
    prop_oneof![Just(Sbp::Broadcast), Just(Sbp::Partial), (0..rank).prop_map(Sbp::Split)]
}

#[derive(Debug, Clone)]
struct Case {
    dims: Vec<usize>,
    mesh: Vec<usize>,
    from: Vec<Sbp>,
    to: Vec<Sbp>,
    dtype: DType,
    seed: u64,
}

fn case() -> impl Strategy<Value = Case> {
    let meshes = prop_oneof![
        Just(vec![1]),
        Just(vec![2]),
        Just(vec![3]),
        Just(vec![4]),
        Just(vec![2, 2]),
        Just(vec![1, 2]),
        Just(vec![2, 1]),
        Just(vec![1, 3]),
    ];
    (
        proptest::collection::vec(1usize..7, 1..4),
        meshes,
        prop_oneof![Just(DType::F64), Just(DType::F32), Just(DType::I64)],
        any::<u64>(),
    )
        .prop_flat_map(|(dims, mesh, dtype, seed)| {
            let n = mesh.len();
            let rank = dims.len();
            (
                Just(dims),
                Just(mesh),
                proptest::collection::vec(sbp(rank), n),
                proptest::collection::vec(sbp(rank), n),
                Just(dtype),
                Just(seed),
            )
        })
        .prop_map(|(dims, mesh, from, to, dtype, seed)| Case { dims, mesh, from, to, dtype, seed })
}

fn value(case: &Case) -> HostArray {
    let n: usize = case.dims.iter().product();
    let mut state = case.seed;
    // Small integers: every sum is exact in every dtype.
    let ints: Vec<i64> = (0..n)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 33) % 19) as i64 - 9
        })
        .collect();
    let shape = case.dims.clone();
    match case.dtype {
        DType::F64 => HostArray::f64(shape, ints.iter().map(|&v| v as f64).collect()),
        DType::F32 => HostArray::f32(shape, ints.iter().map(|&v| v as f32).collect()),
        DType::I64 => HostArray::i64(shape, ints),
        // Small integers are exact in bf16 too (8 bits of mantissa).
        DType::Bf16 => HostArray::bf16(shape, ints.iter().map(|&v| regflow::plan::bf16::from_f64(v as f64)).collect()),
    }
    .unwrap()
}

fn decode(bytes: &[u8], dims: &[usize], dtype: DType) -> HostArray {
    match dtype {
        DType::F64 => {
            HostArray::f64(dims, bytes.chunks(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect())
        }
        DType::F32 => {
            HostArray::f32(dims, bytes.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect())
        }
        DType::I64 => {
            HostArray::i64(dims, bytes.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect())
        }
        DType::Bf16 => HostArray::from_le_bytes(&regflow::graph::TensorMeta::new(dims, DType::Bf16), bytes),
    }
    .unwrap()
}

fn run(case: &Case) {
    let axes: Vec<String> = (0..case.mesh.len()).map(|i| format!("a{i}")).collect();
    let axes: Vec<&str> = axes.iter().map(String::as_str).collect();
    let mesh = Mesh::cpu(&case.mesh, &axes).unwrap();
    let x_value = value(case);
    let g = Graph::new();
    let x = g.input("x", case.dims.clone(), case.dtype).unwrap();
    g.set_layout(x, &mesh, NdSbp(case.from.clone())).unwrap();
    let y = x.to_global(&mesh, NdSbp(case.to.clone())).unwrap();
    let mut options = ParallelOptions::new(mesh.clone());
    options.fetch_parts = true;
    let compiled = g.compile_parallel(&[y], &[], &options).unwrap();
    let info = compiled.parallel.clone().unwrap();
    let mut job = Job::builder(compiled.plan.clone()).build().unwrap();
    let mut feeds = job.graph_feeds().unwrap();
    let whole = job.fetcher(&compiled.fetches[0]).unwrap();
    let parts: Vec<_> = info.fetch_parts[0].iter().map(|name| job.fetcher(name).unwrap()).collect();
    feeds.push("x", &x_value).unwrap();
    feeds.close().unwrap();
    let target = NdSbp(case.to.clone());
    let locals: Vec<HostArray> = parts
        .iter()
        .enumerate()
        .map(|(rank, f)| {
            let local = regflow::graph::sbp::local_meta(&x_value.meta(), &target, &mesh, &mesh.coords(rank));
            decode(f.recv().unwrap().bytes(), local.shape.dims(), case.dtype)
        })
        .collect();
    let got_whole = decode(whole.recv().unwrap().bytes(), &case.dims, case.dtype);
    drop((whole, parts));
    job.wait().unwrap();
    assert_eq!(gather(&locals, &x_value.shape, &target, &mesh).unwrap(), x_value, "{case:?}");
    assert_eq!(got_whole, x_value, "{case:?}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn boxing_gives_back_the_logical_tensor(case in case()) {
        run(&case);
    }
}

#[test]
fn nested_splits_of_one_dimension_regroup() {
    use Sbp::{Broadcast as B, Partial as P, Split as S};
    for (from, to) in [
        (vec![S(0), S(0)], vec![S(0), B]),
        (vec![B, S(0)], vec![S(0), S(0)]),
        (vec![S(0), S(1)], vec![S(1), S(0)]),
        (vec![P, S(0)], vec![S(0), P]),
        (vec![S(1), P], vec![P, S(1)]),
    ] {
        run(&Case { dims: vec![5, 3], mesh: vec![2, 2], from, to, dtype: DType::F64, seed: 7 });
    }
}
