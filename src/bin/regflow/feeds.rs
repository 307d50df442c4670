//! The feeds file of `regflow run`: a safetensors file with one tensor per input of the
//! plan's signature, named after the input, of shape `[steps, ...input shape]` and the
//! input's dtype. Step `k` feeds row `k` of every tensor.

use regflow::graph::checkpoint::{dtype_name, safetensors_problem};
use regflow::graph::plan::{DType, HostArray, InputSignature, Shape, TensorMeta};
use regflow::kernels::nearest;
use safetensors::tensor::{Dtype, SafeTensors};
use std::path::Path;

/// Every input's values for every step, checked against the plan's signature.
#[derive(Debug)]
pub(crate) struct Feeds {
    /// Steps the file holds: the rows of every tensor.
    steps: u64,
    /// Per input, in the signature's order.
    inputs: Vec<InputRows>,
}

/// One input's rows, back to back.
#[derive(Debug)]
struct InputRows {
    name: String,
    meta: TensorMeta,
    bytes: Vec<u8>,
}

impl Feeds {
    /// Reads `path` and checks it against `inputs`: a tensor per input and no other, each
    /// of the input's dtype and of shape `[steps, ...input shape]`, with one `steps` for
    /// all. The error is a sentence naming the tensor, the input and both shapes.
    pub(crate) fn read(path: &Path, inputs: &[InputSignature]) -> Result<Feeds, String> {
        let buffer = std::fs::read(path).map_err(|e| format!("cannot read it: {e}"))?;
        let file = SafeTensors::deserialize(&buffer)
            .map_err(|e| format!("it is not a safetensors file: {}", safetensors_problem(&e)))?;
        let input_names: Vec<&str> = inputs.iter().map(|i| i.name.as_str()).collect();
        let mut tensor_names: Vec<&str> = file.names().into_iter().map(String::as_str).collect();
        tensor_names.sort_unstable();
        for name in &tensor_names {
            if !input_names.contains(name) {
                let hint = match nearest(name, &input_names) {
                    Some(near) => format!("; did you mean '{near}'?"),
                    None => String::new(),
                };
                return Err(format!(
                    "tensor '{name}' is not an input of the plan (its inputs: {}{hint})",
                    input_names.join(", ")
                ));
            }
        }
        let mut rows: Vec<InputRows> = Vec::with_capacity(inputs.len());
        let mut steps: Option<(u64, &str)> = None;
        for input in inputs {
            let name = input.name.as_str();
            let meta = &input.meta;
            let Ok(view) = file.tensor(name) else {
                let holds = if tensor_names.is_empty() {
                    "no tensors".to_string()
                } else {
                    format!("tensors {}", tensor_names.join(", "))
                };
                return Err(format!("it has no tensor '{name}' for input '{name}' ({meta}); it holds {holds}"));
            };
            let needed = stepped_shape(&meta.shape);
            if dtype_of(view.dtype()) != Some(meta.dtype) {
                return Err(format!(
                    "tensor '{name}' holds {} values, but input '{name}' is {meta}: the tensor needs {} values of \
                     shape {needed}",
                    dtype_name(view.dtype()),
                    meta.dtype
                ));
            }
            let shape = view.shape();
            if shape.len() != meta.shape.rank() + 1 || shape[1..] != *meta.shape.dims() {
                return Err(format!(
                    "tensor '{name}' has shape {}, but input '{name}' has shape {}: the tensor needs shape {needed}",
                    Shape::from(shape),
                    meta.shape
                ));
            }
            let count = shape[0] as u64;
            match steps {
                Some((first, other)) if first != count => {
                    return Err(format!(
                        "tensor '{name}' has {count} steps (rows) but tensor '{other}' has {first}: every input \
                         needs the same number of steps"
                    ))
                }
                Some(_) => {}
                None => steps = Some((count, name)),
            }
            let bytes = view.data();
            let needed = meta.checked_bytes().and_then(|row| row.checked_mul(shape[0]));
            if needed != Some(bytes.len()) {
                let needed = needed.map_or_else(|| format!("more than {} bytes", usize::MAX), |n| format!("{n}"));
                return Err(format!(
                    "tensor '{name}' has {} bytes of data, but {count} rows of {meta} take {needed}",
                    bytes.len()
                ));
            }
            rows.push(InputRows { name: name.to_string(), meta: meta.clone(), bytes: bytes.to_vec() });
        }
        Ok(Feeds { steps: steps.map_or(0, |(count, _)| count), inputs: rows })
    }

    /// Steps the file holds.
    pub(crate) fn steps(&self) -> u64 {
        self.steps
    }

    /// Every input's value at `step`, in the signature's order.
    pub(crate) fn step(&self, step: u64) -> impl Iterator<Item = Result<(&str, HostArray), String>> + '_ {
        self.inputs.iter().map(move |input| {
            let row = input.meta.bytes();
            let start = step as usize * row;
            let Some(bytes) = input.bytes.get(start..start + row) else {
                return Err(format!("tensor '{}' has no row {step} (broken invariant: rows were checked)", input.name));
            };
            HostArray::from_le_bytes(&input.meta, bytes)
                .map(|value| (input.name.as_str(), value))
                .map_err(|e| format!("tensor '{}', row {step}: {e}", input.name))
        })
    }
}

/// `[steps, 8, 32]` for an input of shape `[8, 32]`.
fn stepped_shape(shape: &Shape) -> String {
    let dims: Vec<String> =
        std::iter::once("steps".to_string()).chain(shape.dims().iter().map(usize::to_string)).collect();
    format!("[{}]", dims.join(", "))
}

/// The plan dtype of a safetensors dtype, if plans have it.
fn dtype_of(dtype: Dtype) -> Option<DType> {
    match dtype {
        Dtype::F32 => Some(DType::F32),
        Dtype::F64 => Some(DType::F64),
        Dtype::I64 => Some(DType::I64),
        Dtype::BF16 => Some(DType::Bf16),
        Dtype::F16 => Some(DType::F16),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_feeds_file_that_is_not_safetensors_is_described_in_terms_of_the_file() {
        let path = std::env::temp_dir().join(format!("regflow-feeds-garbage-{}.safetensors", std::process::id()));
        std::fs::write(&path, b"short").unwrap();
        let err = Feeds::read(&path, &[]).unwrap_err();
        assert_eq!(err, "it is not a safetensors file: it is shorter than the 8 bytes that give its header's length");
        let header = br#"{"x":{"dtype":"BF16","shape":[1,2],"data_offsets":[0,4]}}"#;
        let mut bf16 = (header.len() as u64).to_le_bytes().to_vec();
        bf16.extend_from_slice(header);
        bf16.extend_from_slice(&[0; 4]);
        std::fs::write(&path, &bf16).unwrap();
        let input = InputSignature { name: "x".into(), meta: TensorMeta::new([2], DType::F32), parts: Vec::new() };
        let err = Feeds::read(&path, &[input]).unwrap_err();
        assert!(err.starts_with("tensor 'x' holds bf16 values, but input 'x' is f32[2]"), "{err}");
        std::fs::remove_file(&path).unwrap();
    }
}
