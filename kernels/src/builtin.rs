//! Kernels every device has: no-op, copy, f32 sum, and the mean over an acc group.

use crate::{Kernel, KernelError, KernelIo};
use regflow_plan::Real;

/// Does nothing (ticks, gates).
pub(crate) struct Noop;

impl Kernel for Noop {
    fn run(&mut self, _io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        Ok(())
    }

    /// Nothing to compute, but its completion (a repeat's hand-off, a tick) must come after
    /// the stream's earlier work: queued, so a device stream orders it without draining.
    fn execution(&self) -> crate::Execution {
        crate::Execution::Queued
    }
}

/// Copies input 0 into every output, up to the shorter length.
pub(crate) struct CopyKernel;

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
pub(crate) struct SumF32;

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

/// The kernel of an acc actor under gradient accumulation (op type
/// [`regflow_plan::ops::ACCUMULATE_MEAN`]): the mean of a group of pieces (the first is
/// copied, the others added, the sum scaled by 1/k on the last). The last piece is added
/// and scaled in one pass, `(sum + x) · (1/k)`: the same two roundings as adding, then
/// scaling in a pass of its own, one read and write of the output fewer (the output is a
/// whole gradient, and this kernel is bound by memory).
pub(crate) struct AccumulateMean<T>(pub(crate) std::marker::PhantomData<T>);

impl<T: Real + bytemuck::Pod> Kernel for AccumulateMean<T> {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let (group, threads) = (io.group(), io.context().threads);
        let input: &[T] =
            bytemuck::try_cast_slice(io.input(0)).map_err(|e| KernelError(format!("accumulate_mean: {e}")))?;
        let out: &mut [T] =
            bytemuck::try_cast_slice_mut(io.output(0)).map_err(|e| KernelError(format!("accumulate_mean: {e}")))?;
        let scale = T::from_f64(1.0 / f64::from(group.count.max(1)));
        let (first, last) = (group.index == 0, group.index + 1 >= group.count);
        let len = out.len().min(input.len());
        let step = |out: &mut [T], input: &[T]| match (first, last) {
            (true, false) => out.copy_from_slice(input),
            (true, true) => out.iter_mut().zip(input).for_each(|(o, &x)| *o = x * scale),
            (false, false) => out.iter_mut().zip(input).for_each(|(o, &x)| *o += x),
            (false, true) => out.iter_mut().zip(input).for_each(|(o, &x)| *o = (*o + x) * scale),
        };
        // A whole gradient per firing, bound by memory: on all the device's threads where it
        // is large, each element still one thread's (the same bits on any count).
        let threads = if len >= crate::cpu::shares::ROWS_PARALLEL_MIN_ELEMENTS { threads } else { 1 };
        let (out, input) = (&mut out[..len], &input[..len]);
        if threads <= 1 {
            step(out, input);
            return Ok(());
        }
        let out = crate::cpu::shares::DisjointParts::new(out);
        crate::cpu::shares::in_shares(threads, len, |range| {
            // SAFETY: shares are disjoint ranges of the output.
            step(unsafe { out.part(range.clone()) }, &input[range]);
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::StreamContext;
    use regflow_memory::{Arena, MemoryKind};
    use regflow_plan::GroupPosition;

    /// Groups of 1 to 4 pieces: the mean is the bits of copying the first piece, adding
    /// the others one by one and scaling the sum in a pass of its own.
    #[test]
    fn the_mean_of_a_group_has_the_bits_of_adding_then_scaling() {
        for (len, threads) in [(37, 1), (37, 2), (1 << 16, 1), ((1 << 16) + 3, 2), ((1 << 16) + 3, 3)] {
            mean_of_groups(len, threads);
        }
    }

    /// [`the_mean_of_a_group_has_the_bits_of_adding_then_scaling`] over `len` elements on
    /// `threads`.
    fn mean_of_groups(len: usize, threads: usize) {
        let slot = (4 * len as u64).next_multiple_of(256);
        let arena = Arena::allocate("test", MemoryKind::Host, 2 * slot).unwrap();
        let views = [arena.view(0, 4 * len as u64).unwrap(), arena.view(slot, 4 * len as u64).unwrap()];
        let context = StreamContext { threads, ..StreamContext::default() };
        let piece =
            |p: u32| -> Vec<f32> { (0..len).map(|i| ((i as f32) * 0.37 + p as f32 * 1.13).sin() * 3.1).collect() };
        for count in 1..=4u32 {
            let mut kernel = AccumulateMean::<f32>(std::marker::PhantomData);
            let mut want = piece(0);
            for p in 1..count {
                want.iter_mut().zip(piece(p)).for_each(|(w, x)| *w += x);
            }
            let scale = (1.0 / f64::from(count)) as f32;
            want.iter_mut().for_each(|w| *w *= scale);
            for p in 0..count {
                // SAFETY: the views are disjoint, and the kernel is not running.
                unsafe { views[0].as_mut_slice().copy_from_slice(bytemuck::cast_slice(&piece(p))) };
                let group = GroupPosition { index: p, count };
                kernel.run(&mut KernelIo::new(u64::from(p), group, &views[..1], &views[1..], &context)).unwrap();
            }
            // SAFETY: the kernel has finished.
            let got: Vec<f32> = bytemuck::cast_slice(unsafe { views[1].as_slice() }).to_vec();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "a group of {count}, {len} elements on {threads} threads");
        }
    }
}
