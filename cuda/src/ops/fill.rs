//! `fill` on CUDA: one grid-stride launch.

use super::{factory, function, op_conf, stream, suffix, Entry};
use crate::driver::{launch, Function, Grid};
use regflow_kernels::{Kernel, KernelError, KernelIo};
use regflow_plan::ops::Fill;
use regflow_plan::DType;

pub(super) const ENTRIES: &[Entry] = &[("fill", &[DType::F32, DType::F64, DType::I64, DType::Bf16], || factory(make))];

fn make(spec: &regflow_kernels::KernelSpec<'_>) -> Result<FillKernel, KernelError> {
    let conf = op_conf(spec)?;
    let op: Fill = conf.parse_attrs().map_err(KernelError)?;
    let dtype = op.meta.dtype;
    Ok(FillKernel {
        function: function(spec, &format!("regflow_fill_{}", suffix(dtype)))?,
        value: op.value,
        dtype,
        n: op.meta.shape.numel() as u64,
    })
}

#[derive(Debug)]
struct FillKernel {
    function: Function,
    value: f64,
    dtype: DType,
    n: u64,
}

impl Kernel for FillKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let (out, n) = (io.output_addr(0), self.n);
        let grid = Grid::linear(n);
        // SAFETY: `out` holds `n` elements of `dtype` (the register of the op's meta), and
        // each kernel takes (pointer, value of the dtype, count).
        unsafe {
            match self.dtype {
                DType::F32 => launch(stream(io), self.function, grid, &mut args![out, self.value as f32, n]),
                DType::F64 => launch(stream(io), self.function, grid, &mut args![out, self.value, n]),
                DType::I64 => launch(stream(io), self.function, grid, &mut args![out, self.value as i64, n]),
                DType::Bf16 => {
                    let bits = regflow_plan::bf16_from_f64(self.value).to_bits();
                    launch(stream(io), self.function, grid, &mut args![out, bits, n])
                }
            }
        }?;
        Ok(())
    }
}
