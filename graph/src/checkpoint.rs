//! Checkpoints: named tensors in a safetensors file. A [`Session`] saves and loads every
//! variable, optimizer state included, so training resumes exactly where it stopped.

use crate::dsl::{TensorId, TensorSource};
use crate::plan::{DType, HostArray, Shape, TensorMeta};
use crate::session::Session;
use crate::GraphError;
use regflow_kernels::{edit_distance, nearest};
use safetensors::tensor::{Dtype, SafeTensorError, SafeTensors, TensorView};
use std::path::Path;

/// Why a checkpoint could not be written or read, or does not fit the graph: a sentence
/// naming the file and the tensor.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The file could not be read or written.
    #[error("checkpoint '{path}' cannot be {action}: {source}")]
    Io {
        /// The file.
        path: String,
        /// `read` or `written`.
        action: &'static str,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not a safetensors file.
    #[error("checkpoint '{path}' is not a safetensors file: {reason}")]
    NotSafetensors {
        /// The file.
        path: String,
        /// What is wrong with it, as [`safetensors_problem`] says it.
        reason: String,
    },
    /// A tensor of the file that regflow cannot hold (an unsupported dtype, a size that
    /// does not fit), or one that cannot be written.
    #[error("checkpoint '{path}': tensor '{tensor}' {problem}")]
    BadTensor {
        /// The file.
        path: String,
        /// The tensor.
        tensor: String,
        /// What is wrong.
        problem: String,
    },
    /// A variable of the graph the checkpoint has no tensor for.
    #[error("checkpoint '{path}' has no tensor for variable '{variable}'{hint}")]
    MissingVariable {
        /// The file.
        path: String,
        /// The variable.
        variable: String,
        /// What the checkpoint holds instead (`; it holds 2 tensors: 'w1', 'b1'`).
        hint: String,
    },
    /// A tensor of the checkpoint that is no variable of the graph.
    #[error("checkpoint '{path}': tensor '{tensor}' is not a variable of the graph{hint}")]
    UnknownTensor {
        /// The file.
        path: String,
        /// The tensor.
        tensor: String,
        /// The nearest variable names (`; did you mean 'w1'?`), or empty.
        hint: String,
    },
    /// A tensor whose shape differs from its variable's (a transposed weight, say), even
    /// when the element counts agree.
    #[error(
        "checkpoint '{path}': tensor '{tensor}' has shape {checkpoint}, but variable '{tensor}' has shape {variable}"
    )]
    ShapeMismatch {
        /// The file.
        path: String,
        /// The tensor and variable name.
        tensor: String,
        /// The tensor's shape in the file.
        checkpoint: Shape,
        /// The variable's shape in the graph.
        variable: Shape,
    },
    /// A tensor whose dtype differs from its variable's.
    #[error("checkpoint '{path}': tensor '{tensor}' holds {checkpoint} values, but variable '{tensor}' is {variable}")]
    DTypeMismatch {
        /// The file.
        path: String,
        /// The tensor and variable name.
        tensor: String,
        /// The tensor's dtype in the file.
        checkpoint: DType,
        /// The variable's dtype and shape in the graph.
        variable: TensorMeta,
    },
    /// A graph error while reading variables.
    #[error(transparent)]
    Graph(#[from] GraphError),
}

/// What is wrong with a file that the safetensors reader refused, as the end of the
/// sentence "... is not a safetensors file: ...", in terms of the file rather than of the
/// reader's internals.
pub fn safetensors_problem(error: &SafeTensorError) -> String {
    match error {
        SafeTensorError::HeaderTooSmall => "it is shorter than the 8 bytes that give its header's length".into(),
        SafeTensorError::HeaderTooLarge => "it declares a header larger than safetensors allows (100 MB)".into(),
        SafeTensorError::InvalidHeaderLength => {
            "its header is cut short: the file ends before the header length it declares".into()
        }
        SafeTensorError::InvalidHeader => "its header is not UTF-8 text".into(),
        SafeTensorError::InvalidHeaderStart
        | SafeTensorError::InvalidHeaderDeserialization
        | SafeTensorError::JsonError(_) => {
            "its header is not the JSON table of tensors a safetensors file starts with".into()
        }
        SafeTensorError::TensorNotFound(name) => format!("it has no tensor '{name}'"),
        SafeTensorError::TensorInvalidInfo => "a tensor's dtype and shape do not match the bytes it declares".into(),
        SafeTensorError::InvalidOffset(name) => {
            format!("tensor '{name}' declares its data outside the file or overlapping another tensor")
        }
        SafeTensorError::MetadataIncompleteBuffer => {
            "its tensors do not cover its data exactly: the file is cut short or has bytes left over".into()
        }
        SafeTensorError::ValidationOverflow => "a tensor's shape is too large to address".into(),
        SafeTensorError::InvalidTensorView(dtype, shape, bytes) => {
            format!(
                "a {} tensor of shape {} cannot hold {bytes} bytes",
                dtype_name(*dtype),
                Shape::from(shape.as_slice())
            )
        }
        SafeTensorError::IoError(error) => format!("it cannot be read: {error}"),
    }
}

/// The lower-case name of a safetensors dtype (`f32`, `bf16`, `u8`, ...).
pub fn dtype_name(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::BOOL => "bool",
        Dtype::U8 => "u8",
        Dtype::I8 => "i8",
        Dtype::F8_E5M2 => "f8_e5m2",
        Dtype::F8_E4M3 => "f8_e4m3",
        Dtype::I16 => "i16",
        Dtype::U16 => "u16",
        Dtype::F16 => "f16",
        Dtype::BF16 => "bf16",
        Dtype::I32 => "i32",
        Dtype::U32 => "u32",
        Dtype::F32 => "f32",
        Dtype::F64 => "f64",
        Dtype::I64 => "i64",
        Dtype::U64 => "u64",
        _ => "unknown",
    }
}

/// `; did you mean 'w1'?` when one candidate is close to `name`, else the three nearest
/// (`; the nearest are 'a', 'b', 'c'`), else nothing.
pub fn suggest(name: &str, candidates: &[&str], what: &str) -> String {
    if let Some(near) = nearest(name, candidates) {
        return format!("; did you mean '{near}'?");
    }
    let mut ranked: Vec<(usize, &str)> = candidates.iter().map(|c| (edit_distance(name, c), *c)).collect();
    ranked.sort_unstable();
    let listed: Vec<String> = ranked.iter().take(3).map(|(_, c)| format!("'{c}'")).collect();
    match listed.len() {
        0 => format!("; it has no {what}"),
        n if n == candidates.len() => format!("; its {what}: {}", listed.join(", ")),
        _ => format!("; the nearest of its {} {what}: {}", candidates.len(), listed.join(", ")),
    }
}

/// `; it holds 2 tensors: 'w1', 'b1'` (the first five, then how many more).
fn holds(names: &[String]) -> String {
    let listed: Vec<String> = names.iter().take(5).map(|n| format!("'{n}'")).collect();
    let more = if names.len() > 5 { format!(" and {} more", names.len() - 5) } else { String::new() };
    match names.len() {
        0 => "; it holds no tensors".to_string(),
        1 => format!("; it holds 1 tensor: {}", listed.join(", ")),
        n => format!("; it holds {n} tensors: {}{more}", listed.join(", ")),
    }
}

/// Writes named tensors to a safetensors file.
pub fn save(path: &Path, tensors: &[(String, HostArray)]) -> Result<(), CheckpointError> {
    let shown = path.display().to_string();
    let bytes: Vec<Vec<u8>> = tensors.iter().map(|(_, a)| a.to_le_bytes()).collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, array), data)| {
            let dtype = match array.dtype() {
                DType::F32 => Dtype::F32,
                DType::F64 => Dtype::F64,
                DType::I64 => Dtype::I64,
                DType::Bf16 => Dtype::BF16,
                DType::F16 => Dtype::F16,
            };
            TensorView::new(dtype, array.shape.dims().to_vec(), data).map(|view| (name.clone(), view)).map_err(|_| {
                CheckpointError::BadTensor {
                    path: shown.clone(),
                    tensor: name.clone(),
                    problem: format!("cannot be written: {} values do not fill shape {}", data.len(), array.shape),
                }
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let serialized = safetensors::tensor::serialize(views, &None)
        .map_err(|e| CheckpointError::NotSafetensors { path: shown.clone(), reason: safetensors_problem(&e) })?;
    std::fs::write(path, serialized).map_err(|source| CheckpointError::Io { path: shown, action: "written", source })
}

/// Reads every tensor of a safetensors file, sorted by name.
pub fn load(path: &Path) -> Result<Vec<(String, HostArray)>, CheckpointError> {
    let shown = path.display().to_string();
    let buffer =
        std::fs::read(path).map_err(|source| CheckpointError::Io { path: shown.clone(), action: "read", source })?;
    let file = SafeTensors::deserialize(&buffer)
        .map_err(|e| CheckpointError::NotSafetensors { path: shown.clone(), reason: safetensors_problem(&e) })?;
    let mut out = Vec::new();
    for (name, view) in file.tensors() {
        let bad = |problem: String| CheckpointError::BadTensor { path: shown.clone(), tensor: name.clone(), problem };
        let shape = Shape::from(view.shape());
        let dtype = match view.dtype() {
            Dtype::F32 => DType::F32,
            Dtype::F64 => DType::F64,
            Dtype::I64 => DType::I64,
            Dtype::BF16 => DType::Bf16,
            Dtype::F16 => DType::F16,
            other => {
                return Err(bad(format!(
                    "holds {} values, which regflow does not support (f32, f64, i64, bf16 and f16 it does)",
                    dtype_name(other)
                )))
            }
        };
        let meta = TensorMeta::new(shape, dtype);
        let data = view.data();
        if meta.checked_bytes() != Some(data.len()) {
            return Err(bad(format!(
                "has {} bytes of data, which do not fill shape {} of {dtype}",
                data.len(),
                meta.shape
            )));
        }
        out.push((name.clone(), HostArray::from_le_bytes(&meta, data).map_err(|e| bad(e.to_string()))?));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Checks a checkpoint tensor against the variable it is loaded into: same dtype, same
/// shape (not only the same element count). The error names the file, the tensor and both.
pub fn check_fits(path: &Path, name: &str, value: &HostArray, variable: &TensorMeta) -> Result<(), CheckpointError> {
    let path = path.display().to_string();
    if value.dtype() != variable.dtype {
        return Err(CheckpointError::DTypeMismatch {
            path,
            tensor: name.to_string(),
            checkpoint: value.dtype(),
            variable: variable.clone(),
        });
    }
    if value.shape != variable.shape {
        return Err(CheckpointError::ShapeMismatch {
            path,
            tensor: name.to_string(),
            checkpoint: value.shape.clone(),
            variable: variable.shape.clone(),
        });
    }
    Ok(())
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
    /// dtype and shape; tensors the graph does not have are an error too. Errors name the
    /// file and the tensor, and suggest the nearest names.
    pub fn load(&mut self, path: &Path) -> Result<(), CheckpointError> {
        let shown = path.display().to_string();
        let graph = self.graph();
        let mut loaded = load(path)?;
        let variables: Vec<(TensorId, crate::TensorInfo)> = (0..graph.tensor_count())
            .map(|i| TensorId(i as u32))
            .map(|id| (id, graph.info(id)))
            .filter(|(_, info)| matches!(info.source, TensorSource::Variable { .. }))
            .collect();
        let variable_names: Vec<&str> = variables.iter().map(|(_, info)| info.name.as_str()).collect();
        let file_names: Vec<String> = loaded.iter().map(|(n, _)| n.clone()).collect();
        if let Some((name, _)) = loaded.iter().find(|(n, _)| !variable_names.contains(&n.as_str())) {
            return Err(CheckpointError::UnknownTensor {
                path: shown,
                tensor: name.clone(),
                hint: suggest(name, &variable_names, "variables"),
            });
        }
        for (id, info) in &variables {
            let Some(t) = graph.tensor(*id) else { continue };
            let Some(position) = loaded.iter().position(|(n, _)| n == &info.name) else {
                return Err(CheckpointError::MissingVariable {
                    path: shown,
                    variable: info.name.clone(),
                    hint: holds(&file_names),
                });
            };
            let (_, value) = loaded.remove(position);
            check_fits(path, &info.name, &value, &info.meta)?;
            self.set(t, value)?;
        }
        Ok(())
    }
}
