//! Meshes, SBP layout pins and placements: meshes of the wrong shape, size or names, split
//! axes out of range, pins that contradict each other or an op's signatures, devices of a
//! kind this build cannot run.

use crate::{quick, without_gpu, Catalogue};
use regflow::graph::plan::DeviceKind;
use regflow::graph::sbp::{Mesh, MeshDevice, NdSbp, Sbp};
use regflow::graph::{DType, Graph, Init, ParallelOptions};

fn cpu(index: u16) -> MeshDevice {
    MeshDevice { node: 0, kind: DeviceKind::Cpu, index }
}

#[test]
fn meshes_and_layouts() {
    let mut c = Catalogue::new("meshes");
    c.case("a mesh with fewer axis names than axes", || Mesh::cpu(&[2, 2], &["dp"]), "String", &["[2, 2]", "dp"]);
    c.case("a mesh with no axes", || Mesh::cpu(&[], &[]), "String", &["[]"]);
    c.case("a mesh with an empty axis", || Mesh::cpu(&[2, 0], &["dp", "tp"]), "String", &["[2, 0]", "empty axis"]);
    c.case("a mesh with one axis name twice", || Mesh::cpu(&[2, 2], &["dp", "dp"]), "String", &["distinct", "dp"]);
    c.case("a mesh with an empty axis name", || Mesh::cpu(&[2], &[""]), "String", &["non-empty"]);
    c.case(
        "a mesh of 3 devices for a shape of 4",
        || Mesh::new(vec![cpu(0), cpu(1), cpu(2)], &[2, 2], &["a", "b"]),
        "String",
        &["[2, 2]", "4 devices", "got 3"],
    );
    c.case(
        "a mesh holding one device twice",
        || Mesh::new(vec![cpu(0), cpu(0)], &[2], &["dp"]),
        "String",
        &["cpu:0", "twice"],
    );

    let g = Graph::new();
    let mesh2 = Mesh::cpu(&[2], &["dp"]).unwrap();
    let mesh22 = Mesh::cpu(&[2, 2], &["dp", "tp"]).unwrap();
    let other = Mesh::new(vec![cpu(2), cpu(3)], &[2], &["dp"]).unwrap();
    let x = g.input("x", [4, 3], DType::F32).unwrap();
    let v = g.input("v", [4], DType::F32).unwrap();
    let y = g.input("y", [4, 3], DType::F32).unwrap();
    c.case(
        "a layout with two entries on a 1-d mesh",
        || g.set_layout(x, &mesh2, NdSbp(vec![Sbp::Split(0), Sbp::Broadcast])),
        "GraphError::Op",
        &["set_layout", "'x'", "(S(0), B)", "1 axes"],
    );
    c.case(
        "a layout with one entry on a 2-d mesh",
        || g.set_layout(x, &mesh22, NdSbp(vec![Sbp::Split(0)])),
        "GraphError::Op",
        &["'x'", "(S(0))", "2 axes", "dp, tp"],
    );
    c.case(
        "a split axis out of range",
        || g.set_layout(v, &mesh2, NdSbp(vec![Sbp::Split(1)])),
        "GraphError::Op",
        &["'v'", "split axis 1", "'dp'", "[4]"],
    );
    c.case(
        "to_global with a split axis out of range",
        || x.to_global(&mesh2, NdSbp(vec![Sbp::Split(2)])),
        "GraphError::Op",
        &["to_global", "'x'", "split axis 2"],
    );
    g.set_layout(y, &mesh2, NdSbp(vec![Sbp::Split(0)])).unwrap();
    let z = g.input("z", [4, 3], DType::F32).unwrap();
    g.set_layout(z, &other, NdSbp(vec![Sbp::Split(0)])).unwrap();
    c.case(
        "an op on tensors of two placements",
        || y.add(&z),
        "GraphError::Op",
        &["add", "different placements", "cpu:0..2", "cpu:2..4", "to_global"],
    );

    // Compile-time layout errors.
    let h = Graph::new();
    let x = h.input("x", [4, 3], DType::F32).unwrap();
    let w = h.variable("w", [3, 2], DType::F32, Init::Zeros).unwrap();
    h.set_layout(x, &mesh2, NdSbp(vec![Sbp::Split(0)])).unwrap();
    h.set_layout(w, &mesh2, NdSbp(vec![Sbp::Partial])).unwrap();
    let out = x.matmul(&w).unwrap();
    c.case(
        "a variable pinned Partial",
        || h.compile_parallel(&[out], &[], &ParallelOptions::new(mesh2.clone())),
        "GraphError::Compile::PartialVariable",
        &["'w'", "f32[3, 2]", "Partial", "dp: P"],
    );
    let k = Graph::new();
    let x = k.input("x", [4, 3], DType::F32).unwrap();
    k.set_layout(x, &mesh2, NdSbp(vec![Sbp::Split(0)])).unwrap();
    let r = x.relu().unwrap();
    k.set_layout(r, &mesh2, NdSbp(vec![Sbp::Partial])).unwrap();
    c.case(
        "relu pinned to give Partial from Split",
        || k.compile_parallel(&[r], &[], &ParallelOptions::new(mesh2.clone())),
        "GraphError::Compile::NoSignature",
        &["relu", "no SBP signature", "dp: P"],
    );
    let cuda = Mesh::of_kind(DeviceKind::Cuda, &[2], &["dp"]).unwrap();
    let m = Graph::new();
    let x = m.input("x", [4, 3], DType::F32).unwrap();
    m.set_layout(x, &cuda, NdSbp(vec![Sbp::Split(0)])).unwrap();
    let r = x.relu().unwrap();
    let compiled = m.compile_parallel(&[r], &[], &ParallelOptions::new(cuda.clone()));
    // Refused only where no GPU can run it (CI); a GPU machine runs it.
    if without_gpu() {
        c.case(
            "a plan on a cuda mesh, run without a cuda backend",
            || quick(compiled.expect("a cuda plan compiles").plan).build(),
            "RuntimeError::UnsupportedDevice",
            &["device node0/cuda:0 cannot run here", "CUDA"],
        );
    }
    c.finish();
}

#[test]
fn a_second_pin_on_another_mesh_is_refused() {
    let mut c = Catalogue::new("meshes");
    let g = Graph::new();
    let mesh2 = Mesh::cpu(&[2], &["dp"]).unwrap();
    let other = Mesh::new(vec![cpu(2), cpu(3)], &[2], &["dp"]).unwrap();
    let y = g.input("y", [4, 3], DType::F32).unwrap();
    g.set_layout(y, &mesh2, NdSbp(vec![Sbp::Split(0)])).unwrap();
    c.case(
        "a second pin on another mesh",
        || g.set_layout(y, &other, NdSbp(vec![Sbp::Split(0)])),
        "GraphError::Op",
        &["'y'", "already placed on cpu:0..2", "cpu:2..4"],
    );
    c.finish();
}
