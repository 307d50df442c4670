//! Host computation of an op on typed tensors, and the kernel that runs it on registers.
//!
//! 16-bit float tensors (bf16, f16) are computed in f32: [`HostOpKernel`] widens an op's
//! bf16 and f16 inputs into f32 buffers it allocated when it was made (from the `OpConf`
//! metas, so a firing allocates nothing), runs the op's f32 computation and rounds its
//! outputs back (nearest even; an f16 result past 65504 becomes infinity, which loss
//! scaling then sees). That is what 16-bit hardware does (tensor cores multiply bf16 or
//! f16 and accumulate in f32), and it keeps one computation per op: no kernel has a 16-bit
//! loop of its own except those that only move elements or convert them
//! ([`HostCompute::half_native`]).

use crate::io::{empty_view, view, view_mut};
use crate::{Kernel, KernelError, KernelIo};
use half::slice::HalfFloatSliceExt;
use regflow_plan::{DType, HostSlice, HostSliceMut, HostTensor, HostTensorMut, OpConf, TensorMeta};

/// What a host computation may use besides its tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostContext {
    /// Threads one computation may use: large matrix products split their output over
    /// them, optimizer updates their elements, row-wise kernels (GELU, layer norm, masked
    /// softmax, the cross-entropy's gradient) their rows. Every output element is still
    /// computed by one thread in a fixed order, so results are bitwise the same for any
    /// count (but for products on the OpenBLAS backend, see
    /// [`gemm_backend`](crate::cpu::gemm_backend)).
    pub threads: usize,
}

impl Default for HostContext {
    fn default() -> Self {
        Self { threads: 1 }
    }
}

/// An op's computation on the host: plain arithmetic on slices, no device. The CPU
/// kernels and the graph's reference evaluator both run it.
pub trait HostCompute: Send + Sync {
    /// Computes the outputs from the inputs. Inputs have the shapes the op's shape rule
    /// accepted and outputs the shapes it gave, except an input given in place: one of a
    /// pair of [`OpConf::in_place_pairs`] whose registers are one buffer arrives with no
    /// elements, and its value is in the paired output, which the op reads there (each
    /// element before it writes it).
    fn compute(
        &self,
        context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String>;

    /// Checks, at job build, that local metas fit the op's attributes beyond what the
    /// register sizes already say (a plan file may contradict itself). The default accepts.
    fn check(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Result<(), String> {
        let _ = (inputs, outputs);
        Ok(())
    }

    /// Whether [`HostCompute::compute`] takes bf16 and f16 tensors as they are (ops that
    /// move or convert elements); otherwise, the default, they reach it widened to f32.
    fn half_native(&self) -> bool {
        false
    }
}

/// f32 buffers for the 16-bit float (bf16, f16) tensors of one op: the op computes on
/// them in f32 (see the module docs). One buffer per such input and output, `None` for
/// the other dtypes.
#[derive(Debug, Default)]
pub struct HalfScratch {
    inputs: Vec<Option<Vec<f32>>>,
    outputs: Vec<Option<Vec<f32>>>,
    /// Room for the widened views of one call.
    views: ViewRoom,
}

/// Room for one firing's tensor views, kept between firings so that no firing allocates
/// for them, however many tensors its op has (a wide concat): emptied after each firing
/// and filled with views of the next one's registers in the same allocation.
#[derive(Debug, Default)]
struct ViewRoom {
    inputs: Vec<HostTensor<'static>>,
    outputs: Vec<HostTensorMut<'static>>,
}

/// `views` emptied, as a vector of another lifetime's views in the same allocation: the
/// views of one firing borrow its registers, the allocation outlives them. Collecting an
/// empty vector into one of a type of the same size and alignment reuses its allocation
/// (std's in-place collection; `kernels/tests/host_views_alloc.rs` checks it does).
fn recycle<T, U>(mut views: Vec<T>) -> Vec<U> {
    views.clear();
    views.into_iter().map(|_| -> U { unreachable!("the vector is empty") }).collect()
}

impl HalfScratch {
    /// Buffers for these metas, or `None` when no tensor is bf16 or f16 (nothing to widen).
    pub fn for_metas(inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Option<Self> {
        let sized = |m: &TensorMeta| (m.dtype, m.shape.numel());
        Self::sized(inputs.iter().map(sized), outputs.iter().map(sized))
    }

    /// Buffers for these tensors (the reference evaluator's path, which allocates per
    /// call), or `None` when no tensor is bf16 or f16.
    pub fn for_tensors(inputs: &[HostTensor<'_>], outputs: &[HostTensorMut<'_>]) -> Option<Self> {
        Self::sized(
            inputs.iter().map(|t| (t.dtype(), t.shape.numel())),
            outputs.iter().map(|t| (t.dtype(), t.shape.numel())),
        )
    }

    /// A buffer of `numel` f32 for each 16-bit float `(dtype, numel)`; `None` when there
    /// is none.
    fn sized(
        inputs: impl Iterator<Item = (DType, usize)>,
        outputs: impl Iterator<Item = (DType, usize)>,
    ) -> Option<Self> {
        let buffer = |(dtype, numel): (DType, usize)| dtype.is_half().then(|| vec![0.0f32; numel]);
        let (inputs, outputs): (Vec<_>, Vec<_>) = (inputs.map(buffer).collect(), outputs.map(buffer).collect());
        let views = ViewRoom { inputs: Vec::with_capacity(inputs.len()), outputs: Vec::with_capacity(outputs.len()) };
        let scratch = Self { inputs, outputs, views };
        scratch.any().then_some(scratch)
    }

    fn any(&self) -> bool {
        self.inputs.iter().chain(&self.outputs).any(Option::is_some)
    }

    /// Runs `op` on `inputs` and `outputs` with every bf16 or f16 tensor widened to f32 and
    /// each such output rounded back (to nearest even) from its f32 result.
    pub fn compute<T: HostCompute + ?Sized>(
        &mut self,
        op: &T,
        context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        if inputs.len() != self.inputs.len() || outputs.len() != self.outputs.len() {
            return Err(format!(
                "{} inputs and {} outputs, but the f32 scratch was made for {} and {} (broken invariant)",
                inputs.len(),
                outputs.len(),
                self.inputs.len(),
                self.outputs.len()
            ));
        }
        let mismatch = |what: &str, index: usize, len: usize, have: usize| {
            format!("16-bit {what} {index} has {len} elements, its f32 scratch {have} (broken invariant)")
        };
        for (index, (tensor, buffer)) in inputs.iter().zip(&mut self.inputs).enumerate() {
            let Some(buffer) = buffer.as_mut() else { continue };
            let widened = match tensor.data {
                HostSlice::Bf16(values) => widen(values, buffer),
                HostSlice::F16(values) => widen(values, buffer),
                _ => Ok(()),
            };
            widened.map_err(|len| mismatch("input", index, len, buffer.len()))?;
        }
        {
            let mut wide_inputs: Vec<HostTensor<'_>> = recycle(std::mem::take(&mut self.views.inputs));
            for (tensor, buffer) in inputs.iter().zip(&self.inputs) {
                wide_inputs.push(match buffer {
                    Some(buffer) => HostTensor { shape: tensor.shape, data: HostSlice::F32(buffer) },
                    None => *tensor,
                });
            }
            let mut wide_outputs: Vec<HostTensorMut<'_>> = recycle(std::mem::take(&mut self.views.outputs));
            for (index, (tensor, buffer)) in outputs.iter_mut().zip(&mut self.outputs).enumerate() {
                wide_outputs.push(match buffer {
                    Some(buffer) => {
                        if buffer.len() != tensor.shape.numel() {
                            return Err(mismatch("output", index, tensor.shape.numel(), buffer.len()));
                        }
                        HostTensorMut { shape: tensor.shape, data: HostSliceMut::F32(buffer) }
                    }
                    None => HostTensorMut { shape: tensor.shape, data: reborrow(&mut tensor.data) },
                });
            }
            let computed = op.compute(context, &wide_inputs, &mut wide_outputs);
            self.views.inputs = recycle(wide_inputs);
            self.views.outputs = recycle(wide_outputs);
            computed?;
        }
        for (index, (tensor, buffer)) in outputs.iter_mut().zip(&self.outputs).enumerate() {
            let Some(buffer) = buffer else { continue };
            let rounded = match &mut tensor.data {
                HostSliceMut::Bf16(values) => round(buffer, values),
                HostSliceMut::F16(values) => round(buffer, values),
                _ => Ok(()),
            };
            rounded.map_err(|len| mismatch("output", index, len, buffer.len()))?;
        }
        Ok(())
    }
}

/// `narrow` widened into `wide` (exact); `Err(narrow.len())` when the lengths differ.
/// `half` converts f16 slices with F16C where the processor has it.
fn widen<H>(narrow: &[H], wide: &mut [f32]) -> Result<(), usize>
where
    [H]: HalfFloatSliceExt,
{
    if narrow.len() != wide.len() {
        return Err(narrow.len());
    }
    narrow.convert_to_f32_slice(wide);
    Ok(())
}

/// `wide` rounded to nearest even into `narrow`; `Err(narrow.len())` when the lengths
/// differ.
fn round<H>(wide: &[f32], narrow: &mut [H]) -> Result<(), usize>
where
    [H]: HalfFloatSliceExt,
{
    if narrow.len() != wide.len() {
        return Err(narrow.len());
    }
    narrow.convert_from_f32_slice(wide);
    Ok(())
}

/// A shorter-lived view of the same elements.
fn reborrow<'s>(data: &'s mut HostSliceMut<'_>) -> HostSliceMut<'s> {
    match data {
        HostSliceMut::F32(v) => HostSliceMut::F32(v),
        HostSliceMut::F64(v) => HostSliceMut::F64(v),
        HostSliceMut::I64(v) => HostSliceMut::I64(v),
        HostSliceMut::Bf16(v) => HostSliceMut::Bf16(v),
        HostSliceMut::F16(v) => HostSliceMut::F16(v),
    }
}

/// Runs `op` once on host tensors, widening bf16 and f16 tensors to f32 (allocating) unless the op
/// takes them as they are: the reference evaluator's entry, where kernels have
/// [`HostOpKernel`] (which allocates its buffers once).
pub fn compute_once<T: HostCompute + ?Sized>(
    op: &T,
    context: &HostContext,
    inputs: &[HostTensor<'_>],
    outputs: &mut [HostTensorMut<'_>],
) -> Result<(), String> {
    match HalfScratch::for_tensors(inputs, outputs).filter(|_| !op.half_native()) {
        Some(mut scratch) => scratch.compute(op, context, inputs, outputs),
        None => op.compute(context, inputs, outputs),
    }
}

/// Runs one op on its actor's registers viewed as tensors of the plan's local metas.
/// The views go into room the kernel keeps from one firing to the next, so a firing
/// allocates nothing, whatever the number of its tensors.
#[derive(Debug)]
pub struct HostOpKernel<T> {
    op: T,
    op_type: String,
    inputs: Vec<TensorMeta>,
    input_map: Vec<usize>,
    outputs: Vec<TensorMeta>,
    /// f32 buffers of the 16-bit float tensors, made with the kernel (`None`: nothing to
    /// widen).
    half: Option<HalfScratch>,
    /// The (op input, op output) pairs the op may take in place
    /// ([`OpConf::in_place_pairs`]).
    in_place: Vec<(usize, usize)>,
    /// Room for one firing's views of its registers.
    views: ViewRoom,
}

impl<T: HostCompute> HostOpKernel<T> {
    /// The kernel of `op` configured by `conf` (its metas and input map).
    pub fn new(op: T, conf: &OpConf) -> Self {
        let half = if op.half_native() { None } else { HalfScratch::for_metas(&conf.inputs, &conf.outputs) };
        Self {
            op,
            half,
            op_type: conf.op_type.clone(),
            inputs: conf.inputs.clone(),
            input_map: conf.input_map.clone(),
            outputs: conf.outputs.clone(),
            in_place: conf.in_place_pairs(),
            views: ViewRoom {
                inputs: Vec::with_capacity(conf.inputs.len()),
                outputs: Vec::with_capacity(conf.outputs.len()),
            },
        }
    }

    /// Whether op input `k` is given in place in this firing: an output the op may write
    /// over it has the input's very bytes for its slot (a register with aliased slots).
    fn given_in_place(&self, io: &KernelIo<'_>, k: usize) -> bool {
        let input = self.input_map[k];
        let (addr, len) = (io.input_addr(input), io.input_len(input));
        len > 0
            && self
                .in_place
                .iter()
                .any(|&(i, o)| i == k && o < io.output_count() && io.output_addr(o) == addr && io.output_len(o) == len)
    }
}

impl<T: HostCompute> Kernel for HostOpKernel<T> {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let fail = |m: String| KernelError(format!("{}: {m}", self.op_type));
        let context = HostContext { threads: io.context().threads };
        // A tick input (constants) comes after the real ones and is not passed on.
        let mut inputs: Vec<HostTensor<'_>> = recycle(std::mem::take(&mut self.views.inputs));
        for (k, (meta, &i)) in self.inputs.iter().zip(&self.input_map).enumerate() {
            // An input whose bytes are its output's (an update over its variable's one
            // buffer) is not viewed: a shared and a mutable view of the same bytes may not
            // both exist. The op reads the old value from the output.
            if !self.given_in_place(io, k) {
                inputs.push(view(meta, io.input(i)).map_err(fail)?);
            } else if self.half.is_some() {
                return Err(fail(format!("input {k} is given in place, which 16-bit scratch does not support")));
            } else {
                inputs.push(empty_view(meta));
            }
        }
        // Outputs are distinct registers: split the borrows one by one.
        let mut outputs: Vec<HostTensorMut<'_>> = recycle(std::mem::take(&mut self.views.outputs));
        for (o, meta) in self.outputs.iter().enumerate() {
            outputs.push(view_mut(meta, io.output_detached(o)).map_err(fail)?);
        }
        let computed = match &mut self.half {
            Some(scratch) => scratch.compute(&self.op, &context, &inputs, &mut outputs),
            None => self.op.compute(&context, &inputs, &mut outputs),
        };
        self.views.inputs = recycle(inputs);
        self.views.outputs = recycle(outputs);
        computed.map_err(fail)
    }
}
