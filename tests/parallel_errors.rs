//! Layout mistakes are reported when the graph is built or compiled, in logical terms: the
//! op, the shapes, the mesh axis names and the layouts; and a plan whose devices could issue
//! collectives in different orders is rejected before it runs.

use regflow::graph::plan::{ActorKind, CollectiveConf, CollectiveOp, DeviceKind, KernelConf, PlanBuilder, StreamKind};
use regflow::graph::sbp::{Mesh, NdSbp, Sbp};
use regflow::graph::{DType, Graph, ParallelOptions};

use Sbp::{Partial as P, Split as S};

fn mesh2() -> Mesh {
    Mesh::cpu(&[2], &["dp"]).unwrap()
}

#[test]
fn split_axis_out_of_range_names_the_tensor_the_axis_and_the_shape() {
    let g = Graph::new();
    let x = g.input("x", [4, 3], DType::F32).unwrap();
    let err = g.set_layout(x, &mesh2(), NdSbp(vec![S(2)])).unwrap_err().to_string();
    assert!(err.contains("'x': f32[4, 3]"), "{err}");
    assert!(err.contains("split axis 2 on mesh axis 'dp' is out of range for shape [4, 3]"), "{err}");
    let mesh = Mesh::cpu(&[2, 2], &["dp", "tp"]).unwrap();
    let err = g.set_layout(x, &mesh, NdSbp(vec![S(0)])).unwrap_err().to_string();
    assert!(err.contains("has 1 entries but mesh cpu:0..4 [dp=2, tp=2] has 2 axes (dp, tp)"), "{err}");
}

#[test]
fn a_binary_op_across_placements_is_rejected_when_built() {
    let g = Graph::new();
    let a = g.input("a", [4], DType::F32).unwrap();
    let b = g.input("b", [4], DType::F32).unwrap();
    let left = Mesh::cpu(&[2], &["dp"]).unwrap();
    let right = Mesh::new(
        (2..4).map(|i| regflow::graph::sbp::MeshDevice { node: 0, kind: DeviceKind::Cpu, index: i }).collect(),
        &[2],
        &["dp"],
    )
    .unwrap();
    g.set_layout(a, &left, NdSbp(vec![S(0)])).unwrap();
    g.set_layout(b, &right, NdSbp(vec![S(0)])).unwrap();
    let err = a.add(&b).unwrap_err().to_string();
    assert_eq!(
        err,
        "add(f32[4], f32[4]): inputs are on different placements: input 0 on cpu:0..2 [dp=2], \
         input 1 on cpu:2..4 [dp=2]; move one with to_global"
    );
}

#[test]
fn a_partial_tensor_into_a_nonlinear_op_needs_boxing() {
    let g = Graph::new();
    let x = g.input("x", [4, 6], DType::F32).unwrap();
    let w = g.variable("w", [6, 3], DType::F32, regflow::graph::Init::Ones).unwrap();
    let mesh = mesh2();
    // Split the contracted dimension: the product comes out Partial.
    g.set_layout(x, &mesh, NdSbp(vec![S(1)])).unwrap();
    g.set_layout(w, &mesh, NdSbp(vec![S(0)])).unwrap();
    let partial = x.matmul(&w).unwrap();
    g.set_layout(partial, &mesh, NdSbp(vec![P])).unwrap();
    let y = partial.relu().unwrap();
    g.set_layout(y, &mesh, NdSbp(vec![P])).unwrap();
    let err = g.compile_parallel(&[y], &[], &ParallelOptions::new(mesh.clone())).unwrap_err().to_string();
    assert!(
        err.starts_with("relu (node 1)(f32[4, 3] (dp: P)): no SBP signature gives the pinned layout (output 0: dp: P)"),
        "{err}"
    );
    assert!(err.contains("Partial(sum) only comes out of an op that is linear in its Partial inputs"), "{err}");
    // The same graph with the Partial boxed first compiles: relu reads it Broadcast.
    let g = Graph::new();
    let x = g.input("x", [4, 6], DType::F32).unwrap();
    let w = g.variable("w", [6, 3], DType::F32, regflow::graph::Init::Ones).unwrap();
    g.set_layout(x, &mesh, NdSbp(vec![S(1)])).unwrap();
    g.set_layout(w, &mesh, NdSbp(vec![S(0)])).unwrap();
    let y = x.matmul(&w).unwrap().relu().unwrap();
    let compiled = g.compile_parallel(&[y], &[], &ParallelOptions::new(mesh)).unwrap();
    let layouts = &compiled.parallel.as_ref().unwrap().layouts;
    assert!(layouts.iter().any(|(name, l)| name.starts_with("matmul") && l.0 == vec![P]), "{layouts:?}");
}

#[test]
fn an_uneven_split_an_op_cannot_take_is_rejected() {
    // Flattening [6, 4] split 4 ways by rows gives parts of 8, 8, 4, 4 elements; a flat
    // [24] split 4 ways needs 6 each: reshape cannot produce the pinned layout.
    let g = Graph::new();
    let x = g.input("x", [6, 4], DType::F32).unwrap();
    let mesh = Mesh::cpu(&[4], &["dp"]).unwrap();
    g.set_layout(x, &mesh, NdSbp(vec![S(0)])).unwrap();
    let flat = x.reshape(&[24]).unwrap();
    g.set_layout(flat, &mesh, NdSbp(vec![S(0)])).unwrap();
    let err = g.compile_parallel(&[flat], &[], &ParallelOptions::new(mesh)).unwrap_err().to_string();
    assert!(
        err.starts_with(
            "reshape (node 0)(f32[6, 4] (dp: S(0))): no SBP signature gives the pinned layout (output 0: dp: S(0))"
        ),
        "{err}"
    );
}

#[test]
fn a_variable_cannot_be_partial() {
    let g = Graph::new();
    let x = g.input("x", [4], DType::F32).unwrap();
    let w = g.variable("w", [4], DType::F32, regflow::graph::Init::Ones).unwrap();
    g.set_layout(w, &mesh2(), NdSbp(vec![P])).unwrap();
    let y = x.mul(&w).unwrap();
    let err = g.compile_parallel(&[y], &[], &ParallelOptions::new(mesh2())).unwrap_err().to_string();
    assert!(err.contains("'w': f32[4]") && err.contains("a variable cannot be Partial (dp: P)"), "{err}");
}

/// Two collectives on two devices, chained A then B on device 0 and B then A on device 1.
#[test]
fn the_collective_order_check_rejects_crossed_orders() {
    let conf = |group: &str, rank: u32| CollectiveConf {
        group: group.into(),
        rank,
        size: 2,
        op: CollectiveOp::AllReduce,
        dtype: DType::F32,
        shape: vec![4],
    };
    let build = |crossed: bool, chained: bool| {
        let mut b = PlanBuilder::new();
        for rank in 0..2u32 {
            let device = b.device(0, DeviceKind::Cpu, rank as u16);
            let compute = b.stream(device, StreamKind::Compute);
            let comm = b.stream(device, StreamKind::Comm);
            let source = b.actor(
                &format!("src@{rank}"),
                compute,
                ActorKind::Source { pieces: regflow::graph::plan::SourcePieces::Count(1) },
            );
            let x = b.regst(&format!("x@{rank}"), source, 16, 1);
            let kernel = |g: &str| ActorKind::Compute { kernel: KernelConf::Collective(conf(g, rank)) };
            let a = b.actor(&format!("A@{rank}"), comm, kernel("A"));
            let bb = b.actor(&format!("B@{rank}"), comm, kernel("B"));
            b.consume(a, x).consume(bb, x);
            let (first, second) = if crossed && rank == 1 { (bb, a) } else { (a, bb) };
            if chained {
                let order = b.regst(&format!("order@{rank}"), first, 0, 1);
                b.consume(second, order);
            }
            for (actor, name) in [(a, "a"), (bb, "b")] {
                let out = b.regst(&format!("{name}.out@{rank}"), actor, 16, 1);
                let sink = b.actor(&format!("sink:{name}@{rank}"), compute, ActorKind::Sink);
                b.consume(sink, out);
            }
        }
        b.build()
    };
    build(false, true).unwrap();
    let err = build(true, true).unwrap_err().to_string();
    assert_eq!(
        err,
        "collective order: device node0/cpu:0 (comm stream) issues 'A' before 'B', \
         but device node0/cpu:1 (comm stream) issues 'B' before 'A'"
    );
    // Unchained collectives on one stream could go either way.
    let err = build(false, false).unwrap_err().to_string();
    assert_eq!(
        err,
        "collective order: 'A@0' (A) and 'B@0' (B) on device node0/cpu:0 (comm stream) could be issued in \
         either order: chain them so that every device issues them in one order"
    );
}
