//! Kernels: what a compute or acc actor runs, behind a small trait, plus the built-in ones.

use crate::collective::CollectiveGroups;
use regflow_actors::GroupPosition;
use regflow_graph::plan::KernelConf;
use regflow_memory::BufferView;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

/// The registers of one firing, as bytes.
///
/// Inputs are read-only, outputs writable. The register protocol guarantees that nobody
/// else writes an input, or touches an output, while the kernel runs.
#[derive(Debug)]
pub struct KernelIo<'a> {
    pub(crate) piece: u64,
    pub(crate) group: GroupPosition,
    pub(crate) inputs: &'a [BufferView],
    pub(crate) outputs: &'a [BufferView],
}

impl<'a> KernelIo<'a> {
    /// Piece number of this firing.
    pub fn piece(&self) -> u64 {
        self.piece
    }

    /// Position in an acc group: `index == 0` starts a new accumulation.
    pub fn group(&self) -> GroupPosition {
        self.group
    }

    /// Number of inputs.
    pub fn input_count(&self) -> usize {
        self.inputs.len()
    }

    /// Number of outputs.
    pub fn output_count(&self) -> usize {
        self.outputs.len()
    }

    /// Input `i`. Panics if `i` is out of range (a kernel bug, not a user error).
    pub fn input(&self, i: usize) -> &'a [u8] {
        // SAFETY: the slot is Ready for this actor and no producer writes it until the
        // actor acks it, which happens after this kernel completes; the arena outlives
        // the job's threads.
        unsafe { self.inputs[i].as_slice() }
    }

    /// Output `i` with the lifetime of the registers, so a kernel can hold several outputs
    /// at once. The caller must take each output at most once per firing: outputs are
    /// distinct registers, but two views of the same one would alias.
    pub(crate) fn output_detached(&mut self, i: usize) -> &'a mut [u8] {
        // SAFETY: as for `output`; distinct indices are distinct slots of distinct registers,
        // and the caller takes each index once.
        unsafe { self.outputs[i].as_mut_slice() }
    }

    /// Output `i`. Panics if `i` is out of range (a kernel bug, not a user error).
    pub fn output(&mut self, i: usize) -> &mut [u8] {
        // SAFETY: the slot was free (every consumer acked it) when this firing took it,
        // and no consumer reads it before this kernel completes; `&mut self` keeps two
        // borrows of one output apart.
        unsafe { self.outputs[i].as_mut_slice() }
    }
}

/// A kernel failure, with a message naming what was wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct KernelError(pub String);

/// A kernel: runs once per firing of its actor, on the actor's stream thread.
pub trait Kernel: Send {
    /// Computes the outputs of one firing from its inputs.
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError>;
}

/// Makes a kernel for one actor; registered by name with [`crate::JobBuilder::kernel`].
pub type KernelFactory = Arc<dyn Fn(&KernelSpec<'_>) -> Result<Box<dyn Kernel>, KernelError> + Send + Sync>;

/// What a kernel factory knows about the actor it serves.
#[derive(Debug)]
pub struct KernelSpec<'a> {
    /// Actor name.
    pub actor: &'a str,
    /// Bytes per slot of each input.
    pub input_bytes: &'a [u64],
    /// Bytes per slot of each output.
    pub output_bytes: &'a [u64],
}

/// Kernels registered by name, and the collective groups of the kernels made so far.
#[derive(Clone, Default)]
pub(crate) struct KernelRegistry {
    factories: HashMap<String, KernelFactory>,
    /// One table per job (a registry builds one job): collective kernels find their
    /// group's rendezvous here, and the job keeps it to wake them on abort.
    collectives: Arc<CollectiveGroups>,
}

impl fmt::Debug for KernelRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.factories.keys()).finish()
    }
}

impl KernelRegistry {
    pub(crate) fn register(&mut self, name: &str, factory: KernelFactory) {
        self.factories.insert(name.to_string(), factory);
    }

    /// The collective groups of the kernels made so far.
    pub(crate) fn collectives(&self) -> Arc<CollectiveGroups> {
        self.collectives.clone()
    }

    /// Builds the kernel a plan names.
    pub(crate) fn make(&self, conf: &KernelConf, spec: &KernelSpec<'_>) -> Result<Box<dyn Kernel>, KernelError> {
        Ok(match conf {
            KernelConf::Noop => Box::new(Noop),
            KernelConf::Copy => Box::new(CopyKernel),
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
            KernelConf::Custom { name } => {
                let factory = self.factories.get(name).ok_or_else(|| {
                    let mut known: Vec<&str> = self.factories.keys().map(String::as_str).collect();
                    known.sort_unstable();
                    KernelError(format!(
                        "actor '{}' names kernel '{name}', which is not registered (registered: [{}])",
                        spec.actor,
                        known.join(", ")
                    ))
                })?;
                factory(spec)?
            }
            KernelConf::Collective(conf) => self.collectives.make_kernel(conf, spec)?,
        })
    }
}

struct Noop;

impl Kernel for Noop {
    fn run(&mut self, _io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        Ok(())
    }
}

/// Copies input 0 into every output, up to the shorter length.
struct CopyKernel;

impl Kernel for CopyKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let src = io.input(0);
        for o in 0..io.output_count() {
            let dst = io.output(o);
            let n = dst.len().min(src.len());
            dst[..n].copy_from_slice(&src[..n]);
        }
        Ok(())
    }
}

/// Elementwise f32 sum of all inputs into every output; in an acc group, the running sum.
struct SumF32;

fn f32_at(bytes: &[u8], i: usize) -> f32 {
    let mut word = [0u8; 4];
    word.copy_from_slice(&bytes[4 * i..4 * i + 4]);
    f32::from_le_bytes(word)
}

impl Kernel for SumF32 {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let accumulate = io.group().index > 0;
        for o in 0..io.output_count() {
            let n = io.output(o).len() / 4;
            for i in 0..n {
                let mut sum = if accumulate { f32_at(io.output(o), i) } else { 0.0 };
                for k in 0..io.input_count() {
                    let input = io.input(k);
                    if input.len() >= 4 * (i + 1) {
                        sum += f32_at(input, i);
                    }
                }
                io.output(o)[4 * i..4 * i + 4].copy_from_slice(&sum.to_le_bytes());
            }
        }
        Ok(())
    }
}
