//! Graph ops as kernels: a compiled plan's compute actors run their op's host computation
//! on their registers, viewed as typed tensors.

use crate::kernel::{Kernel, KernelError, KernelIo};
use crate::{Feeder, Job, JobBuilder, RuntimeError};
use regflow_graph::ops::OpDef;
use regflow_graph::HostArray;
use regflow_graph::{CompiledGraph, DType, HostSlice, HostSliceMut, HostTensor, HostTensorMut, TensorMeta};
use std::sync::Arc;

/// Runs one op of a compiled graph.
struct OpKernel {
    op: Arc<dyn OpDef>,
    inputs: Vec<TensorMeta>,
    input_map: Vec<usize>,
    outputs: Vec<TensorMeta>,
}

fn view<'a>(meta: &'a TensorMeta, bytes: &'a [u8]) -> Result<HostTensor<'a>, String> {
    let cast = |e: bytemuck::PodCastError| format!("register of {meta} is not a whole, aligned {}: {e}", meta.dtype);
    let data = match meta.dtype {
        DType::F32 => HostSlice::F32(bytemuck::try_cast_slice(bytes).map_err(cast)?),
        DType::F64 => HostSlice::F64(bytemuck::try_cast_slice(bytes).map_err(cast)?),
        DType::I64 => HostSlice::I64(bytemuck::try_cast_slice(bytes).map_err(cast)?),
    };
    Ok(HostTensor { shape: &meta.shape, data })
}

fn view_mut<'a>(meta: &'a TensorMeta, bytes: &'a mut [u8]) -> Result<HostTensorMut<'a>, String> {
    let cast = |e: bytemuck::PodCastError| format!("register of {meta} is not a whole, aligned {}: {e}", meta.dtype);
    let data = match meta.dtype {
        DType::F32 => HostSliceMut::F32(bytemuck::try_cast_slice_mut(bytes).map_err(cast)?),
        DType::F64 => HostSliceMut::F64(bytemuck::try_cast_slice_mut(bytes).map_err(cast)?),
        DType::I64 => HostSliceMut::I64(bytemuck::try_cast_slice_mut(bytes).map_err(cast)?),
    };
    Ok(HostTensorMut { shape: &meta.shape, data })
}

impl Kernel for OpKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let fail = |m: String| KernelError(format!("{}: {m}", self.op.name()));
        // A tick input (constants) comes after the real ones and is not passed on.
        let inputs: Vec<HostTensor<'_>> = self
            .inputs
            .iter()
            .zip(&self.input_map)
            .map(|(meta, &i)| view(meta, io.input(i)))
            .collect::<Result<_, _>>()
            .map_err(fail)?;
        // Outputs are distinct registers: split the borrows one by one.
        let mut outputs: Vec<HostTensorMut<'_>> = Vec::with_capacity(self.outputs.len());
        for (o, meta) in self.outputs.iter().enumerate() {
            outputs.push(view_mut(meta, io.output_detached(o)).map_err(fail)?);
        }
        self.op.compute(&inputs, &mut outputs).map_err(fail)
    }
}

impl JobBuilder {
    /// Registers the kernels of a compiled graph and preloads its variables' initial values.
    pub fn compiled(mut self, compiled: &CompiledGraph) -> Self {
        for kernel in &compiled.kernels {
            let kernel = kernel.clone();
            let name = kernel.name.clone();
            self = self.kernel(&name, move |_| {
                Ok(Box::new(OpKernel {
                    op: kernel.op.clone(),
                    inputs: kernel.inputs.clone(),
                    input_map: kernel.input_map.clone(),
                    outputs: kernel.outputs.clone(),
                }))
            });
        }
        for (name, dtype) in &compiled.accumulators {
            let dtype = *dtype;
            self = self.kernel(name, move |_| Ok(Box::new(AccumulateMean { dtype })));
        }
        for variable in &compiled.variables {
            self = self.preload(&variable.regst, variable.initial.clone());
        }
        // Sinks the compiler added for values nobody reads drop their pieces: left to a
        // fetcher nobody takes, they would stop after the fetch depth and stall the job.
        for sink in &compiled.discards {
            self = self.on_sink(sink, |_| {});
        }
        self
    }
}

/// The kernel of an acc actor under gradient accumulation: the mean of a group of pieces
/// (the first is copied, the others added, the sum scaled by 1/k on the last).
struct AccumulateMean {
    dtype: DType,
}

fn accumulate<T: regflow_graph::Real + bytemuck::Pod>(io: &mut KernelIo<'_>) -> Result<(), KernelError> {
    let group = io.group();
    let input: &[T] = bytemuck::try_cast_slice(io.input(0)).map_err(|e| KernelError(format!("accumulate: {e}")))?;
    let out: &mut [T] =
        bytemuck::try_cast_slice_mut(io.output(0)).map_err(|e| KernelError(format!("accumulate: {e}")))?;
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

impl Kernel for AccumulateMean {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        match self.dtype {
            DType::F32 => accumulate::<f32>(io),
            DType::F64 => accumulate::<f64>(io),
            DType::I64 => Err(KernelError("accumulate: integer tensors have no mean".into())),
        }
    }
}

/// Typed feeds of a compiled graph's inputs: each value is checked against the input's
/// shape and dtype before its bytes go to the source. On a mesh, a value is the logical
/// tensor: it is cut into each device's part by the input's layout.
#[derive(Debug)]
pub struct GraphFeeds {
    inputs: Vec<FedInput>,
}

#[derive(Debug)]
struct FedInput {
    name: String,
    meta: TensorMeta,
    /// On a mesh: the mesh and the input's layout; the feeders are by rank.
    layout: Option<(regflow_graph::sbp::Mesh, regflow_graph::sbp::NdSbp)>,
    feeders: Vec<Feeder>,
}

impl Job {
    /// Takes the feeders of every input of `compiled`, for typed pushes.
    pub fn graph_feeds(&mut self, compiled: &CompiledGraph) -> Result<GraphFeeds, RuntimeError> {
        let mut inputs = Vec::new();
        for input in &compiled.inputs {
            let parallel =
                compiled.parallel.as_ref().and_then(|p| p.inputs.iter().find(|i| i.name == input.name).map(|i| (p, i)));
            let fed = match parallel {
                Some((_, parts)) => FedInput {
                    name: input.name.clone(),
                    meta: input.meta.clone(),
                    layout: Some((parts.mesh.clone(), parts.layout.clone())),
                    feeders: parts.parts.iter().map(|(actor, _)| self.feeder(actor)).collect::<Result<_, _>>()?,
                },
                None => FedInput {
                    name: input.name.clone(),
                    meta: input.meta.clone(),
                    layout: None,
                    feeders: vec![self.feeder(&input.actor)?],
                },
            };
            inputs.push(fed);
        }
        Ok(GraphFeeds { inputs })
    }
}

impl GraphFeeds {
    /// Pushes the next value of input `name`.
    pub fn push(&mut self, name: &str, value: &HostArray) -> Result<(), RuntimeError> {
        let Some(input) = self.inputs.iter_mut().find(|i| i.name == name) else {
            let known: Vec<&str> = self.inputs.iter().map(|i| i.name.as_str()).collect();
            return Err(RuntimeError::Feed {
                input: name.to_string(),
                message: format!("the graph has no such input (inputs: {})", known.join(", ")),
            });
        };
        if value.meta() != input.meta {
            return Err(RuntimeError::Feed {
                input: name.to_string(),
                message: format!("got {}, expected {}", value.meta(), input.meta),
            });
        }
        match &input.layout {
            None => input.feeders[0].push(&value.to_le_bytes()),
            Some((mesh, layout)) => {
                for (feeder, part) in input.feeders.iter_mut().zip(regflow_graph::sbp::scatter(value, layout, mesh)) {
                    feeder.push(&part.to_le_bytes())?;
                }
                Ok(())
            }
        }
    }

    /// Ends every input: the job finishes once the pushed steps are through.
    pub fn close(&mut self) -> Result<(), RuntimeError> {
        for input in &mut self.inputs {
            for feeder in &mut input.feeders {
                feeder.close()?;
            }
        }
        Ok(())
    }
}
