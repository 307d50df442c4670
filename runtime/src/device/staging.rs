//! Page-locked staging for what crosses between the host and a `cuda` device's registers:
//! what host-side sources write (fed pieces, a dataset's batches) goes in by queued
//! copies, and what sinks read (a fetcher's pieces, a serving callback's outputs) comes
//! out by copies the sink's stream waits for, so none faults a managed register's pages
//! over to the host.
//!
//! The compiler puts a `cuda` device's fed and dataset sources and fetch sinks on its copy
//! stream, so these copies and waits hold that stream's thread, never the compute
//! stream's: the compute stream keeps launching the step's kernels (and the next step's,
//! once its feed is in) while a feed is copied in or a loss is read back.

use crate::kernel::{Kernel, KernelError, KernelIo};
use regflow_cuda::{Device, PinnedBuffer, StreamHandle};
use regflow_kernels::Execution;
use regflow_memory::{Arena, BufferView, MemoryKind};

/// A source whose kernel writes its pieces on the host (fed pieces, a dataset's batches, a
/// program's reader), on a `cuda` device: the kernel writes into page-locked buffers, one
/// set per slot of the source's first output register, each set claimed by the slot's
/// address at its first use, and the set is copied into the registers by queued copies on
/// the source's stream.
///
/// A slot's set is written again only when the slot is written again, and a slot is free
/// only once the firing that last wrote it completed (its copies ran: the firing completes
/// at a callback queued after them) and its readers let it go. So a buffer is never
/// overwritten while a copy from it is still queued, with no wait of its own.
pub(crate) struct StagedSource {
    inner: Box<dyn Kernel>,
    slots: Vec<StagedSlot>,
}

/// One slot's page-locked outputs: an arena over one buffer, and a view of each output.
struct StagedSlot {
    /// The register slot (its output's address) that claimed this set at its first firing.
    owner: Option<u64>,
    _memory: Arena,
    views: Vec<BufferView>,
}

impl std::fmt::Debug for StagedSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagedSource").field("slots", &self.slots.len()).finish_non_exhaustive()
    }
}

impl StagedSource {
    /// `inner` writing outputs of `output_bytes` into registers of `slots` slots on CUDA
    /// device `ordinal`, its page-locked buffers allocated now (once per job).
    pub(crate) fn new(
        inner: Box<dyn Kernel>,
        ordinal: usize,
        output_bytes: &[u64],
        slots: u32,
    ) -> Result<Self, String> {
        let slots = (0..slots.max(1))
            .map(|_| {
                page_locked_views(ordinal, output_bytes).map(|(memory, views)| StagedSlot {
                    owner: None,
                    _memory: memory,
                    views,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { inner, slots })
    }
}

impl Kernel for StagedSource {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        if io.output_count() == 0 {
            return self.inner.run(io);
        }
        let views = &claim(&mut self.slots, io.output_addr(0))?.views;
        if views.len() != io.output_count() {
            return Err(KernelError(format!(
                "{} outputs for {} staged (broken invariant)",
                io.output_count(),
                views.len()
            )));
        }
        // The inner kernel writes the page-locked views; nothing reads them until the
        // copies below, queued after it returns.
        let mut staged = KernelIo::new(io.piece(), io.group(), &[], views, io.context());
        self.inner.run(&mut staged)?;
        let stream = StreamHandle(io.context().native);
        for (o, view) in views.iter().enumerate() {
            check_len(view.len(), io.output_len(o))?;
            // SAFETY: the output slot holds view.len() bytes (checked) and is free by the
            // register protocol; the view stays untouched until the slot is written again,
            // which needs this firing complete (see the type's docs).
            unsafe { regflow_cuda::copy_to_device_async(stream, io.output_addr(o), view.addr() as u64, view.len()) }
                .map_err(|e| KernelError(e.to_string()))?;
        }
        Ok(())
    }

    /// The copies are queued: the firing completes once they ran.
    fn execution(&self) -> Execution {
        Execution::Queued
    }
}

/// A sink whose kernel reads its inputs on the host (a fetcher's, or a program's callback),
/// on a `cuda` device: its inputs are first copied out into page-locked buffers by the
/// device, on the sink's stream, which waits for the copies; the kernel then reads those.
/// A host read of a managed register would fault its pages over to the host, and the next
/// kernel writing it would fault them back.
pub(crate) struct StagedSink {
    inner: Box<dyn Kernel>,
    _memory: Arena,
    views: Vec<BufferView>,
}

impl std::fmt::Debug for StagedSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagedSink").field("inputs", &self.views.len()).finish_non_exhaustive()
    }
}

impl StagedSink {
    /// `inner` reading inputs of `input_bytes` on CUDA device `ordinal`, its page-locked
    /// buffer allocated now (once per job).
    pub(crate) fn new(inner: Box<dyn Kernel>, ordinal: usize, input_bytes: &[u64]) -> Result<Self, String> {
        let (memory, views) = page_locked_views(ordinal, input_bytes)?;
        Ok(Self { inner, _memory: memory, views })
    }
}

impl Kernel for StagedSink {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        if self.views.len() != io.input_count() {
            return Err(KernelError(format!(
                "{} inputs for {} staged (broken invariant)",
                io.input_count(),
                self.views.len()
            )));
        }
        let stream = StreamHandle(io.context().native);
        for (i, view) in self.views.iter().enumerate() {
            check_len(view.len(), io.input_len(i))?;
            // SAFETY: the view is page-locked host memory this kernel owns, written only
            // here; the input holds view.len() bytes (checked), its slot held by this
            // firing: nothing writes it until the firing acks it, after this returns.
            let staged = unsafe { view.as_mut_slice() };
            unsafe { regflow_cuda::copy_to_host(stream, staged, io.input_addr(i)) }
                .map_err(|e| KernelError(e.to_string()))?;
        }
        // The copies were waited for: the kernel reads the page-locked views.
        let mut staged = KernelIo::new(io.piece(), io.group(), &self.views, &[], io.context());
        self.inner.run(&mut staged)
    }
}

/// One page-locked buffer of CUDA device `ordinal` holding `bytes[k]` bytes for each `k`
/// (each 256-byte aligned, as in an arena), and a view of each.
fn page_locked_views(ordinal: usize, bytes: &[u64]) -> Result<(Arena, Vec<BufferView>), String> {
    let device = Device::open(ordinal).map_err(|e| e.to_string())?;
    let offsets: Vec<u64> = bytes
        .iter()
        .scan(0u64, |at, &len| {
            let offset = *at;
            *at = (offset + len).div_ceil(256) * 256;
            Some(offset)
        })
        .collect();
    let total = offsets.last().zip(bytes.last()).map_or(0, |(o, b)| o + b);
    let total = usize::try_from(total).map_err(|_| format!("{total} bytes of staging do not fit in memory"))?;
    let buffer = PinnedBuffer::new(&device, total).map_err(|e| e.to_string())?;
    let memory = Arena::new("page-locked staging", MemoryKind::Host, Box::new(buffer));
    let views = offsets
        .iter()
        .zip(bytes)
        .map(|(&offset, &len)| memory.view(offset, len))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    Ok((memory, views))
}

/// The staging set of the register slot at `slot` (its output's address): the set that slot
/// claimed at its first firing, or the first unclaimed one. A register has as many slots as
/// there are sets, so a new slot always finds one.
fn claim(sets: &mut [StagedSlot], slot: u64) -> Result<&StagedSlot, KernelError> {
    let index = match sets.iter().position(|set| set.owner == Some(slot)) {
        Some(index) => index,
        None => {
            let count = sets.len();
            let index = sets.iter().position(|set| set.owner.is_none()).ok_or_else(|| {
                KernelError(format!("a source wrote more register slots than the {count} it stages (broken invariant)"))
            })?;
            sets[index].owner = Some(slot);
            index
        }
    };
    Ok(&sets[index])
}

/// Refuses a piece whose length is not its register's (a broken invariant: the feeder
/// checks lengths when a piece is pushed).
pub(crate) fn check_len(piece: usize, register: usize) -> Result<(), KernelError> {
    if piece == register {
        Ok(())
    } else {
        Err(KernelError(format!("{piece} bytes for a register of {register} (broken invariant)")))
    }
}
