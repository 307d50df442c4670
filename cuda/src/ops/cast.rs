//! `cast` on CUDA (`fill.cu`): one grid-stride conversion between f32, f64, bf16 and f16,
//! rounded to nearest even as the CPU's (`half`'s) conversions, eight elements per step
//! where aligned (`EIGHT` in the prelude); a cast to its own dtype is a copy (`movement.cu`).

use super::elementwise::{input_slots, refuse};
use super::{factory, function, op_conf, stream, suffix, Entry};
use crate::driver::{launch, Function, Grid};
use regflow_kernels::{Kernel, KernelError, KernelIo, KernelSpec};
use regflow_plan::ops::Cast;
use regflow_plan::DType;

/// Keyed by the result's dtype (the registry's dtype of an op is its first float output's).
pub(super) const ENTRIES: &[Entry] = &[("cast", FLOATS, || factory(make))];

/// The float dtypes `fill.cu` converts between (and copies).
const FLOATS: &[DType] = &[DType::F32, DType::F64, DType::Bf16, DType::F16];

#[derive(Debug)]
struct CastKernel {
    /// A conversion, or a copy for a cast to the input's own dtype.
    function: Function,
    input: usize,
    n: u64,
    /// The conversions step eight elements per thread (`Grid::eights`); the copy one.
    grid: Grid,
}

fn make(spec: &KernelSpec<'_>) -> Result<CastKernel, KernelError> {
    let conf = op_conf(spec)?;
    let op: Cast = conf.parse_attrs().map_err(|e| refuse(spec, conf, e))?;
    let (from, to) = match (&conf.inputs[..], &conf.outputs[..]) {
        ([x], [out]) if x.shape == out.shape && out.dtype == op.to => (x.dtype, out.dtype),
        _ => return Err(refuse(spec, conf, format!("casts one tensor to {} of the same shape", op.to))),
    };
    if !FLOATS.contains(&from) || !FLOATS.contains(&to) {
        return Err(refuse(spec, conf, format!("casts between f32, f64, bf16 and f16, not {from} to {to}")));
    }
    let [input] = input_slots::<1>(conf);
    let n = conf.outputs[0].shape.numel() as u64;
    let entry = match from == to {
        true => format!("regflow_copy_{}", suffix(to)),
        false => format!("regflow_cast_{}_{}", suffix(from), suffix(to)),
    };
    let grid = if from == to { Grid::linear(n) } else { Grid::eights(n) };
    Ok(CastKernel { function: function(spec, &entry)?, input, n, grid })
}

impl Kernel for CastKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let (x, out, n) = (io.input_addr(self.input), io.output_addr(0), self.n);
        let f = self.function;
        // SAFETY: `x` and `out` hold `n` elements of their dtypes (checked when made); every
        // cast and copy entry takes (x, out, n).
        unsafe { launch(stream(io), f, self.grid, &mut args![x, out, n]) }?;
        Ok(())
    }
}
