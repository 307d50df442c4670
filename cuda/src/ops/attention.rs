//! `attention` and `attention_grad` on CUDA (`attention.cu`): flash attention, the scores
//! made a tile at a time and never stored.
//!
//! bf16 and f16 heads of 16, 32, 64 or 128 on compute capability 8.0 and up run on tensor
//! cores (`regflow_attention_{fwd,dq,dkv}_<dtype>_d<D>`, a block per 64 rows); every other
//! case (f32, f64, other head sizes up to 256, registers not 16-byte aligned, older GPUs)
//! runs one thread per row: with the row in registers and the other side through shared
//! memory where the head size has an entry (`regflow_attention_{fwd,dq,dk,dv}_<dtype>_rows_d<D>`,
//! f32 and f64), else reading both from memory (`regflow_attention_*_<dtype>`, any head up
//! to 256). The gradient first writes the row dots `Σ dout·out` into the stream's
//! scratch, then dq over query blocks and dk, dv over key blocks, each output written by
//! one thread in a fixed order (no atomics: deterministic). Heads past 256, more than 65535 (sequence, head) pairs,
//! sequences of 2^31 positions or more, or an empty tensor, run the CPU kernel on the host.
//!
//! The packed op's `qkv [B, T, H, 3, D]` is read in place: `q`, `k` and `v` are the
//! tensor's address plus 0, `D` and `2·D` elements, with rows of `3·D` values (`out` and
//! `dout` keep rows of `D`). The tensor-core entries have packed twins
//! (`regflow_attention_{fwd,dq,dkv}_<dtype>_d<D>_qkv`, the packing compiled in: as a
//! launch argument its strides cost registers these entries do not have); the row entries
//! take the packing as their `pack` argument (3, else 1).

use super::elementwise::input_slots;
use super::{fail, function, op_conf, queued, stream, suffix, Entry};
use crate::driver::{launch, Device, Function, Grid, StreamHandle};
use regflow_kernels::cpu::attention::lse_dtype;
use regflow_kernels::{HostCompute, HostOpKernel, Kernel, KernelError, KernelIo, KernelSpec};
use regflow_plan::ops::{Attention, AttentionGrad};
use regflow_plan::{DType, OpConf};
use std::sync::Arc;

const DTYPES: &[DType] = &[DType::F32, DType::F64, DType::Bf16, DType::F16];

pub(super) const ENTRIES: &[Entry] = &[
    // Keyed by the output's dtype, q's.
    ("attention", DTYPES, || Arc::new(make_attention)),
    ("attention_grad", DTYPES, || Arc::new(make_attention_grad)),
];

/// Head sizes with tensor-core entries (`ATTENTION_TC` in `attention.cu`).
const TENSOR_CORE_HEADS: [usize; 4] = [16, 32, 64, 128];
/// Head sizes with one-thread-per-row entries that keep a row in registers
/// (`ATTENTION_ROWS`): f32 all four, f64 up to 64 (128 would not fit shared memory).
const ROW_HEADS_F32: [usize; 4] = [16, 32, 64, 128];
const ROW_HEADS_F64: [usize; 3] = [16, 32, 64];
/// Rows of a tensor-core block (`ATT_ROWS`) and its threads (`ATT_THREADS`).
const TENSOR_CORE_ROWS: u64 = 64;
const TENSOR_CORE_THREADS: u32 = 128;
/// Threads of a one-thread-per-row block (`ATT_SIMT_THREADS`) and the largest head it
/// holds (`ATT_SIMT_MAX_D`).
const ROW_THREADS: u32 = 128;
const ROW_MAX_HEAD: usize = 256;
/// The most (sequence, head) pairs a launch takes: they are its grid's `y`.
const MAX_PAIRS: usize = 65_535;

/// The sizes of one attention: q `[batch, tq, heads, d]`, k and v `[batch, tk, heads, d]`
/// (or one qkv `[batch, t, heads, 3, d]`).
#[derive(Debug, Clone, Copy)]
struct Sizes {
    tq: u64,
    tk: u64,
    heads: u64,
    d: u64,
    /// batch · heads.
    pairs: u64,
    /// 3 for a packed qkv (rows of `3·d` values), else 1.
    pack: u64,
}

impl Sizes {
    /// The sizes of `conf`, whose first two inputs are q and k (whose first is qkv, when
    /// `packed`); `None` where the CUDA kernels do not take them (the CPU kernel runs on
    /// the host).
    fn of(conf: &OpConf, packed: bool) -> Option<Self> {
        let first = conf.inputs.first()?.shape.dims();
        let (batch, tq, tk, heads, d, pack) = if packed {
            let &[batch, t, heads, 3, d] = first else { return None };
            (batch, t, t, heads, d, 3)
        } else {
            let (&[batch, tq, heads, d], &[_, tk, _, _]) = (first, conf.inputs.get(1)?.shape.dims()) else {
                return None;
            };
            (batch, tq, tk, heads, d, 1)
        };
        let pairs = batch * heads;
        let empty = [batch, tq, tk, heads, d].contains(&0);
        // The tensor-core entries count positions, and a tile past the last, in 32 bits.
        let positions_fit = tq.max(tk) < 1 << 31;
        (!empty && d <= ROW_MAX_HEAD && pairs <= MAX_PAIRS && positions_fit).then_some(Self {
            tq: tq as u64,
            tk: tk as u64,
            heads: heads as u64,
            d: d as u64,
            pairs: pairs as u64,
            pack,
        })
    }

    /// Bytes from the packed qkv's address to its `k` and `v` (zeros when apart).
    fn packed_offsets(&self, dtype: DType) -> [u64; 3] {
        if self.pack == 1 {
            return [0; 3];
        }
        let row = self.d * dtype.size() as u64;
        [0, row, 2 * row]
    }

    /// The grid of the tensor-core entries over `rows` (queries or keys).
    fn tensor_core_grid(&self, rows: u64) -> Grid {
        let blocks = rows.div_ceil(TENSOR_CORE_ROWS).max(1) as u32;
        Grid { blocks: (blocks, self.pairs as u32, 1), threads: (TENSOR_CORE_THREADS, 1, 1), shared_bytes: 0 }
    }

    /// The grid of the one-thread-per-row entries over `rows`.
    fn row_grid(&self, rows: u64) -> Grid {
        let blocks = rows.div_ceil(u64::from(ROW_THREADS)).max(1) as u32;
        Grid { blocks: (blocks, self.pairs as u32, 1), threads: (ROW_THREADS, 1, 1), shared_bytes: 0 }
    }
}

/// The one-thread-per-row entries: with the head size known to the kernel (the forward,
/// dq, dk and dv) or taking it as an argument (the forward, dq, and dk with dv).
#[derive(Debug, Clone, Copy)]
enum RowEntries {
    /// A head size of [`ROW_HEADS_F32`] or [`ROW_HEADS_F64`].
    Known([Function; 4]),
    /// Any head size up to [`ROW_MAX_HEAD`].
    Any([Function; 3]),
}

/// The entries of one op: on tensor cores where they apply (with the row entries for
/// registers off 16-byte alignment), else one thread per row.
#[derive(Debug, Clone, Copy)]
struct Entries {
    tensor_cores: Option<[Function; 3]>,
    rows: RowEntries,
}

impl Entries {
    fn find(spec: &KernelSpec<'_>, dtype: DType, d: u64, packed: bool) -> Result<Self, KernelError> {
        let s = suffix(dtype);
        let named = |stage: &str, tail: &str| function(spec, &format!("regflow_attention_{stage}_{tail}"));
        let device = Device::open(usize::from(spec.device_index))?;
        let half = matches!(dtype, DType::Bf16 | DType::F16);
        let tensor_cores =
            if half && device.info().compute_capability.0 >= 8 && TENSOR_CORE_HEADS.contains(&(d as usize)) {
                let tail = format!("{s}_d{d}{}", if packed { "_qkv" } else { "" });
                Some([named("fwd", &tail)?, named("dq", &tail)?, named("dkv", &tail)?])
            } else {
                None
            };
        let known = match dtype {
            DType::F32 => ROW_HEADS_F32.contains(&(d as usize)),
            DType::F64 => ROW_HEADS_F64.contains(&(d as usize)),
            _ => false,
        };
        let rows = if known {
            let tail = format!("{s}_rows_d{d}");
            RowEntries::Known([named("fwd", &tail)?, named("dq", &tail)?, named("dk", &tail)?, named("dv", &tail)?])
        } else {
            RowEntries::Any([named("fwd", s)?, named("dq", s)?, named("dkv", s)?])
        };
        Ok(Self { tensor_cores, rows })
    }

    /// The tensor-core entries if every address is 16-byte aligned (their tile loads read
    /// 16 bytes at a time), else `None`.
    fn tensor_cores_for(&self, addresses: &[u64]) -> Option<[Function; 3]> {
        self.tensor_cores.filter(|_| addresses.iter().all(|a| a % 16 == 0))
    }
}

/// What the forward and the gradient kernels share: their entries, sizes and attributes.
#[derive(Debug)]
struct Prepared {
    entries: Entries,
    sizes: Sizes,
    scale: f64,
    causal: u32,
    /// The arithmetic dtype: `lse`'s and the row dots' (f64 for f64 tensors, else f32).
    wide: DType,
}

impl Prepared {
    /// The kernels' state for `conf` (already checked by the op's `check`), or `None` where
    /// the CUDA kernels do not take its sizes (the CPU kernel then runs on the host).
    fn of(
        spec: &KernelSpec<'_>,
        conf: &OpConf,
        scale: f64,
        causal: bool,
        packed: bool,
    ) -> Result<Option<Self>, KernelError> {
        let Some(sizes) = Sizes::of(conf, packed) else { return Ok(None) };
        Ok(Some(Self {
            entries: Entries::find(spec, conf.outputs[0].dtype, sizes.d, packed)?,
            sizes,
            scale,
            causal: u32::from(causal),
            wide: lse_dtype(conf.inputs[0].dtype),
        }))
    }
}

/// `attention`: q, k, v (or qkv) -> out, lse.
#[derive(Debug)]
struct AttentionKernel {
    at: Prepared,
    /// The slots of q, k and v (qkv's thrice, when packed).
    inputs: [usize; 3],
    /// Bytes added to each input's address ([`Sizes::packed_offsets`]).
    offsets: [u64; 3],
}

impl Kernel for AttentionKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let [q, k, v] = std::array::from_fn(|n| io.input_addr(self.inputs[n]) + self.offsets[n]);
        let (out, lse) = (io.output_addr(0), io.output_addr(1));
        let at = &self.at;
        let Sizes { tq, tk, heads, .. } = at.sizes;
        let (causal, s) = (at.causal, stream(io));
        // SAFETY (every launch): out holds batch·tq·heads·d elements, q batch·tq·heads·pack·d
        // from its address (packed: k and v start d and 2·d elements further, in one
        // batch·t·heads·3·d tensor), k and v batch·tk·heads·pack·d, lse batch·heads·tq
        // (checked at build); a grid's y is the (sequence, head) pair and its x covers tq;
        // the argument types are the kernels'.
        unsafe {
            if let Some([forward, ..]) = at.entries.tensor_cores_for(&[q, k, v, out]) {
                let grid = at.sizes.tensor_core_grid(tq);
                let scale = at.scale as f32;
                launch(s, forward, grid, &mut args![q, k, v, out, lse, tq, tk, heads, scale, causal])?;
            } else {
                let pointers = [q, k, v, out, lse];
                if at.wide == DType::F64 {
                    rows_forward(s, at.entries.rows, &at.sizes, pointers, at.scale, causal)?;
                } else {
                    rows_forward(s, at.entries.rows, &at.sizes, pointers, at.scale as f32, causal)?;
                }
            }
        }
        Ok(())
    }
}

fn make_attention(spec: &KernelSpec<'_>) -> Result<Box<dyn Kernel>, KernelError> {
    let conf = op_conf(spec)?;
    let op: Attention = conf.parse_attrs().map_err(KernelError)?;
    op.check(&conf.inputs, &conf.outputs).map_err(|m| fail(spec, conf, m))?;
    Ok(match Prepared::of(spec, conf, op.scale, op.causal, op.packed)? {
        Some(at) => {
            let offsets = at.sizes.packed_offsets(conf.inputs[0].dtype);
            let inputs = if op.packed { [input_slots::<1>(conf)[0]; 3] } else { input_slots(conf) };
            queued(AttentionKernel { at, inputs, offsets })
        }
        None => Box::new(HostOpKernel::new(op, conf)),
    })
}

/// `attention_grad`: q, k, v, out, lse, dout -> dq, dk, dv (or qkv, out, lse, dout ->
/// dqkv).
#[derive(Debug)]
struct AttentionGradKernel {
    at: Prepared,
    /// The row dots' entry, `Σ dout·out` per (sequence, head, query).
    dots: Function,
    /// The slots of q, k, v, out, lse and dout (qkv's thrice, when packed).
    inputs: [usize; 6],
    /// Bytes added to q's, k's and v's addresses, and to those of their gradients
    /// ([`Sizes::packed_offsets`]).
    offsets: [u64; 3],
    /// The output slots of dq, dk and dv (dqkv's thrice).
    outputs: [usize; 3],
}

impl AttentionGradKernel {
    /// Bytes of the row dots in the stream's scratch: one per (sequence, head, query).
    fn dots_bytes(&self) -> u64 {
        self.at.sizes.pairs * self.at.sizes.tq * self.at.wide.size() as u64
    }
}

impl Kernel for AttentionGradKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let [q, k, v, out, lse, dout] =
            std::array::from_fn(|n| io.input_addr(self.inputs[n]) + self.offsets.get(n).copied().unwrap_or(0));
        let [dq, dk, dv] = std::array::from_fn(|n| io.output_addr(self.outputs[n]) + self.offsets[n]);
        let dots = io.scratch(self.dots_bytes())?;
        let at = &self.at;
        let Sizes { tq, tk, heads, d, pairs, .. } = at.sizes;
        let (causal, s) = (at.causal, stream(io));
        let rows = pairs * tq;
        // SAFETY (every launch): as the forward's, with dout shaped as out, dq as q, dk and
        // dv as k (packed: dqkv as qkv, at the same offsets), lse batch·heads·tq; `dots` holds batch·heads·tq values of the
        // arithmetic type, written whole by the first launch and read by the other two,
        // in stream order.
        unsafe {
            launch(s, self.dots, Grid::linear(rows * 8), &mut args![out, dout, dots, rows, tq, heads, d])?;
            if let Some([_, grad_q, grad_kv]) = at.entries.tensor_cores_for(&[q, k, v, dout, dq, dk, dv]) {
                let scale = at.scale as f32;
                let grid = at.sizes.tensor_core_grid(tq);
                launch(s, grad_q, grid, &mut args![q, k, v, dout, lse, dots, dq, tq, tk, heads, scale, causal])?;
                let grid = at.sizes.tensor_core_grid(tk);
                launch(s, grad_kv, grid, &mut args![q, k, v, dout, lse, dots, dk, dv, tq, tk, heads, scale, causal])?;
            } else {
                let pointers = [q, k, v, dout, lse, dots, dq, dk, dv];
                if at.wide == DType::F64 {
                    rows_grad(s, at.entries.rows, &at.sizes, pointers, at.scale, causal)?;
                } else {
                    rows_grad(s, at.entries.rows, &at.sizes, pointers, at.scale as f32, causal)?;
                }
            }
        }
        Ok(())
    }

    fn scratch_bytes(&self) -> u64 {
        self.dots_bytes()
    }
}

/// The one-thread-per-row forward; `S` is the entries' arithmetic type (f64 for f64
/// tensors, f32 otherwise).
///
/// # Safety
/// As [`launch`]: `[q, k, v, out, lse]` hold the tensors of `sizes` in the entry's types.
unsafe fn rows_forward<S>(
    s: StreamHandle,
    entries: RowEntries,
    sizes: &Sizes,
    [q, k, v, out, lse]: [u64; 5],
    scale: S,
    causal: u32,
) -> Result<(), KernelError> {
    let Sizes { tq, tk, heads, d, pack, .. } = *sizes;
    let grid = sizes.row_grid(tq);
    // SAFETY: the caller's.
    unsafe {
        match entries {
            RowEntries::Known([forward, ..]) => {
                launch(s, forward, grid, &mut args![q, k, v, out, lse, tq, tk, heads, pack, scale, causal])?
            }
            RowEntries::Any([forward, ..]) => {
                launch(s, forward, grid, &mut args![q, k, v, out, lse, tq, tk, heads, pack, d, scale, causal])?
            }
        }
    }
    Ok(())
}

/// The one-thread-per-row gradient after the row dots: dq, then dk and dv (two launches
/// where the entries know the head size, one where they take it as an argument).
///
/// # Safety
/// As [`launch`]: `[q, k, v, dout, lse, dots, dq, dk, dv]` hold the tensors of `sizes`.
unsafe fn rows_grad<S: Copy>(
    s: StreamHandle,
    entries: RowEntries,
    sizes: &Sizes,
    [q, k, v, dout, lse, dots, dq, dk, dv]: [u64; 9],
    scale: S,
    causal: u32,
) -> Result<(), KernelError> {
    let Sizes { tq, tk, heads, d, pack, .. } = *sizes;
    let (grid_q, grid_kv) = (sizes.row_grid(tq), sizes.row_grid(tk));
    // SAFETY: the caller's.
    unsafe {
        match entries {
            RowEntries::Known([_, grad_q, grad_k, grad_v]) => {
                let args = &mut args![q, k, v, dout, lse, dots, dq, tq, tk, heads, pack, scale, causal];
                launch(s, grad_q, grid_q, args)?;
                for (entry, grad) in [(grad_k, dk), (grad_v, dv)] {
                    let args = &mut args![q, k, v, dout, lse, dots, grad, tq, tk, heads, pack, scale, causal];
                    launch(s, entry, grid_kv, args)?;
                }
            }
            RowEntries::Any([_, grad_q, grad_kv]) => {
                let args = &mut args![q, k, v, dout, lse, dots, dq, tq, tk, heads, pack, d, scale, causal];
                launch(s, grad_q, grid_q, args)?;
                let args = &mut args![q, k, v, dout, lse, dots, dk, dv, tq, tk, heads, pack, d, scale, causal];
                launch(s, grad_kv, grid_kv, args)?;
            }
        }
    }
    Ok(())
}

fn make_attention_grad(spec: &KernelSpec<'_>) -> Result<Box<dyn Kernel>, KernelError> {
    let conf = op_conf(spec)?;
    let op: AttentionGrad = conf.parse_attrs().map_err(KernelError)?;
    op.check(&conf.inputs, &conf.outputs).map_err(|m| fail(spec, conf, m))?;
    let Some(at) = Prepared::of(spec, conf, op.scale, op.causal, op.packed)? else {
        return Ok(Box::new(HostOpKernel::new(op, conf)));
    };
    let dots = function(spec, &format!("regflow_attention_dots_{}", suffix(conf.outputs[0].dtype)))?;
    let offsets = at.sizes.packed_offsets(conf.inputs[0].dtype);
    let (inputs, outputs) = if op.packed {
        let [qkv, out, lse, dout] = input_slots::<4>(conf);
        ([qkv, qkv, qkv, out, lse, dout], [0; 3])
    } else {
        (input_slots(conf), [0, 1, 2])
    };
    Ok(queued(AttentionGradKernel { at, dots, inputs, offsets, outputs }))
}
