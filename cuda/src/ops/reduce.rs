//! `reduce` (sum, mean, max over any axes), `part_mean` and `max_mask` on CUDA. The input is
//! described to the kernels as its kept and reduced axes (see `reduce.cu`); a reduction
//! whose innermost axis is reduced gives each output a block, one whose innermost axis is
//! kept gives each output a thread in x of a column reduction (the reduced range split over
//! 32 threads in y when it is long), so reads are coalesced either way.

use super::{function, op_conf, queued, stream, suffix, Entry};
use crate::driver::{launch, Function, Grid};
use regflow_kernels::cpu::axes;
use regflow_kernels::{HostOpKernel, Kernel, KernelError, KernelIo, KernelSpec};
use regflow_plan::ops::{reduced_axes, MaxMask, PartMean, Reduce, ReduceKind};
use regflow_plan::{DType, OpConf, Shape};
use std::sync::Arc;

const FLOAT: &[DType] = &[DType::F32, DType::F64];

pub(super) const ENTRIES: &[Entry] = &[
    ("reduce", FLOAT, || Arc::new(make_reduce)),
    ("part_mean", FLOAT, || Arc::new(make_part_mean)),
    ("max_mask", FLOAT, || Arc::new(make_max_mask)),
];

/// Most axes a kernel's [`Axes`] holds (after dropping and merging).
pub(crate) const MAX_AXES: usize = 8;

/// How a flat row-major index over `dims` maps to an element offset with `strides`: the
/// `Axes` struct of the kernel sources, passed by value.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Axes {
    rank: u64,
    dims: [u64; MAX_AXES],
    strides: [u64; MAX_AXES],
}

impl Axes {
    /// `dims` read at `strides`, with axes of one element dropped and neighbours merged
    /// where the outer one steps over the inner one whole (`s[d] == s[d + 1] · dims[d + 1]`,
    /// including two broadcast axes of stride 0); `None` beyond [`MAX_AXES`] axes.
    pub(crate) fn collapsed(dims: &[usize], strides: &[usize]) -> Option<Self> {
        let mut pairs: Vec<(usize, usize)> = Vec::with_capacity(dims.len());
        for (&dim, &stride) in dims.iter().zip(strides) {
            if dim == 1 {
                continue;
            }
            match pairs.last_mut() {
                // The merged axis steps by the inner stride.
                Some((d, s)) if *s == stride * dim => (*d, *s) = (*d * dim, stride),
                _ => pairs.push((dim, stride)),
            }
        }
        if pairs.len() > MAX_AXES {
            return None;
        }
        let mut axes = Axes { rank: pairs.len() as u64, ..Default::default() };
        for (i, (d, s)) in pairs.into_iter().enumerate() {
            (axes.dims[i], axes.strides[i]) = (d as u64, s as u64);
        }
        Some(axes)
    }

    /// The offset of flat index `flat`, as the kernels compute it (the unit tests' mirror).
    #[cfg(test)]
    pub(crate) fn offset(&self, mut flat: u64) -> u64 {
        let mut offset = 0;
        for d in (0..self.rank as usize).rev() {
            offset += (flat % self.dims[d]) * self.strides[d];
            flat /= self.dims[d];
        }
        offset
    }

    /// Whether the innermost axis with more than one element is read at stride 1.
    fn innermost_unit(&self) -> bool {
        self.rank > 0 && self.strides[self.rank as usize - 1] == 1
    }
}

/// A reduction described for the kernels: `(kept, reduced, count)`, or `None` when either
/// side needs more than [`MAX_AXES`] axes.
pub(crate) fn reduction(dims: &[usize], reduced: &[bool]) -> Option<(Axes, Axes, u64)> {
    let strides = axes::strides(dims);
    let pick = |want: bool| -> (Vec<usize>, Vec<usize>) {
        dims.iter().zip(&strides).zip(reduced).filter(|(_, &r)| r == want).map(|((&d, &s), _)| (d, s)).unzip()
    };
    let (kept_dims, kept_strides) = pick(false);
    let (red_dims, red_strides) = pick(true);
    let count: usize = red_dims.iter().product();
    Some((Axes::collapsed(&kept_dims, &kept_strides)?, Axes::collapsed(&red_dims, &red_strides)?, count as u64))
}

/// A reduction kernel: one launch.
#[derive(Debug)]
struct ReduceKernel {
    function: Function,
    grid: Grid,
    dtype: DType,
    input: usize,
    outputs: u64,
    kept: Axes,
    reduced: Axes,
    count: u64,
    /// 0: sum (scaled), 1: max.
    kind: i32,
    scale: f64,
}

impl Kernel for ReduceKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let (x, out) = (io.input_addr(self.input), io.output_addr(0));
        let (n, kept, reduced, count, kind) = (self.outputs, self.kept, self.reduced, self.count, self.kind);
        // SAFETY: `kept` and `reduced` address only elements of the input (built from its
        // meta), `n` is the output's element count; the argument types are the kernel's.
        unsafe {
            match self.dtype {
                DType::F64 => launch(
                    stream(io),
                    self.function,
                    self.grid,
                    &mut args![x, out, n, kept, reduced, count, kind, self.scale],
                ),
                _ => launch(
                    stream(io),
                    self.function,
                    self.grid,
                    &mut args![x, out, n, kept, reduced, count, kind, self.scale as f32],
                ),
            }
        }?;
        Ok(())
    }
}

/// Threads per block of the block-per-output reductions.
const BLOCK_THREADS: u32 = 256;

/// Threads per block of a block-per-output reduction of fewer than [`FEW_OUTPUTS`] outputs:
/// a block's most (the prelude's block reductions take up to 32 warps), so that a reduction
/// to a few values, a whole tensor to a scalar say, has more threads reading.
const FULL_BLOCK_THREADS: u32 = 1024;

/// From this many outputs on, blocks of [`BLOCK_THREADS`] already give about a current
/// GPU's resident threads (1024 × 256: an H100 holds 132 × 2048).
const FEW_OUTPUTS: u64 = 1024;

/// The launch of a reduction of `outputs` outputs of `count` elements each: a block per
/// output when the reduced elements are contiguous (`by_blocks`), else a column reduction.
fn reduce_grid(by_blocks: bool, outputs: u64, count: u64) -> Grid {
    if !by_blocks {
        return Grid::columns(outputs, count);
    }
    let threads = if outputs < FEW_OUTPUTS { FULL_BLOCK_THREADS } else { BLOCK_THREADS };
    Grid::rows(outputs, threads, 0)
}

/// One input, one output of its dtype, float, the output shaped as `op` says.
fn check_reduce(spec: &KernelSpec<'_>, conf: &OpConf, op: &Reduce) -> Result<Vec<bool>, KernelError> {
    let fail = |m: String| KernelError(format!("actor '{}': op '{}': {m}", spec.actor, conf.op_type));
    let ([x], [out]) = (conf.inputs.as_slice(), conf.outputs.as_slice()) else {
        return Err(fail(format!(
            "takes 1 input and gives 1 output, but has {} and {}",
            conf.inputs.len(),
            conf.outputs.len()
        )));
    };
    if x.dtype != out.dtype || !x.dtype.is_float() {
        return Err(fail(format!("reduces a float tensor to one of its dtype, got {x} -> {out}")));
    }
    let shape = op.output_shape(&x.shape).map_err(fail)?;
    if shape.numel() != out.shape.numel() {
        return Err(fail(format!("reducing {} gives {shape}, but the output is {}", x.shape, out.shape)));
    }
    reduced_axes(&x.shape, &op.axes).map_err(fail)
}

fn reduce_kernel(
    spec: &KernelSpec<'_>,
    conf: &OpConf,
    kind: ReduceKind,
    reduced: &[bool],
    divisor: Option<usize>,
) -> Result<Option<ReduceKernel>, KernelError> {
    let x = &conf.inputs[0];
    let Some((kept, red, count)) = reduction(x.shape.dims(), reduced) else { return Ok(None) };
    let outputs = conf.outputs[0].shape.numel() as u64;
    let by_blocks = red.innermost_unit();
    let name = if by_blocks { "blocks" } else { "threads" };
    let grid = reduce_grid(by_blocks, outputs, count);
    let scale = match kind {
        // An empty mean is 0 · (1 / 0) = NaN, as on the CPU.
        ReduceKind::Mean => 1.0 / divisor.unwrap_or(count as usize) as f64,
        _ => 1.0,
    };
    Ok(Some(ReduceKernel {
        function: function(spec, &format!("regflow_reduce_{name}_{}", suffix(x.dtype)))?,
        grid,
        dtype: x.dtype,
        input: conf.input_map[0],
        outputs,
        kept,
        reduced: red,
        count,
        kind: i32::from(kind == ReduceKind::Max),
        scale,
    }))
}

/// A reduction of more than [`MAX_AXES`] alternating axes runs its CPU kernel on the host.
fn make_reduce(spec: &KernelSpec<'_>) -> Result<Box<dyn Kernel>, KernelError> {
    let conf = op_conf(spec)?;
    let op: Reduce = conf.parse_attrs().map_err(KernelError)?;
    let reduced = check_reduce(spec, conf, &op)?;
    Ok(match reduce_kernel(spec, conf, op.kind, &reduced, None)? {
        Some(kernel) => queued(kernel),
        None => Box::new(HostOpKernel::new(op, conf)),
    })
}

fn make_part_mean(spec: &KernelSpec<'_>) -> Result<Box<dyn Kernel>, KernelError> {
    let conf = op_conf(spec)?;
    let op: PartMean = conf.parse_attrs().map_err(KernelError)?;
    let reduced = check_reduce(spec, conf, &op.mean)?;
    Ok(match reduce_kernel(spec, conf, ReduceKind::Mean, &reduced, Some(op.logical_count))? {
        Some(kernel) => queued(kernel),
        None => Box::new(HostOpKernel::new(op, conf)),
    })
}

/// `max_mask`: one grid-stride launch.
#[derive(Debug)]
struct MaxMaskKernel {
    function: Function,
    inputs: (usize, usize),
    n: u64,
    m_axes: Axes,
}

impl Kernel for MaxMaskKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let (x, m, out) = (io.input_addr(self.inputs.0), io.input_addr(self.inputs.1), io.output_addr(0));
        let (n, m_axes) = (self.n, self.m_axes);
        // SAFETY: `x` and `out` hold `n` elements, `m_axes` addresses only elements of `m`
        // (its broadcast strides); the argument types are the kernel's.
        unsafe { launch(stream(io), self.function, Grid::linear(n), &mut args![x, m, out, n, m_axes]) }?;
        Ok(())
    }
}

fn make_max_mask(spec: &KernelSpec<'_>) -> Result<Box<dyn Kernel>, KernelError> {
    let conf = op_conf(spec)?;
    let op: MaxMask = conf.parse_attrs().map_err(KernelError)?;
    let fail = |m: String| KernelError(format!("actor '{}': op '{}': {m}", spec.actor, conf.op_type));
    let ([x, m], [out]) = (conf.inputs.as_slice(), conf.outputs.as_slice()) else {
        return Err(fail(format!(
            "takes 2 inputs and gives 1 output, but has {} and {}",
            conf.inputs.len(),
            conf.outputs.len()
        )));
    };
    if x.dtype != m.dtype || !x.dtype.is_float() || out != x {
        return Err(fail(format!("compares a float tensor with its maximum, got {x} and {m} -> {out}")));
    }
    if Shape::broadcast(&x.shape, &m.shape).as_ref() != Some(&x.shape) {
        return Err(fail(format!("the maximum {} does not broadcast to {}", m.shape, x.shape)));
    }
    let strides = axes::broadcast_strides(m.shape.dims(), x.shape.dims());
    let Some(m_axes) = Axes::collapsed(x.shape.dims(), &strides) else {
        return Ok(Box::new(HostOpKernel::new(op, conf)));
    };
    Ok(queued(MaxMaskKernel {
        function: function(spec, &format!("regflow_max_mask_{}", suffix(x.dtype)))?,
        inputs: (conf.input_map[0], conf.input_map[1]),
        n: x.shape.numel() as u64,
        m_axes,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every offset of `dims` read at `strides`, the plain way.
    fn offsets(dims: &[usize], strides: &[usize]) -> Vec<u64> {
        let n: usize = dims.iter().product();
        (0..n)
            .map(|mut flat| {
                let mut off = 0;
                for d in (0..dims.len()).rev() {
                    off += (flat % dims[d]) * strides[d];
                    flat /= dims[d];
                }
                off as u64
            })
            .collect()
    }

    #[test]
    fn collapsing_keeps_every_offset() {
        for (dims, strides, rank) in [
            (vec![2, 3, 4], vec![12, 4, 1], 1),
            (vec![2, 1, 3, 4], vec![0, 0, 4, 1], 2),
            (vec![5, 6, 7], vec![0, 7, 1], 2),
            (vec![5, 6, 7], vec![0, 0, 1], 2),
            (vec![4, 3, 2], vec![1, 0, 0], 2),
            (vec![1, 1], vec![0, 0], 0),
            (vec![], vec![], 0),
        ] {
            let axes = Axes::collapsed(&dims, &strides).unwrap();
            assert_eq!(axes.rank, rank, "{dims:?} {strides:?}: {axes:?}");
            let got: Vec<u64> = (0..dims.iter().product::<usize>() as u64).map(|i| axes.offset(i)).collect();
            assert_eq!(got, offsets(&dims, &strides), "{dims:?} {strides:?}");
        }
        // Alternating broadcast axes cannot merge: more than 8 is refused.
        let dims = vec![2; 10];
        let strides: Vec<usize> = (0..10).map(|i| if i % 2 == 0 { 0 } else { 1 << (9 - i) }).collect();
        assert!(Axes::collapsed(&dims, &strides).is_none());
    }

    #[test]
    fn reductions_split_into_kept_and_reduced_axes() {
        // [2, 3, 4] over axis 1: kept [2, 4] at (12, 1), reduced [3] at 4; column-like.
        let (kept, red, count) = reduction(&[2, 3, 4], &[false, true, false]).unwrap();
        assert_eq!(count, 3);
        assert_eq!((kept.rank, &kept.dims[..2], &kept.strides[..2]), (2, &[2, 4][..], &[12, 1][..]));
        assert!(!red.innermost_unit());
        // Over the last two axes: one reduced axis of 12 at stride 1 (block per output).
        let (kept, red, count) = reduction(&[2, 3, 4], &[false, true, true]).unwrap();
        assert_eq!((count, kept.rank, red.rank, red.dims[0]), (12, 1, 1, 12));
        assert!(red.innermost_unit());
        // Every output's reduced elements are exactly the input's, once each.
        let (kept, red, count) = reduction(&[3, 1, 5, 2], &[true, false, false, true]).unwrap();
        assert_eq!((count, kept.rank), (6, 1));
        let mut seen: Vec<u64> = (0..5).flat_map(|o| (0..count).map(move |r| kept.offset(o) + red.offset(r))).collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..30).collect::<Vec<u64>>());
    }

    #[test]
    fn few_outputs_get_full_blocks_and_long_columns_get_slices() {
        // A whole tensor to a scalar: one block of 1024 threads.
        let grid = reduce_grid(true, 1, 38_000_000);
        assert_eq!((grid.blocks, grid.threads), ((1, 1, 1), (1024, 1, 1)));
        assert_eq!(reduce_grid(true, 1023, 7).threads.0, 1024);
        assert_eq!(reduce_grid(true, 1024, 7).threads.0, BLOCK_THREADS);
        // Column sums: 32 × 32 blocks over a long range, one thread per output over a short.
        assert_eq!(reduce_grid(false, 768, 8192).threads, (32, 32, 1));
        assert_eq!(reduce_grid(false, 768, 7).threads, (256, 1, 1));
    }
}
