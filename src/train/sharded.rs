//! Sharded checkpoints: every rank of a multi-node job writes the variable parts it holds
//! to its own safetensors file, rank 0 writes an index of them last, and a load gathers
//! whole tensors back, ready for any layout (`docs/training.md`, "Sharded checkpoints").
//!
//! A checkpoint directory, once complete:
//!
//! ```text
//! step10/
//!   rank0.safetensors   rank 0's parts, named `{variable}@{o0}_{o1}...` (their offsets)
//!   rank0.json          rank 0's list of them (written after its safetensors file)
//!   rank1.safetensors
//!   rank1.json
//!   index.json          written last, by rank 0, once every rank{k}.json exists
//! ```
//!
//! Every file is written under a temporary name, synced and renamed, so a file that has
//! its final name is whole; a checkpoint without `index.json` is incomplete and ignored by
//! [`latest_complete`].

use super::{StateDict, TrainError};
use regflow_graph::checkpoint::{dtype_name, safetensors_problem, CheckpointError};
use regflow_plan::{DType, HostArray, HostData, Shape, TensorMeta};
use regflow_runtime::StatePart;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

mod layout;

use layout::{copy_into, uncovered};

/// The file every complete checkpoint directory holds, written last.
pub const INDEX_FILE: &str = "index.json";

/// What `index.json` and `rank{r}.json` say they are.
const FORMAT: &str = "regflow-sharded-checkpoint/1";

/// How long rank 0 waits for the other ranks' parts by default ([`save_sharded`]).
pub const DEFAULT_RANK_WAIT: Duration = Duration::from_secs(600);

/// The directory of the checkpoint of `step` under `root` (`root/step{step}`), the one
/// [`latest_complete`] looks for.
pub fn checkpoint_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!("step{step}"))
}

/// The checkpoint directory `root/step{N}` of the largest `N` that holds an `index.json`
/// (a complete checkpoint); `None` when there is none. A directory whose index is missing
/// (a save that crashed or is still running) is passed over.
pub fn latest_complete(root: &Path) -> Option<PathBuf> {
    let entries = std::fs::read_dir(root).ok()?;
    entries
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let name = entry.file_name();
            let step: u64 = name.to_str()?.strip_prefix("step")?.parse().ok()?;
            let dir = entry.path();
            dir.join(INDEX_FILE).is_file().then_some((step, dir))
        })
        .max_by_key(|(step, _)| *step)
        .map(|(_, dir)| dir)
}

/// One part as a rank's list and the index record it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PartRecord {
    /// The shard file that holds it (`rank1.safetensors`).
    file: String,
    /// Its tensor's name in that file.
    tensor: String,
    /// Where it starts in each dimension of the whole.
    offsets: Vec<usize>,
    /// Its shape.
    shape: Vec<usize>,
    /// [`checksum`] of its little-endian bytes.
    checksum: u64,
}

/// A variable as a rank's list and the index record it: whole shape and dtype, and parts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct VariableRecord {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    parts: Vec<PartRecord>,
}

/// `rank{r}.json`: what rank `r` wrote.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RankList {
    format: String,
    rank: u32,
    world: u32,
    step: u64,
    /// Its shard file and that file's length in bytes.
    file: String,
    bytes: u64,
    variables: Vec<VariableRecord>,
}

/// `index.json`: the whole checkpoint.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Index {
    format: String,
    step: u64,
    world: u32,
    extra: serde_json::Value,
    /// Each rank's shard file and its length in bytes, by rank.
    files: Vec<(String, u64)>,
    /// Every variable, in the order rank 0, rank 1, ... first list them.
    variables: Vec<VariableRecord>,
}

/// Writes rank `rank`'s parts (of `world` ranks) of the state after `step` into `dir`; rank
/// 0 then waits up to [`DEFAULT_RANK_WAIT`] for every other rank's list and writes the
/// index, which completes the checkpoint. `extra` (a dataset position, say) is kept in the
/// index as given; only rank 0's counts. Every rank of a job calls it with the same `dir`,
/// `world` and `step`, and its [`JobReport::state_parts`](regflow_runtime::JobReport::state_parts).
///
/// A directory takes one checkpoint: saving into one that holds an index already is an
/// error. [`checkpoint_dir`] names a directory per step.
pub fn save_sharded(
    dir: &Path,
    rank: u32,
    world: u32,
    step: u64,
    parts: &[StatePart],
    extra: &serde_json::Value,
) -> Result<(), TrainError> {
    save_sharded_within(dir, rank, world, step, parts, extra, DEFAULT_RANK_WAIT)
}

/// [`save_sharded`] where rank 0 waits at most `rank_wait` for the other ranks' lists
/// before failing with [`TrainError::RanksMissing`], naming them.
pub fn save_sharded_within(
    dir: &Path,
    rank: u32,
    world: u32,
    step: u64,
    parts: &[StatePart],
    extra: &serde_json::Value,
    rank_wait: Duration,
) -> Result<(), TrainError> {
    let shown = dir.display().to_string();
    let refuse = |problem: String| TrainError::ShardSave { path: shown.clone(), problem };
    if rank >= world {
        return Err(refuse(format!("rank {rank} is not a rank of a world of {world}")));
    }
    if dir.join(INDEX_FILE).exists() {
        return Err(refuse(format!(
            "it holds a complete checkpoint already ({INDEX_FILE}); save each checkpoint into a directory of its own"
        )));
    }
    std::fs::create_dir_all(dir).map_err(|e| refuse(format!("the directory cannot be created: {e}")))?;
    let list = write_shard(dir, rank, world, step, parts)?;
    write_atomic(&dir.join(format!("rank{rank}.json")), &to_json(&list))?;
    if rank == 0 {
        let lists = wait_for_ranks(dir, world, step, rank_wait)?;
        write_atomic(&dir.join(INDEX_FILE), &to_json(&merge(step, world, extra, lists)))?;
    }
    Ok(())
}

/// A background save started by [`save_sharded_async`].
#[derive(Debug)]
pub struct SaveHandle {
    dir: PathBuf,
    thread: std::thread::JoinHandle<Result<(), TrainError>>,
}

impl SaveHandle {
    /// Waits for the save to end; its error, if it failed.
    pub fn wait(self) -> Result<(), TrainError> {
        let path = self.dir.display().to_string();
        self.thread
            .join()
            .unwrap_or_else(|_| Err(TrainError::ShardSave { path, problem: "the saving thread panicked".into() }))
    }

    /// Whether the save has ended (then [`SaveHandle::wait`] returns at once).
    pub fn is_finished(&self) -> bool {
        self.thread.is_finished()
    }
}

/// [`save_sharded`] on a thread of its own: the parts are already a host copy (the job's
/// report), so training goes on while they are serialized and written.
pub fn save_sharded_async(
    dir: PathBuf,
    rank: u32,
    world: u32,
    step: u64,
    parts: Vec<StatePart>,
    extra: serde_json::Value,
) -> SaveHandle {
    let thread = {
        let dir = dir.clone();
        std::thread::spawn(move || save_sharded(&dir, rank, world, step, &parts, &extra))
    };
    SaveHandle { dir, thread }
}

/// The name of a part's tensor in its shard file: `w1@0_8` (a scalar's: `step@`).
fn tensor_name(variable: &str, offsets: &[usize]) -> String {
    let offsets: Vec<String> = offsets.iter().map(usize::to_string).collect();
    format!("{variable}@{}", offsets.join("_"))
}

/// Writes `rank{rank}.safetensors` and returns the list of what it holds.
fn write_shard(dir: &Path, rank: u32, world: u32, step: u64, parts: &[StatePart]) -> Result<RankList, TrainError> {
    let file = format!("rank{rank}.safetensors");
    let path = dir.join(&file);
    let shown = path.display().to_string();
    let bytes: Vec<Cow<'_, [u8]>> = parts.iter().map(|p| le_bytes(&p.value)).collect();
    let mut variables: Vec<VariableRecord> = Vec::new();
    let mut views = Vec::with_capacity(parts.len());
    for (part, data) in parts.iter().zip(&bytes) {
        let tensor = tensor_name(&part.variable, &part.offsets);
        let shape = part.value.shape.dims().to_vec();
        let fits = part.offsets.len() == part.meta.shape.rank()
            && part.offsets.iter().zip(&shape).zip(part.meta.shape.dims()).all(|((o, n), whole)| o + n <= *whole);
        if !fits || part.value.dtype() != part.meta.dtype {
            return Err(TrainError::ShardSave {
                path: shown,
                problem: format!(
                    "part '{tensor}' ({}) at offsets {:?} is not a part of a {} tensor",
                    part.value.meta(),
                    part.offsets,
                    part.meta
                ),
            });
        }
        let view = TensorView::new(safetensors_dtype(part.meta.dtype), shape.clone(), data).map_err(|_| {
            TrainError::ShardSave { path: shown.clone(), problem: format!("part '{tensor}' cannot be written") }
        })?;
        let record = PartRecord {
            file: file.clone(),
            tensor: tensor.clone(),
            offsets: part.offsets.clone(),
            shape,
            checksum: checksum(data),
        };
        match variables.iter_mut().find(|v| v.name == part.variable) {
            Some(variable) => variable.parts.push(record),
            None => variables.push(VariableRecord {
                name: part.variable.clone(),
                dtype: part.meta.dtype,
                shape: part.meta.shape.dims().to_vec(),
                parts: vec![record],
            }),
        }
        views.push((tensor, view));
    }
    let length = write_atomic_with(&path, |temp| {
        safetensors::tensor::serialize_to_file(views, &None, temp).map_err(|e| {
            CheckpointError::NotSafetensors { path: shown.clone(), reason: safetensors_problem(&e) }.into()
        })
    })?;
    Ok(RankList { format: FORMAT.into(), rank, world, step, file, bytes: length, variables })
}

/// Waits until every `rank{k}.json` of `dir` exists and reads them, in rank order; an
/// error naming the ranks still missing after `limit`, or a list of another save.
fn wait_for_ranks(dir: &Path, world: u32, step: u64, limit: Duration) -> Result<Vec<RankList>, TrainError> {
    let start = Instant::now();
    let mut lists: Vec<Option<RankList>> = vec![None; world as usize];
    loop {
        for (rank, slot) in lists.iter_mut().enumerate().filter(|(_, s)| s.is_none()) {
            let path = dir.join(format!("rank{rank}.json"));
            if !path.is_file() {
                continue;
            }
            let list: RankList = read_json(&path)?;
            if list.format != FORMAT || list.rank != rank as u32 || list.world != world || list.step != step {
                return Err(TrainError::ShardIndex {
                    path: path.display().to_string(),
                    problem: format!(
                        "it lists rank {} of {} at step {}, not rank {rank} of {world} at step {step}: another save wrote into this directory",
                        list.rank, list.world, list.step
                    ),
                });
            }
            *slot = Some(list);
        }
        if lists.iter().all(Option::is_some) {
            return Ok(lists.into_iter().flatten().collect());
        }
        if start.elapsed() >= limit {
            let missing = lists.iter().enumerate().filter(|(_, l)| l.is_none()).map(|(r, _)| r as u32).collect();
            return Err(TrainError::RanksMissing { path: dir.display().to_string(), missing, waited: limit });
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The index of the ranks' lists.
fn merge(step: u64, world: u32, extra: &serde_json::Value, lists: Vec<RankList>) -> Index {
    let files = lists.iter().map(|l| (l.file.clone(), l.bytes)).collect();
    let mut variables: Vec<VariableRecord> = Vec::new();
    for variable in lists.into_iter().flat_map(|l| l.variables) {
        match variables.iter_mut().find(|v| v.name == variable.name) {
            Some(known) => known.parts.extend(variable.parts),
            None => variables.push(variable),
        }
    }
    Index { format: FORMAT.into(), step, world, extra: extra.clone(), files, variables }
}

/// A loaded sharded checkpoint: the step it was saved after, how many ranks wrote it, the
/// caller's `extra` value, and every variable as a whole tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardedCheckpoint {
    /// The step it was saved after.
    pub step: u64,
    /// How many ranks wrote it.
    pub world: u32,
    /// What the caller gave [`save_sharded`] on rank 0.
    pub extra: serde_json::Value,
    tensors: Vec<(String, HostArray)>,
}

impl ShardedCheckpoint {
    /// Every variable, whole, as a [`StateDict`] to load into a job of any layout
    /// ([`LoadStateDict::load_state_dict`](super::LoadStateDict::load_state_dict) cuts
    /// it again by the new plan).
    pub fn state_dict(&self) -> StateDict {
        StateDict::from(self.tensors.clone())
    }

    /// [`ShardedCheckpoint::state_dict`] without a copy.
    pub fn into_state_dict(self) -> StateDict {
        StateDict::from(self.tensors)
    }

    /// The whole value of `name`.
    pub fn get(&self, name: &str) -> Option<&HostArray> {
        self.tensors.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }
}

/// Reads the checkpoint in `dir` ([`save_sharded`]'s): its index, every shard file, each
/// part checked against the index (present, same dtype and shape, same checksum) and put
/// into its whole tensor; an error naming the file and the tensor at the first problem,
/// and nothing loaded. Every element of every tensor must be in some part.
pub fn load_sharded(dir: &Path) -> Result<ShardedCheckpoint, TrainError> {
    let index_path = dir.join(INDEX_FILE);
    let index: Index = read_json(&index_path)?;
    let index_error = |problem: String| TrainError::ShardIndex { path: index_path.display().to_string(), problem };
    if index.format != FORMAT {
        return Err(index_error(format!("its format is '{}', not '{FORMAT}'", index.format)));
    }
    if index.files.len() != index.world as usize {
        return Err(index_error(format!("it lists {} shard files for {} ranks", index.files.len(), index.world)));
    }
    let mut buffers: Vec<(&str, String, Vec<u8>)> = Vec::with_capacity(index.files.len());
    for (file, bytes) in &index.files {
        if Path::new(file).components().count() != 1 {
            return Err(index_error(format!("shard file '{file}' is not a file name in the checkpoint directory")));
        }
        let path = dir.join(file);
        buffers.push((file, path.display().to_string(), read_shard(&path, *bytes)?));
    }
    let mut files: HashMap<&str, Shard<'_>> = HashMap::new();
    for (file, path, buffer) in &buffers {
        let tensors = SafeTensors::deserialize(buffer)
            .map_err(|e| CheckpointError::NotSafetensors { path: path.clone(), reason: safetensors_problem(&e) })?;
        files.insert(file, Shard { path, tensors });
    }
    let mut tensors = Vec::with_capacity(index.variables.len());
    for variable in &index.variables {
        let meta = TensorMeta::new(variable.shape.clone(), variable.dtype);
        meta.check_size().map_err(|e| index_error(format!("tensor '{}': {e}", variable.name)))?;
        let mut whole = HostArray::zeros(&meta);
        let mut covered = vec![false; meta.shape.numel()];
        for part in &variable.parts {
            let shard = files.get(part.file.as_str()).ok_or_else(|| {
                index_error(format!(
                    "part '{}' of '{}' is in '{}', which it lists for no rank",
                    part.tensor, variable.name, part.file
                ))
            })?;
            let value = shard.part(variable, part)?;
            copy_into(&mut whole, &mut covered, &part.offsets, &value);
        }
        if let Some((region, missing)) = uncovered(meta.shape.dims(), &covered) {
            return Err(TrainError::ShardCoverage {
                path: dir.display().to_string(),
                tensor: variable.name.clone(),
                region,
                missing,
                total: covered.len(),
            });
        }
        tensors.push((variable.name.clone(), whole));
    }
    Ok(ShardedCheckpoint { step: index.step, world: index.world, extra: index.extra, tensors })
}

/// The bytes of shard file `path`, checked to be the length the index gives.
fn read_shard(path: &Path, bytes: u64) -> Result<Vec<u8>, TrainError> {
    let shown = path.display().to_string();
    let buffer = std::fs::read(path).map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => {
            TrainError::ShardFile { path: shown.clone(), problem: "it is missing (the index lists it)".into() }
        }
        _ => CheckpointError::Io { path: shown.clone(), action: "read", source }.into(),
    })?;
    if buffer.len() as u64 != bytes {
        let how = if (buffer.len() as u64) < bytes { "cut short" } else { "longer than written" };
        return Err(TrainError::ShardFile {
            path: shown,
            problem: format!("it is {} bytes, the index says {bytes}: it is {how}", buffer.len()),
        });
    }
    Ok(buffer)
}

/// A shard file read into memory, its safetensors header parsed.
struct Shard<'a> {
    path: &'a str,
    tensors: SafeTensors<'a>,
}

impl Shard<'_> {
    /// The part `part` of `variable`, checked against the index.
    fn part(&self, variable: &VariableRecord, part: &PartRecord) -> Result<HostArray, TrainError> {
        let bad = |problem: String| TrainError::ShardFile {
            path: self.path.to_string(),
            problem: format!("tensor '{}' (part of '{}'): {problem}", part.tensor, variable.name),
        };
        let view = self
            .tensors
            .tensor(&part.tensor)
            .map_err(|_| bad("the file has no such tensor (the index lists it)".into()))?;
        if view.dtype() != safetensors_dtype(variable.dtype) {
            return Err(bad(format!(
                "it holds {} values, the index says {}",
                dtype_name(view.dtype()),
                variable.dtype
            )));
        }
        if view.shape() != part.shape.as_slice() {
            return Err(bad(format!(
                "its shape is {}, the index says {}",
                Shape::from(view.shape()),
                Shape::from(part.shape.as_slice())
            )));
        }
        let fits = part.offsets.len() == variable.shape.len()
            && part.offsets.iter().zip(&part.shape).zip(&variable.shape).all(|((o, n), whole)| o + n <= *whole);
        if !fits {
            return Err(bad(format!(
                "a part of shape {} at offsets {:?} does not fit the whole shape {}",
                Shape::from(part.shape.as_slice()),
                part.offsets,
                Shape::from(variable.shape.as_slice())
            )));
        }
        if checksum(view.data()) != part.checksum {
            return Err(bad("its data is corrupt: the checksum differs from the one written".into()));
        }
        let meta = TensorMeta::new(part.shape.clone(), variable.dtype);
        from_le_bytes(&meta, view.data()).map_err(bad)
    }
}

fn safetensors_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::I64 => Dtype::I64,
        DType::Bf16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
    }
}

fn to_json<T: Serialize>(value: &T) -> Vec<u8> {
    // A tree of strings, numbers and JSON values: serializing it cannot fail.
    serde_json::to_vec_pretty(value).unwrap_or_default()
}

/// Reads a JSON file of the checkpoint; an error naming it when it is missing or is not
/// what the format says.
fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, TrainError> {
    let shown = path.display().to_string();
    let text = std::fs::read(path)
        .map_err(|e| TrainError::ShardIndex { path: shown.clone(), problem: format!("it cannot be read: {e}") })?;
    serde_json::from_slice(&text).map_err(|e| TrainError::ShardIndex {
        path: shown,
        problem: format!("it is not the JSON of a sharded checkpoint: {e}"),
    })
}

/// Writes `bytes` to `path` whole or not at all ([`write_atomic_with`]).
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    write_atomic_with(path, |temp| {
        std::fs::write(temp, bytes).map_err(|source| {
            CheckpointError::Io { path: temp.display().to_string(), action: "written", source }.into()
        })
    })
    .map(|_| ())
}

/// Has `write` write `path` under a temporary name, then syncs it, renames it and syncs
/// the directory, so that `path` is whole or absent even after a crash; the file's length.
fn write_atomic_with(path: &Path, write: impl FnOnce(&Path) -> Result<(), TrainError>) -> Result<u64, TrainError> {
    let shown = path.display().to_string();
    let io = |source: std::io::Error| CheckpointError::Io { path: shown.clone(), action: "written", source };
    let mut temp = path.as_os_str().to_owned();
    temp.push(".tmp");
    let temp = PathBuf::from(temp);
    write(&temp)?;
    let file = std::fs::OpenOptions::new().write(true).open(&temp).map_err(io)?;
    file.sync_all().map_err(io)?;
    let length = file.metadata().map_err(io)?.len();
    drop(file);
    std::fs::rename(&temp, path).map_err(io)?;
    if let Some(dir) = path.parent() {
        // Not every platform opens directories; the rename itself is atomic either way.
        if let Ok(dir) = std::fs::File::open(dir) {
            let _ = dir.sync_all();
        }
    }
    Ok(length)
}

/// A tensor's little-endian bytes: its own memory on a little-endian machine, a copy
/// otherwise.
fn le_bytes(value: &HostArray) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "big") {
        return Cow::Owned(value.to_le_bytes());
    }
    match &value.data {
        HostData::F32(v) => Cow::Borrowed(bytemuck::cast_slice(v)),
        HostData::F64(v) => Cow::Borrowed(bytemuck::cast_slice(v)),
        HostData::I64(v) => Cow::Borrowed(bytemuck::cast_slice(v)),
        HostData::Bf16(v) => Cow::Borrowed(bytemuck::cast_slice(v)),
        HostData::F16(v) => Cow::Borrowed(bytemuck::cast_slice(v)),
    }
}

/// The tensor of `meta` whose little-endian bytes are `bytes` (as many as `meta` needs).
fn from_le_bytes(meta: &TensorMeta, bytes: &[u8]) -> Result<HostArray, String> {
    if cfg!(target_endian = "big") || meta.checked_bytes() != Some(bytes.len()) {
        return HostArray::from_le_bytes(meta, bytes).map_err(|e| e.to_string());
    }
    // Copied into an aligned vector whatever the bytes' alignment in the file.
    fn collect<T: bytemuck::Pod + Default>(bytes: &[u8]) -> Vec<T> {
        let mut values = vec![T::default(); bytes.len() / std::mem::size_of::<T>()];
        bytemuck::cast_slice_mut(&mut values).copy_from_slice(bytes);
        values
    }
    let data = match meta.dtype {
        DType::F32 => HostData::F32(collect(bytes)),
        DType::F64 => HostData::F64(collect(bytes)),
        DType::I64 => HostData::I64(collect(bytes)),
        DType::Bf16 => HostData::Bf16(collect(bytes)),
        DType::F16 => HostData::F16(collect(bytes)),
    };
    HostArray::new(meta.shape.clone(), data).map_err(|e| e.to_string())
}

/// A 64-bit checksum of `bytes` (four multiply-rotate lanes over 8-byte words): any change
/// of one word changes it.
fn checksum(bytes: &[u8]) -> u64 {
    const MULTIPLIER: u64 = 0x9E37_79B9_7F4A_7C15;
    let mix = |state: u64, word: u64| (state ^ word).wrapping_mul(MULTIPLIER).rotate_left(29);
    let word = |chunk: &[u8]| {
        let mut w = [0u8; 8];
        w[..chunk.len()].copy_from_slice(chunk);
        u64::from_le_bytes(w)
    };
    let mut lanes = [0x243F_6A88_85A3_08D3u64, 0x1319_8A2E_0370_7344, 0xA409_3822_299F_31D0, 0x082E_FA98_EC4E_6C89];
    let blocks = bytes.chunks_exact(32);
    let rest = blocks.remainder();
    for block in blocks {
        for (lane, chunk) in lanes.iter_mut().zip(block.chunks_exact(8)) {
            *lane = mix(*lane, word(chunk));
        }
    }
    for chunk in rest.chunks(8) {
        lanes[0] = mix(lanes[0], word(chunk));
    }
    lanes.iter().fold(mix(0, bytes.len() as u64), |state, &lane| mix(state, lane))
}

#[cfg(test)]
mod tests {
    use super::{checksum, from_le_bytes, le_bytes, tensor_name};
    use regflow_plan::{DType, HostArray, TensorMeta};

    #[test]
    fn bytes_are_little_endian_both_ways() {
        let value = HostArray::f64([3], vec![1.5, -2.0, 1e300]).unwrap();
        assert_eq!(le_bytes(&value).as_ref(), value.to_le_bytes().as_slice());
        // Unaligned bytes are copied into an aligned tensor.
        let mut bytes = vec![0u8];
        bytes.extend(value.to_le_bytes());
        assert_eq!(from_le_bytes(&value.meta(), &bytes[1..]), Ok(value));
        let err = from_le_bytes(&TensorMeta::new([2], DType::I64), &[0; 9]).unwrap_err();
        assert!(err.contains("needs 2 values"), "{err}");
    }

    #[test]
    fn a_change_of_one_byte_changes_the_checksum() {
        let bytes: Vec<u8> = (0..100u8).collect();
        let base = checksum(&bytes);
        for at in [0, 7, 31, 32, 99] {
            let mut changed = bytes.clone();
            changed[at] ^= 1;
            assert_ne!(checksum(&changed), base, "byte {at}");
        }
        assert_ne!(checksum(&bytes[..99]), base);
    }

    #[test]
    fn parts_are_named_by_their_offsets() {
        assert_eq!(tensor_name("w1", &[0, 8]), "w1@0_8");
        assert_eq!(tensor_name("step", &[]), "step@");
    }
}
