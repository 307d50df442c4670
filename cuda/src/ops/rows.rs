//! The row-wise ops on CUDA: `softmax`, `log_softmax`, `softmax_grad`, `masked_softmax`,
//! `masked_softmax_grad`, `layer_norm`, `layer_norm_grad`, `sparse_cross_entropy`,
//! `sparse_cross_entropy_grad` and `part_cross_entropy` (a device's rows of either, over
//! the whole batch) (`rows.cu`; the cross-entropy also reads bf16 logits, widening them as
//! they load, for an f32 loss and a bf16 gradient). One block per row
//! with the prelude's block reductions; the sizes, strides and scalars of every launch are
//! worked out when the actor is made, and a firing only queues its launches.

use super::reduce::Axes;
use super::{fail, function, op_conf, queued, stream, suffix, Entry};
use crate::driver::{launch, Function, Grid};
use regflow_kernels::cpu::axes;
use regflow_kernels::{HostCompute, HostOpKernel, Kernel, KernelError, KernelIo, KernelSpec};
use regflow_plan::ops::{
    LayerNorm, LayerNormGrad, LogSoftmax, MaskedSoftmax, MaskedSoftmaxGrad, PartCrossEntropy, Softmax, SoftmaxGrad,
    SparseCrossEntropy, SparseCrossEntropyGrad,
};
use regflow_plan::{DType, OpConf, TensorMeta};
use std::sync::Arc;

const FLOAT: &[DType] = &[DType::F32, DType::F64];

pub(super) const ENTRIES: &[Entry] = &[
    ("softmax", FLOAT, || Arc::new(|spec| make_softmax(spec, Lane::Softmax))),
    ("log_softmax", FLOAT, || Arc::new(|spec| make_softmax(spec, Lane::LogSoftmax))),
    ("softmax_grad", FLOAT, || Arc::new(|spec| make_softmax(spec, Lane::Grad))),
    // Keyed by the probabilities' dtype, the scores': bf16 for mixed precision's.
    ("masked_softmax", LOW, || Arc::new(make_masked_softmax)),
    ("masked_softmax_grad", LOW, || Arc::new(make_masked_softmax_grad)),
    // Keyed by the output's dtype: bf16 and f16 for an f32 norm that writes them (the
    // compiler's folded casts, `LayerNorm::out`). The gradient, keyed f32, may read a bf16
    // or f16 dy (`LayerNormGrad::dy`).
    ("layer_norm", LOW, || Arc::new(make_layer_norm)),
    ("layer_norm_grad", FLOAT, || Arc::new(make_layer_norm_grad)),
    // Keyed by the loss's dtype: f32 for f32 and bf16 logits alike.
    ("sparse_cross_entropy", FLOAT, || Arc::new(make_cross_entropy)),
    // Keyed by the gradient's dtype, the logits'.
    ("sparse_cross_entropy_grad", LOW, || Arc::new(make_cross_entropy_grad)),
    // A device's rows of either (data parallelism), over the whole batch: keyed by the
    // output's dtype, as the two above.
    ("part_cross_entropy", LOW, || Arc::new(make_part_cross_entropy)),
];

/// Float dtypes, and bf16 and f16 (widened to f32 as they load: the cross-entropy's logits).
const LOW: &[DType] = &[DType::F32, DType::F64, DType::Bf16, DType::F16];

/// Threads of a block that reduces a row of `len`: a power of two from one warp (short
/// rows waste no more than a warp) to 512 (long rows: a vocabulary of logits).
pub(crate) fn row_threads(len: usize) -> u32 {
    len.next_power_of_two().clamp(32, 512) as u32
}

/// The block-per-row grid for `rows` rows of `len`.
fn row_grid(rows: usize, len: usize) -> Grid {
    Grid::rows(rows as u64, row_threads(len), 0)
}

/// Elements per lane of the warp-per-row entries (`regflow_<op>_f32_w<N>` in `rows.cu`).
const WARP_LANE_ELEMENTS: [u32; 4] = [8, 16, 24, 32];

/// Rows (warps) per block of the warp-per-row entries: `WARP_ROWS` in `rows.cu`.
const WARP_ROWS: u64 = 8;

/// The elements per lane of the warp-per-row entry for rows of `len` elements of `dtype`:
/// the smallest that holds a row, for rows of at most 1024 elements computed in f32 (f32,
/// and bf16 or f16 widened as it loads or rounded as it is stored); `None` (one block per row)
/// for longer rows and for f64, whose rows would not fit a warp's registers. Rows that fill
/// all 32·N places of 16-byte aligned tensors move in 16-byte accesses (runs of 8 bf16 or
/// f16, 4 f32, per lane: see `rows.cu`); the others one element per access.
fn warp_lane_elements(dtype: DType, len: usize) -> Option<u32> {
    if !matches!(dtype, DType::F32 | DType::Bf16 | DType::F16) {
        return None;
    }
    WARP_LANE_ELEMENTS.into_iter().find(|&n| len <= 32 * n as usize)
}

/// One warp per row, [`WARP_ROWS`] rows per block, for `rows` rows (the kernels loop over
/// rows beyond the grid).
fn warp_row_grid(rows: usize) -> Grid {
    let blocks = (rows as u64).div_ceil(WARP_ROWS).clamp(1, crate::driver::MAX_LINEAR_BLOCKS);
    Grid { blocks: (blocks as u32, 1, 1), threads: (32 * WARP_ROWS as u32, 1, 1), shared_bytes: 0 }
}

/// The entry and grid of row op `name` over `rows` rows of `len`, its entries named by
/// `dtype` (`regflow_<name>_<dtype>[_w<N>]`): the warp-per-row entry where a row fits a
/// warp, else the block-per-row one.
fn row_entry(
    spec: &KernelSpec<'_>,
    name: &str,
    dtype: DType,
    rows: usize,
    len: usize,
) -> Result<(Function, Grid), KernelError> {
    Ok(match warp_lane_elements(dtype, len) {
        Some(n) => (function(spec, &format!("regflow_{name}_{}_w{n}", suffix(dtype)))?, warp_row_grid(rows)),
        None => (entry(spec, name, dtype)?, row_grid(rows, len)),
    })
}

/// Checks `conf` has `inputs` inputs and `outputs` outputs, all of one float dtype except
/// the inputs at `integer` (labels), which are i64; returns the float dtype.
fn metas(
    spec: &KernelSpec<'_>,
    conf: &OpConf,
    inputs: usize,
    outputs: usize,
    integer: &[usize],
) -> Result<DType, KernelError> {
    if conf.inputs.len() != inputs || conf.outputs.len() != outputs {
        return Err(fail(
            spec,
            conf,
            format!(
                "takes {inputs} inputs and gives {outputs} outputs, but has {} and {}",
                conf.inputs.len(),
                conf.outputs.len()
            ),
        ));
    }
    let dtype = conf.outputs[0].dtype;
    if !dtype.is_float() {
        return Err(fail(spec, conf, format!("needs float tensors, got {}", conf.outputs[0])));
    }
    for (i, meta) in conf.inputs.iter().enumerate() {
        let want = if integer.contains(&i) { DType::I64 } else { dtype };
        if meta.dtype != want {
            return Err(fail(spec, conf, format!("input {i} must be {want}, got {meta}")));
        }
    }
    if let Some(out) = conf.outputs.iter().find(|m| m.dtype != dtype) {
        return Err(fail(spec, conf, format!("every output must be {dtype}, got {out}")));
    }
    Ok(dtype)
}

/// Checks that the metas at `same` (inputs, then outputs numbered after them) equal the
/// first input's.
fn same_meta(spec: &KernelSpec<'_>, conf: &OpConf, same: &[usize]) -> Result<(), KernelError> {
    let all: Vec<&TensorMeta> = conf.inputs.iter().chain(&conf.outputs).collect();
    for &i in same {
        if all[i] != all[0] {
            return Err(fail(spec, conf, format!("tensor {i} must match {}, got {}", all[0], all[i])));
        }
    }
    Ok(())
}

/// The entry point `regflow_<name>_<dtype>`.
fn entry(spec: &KernelSpec<'_>, name: &str, dtype: DType) -> Result<Function, KernelError> {
    function(spec, &format!("regflow_{name}_{}", suffix(dtype)))
}

/// Which lane kernel a softmax op runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lane {
    Softmax,
    LogSoftmax,
    Grad,
}

/// `softmax`, `log_softmax` (one launch of `regflow_softmax`) and `softmax_grad`
/// (`regflow_softmax_grad`) along any axis.
#[derive(Debug)]
struct SoftmaxKernel {
    function: Function,
    grid: Grid,
    /// The actor inputs: `x`, or `y` and `dy`.
    inputs: (usize, usize),
    grad: bool,
    lanes: u64,
    len: u64,
    inner: u64,
    log: i32,
}

impl Kernel for SoftmaxKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let (a, b, out) = (io.input_addr(self.inputs.0), io.input_addr(self.inputs.1), io.output_addr(0));
        let (lanes, len, inner, log) = (self.lanes, self.len, self.inner, self.log);
        // SAFETY: the inputs and output hold `lanes · len` elements of the dtype (one meta,
        // checked at build); the argument types are the kernels'.
        unsafe {
            if self.grad {
                launch(stream(io), self.function, self.grid, &mut args![a, b, out, lanes, len, inner, log])
            } else {
                launch(stream(io), self.function, self.grid, &mut args![a, out, lanes, len, inner, log])
            }
        }?;
        Ok(())
    }
}

fn make_softmax(spec: &KernelSpec<'_>, lane: Lane) -> Result<Box<dyn Kernel>, KernelError> {
    let conf = op_conf(spec)?;
    let (axis, log) = match lane {
        Lane::Softmax => (conf.parse_attrs::<Softmax>().map_err(KernelError)?.axis, false),
        Lane::LogSoftmax => (conf.parse_attrs::<LogSoftmax>().map_err(KernelError)?.axis, true),
        Lane::Grad => {
            let op: SoftmaxGrad = conf.parse_attrs().map_err(KernelError)?;
            (op.axis, op.log)
        }
    };
    let grad = lane == Lane::Grad;
    let dtype = metas(spec, conf, if grad { 2 } else { 1 }, 1, &[])?;
    same_meta(spec, conf, if grad { &[1, 2] } else { &[1] })?;
    let shape = &conf.inputs[0].shape;
    let a = shape
        .axis(axis)
        .ok_or_else(|| fail(spec, conf, format!("axis {axis} is out of range for rank {}", shape.rank())))?;
    let dims = shape.dims();
    let (outer, len, inner) = (dims[..a].iter().product::<usize>(), dims[a], dims[a + 1..].iter().product::<usize>());
    let input = conf.input_map[0];
    Ok(queued(SoftmaxKernel {
        function: entry(spec, if grad { "softmax_grad" } else { "softmax" }, dtype)?,
        grid: row_grid(outer * inner, len),
        inputs: (input, if grad { conf.input_map[1] } else { input }),
        grad,
        lanes: (outer * inner) as u64,
        len: len as u64,
        inner: inner as u64,
        log: i32::from(log),
    }))
}

/// `masked_softmax`: softmax over the last axis of `scale · x + mask`.
#[derive(Debug)]
struct MaskedSoftmaxKernel {
    function: Function,
    grid: Grid,
    dtype: DType,
    inputs: (usize, usize),
    rows: u64,
    len: u64,
    scale: f64,
    mask_rows: Axes,
    mask_step: u64,
}

impl Kernel for MaskedSoftmaxKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let (x, mask, y) = (io.input_addr(self.inputs.0), io.input_addr(self.inputs.1), io.output_addr(0));
        let (rows, len, mask_rows, mask_step) = (self.rows, self.len, self.mask_rows, self.mask_step);
        let f = self.function;
        // SAFETY: `x` and `y` hold `rows · len` elements; `mask_rows` and `mask_step` read
        // only the mask's elements (its broadcast strides); the argument types are the
        // kernel's.
        unsafe {
            match self.dtype {
                DType::F64 => launch(
                    stream(io),
                    f,
                    self.grid,
                    &mut args![x, mask, y, rows, len, self.scale, mask_rows, mask_step],
                ),
                _ => launch(
                    stream(io),
                    f,
                    self.grid,
                    &mut args![x, mask, y, rows, len, self.scale as f32, mask_rows, mask_step],
                ),
            }
        }?;
        Ok(())
    }
}

/// The rows and row length of a tensor of `dims` over its last axis.
fn rows_of(dims: &[usize]) -> (usize, usize) {
    let len = dims.last().copied().unwrap_or(1);
    (dims[..dims.len().saturating_sub(1)].iter().product(), len)
}

/// A mask of more than 8 alternating broadcast runs per row runs the CPU kernel on the host.
fn make_masked_softmax(spec: &KernelSpec<'_>) -> Result<Box<dyn Kernel>, KernelError> {
    let conf = op_conf(spec)?;
    let op: MaskedSoftmax = conf.parse_attrs().map_err(KernelError)?;
    op.check(&conf.inputs, &conf.outputs).map_err(|m| fail(spec, conf, m))?;
    let (x, mask) = (&conf.inputs[0], &conf.inputs[1]);
    let dims = x.shape.dims();
    let (rows, len) = rows_of(dims);
    let strides = axes::broadcast_strides(mask.shape.dims(), dims);
    let last = dims.len() - 1;
    let (Some(entries), Some(mask_rows)) =
        (masked_entries(x.dtype, mask.dtype), Axes::collapsed(&dims[..last], &strides[..last]))
    else {
        return Ok(Box::new(HostOpKernel::new(op, conf)));
    };
    let (function, grid) = row_entry(spec, "masked_softmax", entries, rows, len)?;
    Ok(queued(MaskedSoftmaxKernel {
        function,
        grid,
        dtype: conf.outputs[0].dtype,
        inputs: (conf.input_map[0], conf.input_map[1]),
        rows: rows as u64,
        len: len as u64,
        scale: op.scale,
        mask_rows,
        mask_step: strides[last] as u64,
    }))
}

/// The dtype naming the masked softmax entries for scores `x` and a mask `mask`: the
/// scores', where the mask is in the entries' arithmetic type (f64 for f64 scores, f32
/// for f32 and bf16 ones: mixed precision's bf16 scores widen as they load). Other pairs
/// (f32 scores with a bf16 mask, bf16 with bf16) have no entry and run the CPU kernel on
/// the host: the bf16 entries read the mask as f32.
fn masked_entries(x: DType, mask: DType) -> Option<DType> {
    let arithmetic = if x == DType::F64 { DType::F64 } else { DType::F32 };
    (mask == arithmetic).then_some(x)
}

/// `masked_softmax_grad` (y, dy -> dx): one launch over rows whose only scalar is the
/// scale. (Layer norm has a kernel of its own, [`LayerNormKernel`].)
#[derive(Debug)]
struct RowsKernel {
    function: Function,
    grid: Grid,
    dtype: DType,
    /// The actor inputs, in the kernel's order.
    inputs: [usize; 2],
    rows: u64,
    len: u64,
    scalar: f64,
}

impl Kernel for RowsKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let [a, b] = self.inputs.map(|i| io.input_addr(i));
        let out = io.output_addr(0);
        let (rows, len, f, g) = (self.rows, self.len, self.function, self.grid);
        let (s64, s32) = (self.scalar, self.scalar as f32);
        // SAFETY: every tensor holds `rows · len` elements (checked at build); the argument
        // types are the kernels'.
        unsafe {
            if self.dtype == DType::F64 {
                launch(stream(io), f, g, &mut args![a, b, out, rows, len, s64])
            } else {
                launch(stream(io), f, g, &mut args![a, b, out, rows, len, s32])
            }
        }?;
        Ok(())
    }
}

/// y, dy and the gradient share one dtype; bf16 (the `_bf16` entries) is computed in f32.
fn make_masked_softmax_grad(spec: &KernelSpec<'_>) -> Result<Box<dyn Kernel>, KernelError> {
    let conf = op_conf(spec)?;
    let op: MaskedSoftmaxGrad = conf.parse_attrs().map_err(KernelError)?;
    op.check(&conf.inputs, &conf.outputs).map_err(|m| fail(spec, conf, m))?;
    if conf.inputs[0].shape.rank() == 0 {
        return Err(fail(spec, conf, "the scores must have rank >= 1, got a scalar"));
    }
    let (rows, len) = rows_of(conf.inputs[0].shape.dims());
    let (function, grid) = row_entry(spec, "masked_softmax_grad", conf.outputs[0].dtype, rows, len)?;
    Ok(queued(RowsKernel {
        function,
        grid,
        // The probabilities' dtype: f64 passes an f64 scale, the others f32.
        dtype: conf.inputs[0].dtype,
        inputs: [conf.input_map[0], conf.input_map[1]],
        rows: rows as u64,
        len: len as u64,
        scalar: op.scale,
    }))
}

/// Rows and features of a layer norm over `x` with `gamma` (and `beta` or `dy`), or why
/// they do not fit: gamma is `[features]` and `x`'s last axis is `features`.
fn layer_norm_rows(spec: &KernelSpec<'_>, conf: &OpConf) -> Result<(usize, usize), KernelError> {
    let (x, gamma) = (&conf.inputs[0], &conf.inputs[1]);
    let features = gamma.shape.numel();
    if gamma.shape.rank() != 1 || x.shape.dims().last() != Some(&features) {
        return Err(fail(spec, conf, format!("gamma {gamma} must be [features] of the input {x}'s last axis")));
    }
    Ok((rows_of(x.shape.dims()).0, features))
}

/// `regflow_layer_norm_<dtype>[_w<N>]`, or for an f32 norm writing bf16 or f16
/// `regflow_layer_norm_f32_<out>[_w<N>]`: each element computed in f32 and rounded as the
/// cast kernels round. With a summand (`LayerNorm::residual`) the same entries add it to
/// the input first and write the sum too.
fn make_layer_norm(spec: &KernelSpec<'_>) -> Result<Box<dyn Kernel>, KernelError> {
    let conf = op_conf(spec)?;
    let op: LayerNorm = conf.parse_attrs().map_err(KernelError)?;
    // Every meta against x's, the summand and the sum too; the output's dtype the
    // attributes give.
    op.check(&conf.inputs, &conf.outputs).map_err(|m| fail(spec, conf, m))?;
    let x = conf.inputs[0].dtype;
    if !matches!(x, DType::F32 | DType::F64) {
        return Err(fail(spec, conf, format!("computes in f32 or f64, got {}", conf.inputs[0])));
    }
    let (entries, dtype) = match op.out {
        None => ("layer_norm", x),
        Some(out) => ("layer_norm_f32", out),
    };
    let (rows, features) = layer_norm_rows(spec, conf)?;
    let (function, grid) = row_entry(spec, entries, dtype, rows, features)?;
    // The kernels' code of the summand's storage: 1 x's dtype, 2 bf16, 3 f16.
    let summand = match op.residual {
        None => None,
        Some(b) if b == x => Some((conf.input_map[3], 1)),
        Some(DType::Bf16) => Some((conf.input_map[3], 2)),
        Some(DType::F16) => Some((conf.input_map[3], 3)),
        Some(other) => return Err(fail(spec, conf, format!("a {other} summand (broken invariant)"))),
    };
    Ok(queued(LayerNormKernel {
        function,
        grid,
        f64: x == DType::F64,
        inputs: [conf.input_map[0], conf.input_map[1], conf.input_map[2]],
        summand,
        bias: op.summand_bias.then(|| conf.input_map[4]),
        rows: rows as u64,
        len: features as u64,
        eps: op.eps,
    }))
}

/// `layer_norm` (see `rows.cu`): one launch, a block or a warp per row.
#[derive(Debug)]
struct LayerNormKernel {
    function: Function,
    grid: Grid,
    /// f64 passes an f64 eps, f32 an f32 one.
    f64: bool,
    /// The actor inputs holding x, gamma and beta.
    inputs: [usize; 3],
    /// The actor input holding the summand and the kernels' code of its storage
    /// (`LayerNorm::residual`): the sum is then output 0 and y output 1.
    summand: Option<(usize, u32)>,
    /// The actor input holding the summand's bias (`LayerNorm::summand_bias`), if any.
    bias: Option<usize>,
    rows: u64,
    len: u64,
    eps: f64,
}

impl Kernel for LayerNormKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let [x, gamma, beta] = self.inputs.map(|i| io.input_addr(i));
        // 0: no summand, no sum (the kernels test the pointer).
        let (b, kind, sum, y) = match self.summand {
            Some((i, kind)) => (io.input_addr(i), kind, io.output_addr(0), io.output_addr(1)),
            None => (0, 0, 0, io.output_addr(0)),
        };
        let bias = self.bias.map_or(0, |i| io.input_addr(i));
        let (f, g, rows, len) = (self.function, self.grid, self.rows, self.len);
        // SAFETY: x, y, a summand and a sum hold `rows · len` elements, gamma, beta and a
        // summand's bias `len` (checked at build); the argument types are the kernels'.
        unsafe {
            if self.f64 {
                launch(stream(io), f, g, &mut args![x, gamma, beta, y, rows, len, self.eps, b, kind, sum, bias])
            } else {
                let eps = self.eps as f32;
                launch(stream(io), f, g, &mut args![x, gamma, beta, y, rows, len, eps, b, kind, sum, bias])
            }
        }?;
        Ok(())
    }
}

/// `layer_norm_grad` (see `rows.cu`): deterministic, no atomics, in one of two ways.
#[derive(Debug)]
struct LayerNormGradKernel {
    steps: LayerNormGradSteps,
    /// The actor inputs holding x, gamma and dy.
    inputs: [usize; 3],
    /// The actor input holding the base added to dx (`LayerNormGrad::base`), if any.
    base: Option<usize>,
    /// The kernels' code of the 16-bit copy of dx, the fourth output
    /// (`LayerNormGrad::dx_narrow`): 1 bf16, 2 f16, 0 none.
    narrow_kind: u32,
    rows: u64,
    len: u64,
    eps: f64,
}

/// The launches of a layer-norm gradient.
#[derive(Debug)]
enum LayerNormGradSteps {
    /// Rows that fit a warp: dx and each warp's partial parameter gradients in one pass,
    /// then a column sum of the partials (2 · warps · len f32: `parts` bytes of the
    /// stream's scratch).
    Warp { grad: Function, sum: Function, grid: Grid, parts: u64 },
    /// Longer rows and f64: x̂ into dx, the parameter gradients by columns, then dx.
    Rows { x_hat: Function, params: Function, dx: Function, grid: Grid, dtype: DType },
}

impl Kernel for LayerNormGradKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let [x, gamma, dy] = self.inputs.map(|i| io.input_addr(i));
        let (dx, dgamma, dbeta) = (io.output_addr(0), io.output_addr(1), io.output_addr(2));
        // 0: no base, no copy (the kernels test the pointer and the kind).
        let base = self.base.map_or(0, |i| io.input_addr(i));
        let (narrow, kind) = if self.narrow_kind == 0 { (0, 0) } else { (io.output_addr(3), self.narrow_kind) };
        let (rows, len, s) = (self.rows, self.len, stream(io));
        let (e64, e32) = (self.eps, self.eps as f32);
        // SAFETY (every launch): x, dy, dx, a base and a copy hold `rows · len` elements,
        // gamma, dgamma and dbeta `len` (checked at build); the launches run in order on one
        // stream, so each reads what the one before wrote; the argument types are the
        // kernels'.
        match &self.steps {
            LayerNormGradSteps::Warp { grad, sum, grid, parts } => {
                let warps = u64::from(grid.blocks.0) * WARP_ROWS;
                let parts = io.scratch(*parts)?;
                // SAFETY: as above; `parts` holds 2 · warps · len f32 partials, which the
                // first launch writes whole (its grid has `warps` warps) and the second reads.
                unsafe {
                    launch(s, *grad, *grid, &mut args![x, gamma, dy, dx, parts, rows, len, e32, base, narrow, kind])?;
                    launch(s, *sum, Grid::columns(len, warps), &mut args![parts, dgamma, dbeta, warps, len])?;
                }
            }
            LayerNormGradSteps::Rows { x_hat, params, dx: dx_function, grid, dtype } => {
                let columns = Grid::columns(len, rows);
                // SAFETY: as above.
                unsafe {
                    if *dtype == DType::F64 {
                        launch(s, *x_hat, *grid, &mut args![x, dx, rows, len, e64])?;
                        launch(s, *params, columns, &mut args![dx, dy, dgamma, dbeta, rows, len])?;
                        let args = &mut args![x, gamma, dy, dx, rows, len, e64, base, narrow, kind];
                        launch(s, *dx_function, *grid, args)?;
                    } else {
                        launch(s, *x_hat, *grid, &mut args![x, dx, rows, len, e32])?;
                        launch(s, *params, columns, &mut args![dx, dy, dgamma, dbeta, rows, len])?;
                        let args = &mut args![x, gamma, dy, dx, rows, len, e32, base, narrow, kind];
                        launch(s, *dx_function, *grid, args)?;
                    }
                }
            }
        }
        Ok(())
    }

    fn scratch_bytes(&self) -> u64 {
        match &self.steps {
            LayerNormGradSteps::Warp { parts, .. } => *parts,
            LayerNormGradSteps::Rows { .. } => 0,
        }
    }
}

/// The entries read a dy of x's dtype (`regflow_layer_norm_<step>_<dtype>[_w<N>]`), or
/// with f32 x a bf16 or f16 one (`LayerNormGrad::dy`), widened as it loads
/// (`regflow_layer_norm_<step>_f32_dy_<dy>[_w<N>]`; x̂ reads no dy and keeps its entry).
fn make_layer_norm_grad(spec: &KernelSpec<'_>) -> Result<Box<dyn Kernel>, KernelError> {
    let conf = op_conf(spec)?;
    let op: LayerNormGrad = conf.parse_attrs().map_err(KernelError)?;
    // f32 or f64 x, dy in the dtype the attributes give; dx like x, dgamma and dbeta like
    // gamma.
    op.check(&conf.inputs, &conf.outputs).map_err(|m| fail(spec, conf, m))?;
    let dtype = conf.inputs[0].dtype;
    // The suffix of the entries that read dy.
    let dy_suffix = match op.dy {
        None => {
            // `check` compared every meta with x's (a base's too, and a copy's shape).
            if !matches!(dtype, DType::F32 | DType::F64) {
                return Err(fail(spec, conf, format!("computes in f32 or f64, got {}", conf.inputs[0])));
            }
            String::new()
        }
        Some(dy) => format!("_dy_{}", suffix(dy)),
    };
    let gamma = &conf.inputs[1];
    if conf.outputs[1] != *gamma || conf.outputs[2] != *gamma {
        return Err(fail(spec, conf, format!("dgamma and dbeta must match gamma {gamma}")));
    }
    let (rows, features) = layer_norm_rows(spec, conf)?;
    let reading_dy = |step: &str| function(spec, &format!("regflow_layer_norm_{step}_{}{dy_suffix}", suffix(dtype)));
    let steps = match warp_lane_elements(dtype, features) {
        Some(n) => {
            let grid = warp_row_grid(rows);
            let grid = Grid { blocks: (grid.blocks.0.min(LAYER_NORM_GRAD_BLOCKS), 1, 1), ..grid };
            let warps = u64::from(grid.blocks.0) * WARP_ROWS;
            LayerNormGradSteps::Warp {
                grad: function(spec, &format!("regflow_layer_norm_grad_f32{dy_suffix}_w{n}"))?,
                sum: function(spec, "regflow_layer_norm_params_sum_f32")?,
                grid,
                parts: 2 * warps * features as u64 * 4,
            }
        }
        None => LayerNormGradSteps::Rows {
            x_hat: entry(spec, "layer_norm_x_hat", dtype)?,
            params: reading_dy("params_grad")?,
            dx: reading_dy("dx")?,
            grid: row_grid(rows, features),
            dtype,
        },
    };
    let narrow_kind = match op.dx_narrow {
        None => 0,
        Some(DType::Bf16) => 1,
        Some(DType::F16) => 2,
        Some(other) => return Err(fail(spec, conf, format!("a 16-bit copy of dx in {other} (broken invariant)"))),
    };
    Ok(queued(LayerNormGradKernel {
        steps,
        inputs: [conf.input_map[0], conf.input_map[1], conf.input_map[2]],
        base: op.base.then(|| conf.input_map[3]),
        narrow_kind,
        rows: rows as u64,
        len: features as u64,
        eps: op.eps,
    }))
}

/// Most blocks of the warp-per-row layer-norm gradient: 1024 warps, each a few rows of a
/// large batch, whose partials (2 · 1024 · features f32) stay a few MB.
const LAYER_NORM_GRAD_BLOCKS: u32 = 128;

/// The logits' dtype of a cross-entropy (`inputs`: logits, labels, and for the gradient
/// `dy`), checking the rest against it: labels i64, the loss (and `dy`) f32 for bf16 or f16
/// logits and the logits' dtype otherwise, a gradient like the logits.
fn cross_entropy_dtype(spec: &KernelSpec<'_>, conf: &OpConf, inputs: usize) -> Result<DType, KernelError> {
    if conf.inputs.len() != inputs || conf.outputs.len() != 1 {
        let (i, o) = (conf.inputs.len(), conf.outputs.len());
        return Err(fail(spec, conf, format!("takes {inputs} inputs and gives 1 output, but has {i} and {o}")));
    }
    let logits = conf.inputs[0].dtype;
    let loss = match logits {
        DType::F32 | DType::F64 => logits,
        DType::Bf16 | DType::F16 => DType::F32,
        DType::I64 => return Err(fail(spec, conf, format!("needs float logits, got {}", conf.inputs[0]))),
    };
    let grad = inputs == 3;
    let mut want = vec![(conf.inputs[1].dtype, DType::I64, "labels")];
    if grad {
        want.push((conf.inputs[2].dtype, loss, "dy"));
    }
    want.push((conf.outputs[0].dtype, if grad { logits } else { loss }, "the output"));
    for (got, wanted, what) in want {
        if got != wanted {
            return Err(fail(spec, conf, format!("{what} must be {wanted} for {logits} logits, got {got}")));
        }
    }
    Ok(logits)
}

/// Rows, classes and columns per row of a cross-entropy over logits `[rows, width]` and
/// labels `[rows]`, of which the first `padded` columns are classes when set (else all).
fn cross_entropy_rows(
    spec: &KernelSpec<'_>,
    conf: &OpConf,
    padded: Option<usize>,
) -> Result<(usize, usize, usize), KernelError> {
    let (logits, labels) = (&conf.inputs[0], &conf.inputs[1]);
    match (logits.shape.dims(), labels.shape.dims()) {
        (&[rows, width], &[n]) if n == rows => match padded {
            None => Ok((rows, width, width)),
            Some(classes) if (1..=width).contains(&classes) => Ok((rows, classes, width)),
            Some(classes) => Err(fail(
                spec,
                conf,
                format!("takes the first {classes} columns as classes, but the logits {logits} have {width}"),
            )),
        },
        _ => {
            Err(fail(spec, conf, format!("takes logits [rows, classes] and labels [rows], got {logits} and {labels}")))
        }
    }
}

/// `sparse_cross_entropy`: one block per row writes the row's loss to the stream's scratch
/// (`rows` f64 values), then one block adds them in a fixed order (see `rows.cu`).
#[derive(Debug)]
struct CrossEntropyKernel {
    rows_function: Function,
    mean_function: Function,
    inputs: (usize, usize),
    rows: u64,
    classes: u64,
    /// Columns per row (`classes` and padding).
    width: u64,
    /// What the sum of the row losses is divided by: the rows, or the whole batch's rows
    /// for a device's part (`part_cross_entropy`).
    divisor: f64,
    /// Bytes of the per-row losses in the stream's scratch.
    losses: u64,
}

/// Threads per block of the row pass and of the sum.
const CROSS_ENTROPY_THREADS: u32 = 256;

impl Kernel for CrossEntropyKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let (logits, labels, out) = (io.input_addr(self.inputs.0), io.input_addr(self.inputs.1), io.output_addr(0));
        let (rows, classes, width, divisor) = (self.rows, self.classes, self.width, self.divisor);
        let losses = io.scratch(self.losses)?;
        let per_row = Grid::rows(rows, CROSS_ENTROPY_THREADS, 0);
        let one = Grid { blocks: (1, 1, 1), threads: (CROSS_ENTROPY_THREADS, 1, 1), shared_bytes: 0 };
        // SAFETY: logits hold `rows · width` elements, labels `rows` i64, `losses` `rows`
        // f64 and the output one element (checked at build); the argument types are the
        // kernels' (the divisor is a double for both dtypes: the sum is in f64). The two
        // launches are ordered by the stream.
        unsafe {
            launch(stream(io), self.rows_function, per_row, &mut args![logits, labels, losses, rows, classes, width])?;
            launch(stream(io), self.mean_function, one, &mut args![losses, out, rows, divisor])?;
        }
        Ok(())
    }

    fn scratch_bytes(&self) -> u64 {
        self.losses
    }
}

fn make_cross_entropy(spec: &KernelSpec<'_>) -> Result<Box<dyn Kernel>, KernelError> {
    let conf = op_conf(spec)?;
    let op: SparseCrossEntropy = conf.parse_attrs().map_err(KernelError)?;
    cross_entropy_kernel(spec, conf, None, op.classes)
}

/// `part_cross_entropy`: the loss or its gradient of this device's rows, over `batch` rows.
fn make_part_cross_entropy(spec: &KernelSpec<'_>) -> Result<Box<dyn Kernel>, KernelError> {
    let conf = op_conf(spec)?;
    let op: PartCrossEntropy = conf.parse_attrs().map_err(KernelError)?;
    if op.batch == 0 {
        return Err(fail(spec, conf, "the batch the loss is a mean over has 0 rows"));
    }
    if op.grad {
        cross_entropy_grad_kernel(spec, conf, Some(op.batch), op.classes)
    } else {
        cross_entropy_kernel(spec, conf, Some(op.batch), op.classes)
    }
}

/// The loss of `conf`'s rows divided by `batch` (`None`: by its own rows), over the first
/// `padded` columns of each row when set.
fn cross_entropy_kernel(
    spec: &KernelSpec<'_>,
    conf: &OpConf,
    batch: Option<usize>,
    padded: Option<usize>,
) -> Result<Box<dyn Kernel>, KernelError> {
    let dtype = cross_entropy_dtype(spec, conf, 2)?;
    let (rows, classes, width) = cross_entropy_rows(spec, conf, padded)?;
    if conf.outputs[0].shape.numel() != 1 {
        return Err(fail(spec, conf, format!("gives a scalar loss, but the output is {}", conf.outputs[0])));
    }
    let rows_function = entry(spec, "cross_entropy_rows", dtype)?;
    let mean_function = entry(spec, "cross_entropy_mean", conf.outputs[0].dtype)?;
    let losses = (rows.max(1) * 8) as u64;
    Ok(queued(CrossEntropyKernel {
        rows_function,
        mean_function,
        inputs: (conf.input_map[0], conf.input_map[1]),
        rows: rows as u64,
        classes: classes as u64,
        width: width as u64,
        divisor: batch.unwrap_or(rows) as f64,
        losses,
    }))
}

/// `sparse_cross_entropy_grad`: one block per row.
#[derive(Debug)]
struct CrossEntropyGradKernel {
    function: Function,
    grid: Grid,
    dtype: DType,
    inputs: [usize; 3],
    rows: u64,
    classes: u64,
    /// Columns per row (`classes` and padding, whose gradient is 0).
    width: u64,
    /// The rows the mean is over (this device's, or the whole batch's for a part).
    divisor: u64,
}

impl Kernel for CrossEntropyGradKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let [logits, labels, dy] = self.inputs.map(|i| io.input_addr(i));
        let dx = io.output_addr(0);
        let (rows, classes, width, divisor) = (self.rows, self.classes, self.width, self.divisor);
        let (f, g) = (self.function, self.grid);
        // SAFETY: logits and dx hold `rows · width` elements, labels `rows` i64, dy one
        // element (checked at build); the argument types are the kernel's (the divisor is
        // in the arithmetic type: f64 for f64 logits, f32 for f32 and bf16).
        unsafe {
            match self.dtype {
                DType::F64 => {
                    launch(stream(io), f, g, &mut args![logits, labels, dy, dx, rows, classes, width, divisor as f64])
                }
                _ => launch(stream(io), f, g, &mut args![logits, labels, dy, dx, rows, classes, width, divisor as f32]),
            }
        }?;
        Ok(())
    }
}

fn make_cross_entropy_grad(spec: &KernelSpec<'_>) -> Result<Box<dyn Kernel>, KernelError> {
    let conf = op_conf(spec)?;
    let op: SparseCrossEntropyGrad = conf.parse_attrs().map_err(KernelError)?;
    cross_entropy_grad_kernel(spec, conf, None, op.classes)
}

/// The gradient of `conf`'s rows for a mean over `batch` rows (`None`: its own rows), over
/// the first `padded` columns of each row when set (zero in the rest).
fn cross_entropy_grad_kernel(
    spec: &KernelSpec<'_>,
    conf: &OpConf,
    batch: Option<usize>,
    padded: Option<usize>,
) -> Result<Box<dyn Kernel>, KernelError> {
    let dtype = cross_entropy_dtype(spec, conf, 3)?;
    let (rows, classes, width) = cross_entropy_rows(spec, conf, padded)?;
    if conf.inputs[2].shape.numel() != 1 || conf.outputs[0] != conf.inputs[0] {
        return Err(fail(
            spec,
            conf,
            format!("takes a scalar dy and gives dx like the logits, got {} and {}", conf.inputs[2], conf.outputs[0]),
        ));
    }
    Ok(queued(CrossEntropyGradKernel {
        function: entry(spec, "sparse_cross_entropy_grad", dtype)?,
        grid: row_grid(rows, width),
        dtype,
        inputs: [conf.input_map[0], conf.input_map[1], conf.input_map[2]],
        rows: rows as u64,
        classes: classes as u64,
        width: width as u64,
        divisor: batch.unwrap_or(rows) as u64,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_blocks_are_whole_warps_up_to_512_threads() {
        for (len, threads) in [(0, 32), (1, 32), (7, 32), (33, 64), (1023, 512), (50_257, 512)] {
            assert_eq!(row_threads(len), threads, "{len}");
            assert_eq!(row_threads(len) % 32, 0);
        }
        assert_eq!(row_grid(70_001, 7).blocks.0, 70_001);
    }

    #[test]
    fn a_masked_softmax_runs_on_the_device_only_with_a_mask_its_entries_read() {
        use DType::{Bf16, F16, F32, F64};
        for (x, mask, entries) in [
            (F32, F32, Some(F32)),
            (F64, F64, Some(F64)),
            (Bf16, F32, Some(Bf16)),
            (F16, F32, Some(F16)),
            (Bf16, Bf16, None),
            (F32, Bf16, None),
        ] {
            assert_eq!(masked_entries(x, mask), entries, "scores {x}, mask {mask}");
        }
    }

    #[test]
    fn rows_are_over_the_last_axis() {
        assert_eq!(rows_of(&[2, 3, 5]), (6, 5));
        assert_eq!(rows_of(&[7]), (1, 7));
    }
}
