//! `fill` and `causal_mask` on CUDA: one grid-stride launch each.

use super::{factory, function, op_conf, stream, suffix, Entry};
use crate::driver::{launch, Function, Grid};
use regflow_kernels::{Kernel, KernelError, KernelIo};
use regflow_plan::ops::{CausalMask, Fill};
use regflow_plan::DType;

pub(super) const ENTRIES: &[Entry] = &[
    ("fill", &[DType::F32, DType::F64, DType::I64, DType::Bf16, DType::F16], || factory(make)),
    ("causal_mask", &[DType::F32, DType::F64, DType::Bf16, DType::F16], || factory(make_causal_mask)),
];

fn make(spec: &regflow_kernels::KernelSpec<'_>) -> Result<FillKernel, KernelError> {
    let conf = op_conf(spec)?;
    let op: Fill = conf.parse_attrs().map_err(KernelError)?;
    let dtype = op.meta.dtype;
    Ok(FillKernel {
        function: function(spec, &format!("regflow_fill_{}", suffix(dtype)))?,
        value: op.value,
        dtype,
        n: op.meta.shape.numel() as u64,
        row_len: None,
    })
}

fn make_causal_mask(spec: &regflow_kernels::KernelSpec<'_>) -> Result<FillKernel, KernelError> {
    let conf = op_conf(spec)?;
    let op: CausalMask = conf.parse_attrs().map_err(KernelError)?;
    let dtype = op.meta.dtype;
    let len = op.meta.shape.dims().last().copied().unwrap_or(1) as u64;
    Ok(FillKernel {
        function: function(spec, &format!("regflow_causal_mask_{}", suffix(dtype)))?,
        value: op.masked,
        dtype,
        n: op.meta.shape.numel() as u64,
        row_len: Some(len),
    })
}

/// A fill, or (with `row_len`) a causal mask whose masked value is `value`.
#[derive(Debug)]
struct FillKernel {
    function: Function,
    value: f64,
    dtype: DType,
    n: u64,
    /// A causal mask's row length: its entries take it between the value and the count.
    row_len: Option<u64>,
}

impl Kernel for FillKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let (out, n, f) = (io.output_addr(0), self.n, self.function);
        let grid = Grid::linear(n);
        // SAFETY: `out` holds `n` elements of `dtype` (the register of the op's meta), and
        // each kernel takes (pointer, value of the dtype, [row length,] count).
        unsafe {
            match (self.dtype, self.row_len) {
                (DType::F32, None) => launch(stream(io), f, grid, &mut args![out, self.value as f32, n]),
                (DType::F32, Some(len)) => launch(stream(io), f, grid, &mut args![out, self.value as f32, len, n]),
                (DType::F64, None) => launch(stream(io), f, grid, &mut args![out, self.value, n]),
                (DType::F64, Some(len)) => launch(stream(io), f, grid, &mut args![out, self.value, len, n]),
                (DType::I64, _) => launch(stream(io), f, grid, &mut args![out, self.value as i64, n]),
                (dtype @ (DType::Bf16 | DType::F16), row_len) => {
                    let bits = match dtype {
                        DType::Bf16 => regflow_plan::bf16_from_f64(self.value).to_bits(),
                        _ => regflow_plan::f16_from_f64(self.value).to_bits(),
                    };
                    match row_len {
                        None => launch(stream(io), f, grid, &mut args![out, bits, n]),
                        Some(len) => launch(stream(io), f, grid, &mut args![out, bits, len, n]),
                    }
                }
            }
        }?;
        Ok(())
    }
}
