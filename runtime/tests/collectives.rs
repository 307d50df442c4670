//! In-process collectives as actors on comm streams: exact values of all four operations
//! for f32, f64 and i64 over 2, 3 and 4 devices (uneven parts included) and several pieces;
//! build-time errors; and aborts that wake members waiting for a rank that never comes.

mod common;
use common::within;

use regflow_plan::part_range;
use regflow_plan::DType;
use regflow_plan::{
    ActorKind, CollectiveConf, CollectiveOp, DeviceKind, KernelConf, Plan, PlanBuilder, SourcePieces, StreamKind,
};
use regflow_runtime::{CollectiveMember, Job, RuntimeError};
use std::fmt::Debug;
use std::time::Duration;

/// An element type of the tests: values that make the summation order visible for floats.
trait Elem: Copy + PartialEq + Debug + Send + 'static {
    const DTYPE: DType;
    fn make(seed: u64) -> Self;
    fn add(self, other: Self) -> Self;
    fn to_le(self) -> Vec<u8>;
    fn from_le(bytes: &[u8]) -> Self;
}

/// The byte conversions every element type shares.
macro_rules! le_bytes {
    ($t:ty) => {
        fn to_le(self) -> Vec<u8> {
            self.to_le_bytes().to_vec()
        }
        fn from_le(bytes: &[u8]) -> Self {
            <$t>::from_le_bytes(bytes.try_into().unwrap())
        }
    };
}

impl Elem for f32 {
    const DTYPE: DType = DType::F32;
    fn make(seed: u64) -> Self {
        (seed % 1000) as f32 * 0.1 + 1e-3 / (seed % 7 + 1) as f32
    }
    fn add(self, other: Self) -> Self {
        self + other
    }
    le_bytes!(f32);
}

impl Elem for f64 {
    const DTYPE: DType = DType::F64;
    fn make(seed: u64) -> Self {
        (seed % 1000) as f64 * 0.1 + 1e-9 / (seed % 7 + 1) as f64
    }
    fn add(self, other: Self) -> Self {
        self + other
    }
    le_bytes!(f64);
}

impl Elem for i64 {
    const DTYPE: DType = DType::I64;
    fn make(seed: u64) -> Self {
        (seed as i64 * 7919) % 100_003 - 50_000
    }
    fn add(self, other: Self) -> Self {
        self.wrapping_add(other)
    }
    le_bytes!(i64);
}

/// Part `part` of `parts` along `dim` of a row-major tensor, by walking every index (a naive
/// reference, independent of the runtime's run-based copies).
fn part_of<T: Copy>(whole: &[T], shape: &[usize], dim: usize, parts: usize, part: usize) -> Vec<T> {
    let range = part_range(shape[dim], parts, part);
    let mut out = Vec::new();
    for (flat, &v) in whole.iter().enumerate() {
        let mut rest = flat;
        let mut coord = 0;
        for d in (0..shape.len()).rev() {
            if d == dim {
                coord = rest % shape[d];
            }
            rest /= shape[d];
        }
        if range.contains(&coord) {
            out.push(v);
        }
    }
    out
}

fn to_bytes<T: Elem>(values: &[T]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le()).collect()
}

fn from_bytes<T: Elem>(bytes: &[u8], width: usize) -> Vec<T> {
    bytes.chunks_exact(width).map(T::from_le).collect()
}

/// The inputs of every rank and the outputs they must get, for one piece.
fn reference<T: Elem>(op: CollectiveOp, shape: &[usize], size: usize, piece: u64) -> (Vec<Vec<T>>, Vec<Vec<T>>) {
    let elements: usize = shape.iter().product();
    let tensor = |salt: u64| -> Vec<T> { (0..elements as u64).map(|i| T::make(salt * 1_000_003 + i * 31)).collect() };
    match op {
        CollectiveOp::AllReduce | CollectiveOp::AllReduceBucket { .. } | CollectiveOp::ReduceScatter { .. } => {
            let summands: Vec<Vec<T>> = (0..size as u64).map(|r| tensor(piece * 17 + r + 1)).collect();
            let mut sum = summands[0].clone();
            for summand in &summands[1..] {
                for (s, &x) in sum.iter_mut().zip(summand) {
                    *s = s.add(x);
                }
            }
            let outputs = match op {
                CollectiveOp::ReduceScatter { dim } => (0..size).map(|r| part_of(&sum, shape, dim, size, r)).collect(),
                _ => vec![sum; size],
            };
            (summands, outputs)
        }
        CollectiveOp::AllGather { dim } => {
            let whole = tensor(piece + 1);
            ((0..size).map(|r| part_of(&whole, shape, dim, size, r)).collect(), vec![whole; size])
        }
        CollectiveOp::AllToAll { from, to } => {
            let whole = tensor(piece + 1);
            (
                (0..size).map(|r| part_of(&whole, shape, from, size, r)).collect(),
                (0..size).map(|r| part_of(&whole, shape, to, size, r)).collect(),
            )
        }
        CollectiveOp::ReduceScatterBucket { .. } | CollectiveOp::AllGatherBucket { .. } => {
            unreachable!("buckets of several parts have their own tests (runtime/src/collective/tests.rs)")
        }
    }
}

fn conf(group: &str, rank: usize, size: usize, op: CollectiveOp, dtype: DType, shape: &[usize]) -> CollectiveConf {
    CollectiveConf { group: group.into(), rank: rank as u32, size: size as u32, op, dtype, shape: shape.to_vec() }
}

/// Per rank `r` (device `r`): `in{r}` (fed, compute stream) -> `c{r}` (the collective, comm
/// stream) -> `out{r}` (sink, compute stream). `bytes(r)` gives the input and output sizes.
fn collective_plan(
    kind: DeviceKind,
    size: usize,
    make_conf: impl Fn(usize) -> CollectiveConf,
    bytes: impl Fn(usize) -> (u64, u64),
    sim_nanos: Option<u64>,
) -> Plan {
    let mut b = PlanBuilder::new();
    for r in 0..size {
        let device = b.device(0, kind, r as u16);
        let compute = b.stream(device, StreamKind::Compute);
        let comm = b.stream(device, StreamKind::Comm);
        let (input_bytes, output_bytes) = bytes(r);
        let src = b.actor(&format!("in{r}"), compute, ActorKind::Source { pieces: SourcePieces::Fed });
        let x = b.regst(&format!("x{r}"), src, input_bytes, 2);
        let c = b.actor(&format!("c{r}"), comm, ActorKind::Compute { kernel: KernelConf::Collective(make_conf(r)) });
        if let Some(nanos) = sim_nanos {
            b.sim_nanos(c, nanos);
        }
        b.consume(c, x);
        let y = b.regst(&format!("y{r}"), c, output_bytes, 2);
        let sink = b.actor(&format!("out{r}"), compute, ActorKind::Sink);
        b.consume(sink, y);
    }
    b.build().unwrap()
}

/// Runs `op` over `size` devices for `pieces` pieces and checks every output, bit for bit.
fn check_op<T: Elem>(kind: DeviceKind, op: CollectiveOp, shape: &[usize], size: usize, pieces: u64) {
    let width = T::DTYPE.size();
    let confs: Vec<CollectiveConf> = (0..size).map(|r| conf("g", r, size, op, T::DTYPE, shape)).collect();
    let bytes = |r: usize| {
        let count = |s: Vec<usize>| (s.iter().product::<usize>() * width) as u64;
        (count(confs[r].input_shape()), count(confs[r].output_shape()))
    };
    let sim = (kind == DeviceKind::Sim).then_some(20_000);
    let plan = collective_plan(kind, size, |r| confs[r].clone(), bytes, sim);
    let mut job = Job::builder(plan).watchdog(Duration::from_secs(20)).build().unwrap();
    let feeders: Vec<_> = (0..size).map(|r| job.feeder(&format!("in{r}")).unwrap()).collect();
    let fetchers: Vec<_> = (0..size).map(|r| job.fetcher(&format!("out{r}")).unwrap()).collect();
    let shape_owned = shape.to_vec();
    let pushers: Vec<_> = feeders
        .into_iter()
        .enumerate()
        .map(|(r, mut feeder)| {
            let shape = shape_owned.clone();
            std::thread::spawn(move || {
                for piece in 0..pieces {
                    let (inputs, _) = reference::<T>(op, &shape, size, piece);
                    feeder.push(&to_bytes(&inputs[r])).unwrap();
                }
                feeder.close().unwrap();
            })
        })
        .collect();
    for piece in 0..pieces {
        let (_, expected) = reference::<T>(op, shape, size, piece);
        for (r, fetcher) in fetchers.iter().enumerate() {
            let got = fetcher.recv().unwrap_or_else(|| panic!("rank {r} delivered no piece {piece}"));
            assert_eq!(got.piece(), piece);
            let values: Vec<T> = from_bytes(got.bytes(), width);
            assert_eq!(values, expected[r], "{op:?} {shape:?} over {size}: rank {r}, piece {piece}");
        }
    }
    for fetcher in &fetchers {
        assert!(fetcher.recv().is_none());
    }
    for pusher in pushers {
        pusher.join().unwrap();
    }
    let report = job.wait().unwrap();
    for r in 0..size {
        assert_eq!(report.actor(&format!("c{r}")).unwrap().fires, pieces);
    }
}

/// Every op with its dims on a 3-d shape whose dims (7, 5, 3) split unevenly over 2..=4.
fn ops_3d() -> Vec<CollectiveOp> {
    let mut ops = vec![CollectiveOp::AllReduce];
    for dim in 0..3 {
        ops.push(CollectiveOp::ReduceScatter { dim });
        ops.push(CollectiveOp::AllGather { dim });
    }
    for (from, to) in [(0, 1), (1, 0), (0, 2), (2, 0), (1, 2), (2, 1), (1, 1)] {
        ops.push(CollectiveOp::AllToAll { from, to });
    }
    ops
}

fn check_all_ops<T: Elem>() {
    for size in [2, 3, 4] {
        for op in ops_3d() {
            check_op::<T>(DeviceKind::Cpu, op, &[7, 5, 3], size, 3);
        }
    }
}

#[test]
fn all_ops_give_exact_f32_results_over_2_3_and_4_devices() {
    check_all_ops::<f32>();
}

#[test]
fn all_ops_give_exact_f64_results_over_2_3_and_4_devices() {
    check_all_ops::<f64>();
}

#[test]
fn all_ops_give_exact_i64_results_over_2_3_and_4_devices() {
    check_all_ops::<i64>();
}

#[test]
fn seven_rows_split_over_three_ranks_as_three_two_two() {
    // 1-d: the parts are rows [0, 3), [3, 5), [5, 7).
    for op in [CollectiveOp::ReduceScatter { dim: 0 }, CollectiveOp::AllGather { dim: 0 }] {
        check_op::<f32>(DeviceKind::Cpu, op, &[7], 3, 4);
    }
    let c = conf("g", 0, 3, CollectiveOp::ReduceScatter { dim: 0 }, DType::F32, &[7]);
    assert_eq!(c.output_shape(), [3]);
}

#[test]
fn fewer_rows_than_ranks_leave_empty_parts() {
    // Dim 1 has 2 rows over 4 ranks: ranks 2 and 3 hold empty parts.
    check_op::<f64>(DeviceKind::Cpu, CollectiveOp::AllGather { dim: 1 }, &[3, 2], 4, 2);
    check_op::<f64>(DeviceKind::Cpu, CollectiveOp::AllToAll { from: 1, to: 0 }, &[3, 2], 4, 2);
}

#[test]
fn many_pieces_in_a_row_reuse_the_rendezvous() {
    check_op::<i64>(DeviceKind::Cpu, CollectiveOp::AllReduce, &[16], 2, 200);
    check_op::<f32>(DeviceKind::Cpu, CollectiveOp::AllToAll { from: 0, to: 1 }, &[4, 6], 3, 50);
}

#[test]
fn collectives_run_on_sim_devices() {
    check_op::<f32>(DeviceKind::Sim, CollectiveOp::AllReduce, &[5, 3], 2, 5);
    check_op::<f64>(DeviceKind::Sim, CollectiveOp::ReduceScatter { dim: 0 }, &[5, 3], 3, 5);
}

#[test]
fn members_agree_bitwise_on_float_sums() {
    // The reference sums in rank order; every rank's result must equal it bit for bit.
    check_op::<f32>(DeviceKind::Cpu, CollectiveOp::AllReduce, &[1000], 4, 3);
}

#[test]
fn collectives_chained_by_zero_byte_order_tokens_run_every_piece() {
    // As the parallel compiler lowers them: per device, all_reduce then reduce_scatter on
    // one comm stream, chained by a zero-byte token, closed by a preloaded step token.
    let (size, shape) = (3, [7usize, 2]);
    let whole_bytes = (shape.iter().product::<usize>() * 8) as u64;
    let mut b = PlanBuilder::new();
    for r in 0..size {
        let device = b.device(0, DeviceKind::Cpu, r as u16);
        let compute = b.stream(device, StreamKind::Compute);
        let comm = b.stream(device, StreamKind::Comm);
        let src = b.actor(&format!("in{r}"), compute, ActorKind::Source { pieces: SourcePieces::Fed });
        let x = b.regst(&format!("x{r}"), src, whole_bytes, 2);
        let reduce = conf("sum", r, size, CollectiveOp::AllReduce, DType::F64, &shape);
        let sum = b.actor(&format!("sum{r}"), comm, ActorKind::Compute { kernel: KernelConf::Collective(reduce) });
        b.consume(sum, x);
        let y = b.regst(&format!("y{r}"), sum, whole_bytes, 2);
        let scatter_conf = conf("part", r, size, CollectiveOp::ReduceScatter { dim: 0 }, DType::F64, &shape);
        let part_bytes = (scatter_conf.output_shape().iter().product::<usize>() * 8) as u64;
        let kernel = KernelConf::Collective(scatter_conf);
        let scatter = b.actor(&format!("part{r}"), comm, ActorKind::Compute { kernel });
        b.consume(scatter, y);
        let z = b.regst(&format!("z{r}"), scatter, part_bytes, 2);
        let order = b.regst(&format!("order{r}"), sum, 0, 1);
        b.consume(scatter, order);
        let step = b.regst(&format!("step{r}"), scatter, 0, 1);
        b.preload(step, 1);
        b.consume(sum, step);
        let sink = b.actor(&format!("out{r}"), compute, ActorKind::Sink);
        b.consume(sink, z);
    }
    let mut job = Job::builder(b.build().unwrap()).watchdog(Duration::from_secs(20)).build().unwrap();
    let mut feeders: Vec<_> = (0..size).map(|r| job.feeder(&format!("in{r}")).unwrap()).collect();
    let fetchers: Vec<_> = (0..size).map(|r| job.fetcher(&format!("out{r}")).unwrap()).collect();
    let pieces = 6u64;
    let pusher = std::thread::spawn(move || {
        for piece in 0..pieces {
            let (inputs, _) = reference::<f64>(CollectiveOp::AllReduce, &shape, size, piece);
            for (r, feeder) in feeders.iter_mut().enumerate() {
                feeder.push(&to_bytes(&inputs[r])).unwrap();
            }
        }
    });
    for piece in 0..pieces {
        let (_, sums) = reference::<f64>(CollectiveOp::AllReduce, &shape, size, piece);
        // Second collective: every member's summand is the sum, so it sums `size` copies.
        let mut twice = sums[0].clone();
        for _ in 1..size {
            for (t, &s) in twice.iter_mut().zip(&sums[0]) {
                *t += s;
            }
        }
        for (r, fetcher) in fetchers.iter().enumerate() {
            let got = fetcher.recv().unwrap();
            assert_eq!(got.piece(), piece);
            assert_eq!(from_bytes::<f64>(got.bytes(), 8), part_of(&twice, &shape, 0, size, r), "rank {r}");
        }
    }
    pusher.join().unwrap();
    let report = job.wait().unwrap();
    assert_eq!(report.actor("part2").unwrap().fires, pieces);
}

/// The error of building a job for `plan`, as text.
fn build_error(plan: Plan) -> String {
    match Job::builder(plan).build() {
        Ok(_) => panic!("the plan was accepted"),
        Err(e) => e.to_string(),
    }
}

/// The error of building `plan` itself (plan validation checks the groups).
fn plan_error(size: usize, make_conf: impl Fn(usize) -> CollectiveConf, bytes: (u64, u64)) -> String {
    let mut b = PlanBuilder::new();
    add_members(&mut b, size, size, make_conf, |_| bytes);
    b.build().unwrap_err().to_string()
}

/// Per rank `r` (node 0 for the first `ranks_on_node_0`, node 1 after): a counting source on the compute stream, the collective
/// on the comm stream, a sink.
fn add_members(
    b: &mut PlanBuilder,
    ranks_on_node_0: usize,
    size: usize,
    make_conf: impl Fn(usize) -> CollectiveConf,
    bytes: impl Fn(usize) -> (u64, u64),
) {
    for r in 0..size {
        let node = if r < ranks_on_node_0 { 0 } else { 1 };
        let device = b.device(node, DeviceKind::Cpu, r as u16);
        let compute = b.stream(device, StreamKind::Compute);
        let comm = b.stream(device, StreamKind::Comm);
        let (input_bytes, output_bytes) = bytes(r);
        let src = b.actor(&format!("in{r}"), compute, ActorKind::Source { pieces: SourcePieces::Count(1) });
        let x = b.regst(&format!("x{r}"), src, input_bytes, 1);
        let c = b.actor(&format!("c{r}"), comm, ActorKind::Compute { kernel: KernelConf::Collective(make_conf(r)) });
        b.consume(c, x);
        let y = b.regst(&format!("y{r}"), c, output_bytes, 1);
        let sink = b.actor(&format!("out{r}"), compute, ActorKind::Sink);
        b.consume(sink, y);
    }
}

fn members_plan(size: usize, make_conf: impl Fn(usize) -> CollectiveConf, bytes: (u64, u64)) -> Plan {
    let mut b = PlanBuilder::new();
    add_members(&mut b, size, size, make_conf, |_| bytes);
    b.build().unwrap()
}

#[test]
fn register_sizes_that_do_not_match_the_shape_are_refused_at_build() {
    let op = CollectiveOp::AllReduce;
    let err = build_error(members_plan(2, |r| conf("grads", r, 2, op, DType::F32, &[7, 5]), (140, 136)));
    assert_eq!(
        err,
        "cannot make the kernel of actor 'c0': collective 'grads' (all_reduce, rank 0 of 2): the output register \
         has 136 bytes, but output shape [7, 5] of f32 needs 140"
    );
    let op = CollectiveOp::ReduceScatter { dim: 0 };
    let err = build_error(members_plan(3, |r| conf("rs", r, 3, op, DType::F64, &[7]), (56, 24)));
    // Rank 0 holds 3 of the 7 rows (24 bytes of f64), rank 1 only 2: its output is refused.
    assert_eq!(
        err,
        "cannot make the kernel of actor 'c1': collective 'rs' (reduce_scatter, rank 1 of 3): the output register \
         has 24 bytes, but output shape [2] of f64 needs 16"
    );
    let op = CollectiveOp::AllGather { dim: 1 };
    let err = build_error(members_plan(2, |r| conf("g", r, 2, op, DType::F32, &[2]), (4, 8)));
    assert_eq!(
        err,
        "cannot make the kernel of actor 'c0': collective 'g' (all_gather, rank 0 of 2): dimension 1 is out of \
         range for shape [2]"
    );
}

#[test]
fn members_that_disagree_or_miss_ranks_are_refused_when_the_plan_is_built() {
    // Plan validation checks the groups, so the runtime never sees such a plan; the
    // runtime checks the same again when it joins members (see the unit tests).
    let op = CollectiveOp::AllReduce;
    let shape = |r: usize| if r == 1 { vec![4, 2] } else { vec![8] };
    let err = plan_error(2, |r| conf("g", r, 2, op, DType::F32, &shape(r)), (32, 32));
    assert!(err.starts_with("collective 'g': member 'c1'") && err.contains("disagrees with 'c0'"), "{err}");
    let err = plan_error(2, |r| conf("g", r + 1, 2, op, DType::F32, &[2]), (8, 8));
    assert!(err.contains("member 'c1' has rank 2 of 2"), "{err}");
    let err = plan_error(2, |r| conf("g", r, 3, op, DType::F32, &[2]), (8, 8));
    assert!(err.contains("rank 2 of 3 has no member"), "{err}");
}

#[test]
fn a_job_of_one_node_refuses_a_group_that_spans_nodes() {
    let op = CollectiveOp::AllReduce;
    let mut b = PlanBuilder::new();
    // Ranks 0 and 1 on node 0, rank 2 on node 1.
    add_members(&mut b, 2, 3, |r| conf("g", r, 3, op, DType::I64, &[3]), |_| (24, 24));
    let err = match Job::builder(b.build().unwrap()).node(0).build() {
        Ok(_) => panic!("the job was built"),
        Err(e) => e.to_string(),
    };
    assert_eq!(
        err,
        "cannot make the kernel of actor 'c0': collective 'g': size 3 but ranks [2] have no actor in this job \
         (members: [\"c0\", \"c1\"]); a job that runs one node of several needs a cluster for collectives across \
         nodes"
    );
}

#[test]
fn members_block_comm_streams_or_cpu_compute_streams_only() {
    let op = CollectiveOp::AllReduce;
    let plan = |kind: StreamKind| {
        let mut b = PlanBuilder::new();
        for r in 0..2 {
            let device = b.device(0, DeviceKind::Cpu, r as u16);
            let compute = b.stream(device, StreamKind::Compute);
            let blocking = if kind == StreamKind::Compute { compute } else { b.stream(device, kind) };
            let src = b.actor(&format!("in{r}"), compute, ActorKind::Source { pieces: SourcePieces::Count(1) });
            let x = b.regst(&format!("x{r}"), src, 8, 1);
            let kernel = KernelConf::Collective(conf("g", r, 2, op, DType::F32, &[2]));
            let c = b.actor(&format!("c{r}"), blocking, ActorKind::Compute { kernel });
            b.consume(c, x);
            let y = b.regst(&format!("y{r}"), c, 8, 1);
            let sink = b.actor(&format!("out{r}"), compute, ActorKind::Sink);
            b.consume(sink, y);
        }
        b.build()
    };
    // A cpu compute stream may block in a collective (`ParallelOptions::collective_streams`):
    // the two devices exchange nothing else, so the job runs its piece and ends.
    let mut job = Job::builder(plan(StreamKind::Compute).unwrap()).build().unwrap();
    let fetchers: Vec<_> = (0..2).map(|r| job.fetcher(&format!("out{r}")).unwrap()).collect();
    for fetcher in &fetchers {
        assert_eq!(fetcher.recv().unwrap().bytes().len(), 8);
    }
    drop(fetchers);
    job.wait().unwrap();
    // A copy stream may not.
    let err = plan(StreamKind::Copy).unwrap_err().to_string();
    assert_eq!(
        err,
        "collective 'g': member 'c0' runs on a Copy stream of node0/cpu:0: a collective blocks its stream, which only \
         a cpu device's compute stream may do besides comm streams"
    );
}

#[test]
fn a_member_that_never_arrives_fails_the_others_with_the_missing_ranks() {
    let conf = conf("g", 0, 4, CollectiveOp::AllReduce, DType::F32, &[2]);
    let mut members = CollectiveMember::group(&conf).unwrap();
    let mut absent = members.remove(1);
    let waiting: Vec<_> = members
        .into_iter()
        .map(|mut member| {
            std::thread::spawn(move || {
                let input = [0u8; 8];
                let mut output = [0u8; 8];
                member.run(&input, &mut output).map_err(|e| e.to_string())
            })
        })
        .collect();
    // Whether a member is already waiting or arrives after the abort, it fails; the
    // waiting ones list the ranks that were missing when they were woken.
    std::thread::sleep(Duration::from_millis(50));
    absent.abort();
    for (thread, rank) in waiting.into_iter().zip([0, 2, 3]) {
        let err = within(Duration::from_secs(20), move || thread.join().unwrap()).unwrap_err();
        assert!(
            err.starts_with("collective 'g': aborted while waiting for ranks [")
                || err == format!("collective 'g': aborted before rank {rank} arrived"),
            "{err}"
        );
        assert!(!err.contains("aborted while waiting") || err.contains('1'), "rank 1 must be listed missing: {err}");
    }
    let mut output = [0u8; 8];
    let err = absent.run(&[0u8; 8], &mut output).unwrap_err();
    assert_eq!(err.to_string(), "collective 'g': aborted before rank 1 arrived");
}

#[test]
fn members_reject_buffers_of_the_wrong_size() {
    let conf = conf("g", 0, 2, CollectiveOp::AllGather { dim: 0 }, DType::I64, &[3]);
    let mut members = CollectiveMember::group(&conf).unwrap();
    assert_eq!((members[0].input_bytes(), members[0].output_bytes()), (16, 24));
    assert_eq!((members[1].input_bytes(), members[1].output_bytes()), (8, 24));
    let err = members[1].run(&[0u8; 16], &mut [0u8; 24]).unwrap_err();
    assert_eq!(err.to_string(), "collective 'g': rank 1 got 16 input and 24 output bytes; it needs 8 and 24");
}

/// Three ranks, rank 1's input never fed: ranks 0 and 2 block in the rendezvous on their
/// streams of `kind` (comm, or compute: `CollectiveStreams::ComputeStreams`, which `Auto`
/// picks on small hosts). Each such stream's sink callback holds a clone of the returned
/// witness, so its count says whether a stream thread was left behind, blocked.
fn job_with_a_missing_rank(
    watchdog: Option<Duration>,
    kind: StreamKind,
) -> (Job, Vec<regflow_runtime::Feeder>, std::sync::Arc<()>) {
    let size = 3;
    let op = CollectiveOp::AllReduce;
    let mut b = PlanBuilder::new();
    for r in 0..size {
        let device = b.device(0, DeviceKind::Cpu, r as u16);
        let compute = b.stream(device, StreamKind::Compute);
        let comm = if kind == StreamKind::Compute { compute } else { b.stream(device, kind) };
        let src = b.actor(&format!("in{r}"), compute, ActorKind::Source { pieces: SourcePieces::Fed });
        let x = b.regst(&format!("x{r}"), src, 16, 1);
        let kernel = KernelConf::Collective(conf("stuck", r, size, op, DType::F32, &[4]));
        let c = b.actor(&format!("c{r}"), comm, ActorKind::Compute { kernel });
        b.consume(c, x);
        let y = b.regst(&format!("y{r}"), c, 16, 1);
        let sink = b.actor(&format!("out{r}"), comm, ActorKind::Sink);
        b.consume(sink, y);
    }
    let witness = std::sync::Arc::new(());
    let mut builder = Job::builder(b.build().unwrap());
    builder = match watchdog {
        Some(timeout) => builder.watchdog(timeout),
        None => builder.without_watchdog(),
    };
    for r in 0..size {
        let held = witness.clone();
        builder = builder.on_sink(&format!("out{r}"), move |_| {
            let _ = &held;
        });
    }
    let mut job = builder.build().unwrap();
    let mut feeders: Vec<_> = (0..size).map(|r| job.feeder(&format!("in{r}")).unwrap()).collect();
    for r in [0, 2] {
        feeders[r].push(&[0u8; 16]).unwrap();
    }
    (job, feeders, witness)
}

#[test]
fn aborting_the_job_wakes_members_waiting_for_a_rank_that_never_comes() {
    for kind in [StreamKind::Comm, StreamKind::Compute] {
        let (job, feeders, witness) = job_with_a_missing_rank(None, kind);
        let err = within(Duration::from_secs(30), move || {
            // Give ranks 0 and 2 time to enter the rendezvous (not asserted: the abort must
            // work whether they are waiting or not).
            std::thread::sleep(Duration::from_millis(100));
            job.abort(RuntimeError::Data { message: "user abort".into() });
            let result = job.wait();
            drop(feeders);
            result.unwrap_err()
        });
        assert_eq!(err.to_string(), "dataset: user abort", "{kind:?} streams");
        // Every stream thread ended (none was left blocked in the rendezvous), so every
        // kernel, and the witness clones the sink callbacks held, were dropped.
        assert_eq!(std::sync::Arc::strong_count(&witness), 1, "{kind:?} streams");
    }
}

#[test]
fn the_watchdog_names_members_blocked_on_a_missing_rank_and_frees_them() {
    for kind in [StreamKind::Comm, StreamKind::Compute] {
        let (job, feeders, witness) = job_with_a_missing_rank(Some(Duration::from_millis(200)), kind);
        let err = within(Duration::from_secs(30), move || {
            let result = job.wait();
            drop(feeders);
            result.unwrap_err()
        });
        let RuntimeError::Stalled { graph, .. } = &err else { panic!("expected a stall, got {err}") };
        for r in [0, 2] {
            let busy = format!("busy in the kernel of 'c{r}'");
            assert!(graph.silent_streams.iter().any(|s| s.contains(&busy)), "{kind:?} streams: {graph}");
        }
        assert_eq!(std::sync::Arc::strong_count(&witness), 1, "{kind:?} streams");
    }
}
