//! Data movement on CUDA (`movement.cu`): `reshape` (a copy kernel: the driver wrapper has
//! no device-to-device memcpy), `broadcast_to` and `permute` (strided gathers), `slice`,
//! `slice_grad` and `concat` (copies of axis ranges), the boxing steps `take_part` (a
//! device's part of one axis: a slice), `keep_on_first` (a copy, or zeros) and
//! `to_global` (a copy of the device's part, after the layout change), `sum_to`,
//! `embedding`, `embedding_grad` and `vocab_part` (either on a device's rows of the
//! table). Scatters first zero their output with fill.cu's `regflow_fill_*`.

use super::elementwise::{arity, check, float_dtype, input_slots};
use super::fail;
use super::layout::{self, Indexing};
use super::{factory, function, op_conf, stream, suffix, Entry};
use crate::driver::{launch, Function, Grid, StreamHandle, MAX_LINEAR_BLOCKS};
use regflow_kernels::{Kernel, KernelError, KernelIo, KernelSpec};
use regflow_plan::ops::{
    BroadcastTo, Concat, Embedding, EmbeddingGrad, KeepOnFirst, Permute, Reshape, Slice, SliceGrad, SumSquares, SumTo,
    TakePart, ToGlobal, VocabPart,
};
use regflow_plan::{DType, OpConf, Shape};

const ANY: &[DType] = &[DType::F32, DType::F64, DType::I64, DType::Bf16, DType::F16];
const FLOAT: &[DType] = &[DType::F32, DType::F64];

pub(super) const ENTRIES: &[Entry] = &[
    ("reshape", ANY, || factory(make_reshape)),
    ("broadcast_to", ANY, || factory(make_broadcast_to)),
    ("permute", ANY, || factory(make_permute)),
    ("slice", ANY, || factory(make_slice)),
    ("slice_grad", ANY, || factory(make_slice_grad)),
    ("concat", ANY, || factory(make_concat)),
    ("take_part", ANY, || factory(make_take_part)),
    ("keep_on_first", ANY, || factory(make_keep_on_first)),
    ("to_global", ANY, || factory(make_to_global)),
    ("sum_to", &[DType::F32, DType::F64, DType::Bf16, DType::F16], || factory(make_sum_to)),
    ("sum_squares", FLOAT, || factory(make_sum_squares)),
    ("embedding", FLOAT, || factory(make_embedding)),
    ("embedding_grad", FLOAT, || factory(make_embedding_grad)),
    ("vocab_part", FLOAT, || factory(make_vocab_part)),
];

/// The dtype of a movement op: its input's and output's, which must agree.
fn moved_dtype(spec: &KernelSpec<'_>, conf: &OpConf) -> Result<DType, KernelError> {
    let dtype = conf.outputs[0].dtype;
    if let Some(other) = conf.inputs.iter().find(|m| m.dtype != dtype) {
        return Err(fail(spec, conf, format!("moves {other} into {}: one dtype only", conf.outputs[0])));
    }
    Ok(dtype)
}

/// Queues `regflow_fill_*(out, 0, n)`: `fill` is that entry for `dtype`.
///
/// # Safety
///
/// `out` must hold `n` elements of `dtype` on `fill`'s device.
unsafe fn zero(s: StreamHandle, fill: Function, dtype: DType, out: u64, n: u64) -> Result<(), KernelError> {
    let grid = Grid::linear(n);
    // SAFETY: the caller's contract; fill entries take (out, value: T, n).
    unsafe {
        match dtype {
            DType::F32 => launch(s, fill, grid, &mut args![out, 0f32, n]),
            DType::F64 => launch(s, fill, grid, &mut args![out, 0f64, n]),
            DType::I64 => launch(s, fill, grid, &mut args![out, 0i64, n]),
            // bf16 and f16 travel as their bits: +0.0 is all zeros.
            DType::Bf16 | DType::F16 => launch(s, fill, grid, &mut args![out, 0u16, n]),
        }
    }?;
    Ok(())
}

// ---- reshape, broadcast_to, permute ---------------------------------------------------

fn make_reshape(spec: &KernelSpec<'_>) -> Result<GatherKernel, KernelError> {
    let conf = op_conf(spec)?;
    let op: Reshape = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    arity(spec, conf, 1, 1)?;
    let dtype = moved_dtype(spec, conf)?;
    let shape = op.resolve(&conf.inputs[0].shape).map_err(|e| fail(spec, conf, e))?;
    if shape != conf.outputs[0].shape {
        return Err(fail(
            spec,
            conf,
            format!("reshapes {} to {shape}, but the output is {}", conf.inputs[0], conf.outputs[0]),
        ));
    }
    whole_copy(spec, conf, dtype)
}

/// `to_global` on one device: its part is already in the new layout (boxing moved it), so
/// the op copies it as it is.
fn make_to_global(spec: &KernelSpec<'_>) -> Result<GatherKernel, KernelError> {
    let conf = op_conf(spec)?;
    let _: ToGlobal = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    arity(spec, conf, 1, 1)?;
    let dtype = moved_dtype(spec, conf)?;
    same_shape(spec, conf, "copies")?;
    whole_copy(spec, conf, dtype)
}

/// Refuses an op that must write its one input's shape (`verb` says what it does to it)
/// but names another output.
fn same_shape(spec: &KernelSpec<'_>, conf: &OpConf, verb: &str) -> Result<(), KernelError> {
    if conf.inputs[0].shape != conf.outputs[0].shape {
        return Err(fail(spec, conf, format!("{verb} {}, but the output is {}", conf.inputs[0], conf.outputs[0])));
    }
    Ok(())
}

/// The copy of the op's one input into its output, element for element (checked to hold
/// as many): `reshape` and `to_global`.
fn whole_copy(spec: &KernelSpec<'_>, conf: &OpConf, dtype: DType) -> Result<GatherKernel, KernelError> {
    Ok(GatherKernel {
        function: function(spec, &format!("regflow_copy_{}", suffix(dtype)))?,
        input: input_slots::<1>(conf)[0],
        map: None,
        n: conf.outputs[0].shape.numel() as u64,
    })
}

fn make_broadcast_to(spec: &KernelSpec<'_>) -> Result<GatherKernel, KernelError> {
    let conf = op_conf(spec)?;
    let op: BroadcastTo = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    arity(spec, conf, 1, 1)?;
    let dtype = moved_dtype(spec, conf)?;
    let (input, out) = (&conf.inputs[0].shape, &conf.outputs[0].shape);
    if Shape::broadcast(input, out).as_ref() != Some(out) || *out != op.0 {
        return Err(fail(spec, conf, format!("broadcasts {input} to {}, but the output is {out}", op.0)));
    }
    // a: the input's strides, 0 where stretched; b unused (a scalar's strides: all 0).
    let map = layout::broadcast(out.dims(), input.dims(), &[]).map_err(|e| fail(spec, conf, e))?;
    gather_kernel(spec, conf, dtype, map)
}

fn make_permute(spec: &KernelSpec<'_>) -> Result<GatherKernel, KernelError> {
    let conf = op_conf(spec)?;
    let op: Permute = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    arity(spec, conf, 1, 1)?;
    let dtype = moved_dtype(spec, conf)?;
    let input = &conf.inputs[0].shape;
    let perm = op.resolve(input).map_err(|e| fail(spec, conf, e))?;
    let dims: Vec<usize> = perm.iter().map(|&p| input.dims()[p]).collect();
    if dims != conf.outputs[0].shape.dims() {
        return Err(fail(
            spec,
            conf,
            format!("permutes {input} to {}, but the output is {}", Shape::new(dims), conf.outputs[0]),
        ));
    }
    let map = layout::permutation(input.dims(), &perm).map_err(|e| fail(spec, conf, e))?;
    gather_kernel(spec, conf, dtype, map)
}

/// A gather through `map`, or a plain copy where the map is the identity (one contiguous
/// dimension or none).
fn gather_kernel(
    spec: &KernelSpec<'_>,
    conf: &OpConf,
    dtype: DType,
    map: Indexing,
) -> Result<GatherKernel, KernelError> {
    let n = conf.outputs[0].shape.numel() as u64;
    let contiguous = map.rank == 0 && n <= 1 || map.rank == 1 && map.a[0] == 1;
    let (entry, map) = if contiguous { ("copy", None) } else { ("gather", Some(map)) };
    Ok(GatherKernel {
        function: function(spec, &format!("regflow_{entry}_{}", suffix(dtype)))?,
        input: input_slots::<1>(conf)[0],
        map,
        n,
    })
}

/// `dst[i] = src[map(i)]`, or `dst = src` without a map.
#[derive(Debug)]
struct GatherKernel {
    function: Function,
    input: usize,
    map: Option<Indexing>,
    n: u64,
}

impl Kernel for GatherKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let (src, dst, n) = (io.input_addr(self.input), io.output_addr(0), self.n);
        let (s, f, grid) = (stream(io), self.function, Grid::linear(n));
        // SAFETY: dst holds n elements, and the map (strides of the input's shape) only
        // reaches elements of src; copy takes (src, dst, n), gather (src, dst, map, n).
        unsafe {
            match self.map {
                None => launch(s, f, grid, &mut args![src, dst, n]),
                Some(map) => launch(s, f, grid, &mut args![src, dst, map, n]),
            }
        }?;
        Ok(())
    }
}

// ---- slice, slice_grad, concat --------------------------------------------------------

/// One `regflow_copy_blocks_*` launch: `outer` blocks of `run` elements from
/// `src[o·src_block + src_start ..]` to `dst[o·dst_block + dst_start ..]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Blocks {
    /// Which register of the actor is the source.
    input: usize,
    outer: u64,
    run: u64,
    src_block: u64,
    src_start: u64,
    dst_block: u64,
    dst_start: u64,
}

/// Copies of axis ranges into the output, after zeroing it when `zero` names the fill
/// entry (`slice_grad`).
#[derive(Debug)]
struct BlocksKernel {
    function: Function,
    zero: Option<(Function, DType, u64)>,
    copies: Vec<Blocks>,
}

impl Kernel for BlocksKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let (s, dst) = (stream(io), io.output_addr(0));
        if let Some((fill, dtype, n)) = self.zero {
            // SAFETY: the output holds n elements of dtype (its meta).
            unsafe { zero(s, fill, dtype, dst, n) }?;
        }
        for b in &self.copies {
            let src = io.input_addr(b.input);
            let grid = Grid::linear(b.outer * b.run);
            // SAFETY: the blocks were computed from the checked metas of src and dst, so
            // every element copied is inside both; the entry takes (src, dst, outer, run,
            // src_block, src_start, dst_block, dst_start).
            unsafe {
                launch(
                    s,
                    self.function,
                    grid,
                    &mut args![src, dst, b.outer, b.run, b.src_block, b.src_start, b.dst_block, b.dst_start],
                )
            }?;
        }
        Ok(())
    }
}

/// `dims` with `axis` of size `size`.
fn with_axis(dims: &[usize], axis: usize, size: usize) -> Shape {
    let mut dims = dims.to_vec();
    dims[axis] = size;
    Shape::new(dims)
}

fn make_slice(spec: &KernelSpec<'_>) -> Result<BlocksKernel, KernelError> {
    let conf = op_conf(spec)?;
    let op: Slice = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    arity(spec, conf, 1, 1)?;
    let dtype = moved_dtype(spec, conf)?;
    let input = conf.inputs[0].shape.dims();
    let (axis, _) = op.resolve(&conf.inputs[0].shape).map_err(|e| fail(spec, conf, e))?;
    let expected = with_axis(input, axis, op.end - op.start);
    if expected != conf.outputs[0].shape {
        return Err(fail(
            spec,
            conf,
            format!("slices {} to {expected}, but the output is {}", conf.inputs[0], conf.outputs[0]),
        ));
    }
    axis_range(spec, conf, dtype, (input, axis), op.start..op.end)
}

/// The copy of `range` of `axis` of the op's one input (of `dims`) into its output: the
/// kernel of `slice` and of `take_part`.
fn axis_range(
    spec: &KernelSpec<'_>,
    conf: &OpConf,
    dtype: DType,
    (dims, axis): (&[usize], usize),
    range: std::ops::Range<usize>,
) -> Result<BlocksKernel, KernelError> {
    let (outer, inner) = layout::around_axis(dims, axis);
    let run = range.len() as u64 * inner;
    Ok(BlocksKernel {
        function: function(spec, &format!("regflow_copy_blocks_{}", suffix(dtype)))?,
        zero: None,
        copies: vec![Blocks {
            input: input_slots::<1>(conf)[0],
            outer,
            run,
            src_block: dims[axis] as u64 * inner,
            src_start: range.start as u64 * inner,
            dst_block: run,
            dst_start: 0,
        }],
    })
}

/// `B -> S(dim)` on one device: its part of `dim` (`regflow_plan::part_range`, the CPU
/// kernel's split), a slice of that axis.
fn make_take_part(spec: &KernelSpec<'_>) -> Result<BlocksKernel, KernelError> {
    let conf = op_conf(spec)?;
    let op: TakePart = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    arity(spec, conf, 1, 1)?;
    let dtype = moved_dtype(spec, conf)?;
    let input = conf.inputs[0].shape.dims();
    let Some(&size) = input.get(op.dim) else {
        return Err(fail(
            spec,
            conf,
            format!("takes a part of dim {} of {}, which has no such dim", op.dim, conf.inputs[0]),
        ));
    };
    if op.index >= op.parts {
        return Err(fail(spec, conf, format!("takes part {} of {}: parts are numbered from 0", op.index, op.parts)));
    }
    let part = regflow_plan::part_range(size, op.parts, op.index);
    let expected = with_axis(input, op.dim, part.len());
    if expected != conf.outputs[0].shape {
        return Err(fail(
            spec,
            conf,
            format!(
                "part {} of {} of {} along dim {} is {expected}, but the output is {}",
                op.index, op.parts, conf.inputs[0], op.dim, conf.outputs[0]
            ),
        ));
    }
    axis_range(spec, conf, dtype, (input, op.dim), part)
}

/// `B -> P` on one device: the first device of the axis copies the value, the others write
/// zeros (a summand each of them adds nothing with).
fn make_keep_on_first(spec: &KernelSpec<'_>) -> Result<BlocksKernel, KernelError> {
    let conf = op_conf(spec)?;
    let op: KeepOnFirst = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    arity(spec, conf, 1, 1)?;
    let dtype = moved_dtype(spec, conf)?;
    same_shape(spec, conf, "keeps")?;
    let n = conf.outputs[0].shape.numel() as u64;
    let (zero, copies) = if op.first {
        let whole = Blocks {
            input: input_slots::<1>(conf)[0],
            outer: 1,
            run: n,
            src_block: n,
            src_start: 0,
            dst_block: n,
            dst_start: 0,
        };
        (None, vec![whole])
    } else {
        (Some((function(spec, &format!("regflow_fill_{}", suffix(dtype)))?, dtype, n)), Vec::new())
    };
    Ok(BlocksKernel { function: function(spec, &format!("regflow_copy_blocks_{}", suffix(dtype)))?, zero, copies })
}

fn make_slice_grad(spec: &KernelSpec<'_>) -> Result<BlocksKernel, KernelError> {
    let conf = op_conf(spec)?;
    let op: SliceGrad = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    arity(spec, conf, 1, 1)?;
    let dtype = moved_dtype(spec, conf)?;
    let input = conf.inputs[0].shape.dims();
    let (axis, len) = op.resolve(&conf.inputs[0].shape).map_err(|e| fail(spec, conf, e))?;
    let expected = with_axis(input, axis, op.size);
    if expected != conf.outputs[0].shape {
        return Err(fail(
            spec,
            conf,
            format!("places {} in {expected}, but the output is {}", conf.inputs[0], conf.outputs[0]),
        ));
    }
    let (outer, inner) = layout::around_axis(input, axis);
    let run = len as u64 * inner;
    Ok(BlocksKernel {
        function: function(spec, &format!("regflow_copy_blocks_{}", suffix(dtype)))?,
        zero: Some((function(spec, &format!("regflow_fill_{}", suffix(dtype)))?, dtype, expected.numel() as u64)),
        copies: vec![Blocks {
            input: input_slots::<1>(conf)[0],
            outer,
            run,
            src_block: run,
            src_start: 0,
            dst_block: op.size as u64 * inner,
            dst_start: op.start as u64 * inner,
        }],
    })
}

fn make_concat(spec: &KernelSpec<'_>) -> Result<BlocksKernel, KernelError> {
    let conf = op_conf(spec)?;
    let op: Concat = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    if conf.inputs.is_empty() || conf.input_map.len() != conf.inputs.len() || conf.outputs.len() != 1 {
        return Err(fail(spec, conf, "takes one or more inputs and gives 1 output"));
    }
    let dtype = moved_dtype(spec, conf)?;
    let out = conf.outputs[0].shape.dims();
    let axis = op.resolve(&conf.outputs[0].shape).map_err(|e| fail(spec, conf, e))?;
    let (outer, inner) = layout::around_axis(out, axis);
    let total = out[axis] as u64;
    let mut copies = Vec::with_capacity(conf.inputs.len());
    let mut offset = 0u64;
    for (meta, &slot) in conf.inputs.iter().zip(&conf.input_map) {
        let dims = meta.shape.dims();
        let size = dims.get(axis).copied().unwrap_or(0);
        if with_axis(out, axis, size).dims() != dims {
            return Err(fail(
                spec,
                conf,
                format!("cannot place input {meta} along axis {axis} of {}", conf.outputs[0]),
            ));
        }
        let run = size as u64 * inner;
        copies.push(Blocks {
            input: slot,
            outer,
            run,
            src_block: run,
            src_start: 0,
            dst_block: total * inner,
            dst_start: offset * inner,
        });
        offset += size as u64;
    }
    if offset != total {
        return Err(fail(spec, conf, format!("the inputs fill {offset} of the output's {total} along axis {axis}")));
    }
    Ok(BlocksKernel {
        function: function(spec, &format!("regflow_copy_blocks_{}", suffix(dtype)))?,
        zero: None,
        copies,
    })
}

// ---- sum_to ---------------------------------------------------------------------------

fn make_sum_to(spec: &KernelSpec<'_>) -> Result<SumToKernel, KernelError> {
    let conf = op_conf(spec)?;
    let op: SumTo = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    sum_kernel(spec, conf, &op.0, Summands::AsTheyAre)
}

/// `sum_squares`: `sum_to` a scalar with every summand squared as it loads.
fn make_sum_squares(spec: &KernelSpec<'_>) -> Result<SumToKernel, KernelError> {
    let conf = op_conf(spec)?;
    let _: SumSquares = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    sum_kernel(spec, conf, &regflow_plan::Shape::scalar(), Summands::Squared)
}

/// What a sum adds: its input's elements, or their squares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Summands {
    AsTheyAre,
    Squared,
}

/// The sum of `conf`'s input (or of its squares) down to `target`, the output's shape.
fn sum_kernel(
    spec: &KernelSpec<'_>,
    conf: &OpConf,
    target: &regflow_plan::Shape,
    summands: Summands,
) -> Result<SumToKernel, KernelError> {
    arity(spec, conf, 1, 1)?;
    let dtype = float_dtype(spec, conf)?;
    moved_dtype(spec, conf)?;
    let (input, out) = (&conf.inputs[0].shape, &conf.outputs[0].shape);
    if out != target {
        return Err(fail(spec, conf, format!("sums {input} to {target}, but the output is {out}")));
    }
    // The first launch's entries: sum_to's, or the flat ones that square as they load (a
    // squared norm is one value: it only takes the flat sums).
    let flat = if summands == Summands::Squared { "sum_squares_flat" } else { "sum_flat" };
    let entry = |stem: &str| function(spec, &format!("regflow_{stem}_{}", suffix(dtype)));
    // f64 partial sums for f64, f32 for f32 and bf16 (which adds in f32).
    let part_bytes = if dtype == DType::F64 { 8 } else { 4 };
    let reduction = layout::reduction(input.dims(), out.dims()).map_err(|e| fail(spec, conf, e))?;
    let (n_out, n_reduced) = (reduction.kept_count, reduction.reduced_count);
    let input_slot = input_slots::<1>(conf)[0];
    // One output: every element of the (contiguous, row-major) input is a summand, in
    // memory order, so the flat entries read it without index math.
    if n_out == 1 {
        let plan = flat_plan(n_reduced, part_bytes);
        let launches = if plan.chunks == 1 {
            SumLaunches::Flat { first: entry(flat)?, second: None, plan }
        } else {
            SumLaunches::Flat { first: entry(&format!("{flat}_chunks"))?, second: Some(entry("sum_parts")?), plan }
        };
        return Ok(SumToKernel { input: input_slot, reduction, launches });
    }
    if summands == Summands::Squared {
        return Err(fail(spec, conf, format!("sums squares to one value, not {n_out} (broken invariant)")));
    }
    let chunked = n_out <= CHUNKED_MAX_OUTPUTS && n_reduced >= CHUNKED_MIN_RANGE;
    // Outputs that are the trailing columns of a row-major matrix (a bias gradient): rows
    // walked with 16-byte loads, no index math.
    if !chunked && sums_rows(&reduction) {
        if let Some(plan) = rows_plan(n_reduced, n_out, dtype.size() as u64, part_bytes) {
            let launches = if plan.slices == 1 {
                SumLaunches::Rows { first: entry("sum_rows")?, second: None, plan }
            } else {
                SumLaunches::Rows { first: entry("sum_rows_split")?, second: Some(entry("sum_row_slices")?), plan }
            };
            return Ok(SumToKernel { input: input_slot, reduction, launches });
        }
    }
    let two_launch = if chunked {
        Some((PartialLayout::Chunks, (n_reduced / CHUNK_TARGET).clamp(1, MAX_CHUNKS)))
    } else {
        split_count(n_out, n_reduced).map(|splits| (PartialLayout::Splits, splits))
    };
    let launches = match two_launch {
        Some((layout, pieces)) => {
            let (first, second) = match layout {
                PartialLayout::Chunks => ("sum_to_chunks", "sum_parts"),
                PartialLayout::Splits => ("sum_to_split", "sum_splits"),
            };
            SumLaunches::Partial(PartialSums {
                layout,
                first: entry(first)?,
                second: entry(second)?,
                pieces,
                chunk: n_reduced.div_ceil(pieces),
                parts: n_out * pieces * part_bytes,
            })
        }
        None => SumLaunches::Columns(entry("sum_to")?),
    };
    Ok(SumToKernel { input: input_slot, reduction, launches })
}

/// Whether `r` sums the rows of a row-major matrix to its columns: one kept axis of
/// stride 1 (the trailing, contiguous axes, merged) and one reduced axis whose stride is
/// the row length (the leading axes, merged).
fn sums_rows(r: &layout::Reduction) -> bool {
    r.kept.rank == 1 && r.kept.a[0] == 1 && r.reduced.rank == 1 && r.reduced.a[0] == r.kept_count
}

/// How a row sum (`sum_rows` in `movement.cu`) of `rows` × `cols` cuts its work: blocks of
/// [`ROWS_TX`] × [`ROWS_TY`] threads, `column_blocks` of them across the columns (a thread
/// per 16 bytes of a row) times `slices` down the rows, `slice_rows` rows each (the last
/// fewer); more than one slice writes `parts_bytes` of partial sums, `slices` per column,
/// that `sum_row_slices` adds (a column reduction, in an order set by `slices`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RowsPlan {
    column_blocks: u64,
    slices: u64,
    slice_rows: u64,
    parts_bytes: u64,
}

/// The [`RowsPlan`] of `rows` × `cols` elements of `element_bytes` with partial sums of
/// `part_bytes`, or `None` where the columns need more blocks than a grid dimension holds
/// (the general column sum loops over them). A function of the shape alone, so the order
/// of the additions is too.
fn rows_plan(rows: u64, cols: u64, element_bytes: u64, part_bytes: u64) -> Option<RowsPlan> {
    let groups = cols.div_ceil(16 / element_bytes);
    let column_blocks = groups.div_ceil(u64::from(ROWS_TX)).max(1);
    if column_blocks > MAX_LINEAR_BLOCKS {
        return None;
    }
    let wanted = ROWS_TARGET_BLOCKS.div_ceil(column_blocks).min(rows / ROWS_MIN_SLICE).max(1);
    let slice_rows = rows.div_ceil(wanted).next_multiple_of(ROWS_SLICE_QUANTUM).max(ROWS_SLICE_QUANTUM);
    let slices = rows.div_ceil(slice_rows).max(1);
    let parts_bytes = if slices == 1 { 0 } else { slices * cols * part_bytes };
    Some(RowsPlan { column_blocks, slices, slice_rows, parts_bytes })
}

/// Threads of a row-sum block across the columns (`ROWS_TX` in `movement.cu`): 32 × 16
/// bytes, 512 contiguous bytes of a row per warp ...
const ROWS_TX: u32 = 32;
/// ... and down the rows (`ROWS_TY`): 256 threads a block.
const ROWS_TY: u32 = 8;
/// Rows are sliced until there are about this many blocks: four per multiprocessor of an
/// H100 or H200 (132), 1024 threads each with four 16-byte loads in flight, far more bytes
/// in flight than an SM needs to stream at full bandwidth.
const ROWS_TARGET_BLOCKS: u64 = 528;
/// Each slice has at least this many rows (eight per thread of a block: two rounds of its
/// four loads), so that the partial sums (4 bytes a column per slice) stay a few percent
/// of the input's bytes (GPT-2's [8192, 768] bf16: 128 slices, 393 KB beside 12.6 MB).
const ROWS_MIN_SLICE: u64 = 64;
/// Slices are a multiple of this many rows: full rounds of `ROWS_UNROLL` (4) loads for each
/// of the `ROWS_TY` threads of a column.
const ROWS_SLICE_QUANTUM: u64 = 32;

/// How a flat sum (a whole contiguous input to one value) cuts its `n` elements: one block
/// of [`FLAT_SINGLE_THREADS`] when `chunks` is 1, else `chunks` blocks of [`FLAT_THREADS`]
/// over `chunk` elements each (the last fewer), whose sums take `parts_bytes` of scratch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FlatPlan {
    chunks: u64,
    chunk: u64,
    parts_bytes: u64,
}

/// The [`FlatPlan`] of `n` elements with partial sums of `part_bytes` each: a function of
/// `n` alone, so the order of the additions is too.
fn flat_plan(n: u64, part_bytes: u64) -> FlatPlan {
    if n <= FLAT_SINGLE_MAX {
        return FlatPlan { chunks: 1, chunk: n, parts_bytes: 0 };
    }
    let wanted = (n / FLAT_MIN_CHUNK).clamp(2, FLAT_MAX_CHUNKS);
    let chunk = n.div_ceil(wanted).next_multiple_of(FLAT_CHUNK_QUANTUM);
    let chunks = n.div_ceil(chunk);
    FlatPlan { chunks, chunk, parts_bytes: chunks * part_bytes }
}

/// A flat sum of at most this many elements runs as one block, one launch: 32 elements a
/// thread (two rounds of four 16-byte loads in f32) cost about two memory round trips,
/// less than the second launch and the partial sums of the chunked sum would.
const FLAT_SINGLE_MAX: u64 = 1 << 15;
/// Threads of the one-block flat sum (the most a block may have).
const FLAT_SINGLE_THREADS: u32 = 1024;
/// Longer ones are cut into chunks of at least this many elements (8 per thread of a
/// [`FLAT_THREADS`] block: below that a block's reduction outweighs its loads) ...
const FLAT_MIN_CHUNK: u64 = 2048;
/// ... and at most this many: about two waves of 256-thread blocks on an H100 or H200 (132
/// multiprocessors, 4 to 8 such blocks each), so every SM has blocks; a 768 × 768 matrix
/// gets 288 chunks, GPT-2's 50257 × 768 embedding 1019; a grid dimension holds it.
const FLAT_MAX_CHUNKS: u64 = 1024;
/// Chunk lengths are multiples of this many elements, so that every chunk starts 16-byte
/// aligned where the input does (and its 16-byte loads stay vector loads).
const FLAT_CHUNK_QUANTUM: u64 = 1024;
/// Threads per block of the flat chunks.
const FLAT_THREADS: u32 = 256;

/// Into how many splits a column sum of `n_out` outputs over `n_reduced` positions each cuts
/// its range, or `None` where one column block per 32 outputs already gives the GPU
/// [`SPLIT_TARGET_BLOCKS`] blocks, or the range is too short to be worth a second launch.
fn split_count(n_out: u64, n_reduced: u64) -> Option<u64> {
    let columns = Grid::columns(n_out, n_reduced);
    let blocks = u64::from(columns.blocks.0);
    if columns.threads.1 == 1 || blocks >= SPLIT_TARGET_BLOCKS || n_reduced < 2 * SPLIT_MIN_CHUNK {
        return None;
    }
    Some(SPLIT_TARGET_BLOCKS.div_ceil(blocks).min(n_reduced / SPLIT_MIN_CHUNK).max(2))
}

/// A column sum is split until it has about this many blocks: two per multiprocessor of an
/// H100 or H200 (132).
const SPLIT_TARGET_BLOCKS: u64 = 264;
/// Each split covers at least this many positions (16 per slice of a 32 × 32 block).
const SPLIT_MIN_CHUNK: u64 = 512;

/// At most this many outputs (but more than one: see [`flat_plan`]) take the chunked
/// two-launch sum ...
const CHUNKED_MAX_OUTPUTS: u64 = 64;
/// ... when each adds at least this many elements (a column block would leave the GPU idle).
const CHUNKED_MIN_RANGE: u64 = 1 << 16;
/// About this many elements per chunk (one block of [`CHUNK_THREADS`] each) ...
const CHUNK_TARGET: u64 = 8192;
/// ... and at most this many chunks per output.
const MAX_CHUNKS: u64 = 1024;
/// Threads per block of both chunked launches.
const CHUNK_THREADS: u32 = 256;

/// `sum_to` or `sum_squares` (see `movement.cu`): to one value, the flat sum (the input
/// read in memory order, one block or chunks then their sum); over the leading axes to the
/// trailing ones, the row sum (16-byte loads across a row's columns, slices of rows, then
/// their sum); else a column reduction (a thread per output element, its summands split
/// over 32 threads when there are many) or, in two launches, the chunked sum (a few outputs
/// over long ranges) or the split column sum (too few column blocks to fill the GPU).
#[derive(Debug)]
struct SumToKernel {
    input: usize,
    reduction: layout::Reduction,
    launches: SumLaunches,
}

/// The launches of a [`SumToKernel`].
#[derive(Debug)]
enum SumLaunches {
    /// One column reduction (`sum_to`, `sum_squares`).
    Columns(Function),
    /// Pieces of each output's range, then their sum.
    Partial(PartialSums),
    /// The columns of a row-major matrix: `sum_rows` alone (one slice, `second` `None`), or
    /// `sum_rows_split` then `sum_row_slices`.
    Rows { first: Function, second: Option<Function>, plan: RowsPlan },
    /// One output: `sum_flat` alone (`second` `None`), or `sum_flat_chunks` then
    /// `sum_parts`.
    Flat { first: Function, second: Option<Function>, plan: FlatPlan },
}

/// How a two-launch sum cuts each output's range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PartialLayout {
    /// A block per chunk of one output's range (`sum_to_chunks`, then `sum_parts`).
    Chunks,
    /// A column block per split of the range (`sum_to_split`, then `sum_splits`).
    Splits,
}

/// The two launches of a chunked or split sum and their partial sums (in the stream's
/// scratch).
#[derive(Debug)]
struct PartialSums {
    layout: PartialLayout,
    first: Function,
    second: Function,
    /// Chunks or splits per output.
    pieces: u64,
    /// Positions per piece (the last may have fewer).
    chunk: u64,
    /// Bytes of the partial sums.
    parts: u64,
}

impl Kernel for SumToKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let (x, out) = (io.input_addr(self.input), io.output_addr(0));
        let r = self.reduction;
        let (kept, reduced, n_out, n_reduced) = (r.kept, r.reduced, r.kept_count, r.reduced_count);
        let p = match &self.launches {
            SumLaunches::Columns(function) => {
                let grid = Grid::columns(n_out, n_reduced);
                // SAFETY: the maps were built from the input's shape and reach only its
                // elements; out holds n_out; the entry takes (x, out, kept, reduced, n_out,
                // n_reduced).
                unsafe { launch(stream(io), *function, grid, &mut args![x, out, kept, reduced, n_out, n_reduced]) }?;
                return Ok(());
            }
            SumLaunches::Flat { first, second, plan } => return flat_sum(io, x, out, n_reduced, *first, *second, plan),
            SumLaunches::Rows { first, second, plan } => {
                return row_sum(io, x, out, (n_reduced, n_out), *first, *second, plan)
            }
            SumLaunches::Partial(p) => p,
        };
        let (parts, chunk, pieces) = (io.scratch(p.parts)?, p.chunk, p.pieces);
        // SAFETY: as above; `parts` holds n_out · pieces partial sums of the entries' part
        // type; the stream orders the two launches.
        unsafe {
            match p.layout {
                PartialLayout::Chunks => {
                    // n_out <= CHUNKED_MAX_OUTPUTS and pieces <= MAX_CHUNKS: both fit a grid
                    // dimension.
                    let per_chunk = Grid {
                        blocks: (pieces as u32, n_out as u32, 1),
                        threads: (CHUNK_THREADS, 1, 1),
                        shared_bytes: 0,
                    };
                    let per_output =
                        Grid { blocks: (n_out as u32, 1, 1), threads: (CHUNK_THREADS, 1, 1), shared_bytes: 0 };
                    launch(stream(io), p.first, per_chunk, &mut args![x, parts, kept, reduced, n_reduced, chunk])?;
                    launch(stream(io), p.second, per_output, &mut args![parts, out, pieces])?;
                }
                PartialLayout::Splits => {
                    // pieces <= SPLIT_TARGET_BLOCKS: a grid dimension holds it.
                    let columns = Grid::columns(n_out, n_reduced);
                    let grid = Grid { blocks: (columns.blocks.0, pieces as u32, 1), ..columns };
                    let args = &mut args![x, parts, kept, reduced, n_out, n_reduced, chunk];
                    launch(stream(io), p.first, grid, args)?;
                    launch(stream(io), p.second, Grid::linear(n_out), &mut args![parts, out, n_out, pieces])?;
                }
            }
        }
        Ok(())
    }

    fn scratch_bytes(&self) -> u64 {
        match &self.launches {
            SumLaunches::Columns(_) => 0,
            SumLaunches::Partial(p) => p.parts,
            SumLaunches::Flat { plan, .. } => plan.parts_bytes,
            SumLaunches::Rows { plan, .. } => plan.parts_bytes,
        }
    }
}

/// Queues the flat sum of the `n` elements at `x` into the one at `out`: `first` alone
/// (`sum_flat`: x, out, n), or `first` (`sum_flat_chunks`: x, parts, n, chunk) then `second`
/// (`sum_parts`: parts, out, chunks).
fn flat_sum(
    io: &mut KernelIo<'_>,
    x: u64,
    out: u64,
    n: u64,
    first: Function,
    second: Option<Function>,
    plan: &FlatPlan,
) -> Result<(), KernelError> {
    let block = |blocks: u64, threads: u32| Grid::rows(blocks, threads, 0);
    let Some(second) = second else {
        // SAFETY: x holds the input's n elements, out one; the entry takes (x, out, n).
        unsafe { launch(stream(io), first, block(1, FLAT_SINGLE_THREADS), &mut args![x, out, n]) }?;
        return Ok(());
    };
    let (parts, chunk, chunks) = (io.scratch(plan.parts_bytes)?, plan.chunk, plan.chunks);
    // SAFETY: as above; `parts` holds `chunks` partial sums of the entries' part type;
    // chunks <= FLAT_MAX_CHUNKS fits a grid dimension; the stream orders the two launches.
    unsafe {
        launch(stream(io), first, block(chunks, FLAT_THREADS), &mut args![x, parts, n, chunk])?;
        launch(stream(io), second, block(1, CHUNK_THREADS), &mut args![parts, out, chunks])?;
    }
    Ok(())
}

/// Queues the row sum of the `(rows, cols)` matrix at `x` into the `cols` outputs at
/// `out`: `first` alone (`sum_rows`: x, out, rows, cols, slice_rows), or `first`
/// (`sum_rows_split`: x, parts, rows, cols, slice_rows) then `second` (`sum_row_slices`:
/// parts, out, cols, slices).
fn row_sum(
    io: &mut KernelIo<'_>,
    x: u64,
    out: u64,
    (rows, cols): (u64, u64),
    first: Function,
    second: Option<Function>,
    plan: &RowsPlan,
) -> Result<(), KernelError> {
    // column_blocks <= MAX_LINEAR_BLOCKS and slices <= ROWS_TARGET_BLOCKS: grid dimensions
    // hold both.
    let grid = Grid {
        blocks: (plan.column_blocks as u32, plan.slices as u32, 1),
        threads: (ROWS_TX, ROWS_TY, 1),
        shared_bytes: 0,
    };
    let slice_rows = plan.slice_rows;
    let Some(second) = second else {
        // SAFETY: x holds the input's rows · cols elements, out cols; the entry takes (x, out,
        // rows, cols, slice_rows) and its one slice covers every row.
        unsafe { launch(stream(io), first, grid, &mut args![x, out, rows, cols, slice_rows]) }?;
        return Ok(());
    };
    let (parts, slices) = (io.scratch(plan.parts_bytes)?, plan.slices);
    // SAFETY: as above; `parts` holds slices · cols partial sums of the entries' part type;
    // the stream orders the two launches.
    unsafe {
        launch(stream(io), first, grid, &mut args![x, parts, rows, cols, slice_rows])?;
        launch(stream(io), second, Grid::columns(cols, slices), &mut args![parts, out, cols, slices])?;
    }
    Ok(())
}

// ---- embedding ------------------------------------------------------------------------

fn make_embedding(spec: &KernelSpec<'_>) -> Result<EmbeddingKernel, KernelError> {
    let conf = op_conf(spec)?;
    let op: Embedding = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    check(spec, conf, &op)?;
    arity(spec, conf, 2, 1)?;
    gather_rows(spec, conf, None)
}

fn make_embedding_grad(spec: &KernelSpec<'_>) -> Result<EmbeddingKernel, KernelError> {
    let conf = op_conf(spec)?;
    let op: EmbeddingGrad = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    op.check(&conf.inputs, &conf.outputs).map_err(|e| fail(spec, conf, e))?;
    arity(spec, conf, 2 + usize::from(op.base.is_some()), 1)?;
    let base = op.base.map(|dtype| (dtype, conf.input_map[2]));
    scatter_rows(spec, conf, 0..op.vocab_size, &format!("a table of {} rows", op.vocab_size), base)
}

/// `vocab_part`: `embedding` or its gradient on a device's rows `held` of a table split by
/// rows (vocabulary-parallel), through the same entries with `first` the rows' offset.
fn make_vocab_part(spec: &KernelSpec<'_>) -> Result<EmbeddingKernel, KernelError> {
    let conf = op_conf(spec)?;
    let op: VocabPart = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    arity(spec, conf, 2, 1)?;
    let held = op.rows.held.clone();
    if held.start > held.end || held.end > op.rows.vocab_size {
        return Err(fail(
            spec,
            conf,
            format!("holds rows {}..{} of a vocabulary of {}", held.start, held.end, op.rows.vocab_size),
        ));
    }
    if op.grad {
        let what = format!("rows {}..{}", held.start, held.end);
        scatter_rows(spec, conf, held, &what, None)
    } else {
        gather_rows(spec, conf, Some(held))
    }
}

/// The gather of table rows by ids (inputs table, ids): the whole vocabulary (`held`
/// `None`), or the rows `held` of it that the table holds.
fn gather_rows(
    spec: &KernelSpec<'_>,
    conf: &OpConf,
    held: Option<std::ops::Range<usize>>,
) -> Result<EmbeddingKernel, KernelError> {
    let dtype = float_dtype(spec, conf)?;
    let (table, ids, out) = (&conf.inputs[0], &conf.inputs[1], &conf.outputs[0]);
    let [rows, features] = *table.shape.dims() else {
        return Err(fail(spec, conf, format!("the table must be [rows, features], got {table}")));
    };
    let (what, held) = match held {
        Some(held) => (format!("rows {}..{} from {table}", held.start, held.end), held),
        None => (format!("rows of {table}"), 0..rows),
    };
    let mut expected = ids.shape.dims().to_vec();
    expected.push(features);
    if ids.dtype != DType::I64 || table.dtype != dtype || rows != held.len() || out.shape.dims() != expected {
        return Err(fail(spec, conf, format!("gathers {what} by ids {ids}, but the output is {out}")));
    }
    Ok(EmbeddingKernel {
        steps: EmbeddingSteps::Gather(function(spec, &format!("regflow_embedding_{}", suffix(dtype)))?),
        inputs: input_slots(conf),
        ids: ids.shape.numel() as u64,
        features: features as u64,
        first: held.start as u64,
        rows: held.len() as u64,
    })
}

/// The sum of `dy` rows by ids into a table holding the rows `held` of the vocabulary
/// (inputs ids, dy), each row in id order (see `movement.cu`), plus a base of the dtype
/// given, read at the actor input given (`EmbeddingGrad::base`, checked by the caller);
/// `what` names the table in errors.
fn scatter_rows(
    spec: &KernelSpec<'_>,
    conf: &OpConf,
    held: std::ops::Range<usize>,
    what: &str,
    base: Option<(DType, usize)>,
) -> Result<EmbeddingKernel, KernelError> {
    let dtype = float_dtype(spec, conf)?;
    let (ids, dy, out) = (&conf.inputs[0], &conf.inputs[1], &conf.outputs[0]);
    let features = out.shape.dims().get(1).copied().unwrap_or(0);
    if ids.dtype != DType::I64
        || dy.dtype != dtype
        || out.shape.dims() != [held.len(), features]
        || dy.shape.numel() != ids.shape.numel() * features
    {
        return Err(fail(spec, conf, format!("scatters {dy} by ids {ids} into {what}, but the output is {out}")));
    }
    // Row offsets and id positions are u32 in the kernels.
    let tokens = ids.shape.numel();
    if tokens > u32::MAX as usize || held.len() >= u32::MAX as usize {
        return Err(fail(spec, conf, format!("scatters {tokens} ids into {what}: at most {} of either", u32::MAX - 1)));
    }
    Ok(EmbeddingKernel {
        steps: EmbeddingSteps::Scatter(Box::new(ScatterSteps {
            fill: function(spec, "regflow_fill_f32")?,
            count: function(spec, "regflow_embedding_grad_count")?,
            offsets: function(spec, "regflow_embedding_grad_offsets")?,
            order: function(spec, "regflow_embedding_grad_order")?,
            rows: match base {
                Some((base, _)) => {
                    function(spec, &format!("regflow_embedding_grad_base_{}_{}", suffix(dtype), suffix(base)))?
                }
                None => function(spec, &format!("regflow_embedding_grad_{}", suffix(dtype)))?,
            },
            base: base.map(|(_, slot)| slot),
        })),
        inputs: input_slots(conf),
        ids: tokens as u64,
        features: features as u64,
        first: held.start as u64,
        rows: held.len() as u64,
    })
}

/// `embedding` (inputs table, ids) or `embedding_grad` (inputs ids, dy) on a table holding
/// rows `first..first + rows` of the vocabulary.
#[derive(Debug)]
struct EmbeddingKernel {
    steps: EmbeddingSteps,
    inputs: [usize; 2],
    /// How many ids the op reads.
    ids: u64,
    features: u64,
    first: u64,
    rows: u64,
}

/// The launches of an [`EmbeddingKernel`].
#[derive(Debug)]
enum EmbeddingSteps {
    /// One gather of `features` elements per id (`regflow_embedding_<dtype>`).
    Gather(Function),
    /// The gradient's steps (boxed: five functions beside the gather's one).
    Scatter(Box<ScatterSteps>),
}

/// The gradient's four steps (`movement.cu`), after zeroing the row counts with `fill`;
/// `rows` adds the actor input `base` (`EmbeddingGrad::base`) where there is one.
#[derive(Debug)]
struct ScatterSteps {
    fill: Function,
    count: Function,
    offsets: Function,
    order: Function,
    rows: Function,
    base: Option<usize>,
}

/// Threads per block of the gradient's row sums (over a row's features).
const EMBEDDING_ROW_THREADS: u32 = 128;

impl EmbeddingKernel {
    /// Where the gradient's id positions start in its scratch: after `rows + 1` u32 row
    /// offsets, 16-byte aligned.
    fn order_offset(&self) -> u64 {
        ((self.rows + 1) * 4).next_multiple_of(16)
    }
}

impl Kernel for EmbeddingKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let (s, out) = (stream(io), io.output_addr(0));
        let (input0, input1) = (io.input_addr(self.inputs[0]), io.input_addr(self.inputs[1]));
        let (ids, features, first, rows) = (self.ids, self.features, self.first, self.rows);
        match &self.steps {
            EmbeddingSteps::Gather(function) => {
                let n = ids * features;
                // SAFETY: ids hold `ids` i64s, the table and the output the elements of their
                // checked metas; ids outside first..first + rows read zeros.
                unsafe {
                    launch(s, *function, Grid::linear(n), &mut args![input0, input1, out, n, features, first, rows])
                }?;
            }
            EmbeddingSteps::Scatter(steps) => {
                let ScatterSteps { fill, count, offsets: scan, order, rows: sum, base } = steps.as_ref();
                let base = base.map(|slot| io.input_addr(slot));
                let scratch = io.scratch(self.scratch_bytes())?;
                let (offsets, positions) = (scratch, scratch + self.order_offset());
                let (id_array, dy) = (input0, input1);
                let warps_per_block = u64::from(crate::driver::LINEAR_THREADS / 32);
                let order_grid = Grid::linear(ids.div_ceil(warps_per_block) * u64::from(crate::driver::LINEAR_THREADS));
                let row_blocks = rows.clamp(1, MAX_LINEAR_BLOCKS) as u32;
                let row_grid =
                    Grid { blocks: (row_blocks, 1, 1), threads: (EMBEDDING_ROW_THREADS, 1, 1), shared_bytes: 0 };
                let one_block = Grid { blocks: (1, 1, 1), threads: (1024, 1, 1), shared_bytes: 0 };
                // SAFETY: the scratch holds rows + 1 u32 offsets and, from order_offset, one
                // u32 per id (scratch_bytes); the ids hold `ids` i64s, dy `ids · features`
                // elements and the table `rows · features` (checked at build); the launches run
                // in order on one stream, each reading what the one before wrote; the
                // argument types are the entries'.
                unsafe {
                    launch(s, *fill, Grid::linear(rows + 1), &mut args![offsets, 0f32, rows + 1])?;
                    launch(s, *count, Grid::linear(ids), &mut args![id_array, offsets, ids, first, rows])?;
                    launch(s, *scan, one_block, &mut args![offsets, rows])?;
                    launch(s, *order, order_grid, &mut args![id_array, offsets, positions, ids, first, rows])?;
                    match base {
                        // The base holds at least `rows · features` elements of its dtype (checked).
                        Some(base) => {
                            launch(s, *sum, row_grid, &mut args![dy, offsets, positions, base, out, features, rows])?
                        }
                        None => launch(s, *sum, row_grid, &mut args![dy, offsets, positions, out, features, rows])?,
                    }
                }
            }
        }
        Ok(())
    }

    fn scratch_bytes(&self) -> u64 {
        match self.steps {
            EmbeddingSteps::Gather(_) => 0,
            EmbeddingSteps::Scatter(_) => self.order_offset() + self.ids * 4,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{
        flat_plan, rows_plan, split_count, sums_rows, FlatPlan, RowsPlan, FLAT_CHUNK_QUANTUM, FLAT_MAX_CHUNKS,
        FLAT_SINGLE_MAX, ROWS_SLICE_QUANTUM, ROWS_TARGET_BLOCKS,
    };
    use crate::ops::layout::reduction;
    use crate::sources::all_entry_names;

    #[test]
    fn flat_sums_take_one_block_when_short_and_fill_the_gpu_when_long() {
        let plan = |n| flat_plan(n, 4);
        // Short: one block, no partial sums.
        for n in [0, 1, 768, FLAT_SINGLE_MAX] {
            assert_eq!(plan(n), FlatPlan { chunks: 1, chunk: n, parts_bytes: 0 }, "{n}");
        }
        // Just past it: chunks of at least FLAT_MIN_CHUNK, rounded to the quantum.
        assert_eq!(plan(FLAT_SINGLE_MAX + 1), FlatPlan { chunks: 11, chunk: 3072, parts_bytes: 44 });
        // GPT-2's gradients: a 768 × 768 matrix has two blocks per SM of an H100 (132) ...
        assert_eq!(plan(768 * 768), FlatPlan { chunks: 288, chunk: 2048, parts_bytes: 1152 });
        assert_eq!(plan(768 * 3072), FlatPlan { chunks: 768, chunk: 3072, parts_bytes: 3072 });
        // ... and the 50257 × 768 embedding about FLAT_MAX_CHUNKS, f64 parts of 8 bytes.
        assert_eq!(flat_plan(50_257 * 768, 8), FlatPlan { chunks: 1019, chunk: 37_888, parts_bytes: 8152 });
        // Huge inputs stay within a grid dimension: longer chunks, never more of them.
        assert_eq!(plan(1 << 40), FlatPlan { chunks: 1024, chunk: 1 << 30, parts_bytes: 4096 });
        for n in [FLAT_SINGLE_MAX + 1, 70_001, (1 << 20) + 3, 50_257 * 768, 1 << 40, u64::MAX / 2] {
            let p = plan(n);
            assert!((2..=FLAT_MAX_CHUNKS).contains(&p.chunks), "{n}: {p:?}");
            // Every chunk starts 16-byte aligned and holds elements; together they cover n.
            assert_eq!(p.chunk % FLAT_CHUNK_QUANTUM, 0, "{n}: {p:?}");
            assert!((p.chunks - 1) * p.chunk < n && n <= p.chunks * p.chunk, "{n}: {p:?}");
            assert_eq!(p.parts_bytes, p.chunks * 4);
        }
    }

    #[test]
    fn column_sums_split_until_the_gpu_has_blocks() {
        // A bias gradient of GPT-2: 24 column blocks, cut into 11 splits of 745 rows.
        assert_eq!(split_count(768, 8192), Some(11));
        assert_eq!(split_count(3072, 8192), Some(3));
        // Enough column blocks already, a short range, or one slice: one launch.
        assert_eq!(split_count(50_257 * 16, 8192), None);
        assert_eq!(split_count(768, 1023), None);
        assert_eq!(split_count(768, 7), None);
        // Never more splits than SPLIT_MIN_CHUNK-long pieces of the range.
        assert_eq!(split_count(32, 1024), Some(2));
    }

    #[test]
    fn row_sums_slice_the_rows_until_the_gpu_has_blocks() {
        let plan = |rows, cols, element_bytes| rows_plan(rows, cols, element_bytes, 4).expect("a plan");
        let sliced = |column_blocks, slices: u64, slice_rows, cols: u64| RowsPlan {
            column_blocks,
            slices,
            slice_rows,
            parts_bytes: slices * cols * 4,
        };
        // GPT-2's bias gradients over 8192 rows: 768 bf16 columns are 96 16-byte groups, 3
        // column blocks, 128 slices of 64 rows (384 blocks, ~3 per SM of an H100) ...
        assert_eq!(plan(8192, 768, 2), sliced(3, 128, 64, 768));
        // ... in f32 6 column blocks, 86 slices of 96 rows (516 blocks) ...
        assert_eq!(plan(8192, 768, 4), sliced(6, 86, 96, 768));
        // ... and 2304 or 3072 columns: 9, 12 (bf16) or 24 (f32) column blocks.
        assert_eq!(plan(8192, 2304, 2), sliced(9, 52, 160, 2304));
        assert_eq!(plan(8192, 3072, 2), sliced(12, 43, 192, 3072));
        assert_eq!(plan(8192, 3072, 4), sliced(24, 22, 384, 3072));
        // f64 partial sums take 8 bytes; a ragged last column group still has its thread.
        assert_eq!(
            rows_plan(5000, 9, 8, 8),
            Some(RowsPlan { column_blocks: 1, slices: 53, slice_rows: 96, parts_bytes: 53 * 9 * 8 })
        );
        // Few rows, or columns enough to fill the GPU: one slice, one launch, no partial sums.
        for (rows, cols) in [(3, 1024), (125, 7), (127, 768), (8192, 50_257 * 16)] {
            let q = plan(rows, cols, 4);
            assert_eq!((q.slices, q.parts_bytes), (1, 0), "{rows} x {cols}: {q:?}");
            assert!(q.slice_rows >= rows, "{rows} x {cols}: {q:?}");
        }
        // Huge row counts: never more than ROWS_TARGET_BLOCKS slices (a grid dimension holds
        // them), longer slices instead, and the slices cover every row.
        assert_eq!(
            plan(1 << 40, 2, 4),
            RowsPlan { column_blocks: 1, slices: 528, slice_rows: 2_082_408_416, parts_bytes: 4224 }
        );
        for (rows, cols) in [(1 << 40, 2), (1 << 33, 768), ((1 << 31) + 7, 3), (8191, 1000)] {
            let q = plan(rows, cols, 2);
            assert!(q.slices <= ROWS_TARGET_BLOCKS, "{q:?}");
            assert_eq!(q.slice_rows % ROWS_SLICE_QUANTUM, 0, "{q:?}");
            assert!((q.slices - 1) * q.slice_rows < rows && rows <= q.slices * q.slice_rows, "{q:?}");
        }
        // Columns past what a grid dimension's blocks hold take the general column sum.
        assert_eq!(rows_plan(100, 65_536 * 32 * 8, 2, 4), None);
    }

    #[test]
    fn row_sums_take_sums_over_leading_axes_to_trailing_ones() {
        let takes = |input: &[usize], out: &[usize]| sums_rows(&reduction(input, out).expect("reduces"));
        // A bias gradient, to [C] or [1, C], leading axes merged into the rows.
        assert!(takes(&[8192, 768], &[768]));
        assert!(takes(&[8192, 768], &[1, 768]));
        assert!(takes(&[8, 1024, 3072], &[3072]));
        assert!(takes(&[2, 4099, 40], &[1, 1, 40]));
        assert!(takes(&[5, 3, 4], &[3, 4]));
        // Kept axes that are not the trailing ones, or nothing reduced: other paths.
        assert!(!takes(&[3, 1023], &[3, 1]));
        assert!(!takes(&[2, 3, 5, 7], &[3, 1, 7]));
        assert!(!takes(&[7, 1], &[7, 1]));
        assert!(!takes(&[4, 5], &[4, 5]));
    }

    #[test]
    fn every_movement_entry_exists() {
        let entries: Vec<&str> = all_entry_names().collect();
        for dtype in ["f32", "f64", "i64", "bf16"] {
            for stem in ["copy", "gather", "copy_blocks", "fill"] {
                let name = format!("regflow_{stem}_{dtype}");
                assert!(entries.contains(&name.as_str()), "{name}");
            }
        }
        for dtype in ["f32", "f64"] {
            for stem in ["embedding", "embedding_grad"] {
                let name = format!("regflow_{stem}_{dtype}");
                assert!(entries.contains(&name.as_str()), "{name}");
            }
        }
        for stem in ["count", "offsets", "order", "base_f32_f32", "base_f32_bf16", "base_f32_f16", "base_f64_f64"] {
            let name = format!("regflow_embedding_grad_{stem}");
            assert!(entries.contains(&name.as_str()), "{name}");
        }
        for dtype in ["f32", "f64", "bf16", "f16"] {
            for stem in [
                "sum_to",
                "sum_to_chunks",
                "sum_parts",
                "sum_to_split",
                "sum_splits",
                "sum_flat",
                "sum_flat_chunks",
                "sum_rows",
                "sum_rows_split",
                "sum_row_slices",
            ] {
                let name = format!("regflow_{stem}_{dtype}");
                assert!(entries.contains(&name.as_str()), "{name}");
            }
        }
        for dtype in ["f32", "f64"] {
            for stem in ["sum_squares_flat", "sum_squares_flat_chunks"] {
                let name = format!("regflow_{stem}_{dtype}");
                assert!(entries.contains(&name.as_str()), "{name}");
            }
        }
    }
}
