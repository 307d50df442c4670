//! Attributes of `attention` ops: scaled dot-product attention in one op, forward and
//! backward, with the `[T, T]` scores never stored.

use serde::{Deserialize, Serialize};

/// `softmax(scale · q·kᵀ [+ causal mask]) · v` per (sequence, head), in one op.
///
/// Inputs `q [B, Tq, H, D]`, `k [B, Tk, H, D]`, `v [B, Tk, H, D]` in one float dtype, read
/// in the layout the projections write them (`[B·T, H·D]` rows reshaped, no permute).
/// Outputs `out [B, Tq, H, D]` in that dtype and `lse [B, H, Tq]`, each query's
/// log-sum-exp of its scaled scores over the keys it attends (`m + ln Σ e^(s - m)`), in
/// the arithmetic dtype (f64 for f64 inputs, else f32), which the gradient reads instead of
/// the probabilities. With `causal`, query `i` attends keys `0..=i` (then `Tq == Tk`).
///
/// With [`Attention::packed`] the op reads one input, `qkv [B, T, H, 3, D]`: per position
/// and head its query, key and value rows side by side, as one projection to
/// `[B·T, H·3·D]` writes them when its weight's columns are grouped by head (the packed
/// projection of FlashAttention's `qkvpacked` and Megatron's fused QKV; a column split of
/// that weight splits whole heads). It reads them in place, through strides: the three
/// projections, their bias adds and, in the gradient, the sum of their inputs' gradients
/// become one each.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Attention {
    /// What the scores `q·kᵀ` are multiplied by (`1/√D` for the usual attention).
    pub scale: f64,
    /// Whether query `i` attends only keys `0..=i`.
    pub causal: bool,
    /// One input `qkv [B, T, H, 3, D]` instead of `q`, `k` and `v`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub packed: bool,
}

impl Attention {
    /// Attention over `q`, `k` and `v` given apart.
    pub fn new(scale: f64, causal: bool) -> Self {
        Self { scale, causal, packed: false }
    }
}

/// The gradients of [`Attention`]: inputs `(q, k, v, out, lse, dout)`, outputs
/// `(dq, dk, dv)`. The probabilities are recomputed from `q`, `k` and `lse`:
/// `p = e^(scale·q·kᵀ - lse)`, `dv = pᵀ·dout`, `ds = p·(dout·vᵀ - Σ dout·out)`,
/// `dq = scale·ds·k`, `dk = scale·dsᵀ·q`.
///
/// With [`AttentionGrad::packed`] the inputs are `(qkv, out, lse, dout)` and the one
/// output is `dqkv`, laid out as `qkv` (see [`Attention`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AttentionGrad {
    /// The forward op's scale.
    pub scale: f64,
    /// The forward op's `causal`.
    pub causal: bool,
    /// The forward op's `packed`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub packed: bool,
}

impl AttentionGrad {
    /// The gradients of [`Attention::new`]'s op.
    pub fn new(scale: f64, causal: bool) -> Self {
        Self { scale, causal, packed: false }
    }
}
