//! Checkpoints: named tensors in a safetensors file. A [`Session`] saves and loads every
//! variable, optimizer state included, so training resumes exactly where it stopped.

use crate::dsl::{TensorId, TensorSource};
use crate::plan::{DType, HostArray, HostData, Shape};
use crate::session::Session;
use crate::GraphError;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use std::path::Path;

/// Why a checkpoint could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The file could not be read or written.
    #[error("checkpoint {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Not a valid safetensors file, or a tensor that is not whole.
    #[error("checkpoint {path}: {message}")]
    Format {
        /// The file.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// The checkpoint does not fit the graph.
    #[error("checkpoint {path}: {message}")]
    Mismatch {
        /// The file.
        path: String,
        /// Which tensor and how.
        message: String,
    },
    /// A graph error while reading variables.
    #[error(transparent)]
    Graph(#[from] GraphError),
}

/// Writes named tensors to a safetensors file.
pub fn save(path: &Path, tensors: &[(String, HostArray)]) -> Result<(), CheckpointError> {
    let shown = path.display().to_string();
    let bytes: Vec<(String, Vec<u8>)> = tensors.iter().map(|(n, a)| (n.clone(), a.to_le_bytes())).collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, array), (_, data))| {
            let dtype = match array.dtype() {
                DType::F32 => Dtype::F32,
                DType::F64 => Dtype::F64,
                DType::I64 => Dtype::I64,
            };
            TensorView::new(dtype, array.shape.dims().to_vec(), data)
                .map(|view| (name.clone(), view))
                .map_err(|e| CheckpointError::Format { path: shown.clone(), message: format!("tensor '{name}': {e}") })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let serialized = safetensors::tensor::serialize(views, &None)
        .map_err(|e| CheckpointError::Format { path: shown.clone(), message: e.to_string() })?;
    std::fs::write(path, serialized).map_err(|source| CheckpointError::Io { path: shown, source })
}

/// Reads every tensor of a safetensors file, sorted by name.
pub fn load(path: &Path) -> Result<Vec<(String, HostArray)>, CheckpointError> {
    let shown = path.display().to_string();
    let buffer = std::fs::read(path).map_err(|source| CheckpointError::Io { path: shown.clone(), source })?;
    let file = SafeTensors::deserialize(&buffer)
        .map_err(|e| CheckpointError::Format { path: shown.clone(), message: e.to_string() })?;
    let mut out = Vec::new();
    for (name, view) in file.tensors() {
        let format = |message: String| CheckpointError::Format {
            path: shown.clone(),
            message: format!("tensor '{name}': {message}"),
        };
        let shape = Shape::from(view.shape());
        let data = view.data();
        let words = |size: usize| -> Result<Vec<[u8; 8]>, CheckpointError> {
            if data.len() != shape.numel() * size {
                return Err(format(format!("{} bytes for shape {shape}", data.len())));
            }
            Ok(data
                .chunks(size)
                .map(|c| {
                    let mut w = [0u8; 8];
                    w[..size].copy_from_slice(c);
                    w
                })
                .collect())
        };
        let host = match view.dtype() {
            Dtype::F32 => {
                HostData::F32(words(4)?.iter().map(|w| f32::from_le_bytes([w[0], w[1], w[2], w[3]])).collect())
            }
            Dtype::F64 => HostData::F64(words(8)?.iter().map(|w| f64::from_le_bytes(*w)).collect()),
            Dtype::I64 => HostData::I64(words(8)?.iter().map(|w| i64::from_le_bytes(*w)).collect()),
            other => return Err(format(format!("dtype {other:?} is not supported (f32, f64, i64 are)"))),
        };
        out.push((name, HostArray { shape, data: host }));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

impl Session<'_> {
    /// Saves every variable of the graph (parameters and optimizer state).
    pub fn save(&mut self, path: &Path) -> Result<(), CheckpointError> {
        let graph = self.graph();
        let mut tensors = Vec::new();
        for i in 0..graph.tensor_count() {
            let id = TensorId(i as u32);
            let info = graph.info(id);
            if let (TensorSource::Variable { .. }, Some(t)) = (&info.source, graph.tensor(id)) {
                tensors.push((info.name.clone(), self.value(t)?));
            }
        }
        save(path, &tensors)
    }

    /// Loads every variable of the graph from a checkpoint: each must be there, with its
    /// shape and dtype; tensors the graph does not have are an error too.
    pub fn load(&mut self, path: &Path) -> Result<(), CheckpointError> {
        let shown = path.display().to_string();
        let graph = self.graph();
        let mut loaded = load(path)?;
        for i in 0..graph.tensor_count() {
            let id = TensorId(i as u32);
            let info = graph.info(id);
            let (TensorSource::Variable { .. }, Some(t)) = (&info.source, graph.tensor(id)) else { continue };
            let position =
                loaded.iter().position(|(n, _)| n == &info.name).ok_or_else(|| CheckpointError::Mismatch {
                    path: shown.clone(),
                    message: format!("variable '{}' is missing", info.name),
                })?;
            let (_, value) = loaded.remove(position);
            if value.meta() != info.meta {
                return Err(CheckpointError::Mismatch {
                    path: shown,
                    message: format!(
                        "variable '{}' is {} in the checkpoint, {} in the graph",
                        info.name,
                        value.meta(),
                        info.meta
                    ),
                });
            }
            self.set(t, value)?;
        }
        if let Some((name, _)) = loaded.first() {
            return Err(CheckpointError::Mismatch {
                path: shown,
                message: format!("tensor '{name}' is not a variable of the graph"),
            });
        }
        Ok(())
    }
}
