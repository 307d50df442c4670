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
        // Sizes of 8 and 16 make parts that start on 64-byte boundaries, read in place.
        proptest::collection::vec(prop_oneof![1usize..7, Just(8), Just(16)], 1..4),
        meshes,
        prop_oneof![Just(DType::F64), Just(DType::F32), Just(DType::I64), Just(DType::F16)],
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
    // Exact in bf16's 8 bits of mantissa and f16's 11 too.
    let values: Vec<f64> = ints.iter().map(|&v| v as f64).collect();
    HostArray::from_f64(case.dims.clone(), case.dtype, &values).unwrap()
}

fn decode(bytes: &[u8], dims: &[usize], dtype: DType) -> HostArray {
    HostArray::from_le_bytes(&regflow::graph::TensorMeta::new(dims, dtype), bytes).unwrap()
}

/// The case's mesh, and its `to_global` compiled with every device's part fetched too.
fn compile(case: &Case) -> (Mesh, regflow::graph::CompiledGraph) {
    let axes: Vec<String> = (0..case.mesh.len()).map(|i| format!("a{i}")).collect();
    let axes: Vec<&str> = axes.iter().map(String::as_str).collect();
    let mesh = Mesh::cpu(&case.mesh, &axes).unwrap();
    let g = Graph::new();
    let x = g.input("x", case.dims.clone(), case.dtype).unwrap();
    g.set_layout(x, &mesh, NdSbp(case.from.clone())).unwrap();
    let y = x.to_global(&mesh, NdSbp(case.to.clone())).unwrap();
    let mut options = ParallelOptions::new(mesh.clone());
    options.fetch_parts = true;
    let compiled = g.compile_parallel(&[y], &[], &options).unwrap();
    (mesh, compiled)
}

fn run(case: &Case) {
    let x_value = value(case);
    let (mesh, compiled) = compile(case);
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

/// Rows of a replicated tensor that start on a 64-byte boundary are read in place (input
/// windows, nested on a 2-D mesh) and copied out only for the part fetchers, which take
/// whole registers: the parts and the whole are still the tensor.
#[test]
fn replicated_rows_are_read_in_place() {
    use Sbp::{Broadcast as B, Split as S};
    for (dims, mesh, from, to, dtype) in [
        (vec![16, 8], vec![2], vec![B], vec![S(0)], DType::F64),
        (vec![16, 16], vec![2, 2], vec![B, B], vec![S(0), S(0)], DType::F32),
        (vec![32, 8], vec![2, 2], vec![S(0), B], vec![S(0), S(0)], DType::F64),
        (vec![1, 16, 8], vec![2], vec![B], vec![S(1)], DType::F64),
    ] {
        let case = Case { dims, mesh, from, to, dtype, seed: 3 };
        run(&case);
        let plan = compile(&case).1.plan;
        let windows: usize = plan.actors.iter().map(|a| a.windows.len()).sum();
        assert!(windows >= 2, "{case:?}: {windows} windows");
        let takes = plan.actors.iter().filter(|a| a.name.starts_with("box") && a.name.contains("B->S(")).count();
        assert_eq!(takes, 0, "{case:?}: every part is read in place");
    }
}

/// `w · w` with its rows split reads the replicated `w` twice: its rows through a window,
/// and whole. A reader lists a register once, so the rows are copied out for it; the
/// product is the one-device product.
#[test]
fn an_op_reading_one_register_whole_and_in_part_gets_the_part_copied() {
    use regflow::graph::{CompileOptions, Init};
    let build = |mesh: Option<&Mesh>| {
        let g = Graph::new();
        let x = g.input("x", [16, 16], DType::F64).unwrap();
        let w = g.variable("w", [16, 16], DType::F64, Init::Normal { mean: 0.0, std: 1.0, seed: 5 }).unwrap();
        let square = w.matmul(&w).unwrap();
        if let Some(mesh) = mesh {
            g.set_layout(x, mesh, NdSbp(vec![Sbp::Broadcast])).unwrap();
            g.set_layout(square, mesh, NdSbp(vec![Sbp::Split(0)])).unwrap();
        }
        let y = square.add(&x).unwrap();
        let compiled = match mesh {
            Some(mesh) => g.compile_parallel(&[y], &[], &ParallelOptions::new(mesh.clone())).unwrap(),
            None => g.compile(&[y], &[], &CompileOptions::default()).unwrap(),
        };
        let x_value = HostArray::f64([16, 16], (0..256).map(|i| i as f64 / 7.0).collect()).unwrap();
        let mut job = Job::builder(compiled.plan.clone()).build().unwrap();
        let mut feeds = job.graph_feeds().unwrap();
        let fetcher = job.fetcher(&compiled.fetches[0]).unwrap();
        feeds.push("x", &x_value).unwrap();
        feeds.close().unwrap();
        let got = fetcher.recv().unwrap().bytes().to_vec();
        drop(fetcher);
        job.wait().unwrap();
        (compiled.plan, got)
    };
    let mesh = Mesh::cpu(&[2], &["dp"]).unwrap();
    let (plan, parallel) = build(Some(&mesh));
    let (_, single) = build(None);
    assert_eq!(parallel, single);
    let reads_twice = plan.actors.iter().filter(|a| a.name.starts_with("matmul")).all(|a| {
        let mut inputs = a.inputs.clone();
        inputs.sort();
        inputs.dedup();
        inputs.len() == a.inputs.len()
    });
    assert!(reads_twice, "no actor lists a register twice");
    let cuts = plan.actors.iter().filter(|a| a.name.starts_with("cut")).count();
    assert_eq!(cuts, 2, "one copy of the rows per device");
}
