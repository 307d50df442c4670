//! CPU kernels of `attention` and `attention_grad`: scaled dot-product attention per
//! (sequence, head) in blocks of 64 queries and 64 keys, the `[Tq, Tk]` scores never stored.
//!
//! `q [B, Tq, H, D]`, `k` and `v [B, Tk, H, D]` are read where the projections wrote them:
//! element `(b, t, h, d)` at `((b·T + t)·H + h)·D + d`, so one head's row of `D` values is
//! contiguous and consecutive positions of a head are `H·D` apart; the products read them
//! through those strides, never copied. The packed op's `qkv [B, T, H, 3, D]` is read the
//! same way with rows `3·D` wide: `q`, `k` and `v` of `(b, t, h)` at `((b·T + t)·H + h)·3·D`
//! plus `0`, `D` and `2·D`, and its gradient `dqkv` is written so.
//!
//! The forward op is an online softmax over blocks of keys (FlashAttention's): per block
//! of queries and block of keys, one matrix product makes a `[64, 64]` tile of scores on
//! the stack, each query folds its row into its running log-sum-exp and output, and one
//! more product adds the tile's probabilities times the values. The gradient recomputes
//! the probabilities from `lse` tile by tile and runs five products per tile. The products
//! are `gemm` calls (AVX-512 or AVX2 with FMA where the processor has them; their packing
//! buffers are reused per thread, so a firing allocates nothing); the row arithmetic
//! between them is plain loops over contiguous tile rows.
//!
//! Every output element is computed by one thread in a fixed order, so the results are
//! the same bits on any thread count: sequences (the batch) are shared over
//! [`HostContext::threads`], each sequence whole on one thread.

mod tiles;

use crate::cpu::fast_math::{self, FastMath};
use crate::cpu::shares::{in_shares, DisjointParts, ROWS_PARALLEL_MIN_ELEMENTS};
use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::{Attention, AttentionGrad};
use regflow_plan::{DType, HostTensor, HostTensorMut, Shape, TensorMeta};
use tiles::{backward_sequence, forward_sequence, Grads, BLOCK, TILE};

/// The sizes of one attention op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionDims {
    /// `B`: sequences.
    pub batch: usize,
    /// `Tq`: queries per sequence.
    pub queries: usize,
    /// `Tk`: keys (and values) per sequence.
    pub keys: usize,
    /// `H`: heads.
    pub heads: usize,
    /// `D`: values per head.
    pub head_dim: usize,
    /// `q`, `k` and `v` (and their gradients) are one tensor `[B, T, H, 3, D]`.
    pub packed: bool,
}

impl AttentionDims {
    /// The `lse` output's meta, `[B, H, Tq]` in the arithmetic dtype of inputs of `dtype`.
    pub fn lse_meta(&self, dtype: DType) -> TensorMeta {
        TensorMeta::new(Shape(vec![self.batch, self.heads, self.queries]), lse_dtype(dtype))
    }

    /// Multiply-adds of one score and its row of values, summed over every (query, key)
    /// pair attended: what decides whether sharing sequences over threads pays.
    fn multiply_adds(&self, causal: bool) -> usize {
        let pairs = if causal { self.queries * (self.queries + 1) / 2 } else { self.queries * self.keys };
        self.batch * self.heads * pairs * self.head_dim
    }

    /// Elements of one sequence's `q` (and of `out`, `dout`), of its `k` and `v`, in their
    /// tensors: packed, all three are the sequence's whole `[T, H, 3, D]`.
    fn sequence_lens(&self) -> (usize, usize) {
        let row = self.heads * self.head_dim;
        if self.packed {
            (3 * self.queries * row, 3 * self.keys * row)
        } else {
            (self.queries * row, self.keys * row)
        }
    }
}

/// The dtype of `lse` for inputs of `dtype`: the arithmetic dtype, f64 for f64 inputs and
/// f32 otherwise (bf16 and f16 inputs are computed in f32, and a 16-bit log-sum-exp would
/// lose the precision the gradient needs).
pub fn lse_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// `[batch, length, heads, head size]` of one of `q`, `k`, `v`, or why it is not rank 4.
fn rank4(name: &str, meta: &TensorMeta) -> Result<[usize; 4], String> {
    match meta.shape.dims() {
        &[batch, len, heads, head_dim] => Ok([batch, len, heads, head_dim]),
        _ => Err(format!(
            "{name} must have rank 4 [batch, length, heads, head size], got {name} {meta} of rank {}",
            meta.shape.rank()
        )),
    }
}

/// Checks `attention`'s attributes and inputs (shared by the graph's shape rule and the
/// kernels' build-time check): `q [B, Tq, H, D]`, `k` and `v [B, Tk, H, D]` of one float
/// dtype, a finite scale, and `Tq == Tk` when `causal`. Returns the sizes, or a sentence
/// naming the values that do not fit.
pub fn check_attention(
    scale: f64,
    causal: bool,
    q: &TensorMeta,
    k: &TensorMeta,
    v: &TensorMeta,
) -> Result<AttentionDims, String> {
    if !scale.is_finite() {
        return Err(format!("scale must be finite, got {scale}"));
    }
    let [batch, queries, heads, head_dim] = rank4("q", q)?;
    let [k_batch, keys, k_heads, k_head_dim] = rank4("k", k)?;
    rank4("v", v)?;
    if q.dtype != k.dtype || q.dtype != v.dtype {
        return Err(format!("q, k and v must have one dtype, got q {}, k {} and v {}", q.dtype, k.dtype, v.dtype));
    }
    if !q.dtype.is_float() {
        return Err(format!("q, k and v must be floats, got {}", q.dtype));
    }
    if k.shape != v.shape {
        return Err(format!("k and v must have one shape, got k {} and v {}", k.shape, v.shape));
    }
    if (batch, heads, head_dim) != (k_batch, k_heads, k_head_dim) {
        return Err(format!(
            "q, k and v must agree in batch, heads and head size: q {} has batch {batch}, {heads} heads of \
             size {head_dim}; k and v {} have batch {k_batch}, {k_heads} heads of size {k_head_dim}",
            q.shape, k.shape
        ));
    }
    if causal && queries != keys {
        return Err(format!(
            "causal attention needs as many queries as keys (query i attends keys 0..=i), got Tq = {queries} \
             queries and Tk = {keys} keys"
        ));
    }
    Ok(AttentionDims { batch, queries, keys, heads, head_dim, packed: false })
}

/// Checks the packed `attention`'s attributes and input (shared as [`check_attention`]):
/// `qkv [B, T, H, 3, D]` of a float dtype and a finite scale. Returns the sizes (`T`
/// queries and keys), or a sentence naming the values that do not fit.
pub fn check_attention_packed(scale: f64, qkv: &TensorMeta) -> Result<AttentionDims, String> {
    if !scale.is_finite() {
        return Err(format!("scale must be finite, got {scale}"));
    }
    let &[batch, len, heads, three, head_dim] = qkv.shape.dims() else {
        return Err(format!(
            "packed qkv must have rank 5 [batch, length, heads, 3, head size], got qkv {qkv} of rank {}",
            qkv.shape.rank()
        ));
    };
    if three != 3 {
        return Err(format!(
            "packed qkv must hold 3 rows (query, key, value) per position and head on axis 3, got qkv {qkv} \
             with {three}"
        ));
    }
    if !qkv.dtype.is_float() {
        return Err(format!("qkv must be floats, got {}", qkv.dtype));
    }
    Ok(AttentionDims { batch, queries: len, keys: len, heads, head_dim, packed: true })
}

/// The sizes of an attention op's inputs (`q`, `k`, `v`, or `qkv` when `packed`), checked
/// by [`check_attention`] or [`check_attention_packed`].
pub fn check_attention_inputs(
    scale: f64,
    causal: bool,
    packed: bool,
    inputs: &[TensorMeta],
) -> Result<AttentionDims, String> {
    match (packed, inputs) {
        (true, [qkv]) => check_attention_packed(scale, qkv),
        (false, [q, k, v]) => check_attention(scale, causal, q, k, v),
        (true, _) => Err(format!("packed attention takes 1 input (qkv), got {}", inputs.len())),
        (false, _) => Err(format!("takes 3 inputs (q, k, v), got {}", inputs.len())),
    }
}

/// The meta of the `out` (and `dout`) of attention over inputs of `dims` in `dtype`:
/// `[B, Tq, H, D]`.
pub fn out_meta(dims: &AttentionDims, dtype: DType) -> TensorMeta {
    TensorMeta::new(Shape(vec![dims.batch, dims.queries, dims.heads, dims.head_dim]), dtype)
}

/// Checks `attention_grad`'s inputs `(q, k, v, out, lse, dout)`, or `(qkv, out, lse,
/// dout)` when `packed`: the forward op's inputs as [`check_attention_inputs`], `out` and
/// `dout` `[B, Tq, H, D]` in their dtype, `lse [B, H, Tq]` in [`lse_dtype`]. Returns the
/// sizes, or a sentence naming the values that do not fit.
pub fn check_attention_grad(
    scale: f64,
    causal: bool,
    packed: bool,
    inputs: &[TensorMeta],
) -> Result<AttentionDims, String> {
    let forward_inputs = if packed { 1 } else { 3 };
    if inputs.len() != forward_inputs + 3 {
        return Err(if packed {
            format!("packed attention_grad takes 4 inputs (qkv, out, lse, dout), got {}", inputs.len())
        } else {
            format!("takes 6 inputs (q, k, v, out, lse, dout), got {}", inputs.len())
        });
    }
    let (forward, [out, lse, dout]) = inputs.split_at(forward_inputs) else { unreachable!("the count was checked") };
    let dims = check_attention_inputs(scale, causal, packed, forward)?;
    let dtype = forward[0].dtype;
    let expected = out_meta(&dims, dtype);
    for (name, meta) in [("out", out), ("dout", dout)] {
        if *meta != expected {
            return Err(format!("{name} must be {expected} (the forward op's output), got {name} {meta}"));
        }
    }
    let expected = dims.lse_meta(dtype);
    if *lse != expected {
        return Err(format!(
            "lse must be {expected} ([batch, heads, queries] in the arithmetic dtype of {dtype} inputs), got lse {lse}"
        ));
    }
    Ok(dims)
}

/// The sizes of tensors whose metas were checked (the op's shape rule, its kernel's
/// `check`), with the element counts of the slices confirmed: `lens` are those of the
/// forward op's inputs (`q`, `k`, `v`, or `qkv`) then `out`, `lse` and, for the gradient,
/// `dout`.
fn dims_of(packed: bool, inputs: &[HostTensor<'_>], lens: &[usize]) -> Result<AttentionDims, String> {
    let dims = match (packed, inputs.first().map(|t| t.shape.dims()), inputs.get(1).map(|t| t.shape.dims())) {
        (true, Some(&[batch, len, heads, 3, head_dim]), _) => {
            AttentionDims { batch, queries: len, keys: len, heads, head_dim, packed }
        }
        (false, Some(&[batch, queries, heads, head_dim]), Some(&[_, keys, _, _])) => {
            AttentionDims { batch, queries, keys, heads, head_dim, packed }
        }
        _ => {
            let shapes: Vec<String> = inputs.iter().map(|t| t.shape.to_string()).collect();
            return Err(format!("attention inputs of shapes {shapes:?} (packed: {packed}) (broken invariant)"));
        }
    };
    let (q_len, kv_len) = dims.sequence_lens();
    let out_len = dims.queries * dims.heads * dims.head_dim;
    // Per sequence: the forward inputs', then out's, lse's and dout's (packed, qkv's is
    // the last of the three). A firing's check: nothing allocated.
    let apart = [q_len, kv_len, kv_len, out_len, dims.heads * dims.queries, out_len];
    let expected = if packed { &apart[2..] } else { &apart[..] };
    let expected = |index: usize| expected.get(index).map(|per_sequence| per_sequence * dims.batch);
    if let Some(index) = (0..lens.len()).find(|&i| expected(i) != Some(lens[i])) {
        return Err(format!(
            "tensor {index} has {} elements, {:?} expected for {dims:?} (broken invariant)",
            lens[index],
            expected(index)
        ));
    }
    Ok(dims)
}

/// Runs `work(b, parts, scratch)` for every sequence `b`, where `parts` holds sequence
/// `b`'s part of each of `outputs` (each output is `batch` equal parts) and `scratch` is the
/// share's, made once per share by `make_scratch` (tiles on the stack). Sequences are
/// shared over `threads` when the op has enough arithmetic to pay for handing out shares
/// (as many multiply-adds as the elements at which row kernels share theirs): each
/// sequence is one thread's, computed in the same order on any thread count.
fn for_each_sequence<T: Send, S, const N: usize>(
    threads: usize,
    batch: usize,
    multiply_adds: usize,
    outputs: [&mut [T]; N],
    make_scratch: impl Fn() -> S + Sync,
    work: impl Fn(usize, [&mut [T]; N], &mut S) + Sync,
) {
    if batch == 0 {
        return;
    }
    let lens = outputs.each_ref().map(|o| o.len() / batch);
    let threads = if multiply_adds >= ROWS_PARALLEL_MIN_ELEMENTS { threads } else { 1 };
    let parts = outputs.map(DisjointParts::new);
    in_shares(threads, batch, |sequences| {
        fast_math::vectorized(
            #[inline(always)]
            || {
                let mut scratch = make_scratch();
                for b in sequences.clone() {
                    // SAFETY: sequence `b`'s parts are disjoint from every other sequence's,
                    // and each sequence lies in one share.
                    let sequence = std::array::from_fn(|n| unsafe { parts[n].part(b * lens[n]..(b + 1) * lens[n]) });
                    work(b, sequence, &mut scratch);
                }
            },
        )
    });
}

impl HostCompute for Attention {
    fn compute(
        &self,
        context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        let dtype = inputs.first().map_or(DType::I64, HostTensor::dtype);
        by_float!(dtype, "integer attention is not supported", T => forward::<T>(self, context.threads, inputs, outputs))
    }

    fn check(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Result<(), String> {
        let dims = check_attention_inputs(self.scale, self.causal, self.packed, inputs)?;
        let [out, lse] = outputs else {
            return Err(format!("gives 2 outputs (out, lse), but has {}", outputs.len()));
        };
        let expected = out_meta(&dims, inputs[0].dtype);
        if *out != expected {
            return Err(format!("out must be {expected}, got out {out}"));
        }
        let expected = dims.lse_meta(inputs[0].dtype);
        if *lse != expected {
            return Err(format!("lse must be {expected}, got lse {lse}"));
        }
        Ok(())
    }
}

/// The forward op's inputs as `q`, `k` and `v` slices: the three of them, or `qkv` thrice.
fn forward_inputs<'a, T: FastMath>(inputs: &'a [HostTensor<'_>]) -> Result<[&'a [T]; 3], String> {
    match inputs {
        [qkv] => {
            let qkv = qkv.as_slice::<T>()?;
            Ok([qkv; 3])
        }
        [q, k, v] => Ok([q.as_slice::<T>()?, k.as_slice::<T>()?, v.as_slice::<T>()?]),
        _ => Err(format!("attention takes 1 input (qkv) or 3 (q, k, v), got {}", inputs.len())),
    }
}

fn forward<T: FastMath>(
    op: &Attention,
    threads: usize,
    inputs: &[HostTensor<'_>],
    outputs: &mut [HostTensorMut<'_>],
) -> Result<(), String> {
    let [q, k, v] = forward_inputs::<T>(inputs)?;
    let [out, lse] = outputs else { return Err(format!("attention gives 2 outputs, got {}", outputs.len())) };
    // The products' instruction set, capped as every product's is (`REGFLOW_CPU_ISA`).
    crate::cpu::isa::from_environment()?;
    let (out, lse) = (out.as_mut_slice::<T>()?, lse.as_mut_slice::<T>()?);
    // Packed, q, k and v are all qkv: its length counts once.
    let lens = [q.len(), k.len(), v.len(), out.len(), lse.len()];
    let dims = dims_of(op.packed, inputs, if op.packed { &lens[2..] } else { &lens })?;
    let (scale, causal) = (T::from_f64(op.scale), op.causal);
    let (q_len, kv_len) = dims.sequence_lens();
    let multiply_adds = dims.multiply_adds(causal);
    for_each_sequence(
        threads,
        dims.batch,
        multiply_adds,
        [out, lse],
        || [T::zero(); TILE],
        #[inline(always)]
        |b, [out, lse], scores| {
            let (q, k, v) = (&q[b * q_len..][..q_len], &k[b * kv_len..][..kv_len], &v[b * kv_len..][..kv_len]);
            forward_sequence(&dims, scale, causal, [q, k, v], [out, lse], scores);
        },
    );
    Ok(())
}

impl HostCompute for AttentionGrad {
    fn compute(
        &self,
        context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        let dtype = inputs.first().map_or(DType::I64, HostTensor::dtype);
        by_float!(dtype, "integer attention is not supported", T => backward::<T>(self, context.threads, inputs, outputs))
    }

    fn check(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Result<(), String> {
        check_attention_grad(self.scale, self.causal, self.packed, inputs)?;
        let names: &[&str] = if self.packed { &["dqkv"] } else { &["dq", "dk", "dv"] };
        if outputs.len() != names.len() {
            return Err(format!("gives {} outputs ({}), but has {}", names.len(), names.join(", "), outputs.len()));
        }
        for ((name, grad), input) in names.iter().zip(outputs).zip(inputs) {
            if grad != input {
                return Err(format!("{name} must have its input's shape and dtype {input}, got {name} {grad}"));
            }
        }
        Ok(())
    }
}

fn backward<T: FastMath>(
    op: &AttentionGrad,
    threads: usize,
    inputs: &[HostTensor<'_>],
    outputs: &mut [HostTensorMut<'_>],
) -> Result<(), String> {
    let forward_count = if op.packed { 1 } else { 3 };
    if inputs.len() != forward_count + 3 {
        return Err(format!("attention_grad takes {} inputs, got {}", forward_count + 3, inputs.len()));
    }
    let (forward, rest) = inputs.split_at(forward_count);
    let [q, k, v] = forward_inputs::<T>(forward)?;
    let [out, lse, dout] = rest else { unreachable!("the count was checked") };
    crate::cpu::isa::from_environment()?;
    let (out, lse, dout) = (out.as_slice::<T>()?, lse.as_slice::<T>()?, dout.as_slice::<T>()?);
    let lens = [q.len(), k.len(), v.len(), out.len(), lse.len(), dout.len()];
    let dims = dims_of(op.packed, inputs, if op.packed { &lens[2..] } else { &lens })?;
    let (scale, causal) = (T::from_f64(op.scale), op.causal);
    let (q_len, kv_len) = dims.sequence_lens();
    let (out_len, lse_len) = (dims.queries * dims.heads * dims.head_dim, dims.heads * dims.queries);
    // Five products per tile where the forward op has two.
    let multiply_adds = dims.multiply_adds(causal) * 5 / 2;
    let sequence = |b: usize,
                    grads: Grads<'_, T>,
                    (probabilities, score_grads, deltas): &mut ([T; TILE], [T; TILE], [T; BLOCK])| {
        let (out, dout) = (&out[b * out_len..][..out_len], &dout[b * out_len..][..out_len]);
        let (q, k, v) = (&q[b * q_len..][..q_len], &k[b * kv_len..][..kv_len], &v[b * kv_len..][..kv_len]);
        let lse = &lse[b * lse_len..][..lse_len];
        backward_sequence(&dims, scale, causal, [q, k, v, out, lse, dout], grads, [probabilities, score_grads], deltas);
    };
    let scratch = || ([T::zero(); TILE], [T::zero(); TILE], [T::zero(); BLOCK]);
    match outputs {
        [dqkv] if op.packed => {
            let dqkv = dqkv.as_mut_slice::<T>()?;
            if dqkv.len() != q.len() {
                return Err(format!("dqkv of {} elements for {dims:?} (broken invariant)", dqkv.len()));
            }
            for_each_sequence(
                threads,
                dims.batch,
                multiply_adds,
                [dqkv],
                scratch,
                #[inline(always)]
                |b, [dqkv], scratch| sequence(b, Grads::Packed(dqkv), scratch),
            );
        }
        [dq, dk, dv] if !op.packed => {
            let (dq, dk, dv) = (dq.as_mut_slice::<T>()?, dk.as_mut_slice::<T>()?, dv.as_mut_slice::<T>()?);
            if (dq.len(), dk.len(), dv.len()) != (q.len(), k.len(), v.len()) {
                return Err(format!(
                    "gradients of {}, {} and {} elements for {dims:?} (broken invariant)",
                    dq.len(),
                    dk.len(),
                    dv.len()
                ));
            }
            for_each_sequence(
                threads,
                dims.batch,
                multiply_adds,
                [dq, dk, dv],
                scratch,
                #[inline(always)]
                |b, grads, scratch| sequence(b, Grads::Apart(grads), scratch),
            );
        }
        _ => return Err(format!("attention_grad (packed: {}) gives {} outputs", op.packed, outputs.len())),
    }
    Ok(())
}
