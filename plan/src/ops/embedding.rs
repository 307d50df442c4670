//! Attributes of `embedding` ops.

use serde::{Deserialize, Serialize};

/// `table[ids]`: table `[V, D]` (float), ids of any shape (i64, each in `0..V`), output
/// `ids.shape + [D]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Embedding;

/// The gradient of [`Embedding`] with respect to the table, from inputs `(ids, dy)`: a
/// `[vocab_size, D]` table of zeros into which row `i` of `dy` is added at row `ids[i]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EmbeddingGrad {
    /// Rows of the table (`V`).
    pub vocab_size: usize,
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
