//! `attention`: fused scaled dot-product attention (scores, softmax and the values'
//! weighted sum in one op, the `[Tq, Tk]` scores never stored), and `attention_grad`.

use super::{GradCtx, InputGrads, OpDef};
use crate::plan::TensorMeta;
use crate::sbp::{Sbp, SbpSignature};
use crate::{GraphError, Tensor};
use regflow_kernels::cpu::attention::{check_attention_grad, check_attention_inputs, out_meta, AttentionDims};
pub use regflow_plan::ops::{Attention, AttentionGrad};

/// Flops of the forward op's two products, `q·kᵀ` and `p·v`: a multiply and an add each per
/// (query, key, d) attended, `4·B·H·Tq·Tk·D` (half the pairs with `causal`).
fn forward_flops(dims: &AttentionDims, causal: bool) -> f64 {
    let pairs = dims.queries as f64 * dims.keys as f64;
    let pairs = if causal { pairs / 2.0 } else { pairs };
    4.0 * dims.batch as f64 * dims.heads as f64 * pairs * dims.head_dim as f64
}

impl OpDef for Attention {
    fn name(&self) -> &'static str {
        "attention"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let dims = check_attention_inputs(self.scale, self.causal, self.packed, inputs)?;
        let dtype = inputs[0].dtype;
        Ok(vec![out_meta(&dims, dtype), dims.lse_meta(dtype)])
    }

    /// One `attention_grad` op for `q`, `k` and `v` (for `qkv` when packed), reading the
    /// forward op's `out` and `lse`. Only `out` may reach the loss: a gradient through
    /// `lse` is refused.
    fn grad<'g>(&self, ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        if ctx.output_grads.get(1).copied().flatten().is_some() {
            return Err(GraphError::Op {
                op: self.name().into(),
                inputs: ctx.inputs.iter().map(|t| t.meta().to_string()).collect(),
                message: "the loss depends on lse (output 1), whose gradient attention does not have: only out \
                          may reach a differentiated loss"
                    .into(),
            });
        }
        let forward = if self.packed { 1 } else { 3 };
        if ctx.inputs.len() != forward {
            return Err(GraphError::Kernel {
                op: self.name().into(),
                message: format!("gradient rule got {} inputs, not {forward} (broken invariant)", ctx.inputs.len()),
            });
        }
        let [out, lse] = ctx.outputs[..] else {
            return Err(GraphError::Kernel {
                op: self.name().into(),
                message: format!("gradient rule got {} outputs, not 2 (broken invariant)", ctx.outputs.len()),
            });
        };
        let first = ctx.inputs[0];
        let dout = ctx.grad()?.cast(first.dtype())?;
        let grad = AttentionGrad { scale: self.scale, causal: self.causal, packed: self.packed };
        let mut inputs = ctx.inputs.to_vec();
        inputs.extend([out, lse, dout]);
        let grads = first.graph().apply(grad, &inputs)?;
        Ok(grads.into_iter().map(Some).collect())
    }

    /// Sequences and heads are independent: a split of the batch (dimension 0 of every
    /// tensor) or of the heads (dimension 2 of `q`, `k`, `v` and `out`, 1 of `lse`). Without
    /// `causal`, queries are too: a split of `q`'s queries with `k` and `v` whole splits
    /// `out` and `lse` alike (a causal query needs its position, which a part does not
    /// know).
    ///
    /// Packed, `qkv [B, T, H, 3, D]` splits on the batch (0) or the heads (2); a split of
    /// queries would split keys too.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        if self.packed {
            return match inputs.len() {
                1 => vec![
                    SbpSignature::new([Sbp::Split(0)], [Sbp::Split(0), Sbp::Split(0)]),
                    SbpSignature::new([Sbp::Split(2)], [Sbp::Split(2), Sbp::Split(1)]),
                ],
                _ => Vec::new(),
            };
        }
        if inputs.len() != 3 {
            return Vec::new();
        }
        let mut signatures = vec![
            SbpSignature::new([Sbp::Split(0); 3], [Sbp::Split(0), Sbp::Split(0)]),
            SbpSignature::new([Sbp::Split(2); 3], [Sbp::Split(2), Sbp::Split(1)]),
        ];
        if !self.causal {
            signatures.push(SbpSignature::new(
                [Sbp::Split(1), Sbp::Broadcast, Sbp::Broadcast],
                [Sbp::Split(1), Sbp::Split(2)],
            ));
        }
        signatures
    }

    fn flops(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> f64 {
        check_attention_inputs(self.scale, self.causal, self.packed, inputs)
            .map_or(0.0, |dims| forward_flops(&dims, self.causal))
    }

    /// Two products: `q`, `k` and `v` in bf16 (or f16) under mixed precision, computed
    /// with f32 arithmetic; `out` is bf16 and `lse` f32 (its shape rule says so).
    fn autocast(&self) -> super::Autocast {
        super::Autocast::Low
    }
}

impl OpDef for AttentionGrad {
    fn name(&self) -> &'static str {
        "attention_grad"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        check_attention_grad(self.scale, self.causal, self.packed, inputs)?;
        Ok(inputs[..if self.packed { 1 } else { 3 }].to_vec())
    }

    /// Reads its inputs as they are: bf16 `q`, `k`, `v`, `out` and `dout` with the f32
    /// `lse` under mixed precision (a cast of `lse` to bf16 would lose what the
    /// recomputed probabilities need).
    fn autocast(&self) -> super::Autocast {
        super::Autocast::Keep
    }

    fn grad<'g>(&self, _ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        // Second derivatives of attention are not needed by any optimizer here.
        Err(GraphError::NoGradient { op: self.name().into(), index: 0 })
    }

    /// The forward op's splits of sequences and heads (`lse` split alike), and, without
    /// `causal`, of queries (`dk` and `dv` then partial sums over them) or of keys (`dq`
    /// partial). With every other input whole, all three gradients are linear in `dout`
    /// (`Σ dout·out` is too), so summands of `dout` give summands. Packed: the batch and
    /// head splits, and summands of `dout`.
    fn sbp_signatures(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> Vec<SbpSignature> {
        if self.packed {
            if inputs.len() != 4 {
                return Vec::new();
            }
            let whole = Sbp::Broadcast;
            return vec![
                SbpSignature::new([Sbp::Split(0); 4], [Sbp::Split(0)]),
                SbpSignature::new([Sbp::Split(2), Sbp::Split(2), Sbp::Split(1), Sbp::Split(2)], [Sbp::Split(2)]),
                SbpSignature::new([whole, whole, whole, Sbp::Partial], [Sbp::Partial]),
            ];
        }
        if inputs.len() != 6 {
            return Vec::new();
        }
        let (whole, partial) = (Sbp::Broadcast, Sbp::Partial);
        let mut signatures = vec![
            SbpSignature::new([Sbp::Split(0); 6], [Sbp::Split(0); 3]),
            SbpSignature::new(
                [Sbp::Split(2), Sbp::Split(2), Sbp::Split(2), Sbp::Split(2), Sbp::Split(1), Sbp::Split(2)],
                [Sbp::Split(2); 3],
            ),
            SbpSignature::new([whole, whole, whole, whole, whole, partial], [partial; 3]),
        ];
        if !self.causal {
            signatures.push(SbpSignature::new(
                [Sbp::Split(1), whole, whole, Sbp::Split(1), Sbp::Split(2), Sbp::Split(1)],
                [Sbp::Split(1), partial, partial],
            ));
            signatures.push(SbpSignature::new(
                [whole, Sbp::Split(1), Sbp::Split(1), whole, whole, whole],
                [partial, Sbp::Split(1), Sbp::Split(1)],
            ));
        }
        signatures
    }

    /// The forward's products recomputed (`q·kᵀ`) and four more of its size (`dout·vᵀ`,
    /// `dv`, `dq`, `dk`): 2.5 times the forward op's.
    fn flops(&self, inputs: &[TensorMeta], _outputs: &[TensorMeta]) -> f64 {
        check_attention_grad(self.scale, self.causal, self.packed, inputs)
            .map_or(0.0, |dims| 2.5 * forward_flops(&dims, self.causal))
    }
}

impl<'g> Tensor<'g> {
    /// Scaled dot-product attention in one op: `softmax(scale · q·kᵀ) · v` per sequence
    /// and head, with `self` as `q`. Returns `out`.
    ///
    /// `q` is `[B, Tq, H, D]`, `k` and `v` are `[B, Tk, H, D]`, all in one float dtype: the
    /// rows of `[B·T, H·D]` projections reshaped, so heads stay interleaved as the
    /// projections wrote them (no permute). `out` is `[B, Tq, H, D]` in that dtype, ready
    /// to reshape to `[B·Tq, H·D]` for the output projection. `scale` multiplies the
    /// scores (`1/√D` for the usual attention). With `causal`, query `i` attends keys
    /// `0..=i` only (then `Tq` must equal `Tk`); a query with no key gets zeros.
    ///
    /// The `[Tq, Tk]` scores and probabilities are never stored: the forward op keeps only
    /// each query's log-sum-exp of its scores (`lse`, see
    /// [`attention_with_lse`](Self::attention_with_lse)), from which the gradient
    /// recomputes the probabilities. Under mixed precision `q`, `k` and `v` are cast to
    /// bf16 (or f16), the arithmetic is f32 and `out` is bf16.
    pub fn attention(
        &self,
        k: &Tensor<'g>,
        v: &Tensor<'g>,
        scale: f64,
        causal: bool,
    ) -> Result<Tensor<'g>, GraphError> {
        Ok(self.attention_with_lse(k, v, scale, causal)?.0)
    }

    /// [`attention`](Self::attention), also returning `lse [B, H, Tq]`: for each
    /// sequence, head and query `i`, `m + ln Σ_j e^(s_ij - m)` over the keys it attends,
    /// with `s_ij = scale · q_i·k_j` and `m` their maximum (`-inf` with no key), in f64 for
    /// f64 inputs and f32 otherwise. The gradient does not flow through `lse`: a loss
    /// that depends on it cannot be differentiated.
    pub fn attention_with_lse(
        &self,
        k: &Tensor<'g>,
        v: &Tensor<'g>,
        scale: f64,
        causal: bool,
    ) -> Result<(Tensor<'g>, Tensor<'g>), GraphError> {
        let outputs = self.graph().apply(Attention::new(scale, causal), &[*self, *k, *v])?;
        match outputs[..] {
            [out, lse] => Ok((out, lse)),
            _ => Err(GraphError::Kernel {
                op: "attention".into(),
                message: format!("gave {} outputs, not 2 (broken invariant)", outputs.len()),
            }),
        }
    }

    /// [`attention`](Self::attention) over `self` as one packed `qkv [B, T, H, 3, D]`: per
    /// position and head the query, key and value rows side by side, as one projection
    /// `x·w_qkv` to `[B·T, H·3·D]` writes them when `w_qkv`'s columns are grouped by head
    /// (reshape its rows to `[B, T, H, 3, D]`; no copy). `q`, `k` and `v` are read in
    /// place, and the gradient is one `dqkv` laid out alike, so the three projections,
    /// their bias adds and the sum of their inputs' gradients become one each. A column
    /// split of `w_qkv` on a tensor-parallel axis splits whole heads. Returns `out [B, T,
    /// H, D]` (and, with [`attention_packed_with_lse`](Self::attention_packed_with_lse),
    /// `lse`).
    pub fn attention_packed(&self, scale: f64, causal: bool) -> Result<Tensor<'g>, GraphError> {
        Ok(self.attention_packed_with_lse(scale, causal)?.0)
    }

    /// [`attention_packed`](Self::attention_packed), also returning `lse [B, H, T]` (as
    /// [`attention_with_lse`](Self::attention_with_lse)).
    pub fn attention_packed_with_lse(&self, scale: f64, causal: bool) -> Result<(Tensor<'g>, Tensor<'g>), GraphError> {
        let outputs = self.graph().apply(Attention { scale, causal, packed: true }, &[*self])?;
        match outputs[..] {
            [out, lse] => Ok((out, lse)),
            _ => Err(GraphError::Kernel {
                op: "attention".into(),
                message: format!("gave {} outputs, not 2 (broken invariant)", outputs.len()),
            }),
        }
    }
}
