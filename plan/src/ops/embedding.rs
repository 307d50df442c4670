//! Attributes of `embedding` ops.

use crate::{DType, TensorMeta};
use serde::{Deserialize, Serialize};

/// `table[ids]`: table `[V, D]` (float), ids of any shape (i64, each in `0..V`), output
/// `ids.shape + [D]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Embedding;

/// The gradient of [`Embedding`] with respect to the table, from inputs `(ids, dy)`: a
/// `[vocab_size, D]` table of zeros into which row `i` of `dy` is added at row `ids[i]`,
/// the rows of `dy` in id order; with [`EmbeddingGrad::base`], a third input added to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EmbeddingGrad {
    /// Rows of the table (`V`).
    pub vocab_size: usize,
    /// A third input `base`, `[R, D]` with `R ≥ vocab_size`, of this dtype (`dy`'s, or bf16
    /// or f16 beside f32 `dy`, widened): row `r` of the output is then the sum of its `dy`
    /// rows plus `base[r]` (the rows past `vocab_size` unread), the bits of an `add` of the
    /// two. The compiler folds a tied weight's other gradient in this way
    /// (`graph/src/compile/fold_table_grads.rs`); `None`, the default and absent from plan
    /// files, adds nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<DType>,
}

impl EmbeddingGrad {
    /// The plain gradient of a table of `vocab_size` rows (no base).
    pub fn new(vocab_size: usize) -> Self {
        Self { vocab_size, base: None }
    }

    /// Checks an op's local metas against the attributes: `(ids, dy[, base])` in, the
    /// `[vocab_size, D]` table of `dy`'s float dtype out (module docs of the fields).
    pub fn check(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Result<(), String> {
        let want = 2 + usize::from(self.base.is_some());
        let (Some(ids), Some(dy), [out]) = (inputs.first(), inputs.get(1), outputs) else {
            return Err(format!("takes {want} inputs and gives 1 output, got {} and {}", inputs.len(), outputs.len()));
        };
        if inputs.len() != want {
            return Err(format!(
                "takes {want} inputs (ids, dy{}), got {}",
                if want == 3 { ", base" } else { "" },
                inputs.len()
            ));
        }
        if ids.dtype != DType::I64 {
            return Err(format!("ids must be i64, got {}", ids.dtype));
        }
        if !dy.dtype.is_float() {
            return Err(format!("dy must be float, got {}", dy.dtype));
        }
        let Some((&features, _)) = dy.shape.dims().split_last().filter(|(_, lead)| *lead == ids.shape.dims()) else {
            return Err(format!("dy must have shape {} + [D], got {}", ids.shape, dy.shape));
        };
        if *out != TensorMeta::new([self.vocab_size, features], dy.dtype) {
            return Err(format!(
                "gives a table of {} rows of dy's {features} features in {}, not {out}",
                self.vocab_size, dy.dtype
            ));
        }
        if let (Some(dtype), Some(base)) = (self.base, inputs.get(2)) {
            let widened = dy.dtype == DType::F32 && matches!(dtype, DType::Bf16 | DType::F16);
            let rows = base.shape.dims().first().copied().unwrap_or(0);
            if base.dtype != dtype || !(dtype == dy.dtype || widened) {
                return Err(format!(
                    "reads a base of {dtype}, got {base}: it must be dy's {}, or bf16 or f16 beside f32",
                    dy.dtype
                ));
            }
            if base.shape.rank() != 2 || base.shape.dims()[1] != features || rows < self.vocab_size {
                return Err(format!(
                    "adds a base {base} to a table {out}: it needs at least the table's rows, of its features"
                ));
            }
        }
        Ok(())
    }
}

/// A device's share of [`Embedding`] (or, with `grad`, of [`EmbeddingGrad`]) when the
/// table's rows are split (vocabulary parallelism): ids of rows held elsewhere gather
/// zeros (the devices' outputs are summands) and scatter nothing.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VocabPart {
    /// The rows this device holds.
    pub rows: Rows,
    /// Scatter into the table (the gradient) rather than gather from it.
    pub grad: bool,
}

/// Which rows of the table a device holds: `held` of the `vocab_size` logical rows. Ids
/// outside `0..vocab_size` are errors; ids of rows held elsewhere read (and write) zeros.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rows {
    /// Rows of the whole table.
    pub vocab_size: usize,
    /// The logical rows this device holds.
    pub held: std::ops::Range<usize>,
}

impl Rows {
    /// The whole table of `rows` rows.
    pub fn all(rows: usize) -> Self {
        Self { vocab_size: rows, held: 0..rows }
    }

    /// The local row of id `i`, `None` if another device holds it, or an error naming it.
    pub fn local(&self, ids: &[i64], i: usize) -> Result<Option<usize>, String> {
        let id = ids[i];
        let row = usize::try_from(id)
            .ok()
            .filter(|&r| r < self.vocab_size)
            .ok_or_else(|| format!("id {id} out of range for {} rows", self.vocab_size))?;
        Ok(self.held.contains(&row).then(|| row - self.held.start))
    }
}
