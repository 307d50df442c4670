//! Checkpoints: missing files, files that are not safetensors, headers that lie, tensors
//! of a dtype regflow does not hold, and checkpoints that do not fit the graph.

use crate::common::temp_dir;
use crate::Catalogue;
use regflow::graph::checkpoint::{self, CheckpointError};
use regflow::graph::{DType, Graph, HostArray, Init, Session};
use std::path::{Path, PathBuf};

/// A safetensors file of one tensor with this header entry and `data` bytes.
pub(crate) fn safetensors_bytes(entry: &str, data: &[u8]) -> Vec<u8> {
    let header = format!("{{\"t\":{entry}}}");
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    bytes
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).expect("writes the file");
    path
}

fn load_into_graph(path: &Path) -> Result<(), CheckpointError> {
    let g = Graph::new();
    g.variable("w", [2, 3], DType::F32, Init::Zeros).expect("variable");
    g.variable("b", [3], DType::F32, Init::Zeros).expect("variable");
    Session::new(&g).load(path)
}

#[test]
fn checkpoints() {
    let mut c = Catalogue::new("checkpoints");
    let dir = temp_dir("bad_input", "checkpoints");
    let shown = |p: &Path| p.display().to_string();
    let missing = dir.join("missing.safetensors");
    c.case(
        "a checkpoint that does not exist",
        || checkpoint::load(&missing),
        "CheckpointError::Io",
        &[&shown(&missing), "No such file"],
    );
    let text = write(&dir, "text.safetensors", b"not a checkpoint");
    c.case(
        "a checkpoint that is text",
        || checkpoint::load(&text),
        "CheckpointError::NotSafetensors",
        &[&shown(&text)],
    );
    let empty = write(&dir, "empty.safetensors", b"");
    c.case("an empty checkpoint", || checkpoint::load(&empty), "CheckpointError::NotSafetensors", &[&shown(&empty)]);
    let huge_header = write(&dir, "huge_header.safetensors", &u64::MAX.to_le_bytes());
    c.case(
        "a header length of 2^64 - 1",
        || checkpoint::load(&huge_header),
        "CheckpointError::NotSafetensors",
        &[&shown(&huge_header)],
    );
    let huge = write(
        &dir,
        "huge.safetensors",
        &safetensors_bytes(r#"{"dtype":"F32","shape":[1073741824,1073741824],"data_offsets":[0,16]}"#, &[0; 16]),
    );
    c.case(
        "a tensor claiming 2^60 elements",
        || checkpoint::load(&huge),
        "CheckpointError::NotSafetensors",
        &[&shown(&huge)],
    );
    let lying = write(
        &dir,
        "lying.safetensors",
        &safetensors_bytes(r#"{"dtype":"F32","shape":[4],"data_offsets":[0,1152921504606846976]}"#, &[0; 16]),
    );
    c.case(
        "data offsets past the end of the file",
        || checkpoint::load(&lying),
        "CheckpointError::NotSafetensors",
        &[&shown(&lying)],
    );
    let bytes = write(
        &dir,
        "u8.safetensors",
        &safetensors_bytes(r#"{"dtype":"U8","shape":[4],"data_offsets":[0,4]}"#, &[0; 4]),
    );
    c.case(
        "a u8 tensor",
        || checkpoint::load(&bytes),
        "CheckpointError::BadTensor",
        &["tensor 't'", "u8", "f32, f64, i64, bf16 and f16"],
    );
    let truncated = {
        let mut bytes = safetensors_bytes(r#"{"dtype":"F32","shape":[4],"data_offsets":[0,16]}"#, &[0; 16]);
        bytes.truncate(bytes.len() - 5);
        write(&dir, "truncated.safetensors", &bytes)
    };
    c.case(
        "a checkpoint cut short",
        || checkpoint::load(&truncated),
        "CheckpointError::NotSafetensors",
        &[&shown(&truncated)],
    );
    let only_w = dir.join("only_w.safetensors");
    checkpoint::save(&only_w, &[("w".into(), HostArray::f32([2, 3], vec![0.0; 6]).expect("value"))]).expect("saves");
    c.case(
        "a checkpoint without a variable of the graph",
        || load_into_graph(&only_w),
        "CheckpointError::MissingVariable",
        &["variable 'b'", "only_w"],
    );
    let wrong_shape = dir.join("wrong_shape.safetensors");
    checkpoint::save(
        &wrong_shape,
        &[
            ("w".into(), HostArray::f32([3, 2], vec![0.0; 6]).expect("value")),
            ("b".into(), HostArray::f32([3], vec![0.0; 3]).expect("value")),
        ],
    )
    .expect("saves");
    c.case(
        "a variable of another shape",
        || load_into_graph(&wrong_shape),
        "CheckpointError::ShapeMismatch",
        &["tensor 'w' has shape [3, 2]", "variable 'w' has shape [2, 3]"],
    );
    let wrong_dtype = dir.join("wrong_dtype.safetensors");
    checkpoint::save(
        &wrong_dtype,
        &[
            ("w".into(), HostArray::f64([2, 3], vec![0.0; 6]).expect("value")),
            ("b".into(), HostArray::f32([3], vec![0.0; 3]).expect("value")),
        ],
    )
    .expect("saves");
    c.case(
        "a variable of another dtype",
        || load_into_graph(&wrong_dtype),
        "CheckpointError::DTypeMismatch",
        &["tensor 'w' holds f64", "f32[2, 3]"],
    );
    let stray = dir.join("stray.safetensors");
    checkpoint::save(
        &stray,
        &[
            ("w".into(), HostArray::f32([2, 3], vec![0.0; 6]).expect("value")),
            ("b".into(), HostArray::f32([3], vec![0.0; 3]).expect("value")),
            ("bias".into(), HostArray::f32([3], vec![0.0; 3]).expect("value")),
        ],
    )
    .expect("saves");
    c.case(
        "a checkpoint with a tensor the graph does not have",
        || load_into_graph(&stray),
        "CheckpointError::UnknownTensor",
        &["tensor 'bias'", "not a variable"],
    );
    c.case(
        "saving into a directory that does not exist",
        || checkpoint::save(&dir.join("no/such/dir.safetensors"), &[]),
        "CheckpointError::Io",
        &["no/such/dir.safetensors"],
    );
    c.case("loading a directory", || checkpoint::load(&dir), "CheckpointError::Io", &[&shown(&dir)]);
    c.finish();
}
