//! The tiles of one sequence's attention and its gradient: blocks of 64 queries and 64
//! keys per head, their products by `gemm`, the online softmax between them.

use super::AttentionDims;
use crate::cpu::fast_math::{self, FastMath};

/// Queries and keys taken together: one block of each makes a `[BLOCK, BLOCK]` tile of
/// scores on the stack, from one matrix product, and one more product folds the tile's
/// probabilities into the queries' outputs.
pub(super) const BLOCK: usize = 64;

/// Elements of one tile of scores (or of their gradients).
pub(super) const TILE: usize = BLOCK * BLOCK;

/// A matrix inside a slice: element `(row, column)` at
/// `offset + row·row_stride + column·column_stride`.
#[derive(Debug, Clone, Copy)]
struct View {
    offset: usize,
    rows: usize,
    columns: usize,
    row_stride: usize,
    column_stride: usize,
}

/// Which of a head's rows a view reads: packed, `q`, `k` and `v` lie side by side in one
/// row of `3·D` per position and head; `out` (and `dout`) is never packed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Part {
    Query = 0,
    Key = 1,
    Value = 2,
    Out = 3,
}

impl View {
    /// Rows `first..first + rows` of one head of a sequence's `[T, H, D]` tensor (`part`
    /// of a packed `[T, H, 3, D]` one): `D` columns, rows `H·D` (`H·3·D`) apart.
    fn head_rows(dims: &AttentionDims, part: Part, head: usize, first: usize, rows: usize) -> Self {
        let (width, base) = match part {
            Part::Out => (dims.head_dim, 0),
            _ if dims.packed => (3 * dims.head_dim, part as usize * dims.head_dim),
            _ => (dims.head_dim, 0),
        };
        let stride = dims.heads * width;
        Self {
            offset: base + first * stride + head * width,
            rows,
            columns: dims.head_dim,
            row_stride: stride,
            column_stride: 1,
        }
    }

    /// The first `rows × columns` of a tile.
    fn tile(rows: usize, columns: usize) -> Self {
        Self { offset: 0, rows, columns, row_stride: BLOCK, column_stride: 1 }
    }

    /// The same elements read as the transposed matrix.
    fn transposed(self) -> Self {
        Self {
            offset: self.offset,
            rows: self.columns,
            columns: self.rows,
            row_stride: self.column_stride,
            column_stride: self.row_stride,
        }
    }

    /// Whether every element lies inside a slice of `len` elements.
    fn fits(&self, len: usize) -> bool {
        if self.rows == 0 || self.columns == 0 {
            return self.offset <= len;
        }
        let last = (self.rows - 1)
            .checked_mul(self.row_stride)
            .zip((self.columns - 1).checked_mul(self.column_stride))
            .and_then(|(rows, columns)| rows.checked_add(columns)?.checked_add(self.offset));
        last.is_some_and(|last| last < len)
    }
}

/// `dst = [dst +] beta · lhs · rhs` (`accumulate` says whether `dst` is added to), by one
/// single-threaded `gemm` call: its summation order is fixed for a shape and instruction
/// set, so results do not depend on the thread count.
///
/// Panics when the views do not fit their slices or each other (a broken invariant: the
/// kernels make them from checked dims).
#[inline(always)]
fn product<T: FastMath>(
    (dst, dst_view): (&mut [T], View),
    accumulate: bool,
    (lhs, lhs_view): (&[T], View),
    (rhs, rhs_view): (&[T], View),
    beta: T,
) {
    let (m, n, k) = (dst_view.rows, dst_view.columns, lhs_view.columns);
    assert!(
        lhs_view.rows == m && rhs_view.rows == k && rhs_view.columns == n,
        "attention product of {lhs_view:?} by {rhs_view:?} into {dst_view:?} (broken invariant)"
    );
    assert!(
        dst_view.fits(dst.len()) && lhs_view.fits(lhs.len()) && rhs_view.fits(rhs.len()),
        "attention product views {dst_view:?}, {lhs_view:?}, {rhs_view:?} outside their slices of {}, {} and {} \
         elements (broken invariant)",
        dst.len(),
        lhs.len(),
        rhs.len()
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for row in 0..m {
                for column in 0..n {
                    dst[dst_view.offset + row * dst_view.row_stride + column * dst_view.column_stride] = T::zero();
                }
            }
        }
        return;
    }
    let stride = |s: usize| s as isize;
    // SAFETY: the three views lie inside their slices (checked above, with no overflow),
    // so every element gemm reads or writes is in bounds; `dst` is borrowed mutably, so it
    // overlaps neither `lhs` nor `rhs`; strides of slices' indices fit in isize (a slice
    // holds at most isize::MAX bytes). gemm dispatches on `T` (f32 or f64 here, the types
    // `FastMath` is for) and panics for a type it does not support.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr().add(dst_view.offset),
            stride(dst_view.column_stride),
            stride(dst_view.row_stride),
            accumulate,
            lhs.as_ptr().add(lhs_view.offset),
            stride(lhs_view.column_stride),
            stride(lhs_view.row_stride),
            rhs.as_ptr().add(rhs_view.offset),
            stride(rhs_view.column_stride),
            stride(rhs_view.row_stride),
            T::one(),
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// Where a sequence's gradients go: `dq`, `dk` and `dv` apart, or one packed `dqkv`.
pub(super) enum Grads<'a, T> {
    Apart([&'a mut [T]; 3]),
    Packed(&'a mut [T]),
}

impl<T: FastMath> Grads<'_, T> {
    /// The slice that holds `part`'s gradient.
    #[inline(always)]
    fn of(&mut self, part: Part) -> &mut [T] {
        match self {
            Self::Apart(grads) => &mut *grads[part as usize],
            Self::Packed(dqkv) => dqkv,
        }
    }

    /// Zeros every gradient.
    fn zero(&mut self) {
        match self {
            Self::Apart(grads) => grads.iter_mut().for_each(|g| g.fill(T::zero())),
            Self::Packed(dqkv) => dqkv.fill(T::zero()),
        }
    }
}

/// `ln(e^a + e^b)`, with `-inf` for an empty sum.
#[inline(always)]
fn log_add_exp<T: FastMath>(a: T, b: T) -> T {
    let (high, low) = if a > b { (a, b) } else { (b, a) };
    high + (T::one() + (low - high).fast_exp()).ln()
}

/// The keys the queries `first..first + len` attend: all of them, or with `causal` the
/// keys up to the last of these queries.
fn keys_of_block(dims: &AttentionDims, causal: bool, first: usize, len: usize) -> usize {
    if causal {
        (first + len).min(dims.keys)
    } else {
        dims.keys
    }
}

/// How many of the `keys` from `first_key` on query `query` attends: all, or with
/// `causal` those up to itself (the rest of its tile row is 0).
#[inline(always)]
fn keys_attended_by(causal: bool, query: usize, first_key: usize, keys: usize) -> usize {
    if causal {
        (query + 1).saturating_sub(first_key).min(keys)
    } else {
        keys
    }
}

/// One sequence's attention. Per head, per block of [`BLOCK`] queries, per block of keys
/// they attend, in order: the tile of scores `scale · q·kᵀ` (one product), per query its
/// row's log-sum-exp `b` folded into the query's running log-sum-exp `r` (in `lse`), and
/// the tile's probabilities into the queries' outputs (kept normalized, one product):
/// `r' = ln(e^r + e^b)`, `out' = e^(r - r')·out + Σ_j e^(s_j - r')·v_j`.
#[inline(always)]
pub(super) fn forward_sequence<T: FastMath>(
    dims: &AttentionDims,
    scale: T,
    causal: bool,
    [q, k, v]: [&[T]; 3],
    [out, lse]: [&mut [T]; 2],
    scores: &mut [T; TILE],
) {
    out.fill(T::zero());
    lse.fill(T::from_f64(f64::NEG_INFINITY));
    for head in 0..dims.heads {
        let lse_row = &mut lse[head * dims.queries..][..dims.queries];
        for first_query in (0..dims.queries).step_by(BLOCK) {
            let queries = (dims.queries - first_query).min(BLOCK);
            let query_rows = View::head_rows(dims, Part::Query, head, first_query, queries);
            let out_rows = View::head_rows(dims, Part::Out, head, first_query, queries);
            let keys_attended = keys_of_block(dims, causal, first_query, queries);
            for first_key in (0..keys_attended).step_by(BLOCK) {
                let keys = (keys_attended - first_key).min(BLOCK);
                let key_rows = View::head_rows(dims, Part::Key, head, first_key, keys);
                let value_rows = View::head_rows(dims, Part::Value, head, first_key, keys);
                let tile = View::tile(queries, keys);
                product((scores, tile), false, (q, query_rows), (k, key_rows.transposed()), scale);
                for (row, query) in (first_query..first_query + queries).enumerate() {
                    // With `causal`, query i attends keys up to i: the rest of its row is 0.
                    let attended = keys_attended_by(causal, query, first_key, keys);
                    let (scores, masked) = scores[row * BLOCK..][..keys].split_at_mut(attended);
                    masked.fill(T::zero());
                    let Some(block_max) = fast_math::max(scores) else { continue };
                    for score in scores.iter_mut() {
                        *score = (*score - block_max).fast_exp();
                    }
                    let sum = fast_math::sum(scores);
                    let block_lse = block_max + sum.ln();
                    // The first block needs no merging: its output is its weighted sum over
                    // its own sum.
                    let (merged, weight) = if first_key == 0 {
                        (block_lse, T::one() / sum)
                    } else {
                        let running = lse_row[query];
                        let merged = log_add_exp(running, block_lse);
                        let keep = (running - merged).fast_exp();
                        let out_row = &mut out[out_rows.offset + row * out_rows.row_stride..][..dims.head_dim];
                        for value in out_row.iter_mut() {
                            *value = keep * *value;
                        }
                        (merged, (block_max - merged).fast_exp())
                    };
                    for p in scores.iter_mut() {
                        *p = weight * *p;
                    }
                    lse_row[query] = merged;
                }
                product((out, out_rows), true, (scores, tile), (v, value_rows), T::one());
            }
        }
    }
}

/// One sequence's gradients: zeroed, then per head, per block of [`BLOCK`] queries (each
/// query's `Σ dout·out` first), per block of keys they attend, in order: the tiles of
/// probabilities `p = e^(scale·q·kᵀ - lse)` and of `dout·vᵀ` (a product each), the scores'
/// gradient `ds = p·(dout·vᵀ - Σ dout·out)` in place of the latter, then three products:
/// `dv += pᵀ·dout`, `dk += scale·dsᵀ·q`, `dq += scale·ds·k`.
#[inline(always)]
pub(super) fn backward_sequence<T: FastMath>(
    dims: &AttentionDims,
    scale: T,
    causal: bool,
    [q, k, v, out, lse, dout]: [&[T]; 6],
    mut grads: Grads<'_, T>,
    [probabilities, score_grads]: [&mut [T; TILE]; 2],
    deltas: &mut [T; BLOCK],
) {
    grads.zero();
    for head in 0..dims.heads {
        let lse_row = &lse[head * dims.queries..][..dims.queries];
        for first_query in (0..dims.queries).step_by(BLOCK) {
            let queries = (dims.queries - first_query).min(BLOCK);
            let query_rows = View::head_rows(dims, Part::Query, head, first_query, queries);
            let out_rows = View::head_rows(dims, Part::Out, head, first_query, queries);
            for (row, delta) in deltas[..queries].iter_mut().enumerate() {
                let at = out_rows.offset + row * out_rows.row_stride;
                *delta = fast_math::dot(&dout[at..][..dims.head_dim], &out[at..][..dims.head_dim]);
            }
            let keys_attended = keys_of_block(dims, causal, first_query, queries);
            for first_key in (0..keys_attended).step_by(BLOCK) {
                let keys = (keys_attended - first_key).min(BLOCK);
                let key_rows = View::head_rows(dims, Part::Key, head, first_key, keys);
                let value_rows = View::head_rows(dims, Part::Value, head, first_key, keys);
                let tile = View::tile(queries, keys);
                product((probabilities, tile), false, (q, query_rows), (k, key_rows.transposed()), scale);
                product((score_grads, tile), false, (dout, out_rows), (v, value_rows.transposed()), T::one());
                for (row, query) in (first_query..first_query + queries).enumerate() {
                    let attended = keys_attended_by(causal, query, first_key, keys);
                    let (p, p_masked) = probabilities[row * BLOCK..][..keys].split_at_mut(attended);
                    let (ds, ds_masked) = score_grads[row * BLOCK..][..keys].split_at_mut(attended);
                    p_masked.fill(T::zero());
                    ds_masked.fill(T::zero());
                    let (lse_value, delta) = (lse_row[query], deltas[row]);
                    for (p, ds) in p.iter_mut().zip(ds.iter_mut()) {
                        *p = (*p - lse_value).fast_exp();
                        *ds = *p * (*ds - delta);
                    }
                }
                let (p, ds) = (&probabilities[..], &score_grads[..]);
                product((grads.of(Part::Value), value_rows), true, (p, tile.transposed()), (dout, out_rows), T::one());
                product((grads.of(Part::Key), key_rows), true, (ds, tile.transposed()), (q, query_rows), scale);
                product((grads.of(Part::Query), query_rows), true, (ds, tile), (k, key_rows), scale);
            }
        }
    }
}
