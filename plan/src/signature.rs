//! What a plan reads and writes in logical terms: its typed signature (inputs cut into
//! device parts by [`Region`]s, outputs), its variables' initializers, and the dataset files
//! its sources name.

use crate::{ActorIndex, RegstDescId};
use serde::{Deserialize, Serialize};

/// Where one device's part of a logical tensor lies: `offsets` and `shape` in the logical
/// tensor's coordinates; `zeros` for a summand (`Partial`) part that another device holds,
/// which is all zeros.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Region {
    /// Start of the part in each dimension.
    pub offsets: Vec<usize>,
    /// Length of the part in each dimension.
    pub shape: Vec<usize>,
    /// The part is zeros (a `Partial` summand held by another device).
    #[serde(default)]
    pub zeros: bool,
}

impl Region {
    /// The whole of a tensor of `shape`.
    pub fn whole(shape: &crate::Shape) -> Self {
        Self { offsets: vec![0; shape.rank()], shape: shape.dims().to_vec(), zeros: false }
    }

    /// This region's part of the logical `value` (zeros for a zero part).
    pub fn cut(&self, value: &crate::HostArray) -> crate::HostArray {
        let meta = crate::TensorMeta::new(self.shape.clone(), value.meta().dtype);
        if self.zeros {
            return crate::HostArray::zeros(&meta);
        }
        let ranges: Vec<std::ops::Range<usize>> =
            self.offsets.iter().zip(&self.shape).map(|(&o, &n)| o..o + n).collect();
        value.region(&ranges)
    }

    /// Whether the region lies inside a tensor of `shape`.
    pub fn fits(&self, shape: &crate::Shape) -> bool {
        self.offsets.len() == shape.rank()
            && self.shape.len() == shape.rank()
            && self
                .offsets
                .iter()
                .zip(&self.shape)
                .zip(shape.dims())
                .all(|((&o, &n), &d)| o.checked_add(n).is_some_and(|end| end <= d))
    }
}

/// One device's part of a fed input or a fetched output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorPart {
    /// The source (input) or sink (output) actor of the part.
    pub actor: ActorIndex,
    /// Where the part lies in the logical tensor.
    pub region: Region,
}

/// A typed input: a logical tensor fed once per piece, cut into its devices' parts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InputSignature {
    /// The input's name in the graph.
    pub name: String,
    /// Shape and dtype of every logical value.
    pub meta: crate::TensorMeta,
    /// The fed source of each device's part, in feed order.
    pub parts: Vec<TensorPart>,
}

/// A typed output: a logical tensor delivered whole by one sink.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputSignature {
    /// The output's name (`fetch:k`).
    pub name: String,
    /// Shape and dtype of every value.
    pub meta: crate::TensorMeta,
    /// The sink that delivers the whole value.
    pub actor: ActorIndex,
}

/// What a plan reads and writes, in logical terms.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Signature {
    /// Fed inputs, in the graph's order.
    pub inputs: Vec<InputSignature>,
    /// Fetched outputs, in fetch order.
    pub outputs: Vec<OutputSignature>,
}

/// A loop register's first value: the part `region` of the logical variable `meta`
/// drawn from `init`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VariableDesc {
    /// The variable's name (with its device, `w@1`, on a mesh).
    pub name: String,
    /// The register whose preloaded slots take the value.
    pub regst: RegstDescId,
    /// Shape and dtype of the whole (logical) variable.
    pub meta: crate::TensorMeta,
    /// How its value is drawn.
    pub init: crate::Init,
    /// This register's part of it.
    pub region: Region,
    /// The register holds the part in *every* slot, written once when the job starts, and
    /// nothing ever writes it again: a variable nobody updates, handed out each step by a
    /// no-op actor without a copy. Otherwise the part goes into the register's preloaded
    /// slots (a loop's first value).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub constant: bool,
}

/// A dataset source: shuffled batches of a file of fixed-size records, each record split
/// into fields, one field per output register.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetConf {
    /// The record file (a relative path is resolved against the job's data directory).
    pub path: String,
    /// Bytes of each field of a record, in output order.
    pub fields: Vec<u64>,
    /// Records per piece.
    pub batch: u64,
    /// Seed of the per-epoch shuffle.
    pub seed: u64,
    /// Pieces to produce (batches, over as many epochs as they take).
    pub pieces: u64,
}
