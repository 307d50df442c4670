//! Datasets for source actors: a file of fixed-size records, read once into memory and
//! served in batches, reshuffled by seed every epoch. Each record is split into fields
//! (features, label, ...) and each field goes to its own output register.

use crate::kernel::{Kernel, KernelError, KernelIo, KernelSpec};
use crate::{JobBuilder, RuntimeError};
use regflow_plan::SplitMix64;
use std::path::Path;
use std::sync::Arc;

/// Fixed-size records held in memory.
#[derive(Debug, Clone)]
pub struct RecordFile {
    bytes: Arc<Vec<u8>>,
    record_bytes: usize,
}

fn data_error(message: String) -> RuntimeError {
    RuntimeError::Data { message }
}

impl RecordFile {
    /// Reads a file of records of `record_bytes` bytes each.
    pub fn open(path: &Path, record_bytes: usize) -> Result<Self, RuntimeError> {
        let bytes = std::fs::read(path).map_err(|e| data_error(format!("reading {}: {e}", path.display())))?;
        Self::from_bytes(bytes, record_bytes).map_err(|e| match e {
            RuntimeError::Data { message } => data_error(format!("{}: {message}", path.display())),
            other => other,
        })
    }

    /// Records already in memory.
    pub fn from_bytes(bytes: Vec<u8>, record_bytes: usize) -> Result<Self, RuntimeError> {
        if record_bytes == 0 {
            return Err(data_error("a record must have at least one byte".into()));
        }
        if bytes.is_empty() || !bytes.len().is_multiple_of(record_bytes) {
            return Err(data_error(format!(
                "{} bytes is not a whole number of {record_bytes}-byte records",
                bytes.len()
            )));
        }
        Ok(Self { bytes: Arc::new(bytes), record_bytes })
    }

    /// Number of records.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.record_bytes
    }

    /// Whether there are no records (never true for a constructed file).
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Batches of `batch` records, each split into fields of the given byte sizes, in an
    /// order reshuffled from `seed` at every epoch. The last partial batch of an epoch is
    /// dropped, so every piece has the same shape.
    pub fn batches(&self, fields: &[usize], batch: usize, seed: u64) -> Result<ShuffledBatches, RuntimeError> {
        if fields.iter().sum::<usize>() != self.record_bytes {
            return Err(data_error(format!(
                "fields {fields:?} add up to {} bytes, but a record has {}",
                fields.iter().sum::<usize>(),
                self.record_bytes
            )));
        }
        if batch == 0 || batch > self.len() {
            return Err(data_error(format!("batch {batch} must be between 1 and the {} records", self.len())));
        }
        Ok(ShuffledBatches {
            file: self.clone(),
            fields: fields.to_vec(),
            batch,
            seed,
            order: (0..self.len() as u32).collect(),
            epoch: None,
        })
    }
}

/// A source kernel serving shuffled batches of a [`RecordFile`]: piece `p` is batch
/// `p % batches_per_epoch` of epoch `p / batches_per_epoch`.
#[derive(Debug, Clone)]
pub struct ShuffledBatches {
    file: RecordFile,
    fields: Vec<usize>,
    batch: usize,
    seed: u64,
    /// The current epoch's order, reshuffled in place (no allocation) at each new epoch.
    order: Vec<u32>,
    epoch: Option<u64>,
}

impl ShuffledBatches {
    /// Full batches per epoch.
    pub fn batches_per_epoch(&self) -> u64 {
        (self.file.len() / self.batch) as u64
    }

    /// Pieces for `epochs` epochs: the `count` of the source actor.
    pub fn pieces(&self, epochs: u64) -> u64 {
        epochs * self.batches_per_epoch()
    }

    /// Record order of `epoch`: identity shuffled by Fisher–Yates from `seed` and the epoch.
    fn shuffle(&mut self, epoch: u64) {
        for (i, slot) in self.order.iter_mut().enumerate() {
            *slot = i as u32;
        }
        let mut rng = SplitMix64::new(self.seed ^ epoch.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        for i in (1..self.order.len()).rev() {
            self.order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        self.epoch = Some(epoch);
    }
}

impl Kernel for ShuffledBatches {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let per_epoch = self.batches_per_epoch();
        let (epoch, batch) = (io.piece() / per_epoch, (io.piece() % per_epoch) as usize);
        if self.epoch != Some(epoch) {
            self.shuffle(epoch);
        }
        let record_bytes = self.file.record_bytes;
        for (i, &record) in self.order[batch * self.batch..(batch + 1) * self.batch].iter().enumerate() {
            let mut at = record as usize * record_bytes;
            for (f, &size) in self.fields.iter().enumerate() {
                io.output(f)[i * size..(i + 1) * size].copy_from_slice(&self.file.bytes[at..at + size]);
                at += size;
            }
        }
        Ok(())
    }
}

/// The kernel of a [`SourcePieces::Dataset`](regflow_plan::SourcePieces::Dataset) source:
/// its record file opened (relative paths under `data_dir`) and checked against the
/// source's registers.
pub(crate) fn dataset_kernel(
    conf: &regflow_plan::DatasetConf,
    data_dir: Option<&Path>,
    spec: &KernelSpec<'_>,
) -> Result<Box<dyn Kernel>, RuntimeError> {
    let setup = |message: String| RuntimeError::KernelSetup { actor: spec.actor.to_string(), message };
    let path = match data_dir {
        Some(dir) if Path::new(&conf.path).is_relative() => dir.join(&conf.path),
        _ => Path::new(&conf.path).to_path_buf(),
    };
    let fields: Vec<usize> = conf.fields.iter().map(|&f| f as usize).collect();
    let file = RecordFile::open(&path, fields.iter().sum()).map_err(|e| setup(e.to_string()))?;
    let batches = file.batches(&fields, conf.batch as usize, conf.seed).map_err(|e| setup(e.to_string()))?;
    check_outputs(&batches, spec).map_err(|e| setup(e.0))?;
    Ok(Box::new(batches))
}

/// A source serving `batches` must have one output per field, each holding one batch.
fn check_outputs(batches: &ShuffledBatches, spec: &KernelSpec<'_>) -> Result<(), KernelError> {
    let expected: Vec<u64> = batches.fields.iter().map(|&f| (f * batches.batch) as u64).collect();
    if spec.output_bytes != expected.as_slice() {
        return Err(KernelError(format!(
            "dataset source '{}' writes batches of {expected:?} bytes per output, but its registers hold {:?}",
            spec.actor, spec.output_bytes
        )));
    }
    Ok(())
}

impl JobBuilder {
    /// Registers `batches` as the kernel `name` of a `SourcePieces::Custom` source; its
    /// outputs must hold one batch of each field, in field order.
    pub fn dataset(self, name: &str, batches: ShuffledBatches) -> Self {
        self.kernel(name, move |spec: &KernelSpec<'_>| {
            check_outputs(&batches, spec)?;
            Ok(Box::new(batches.clone()))
        })
    }
}
