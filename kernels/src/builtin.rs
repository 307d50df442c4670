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
/// copied, the others added, the sum scaled by 1/k on the last).
pub(crate) struct AccumulateMean<T>(pub(crate) std::marker::PhantomData<T>);

impl<T: Real + bytemuck::Pod> Kernel for AccumulateMean<T> {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let group = io.group();
        let input: &[T] =
            bytemuck::try_cast_slice(io.input(0)).map_err(|e| KernelError(format!("accumulate_mean: {e}")))?;
        let out: &mut [T] =
            bytemuck::try_cast_slice_mut(io.output(0)).map_err(|e| KernelError(format!("accumulate_mean: {e}")))?;
        if group.index == 0 {
            out.copy_from_slice(input);
        } else {
            for (o, &x) in out.iter_mut().zip(input) {
                *o += x;
            }
        }
        if group.index + 1 == group.count {
            let scale = T::from_f64(1.0 / f64::from(group.count));
            for o in out.iter_mut() {
                *o = *o * scale;
            }
        }
        Ok(())
    }
}
