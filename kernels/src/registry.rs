//! The kernel registry: factories keyed by (op type, device kind, dtype) for the ops a plan
//! names as data, and by name for kernels an embedding program brings itself.

use crate::builtin::{CopyKernel, Noop, SumF32};
use crate::{Kernel, KernelError};
use regflow_plan::{DType, DeviceKind, KernelConf, OpConf};
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

/// Makes a kernel for one actor.
pub type KernelFactory = Arc<dyn Fn(&KernelSpec<'_>) -> Result<Box<dyn Kernel>, KernelError> + Send + Sync>;

/// What a kernel factory knows about the actor it serves.
#[derive(Debug)]
pub struct KernelSpec<'a> {
    /// Actor name.
    pub actor: &'a str,
    /// Kind of the actor's device.
    pub device: DeviceKind,
    /// Index of the device among its node's devices of that kind (the CUDA ordinal).
    pub device_index: u16,
    /// The op, for actors that run one ([`KernelConf::Op`]).
    pub op: Option<&'a OpConf>,
    /// Bytes per slot of each input.
    pub input_bytes: &'a [u64],
    /// Bytes per slot of each output.
    pub output_bytes: &'a [u64],
    /// For each input, for how many consecutive pieces (from piece 0) it holds the same
    /// bytes ([`Plan::input_repeats`](regflow_plan::Plan::input_repeats)): a kernel may
    /// keep what it derives from it that long. Empty: 1 for every input.
    pub input_repeats: &'a [u64],
}

/// The key of an op kernel: which op, on which kind of device, for which element type.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KernelKey {
    /// Op type ([`OpConf::op_type`]).
    pub op_type: String,
    /// Device kind.
    pub device: DeviceKind,
    /// Element type ([`OpConf::dtype`]).
    pub dtype: DType,
}

impl fmt::Display for KernelKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "op '{}' on device kind {} with dtype {}", self.op_type, self.device.name(), self.dtype)
    }
}

/// Kernel factories: op kernels by (op type, device kind, dtype), named kernels
/// ([`KernelConf::Custom`]) registered by the program that builds a job, and the register
/// copy ([`KernelConf::Copy`]) of devices that copy on the device (a host copy otherwise).
#[derive(Clone, Default)]
pub struct KernelRegistry {
    ops: HashMap<KernelKey, KernelFactory>,
    named: HashMap<String, KernelFactory>,
    copies: HashMap<DeviceKind, KernelFactory>,
}

impl fmt::Debug for KernelRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut ops: Vec<String> = self.ops.keys().map(ToString::to_string).collect();
        ops.sort_unstable();
        let mut named: Vec<&String> = self.named.keys().collect();
        named.sort_unstable();
        f.debug_struct("KernelRegistry").field("ops", &ops).field("named", &named).finish()
    }
}

impl KernelRegistry {
    /// An empty registry (devices add their kernels with [`KernelRegistry::register_op`]).
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers the kernel of `op_type` on `device` for `dtype`, replacing any before it.
    pub fn register_op(&mut self, op_type: &str, device: DeviceKind, dtype: DType, factory: KernelFactory) {
        self.ops.insert(KernelKey { op_type: op_type.to_string(), device, dtype }, factory);
    }

    /// Registers the kernel of [`KernelConf::Copy`] on `device` (a variable's per-step
    /// assign, copies out of windows), replacing the host copy every device has otherwise.
    pub fn register_copy(&mut self, device: DeviceKind, factory: KernelFactory) {
        self.copies.insert(device, factory);
    }

    /// Registers a named kernel for [`KernelConf::Custom`] (and custom sources).
    pub fn register_named(&mut self, name: &str, factory: KernelFactory) {
        self.named.insert(name.to_string(), factory);
    }

    /// Whether an op kernel is registered for `key`.
    pub fn has_op(&self, key: &KernelKey) -> bool {
        self.ops.contains_key(key)
    }

    /// Every (op, device, dtype) with a kernel, in no particular order.
    pub fn op_keys(&self) -> impl Iterator<Item = &KernelKey> + '_ {
        self.ops.keys()
    }

    /// Builds the kernel `conf` names for the actor `spec` describes. Collectives are not
    /// made here: they need the job's rendezvous, which the runtime owns.
    pub fn make(&self, conf: &KernelConf, spec: &KernelSpec<'_>) -> Result<Box<dyn Kernel>, KernelError> {
        Ok(match conf {
            KernelConf::Noop => Box::new(Noop),
            KernelConf::Copy => match self.copies.get(&spec.device) {
                Some(factory) => factory(spec)?,
                None => Box::new(CopyKernel),
            },
            KernelConf::SumF32 => {
                for (i, bytes) in spec.input_bytes.iter().chain(spec.output_bytes).enumerate() {
                    if bytes % 4 != 0 {
                        return Err(KernelError(format!(
                            "sum_f32 in actor '{}': register {i} has {bytes} bytes, not a whole number of f32",
                            spec.actor
                        )));
                    }
                }
                Box::new(SumF32)
            }
            KernelConf::Op(op) => self.make_op(op, spec)?,
            KernelConf::Custom { name } => self.make_named(name, spec)?,
            KernelConf::Collective(c) => {
                return Err(KernelError(format!(
                    "actor '{}' runs collective '{}', which only a job's collective groups can make (broken invariant)",
                    spec.actor, c.group
                )))
            }
        })
    }

    /// Builds a named kernel.
    pub fn make_named(&self, name: &str, spec: &KernelSpec<'_>) -> Result<Box<dyn Kernel>, KernelError> {
        let factory = self.named.get(name).ok_or_else(|| {
            let mut known: Vec<&str> = self.named.keys().map(String::as_str).collect();
            known.sort_unstable();
            let registered = match (known.is_empty(), nearest(name, &known)) {
                (true, _) => "the job registers no kernels by name: add it with JobBuilder::kernel".to_string(),
                (false, Some(near)) => format!("registered: {}; did you mean '{near}'?", known.join(", ")),
                (false, None) => format!("registered: {}", known.join(", ")),
            };
            KernelError(format!("actor '{}' names kernel '{name}', which is not registered ({registered})", spec.actor))
        })?;
        factory(spec)
    }

    fn make_op(&self, op: &OpConf, spec: &KernelSpec<'_>) -> Result<Box<dyn Kernel>, KernelError> {
        let key = KernelKey { op_type: op.op_type.clone(), device: spec.device, dtype: op.dtype() };
        let Some(factory) = self.ops.get(&key) else { return Err(self.missing(&key)) };
        check_metas(op, spec)?;
        let with_op = KernelSpec { op: Some(op), ..*spec };
        factory(&with_op)
    }

    /// The error for a missing kernel: which op, device and dtype (the caller names the
    /// actor), and what the registry does have (the nearest op type, or the dtypes and devices of this op).
    fn missing(&self, key: &KernelKey) -> KernelError {
        let mut same_op: Vec<String> = self
            .ops
            .keys()
            .filter(|k| k.op_type == key.op_type)
            .map(|k| format!("{} {}", k.device.name(), k.dtype))
            .collect();
        same_op.sort_unstable();
        same_op.dedup();
        let hint = if !same_op.is_empty() {
            format!("; '{}' has kernels for: {}", key.op_type, same_op.join(", "))
        } else {
            let mut types: Vec<&str> = self.ops.keys().map(|k| k.op_type.as_str()).collect();
            types.sort_unstable();
            types.dedup();
            match nearest(&key.op_type, &types) {
                Some(near) => format!("; no device has op type '{}' (did you mean '{near}'?)", key.op_type),
                None => format!("; no device has op type '{}'", key.op_type),
            }
        };
        KernelError(format!("no kernel is registered for {key}{hint}"))
    }
}

/// The metas must describe the registers: the same bytes, and any registers besides the
/// op's tensors zero-byte tokens.
fn check_metas(op: &OpConf, spec: &KernelSpec<'_>) -> Result<(), KernelError> {
    let fail = |m: String| KernelError(format!("op '{}': {m}", op.op_type));
    if op.inputs.len() != op.input_map.len() {
        return Err(fail(format!(
            "{} input metas but an input map of {} entries",
            op.inputs.len(),
            op.input_map.len()
        )));
    }
    for (k, (meta, &i)) in op.inputs.iter().zip(&op.input_map).enumerate() {
        let Some(&bytes) = spec.input_bytes.get(i) else {
            return Err(fail(format!("input {k} reads actor input {i}, but the actor has {}", spec.input_bytes.len())));
        };
        if meta_bytes(meta) != Some(bytes) {
            return Err(fail(format!(
                "input {k} is {meta} ({}), but its register has {bytes} bytes",
                bytes_phrase(meta)
            )));
        }
    }
    // Registers past the op's outputs are zero-byte tokens (ordering and gates).
    if op.outputs.len() > spec.output_bytes.len() || spec.output_bytes[op.outputs.len()..].iter().any(|&b| b != 0) {
        return Err(fail(format!(
            "{} output metas, but the actor produces registers of {:?} bytes (extra registers must be zero-byte tokens)",
            op.outputs.len(),
            spec.output_bytes
        )));
    }
    for (k, (meta, &bytes)) in op.outputs.iter().zip(spec.output_bytes).enumerate() {
        if meta_bytes(meta) != Some(bytes) {
            return Err(fail(format!(
                "output {k} is {meta} ({}), but its register has {bytes} bytes",
                bytes_phrase(meta)
            )));
        }
    }
    Ok(())
}

/// Bytes of a tensor of `meta`, `None` past 2^64 (metas come from plan files; shapes
/// checked here are safe to count elements of afterwards).
fn meta_bytes(meta: &regflow_plan::TensorMeta) -> Option<u64> {
    meta.shape.dims().iter().try_fold(meta.dtype.size() as u64, |bytes, &len| bytes.checked_mul(len as u64))
}

fn bytes_phrase(meta: &regflow_plan::TensorMeta) -> String {
    match meta_bytes(meta) {
        Some(bytes) => format!("{bytes} bytes"),
        None => "more bytes than fit in 64 bits".into(),
    }
}

/// The candidate closest to `name` by edit distance, if it is close enough to be a typo.
pub fn nearest<'a>(name: &str, candidates: &[&'a str]) -> Option<&'a str> {
    candidates
        .iter()
        .map(|c| (edit_distance(name, c), *c))
        .filter(|(d, c)| *d <= (name.len().max(c.len()) / 3).max(2))
        .min()
        .map(|(_, c)| c)
}

/// Levenshtein distance over characters: the edits that turn `a` into `b`.
pub fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let substitute = diagonal + usize::from(ca != *cb);
            diagonal = row[j + 1];
            row[j + 1] = substitute.min(row[j] + 1).min(diagonal + 1);
        }
    }
    row[b.len()]
}
