//! A tiny GPT in the graph DSL, shared by the examples: learned token and position
//! embeddings; per block `x + attn(ln1(x))` then `x + mlp(ln2(x))`, where attention has
//! separate Q/K/V projections, scaled dot-product scores plus a causal mask (an input
//! `[T, T]` of 0 / -1e9 that broadcasts over batch and heads), a softmax and an output
//! projection, and the MLP is `gelu(x·w1 + b1)·w2 + b2`; a final LayerNorm, then logits from
//! the *tied* token embedding (`h · wteᵀ`).
//!
//! The step runs on fused kernels: the heads are read from `[B, T, H, d]` by strided
//! products (`matmul_permuted`, no permute copies), the scaled, masked softmax is one op
//! (`masked_softmax`) and so is the MLP's bias add and GELU (`bias_gelu`); the arithmetic is
//! that of the unfused composition. With `fused_attention` the products and the softmax
//! are one `attention` op (causal, the mask input then unused), whose sums run in
//! another order, and the Q/K/V projections are one, `attn.qkv` (`[D, 3·D]`, its columns
//! grouped by head: per head its query, key and value columns), read in place by the
//! packed op (`Tensor::attention_packed`): one product, one bias add and one bias gradient
//! where there were three, and no sum of three input gradients. A column split of
//! `attn.qkv` on a tensor-parallel axis splits whole heads, as the three projections'
//! splits did.

use regflow::graph::{DType, Graph, GraphError, Init, Tensor};

/// `[B, T, H, d]` read as `[B, H, T, d]` (and back: the order is its own inverse).
const HEADS_FIRST: [usize; 4] = [0, 2, 1, 3];

/// The model's sizes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GptConfig {
    pub(crate) d_model: usize,
    pub(crate) heads: usize,
    pub(crate) layers: usize,
    pub(crate) context: usize,
    pub(crate) mlp_width: usize,
    /// Attention as one fused op (`Tensor::attention_packed`, flash attention on CUDA: the
    /// `[T, T]` scores never stored) over one packed Q/K/V projection, instead of three
    /// projections, the products and the masked softmax.
    pub(crate) fused_attention: bool,
    /// With `fused_attention`, three Q/K/V projections and the op over them apart
    /// (`Tensor::attention`) instead of one packed projection: for benchmarks that time
    /// the packing against what it replaced.
    pub(crate) apart_qkv: bool,
}

impl GptConfig {
    /// The character GPT the CPU benchmarks and their peers run (`bench_gpt`,
    /// `bench_gpu_gpt2 --size tiny`, `benches/peers/gpt_peers.py`): 2 layers of 64 wide
    /// with 4 heads over 64 positions, composed attention.
    #[allow(dead_code)] // the examples that train other sizes share this module
    pub(crate) const CHAR: Self = Self {
        d_model: 64,
        heads: 4,
        layers: 2,
        context: 64,
        mlp_width: 256,
        fused_attention: false,
        apart_qkv: false,
    };

    fn head_dim(&self) -> usize {
        self.d_model / self.heads
    }
}

struct Params<'g> {
    graph: &'g Graph,
    next_seed: u64,
    config: GptConfig,
}

impl<'g> Params<'g> {
    /// GPT-2's initialization: N(0, 0.02) weights (`std` scales it), zero biases.
    fn normal(&mut self, name: &str, shape: [usize; 2], std: f64) -> Result<Tensor<'g>, GraphError> {
        self.next_seed += 1;
        self.graph.variable(name, shape, DType::F32, Init::Normal { mean: 0.0, std, seed: self.next_seed })
    }

    fn linear(&mut self, name: &str, inputs: usize, outputs: usize, std: f64) -> Result<Linear<'g>, GraphError> {
        Ok(Linear {
            weight: self.normal(&format!("{name}.weight"), [inputs, outputs], std)?,
            bias: self.graph.variable(&format!("{name}.bias"), [outputs], DType::F32, Init::Zeros)?,
        })
    }

    fn layer_norm(&self, name: &str) -> Result<LayerNorm<'g>, GraphError> {
        let d = self.config.d_model;
        Ok(LayerNorm {
            gamma: self.graph.variable(&format!("{name}.gamma"), [d], DType::F32, Init::Ones)?,
            beta: self.graph.variable(&format!("{name}.beta"), [d], DType::F32, Init::Zeros)?,
        })
    }
}

/// `x·weight + bias` on rows `[N, inputs]`.
struct Linear<'g> {
    weight: Tensor<'g>,
    bias: Tensor<'g>,
}

impl<'g> Linear<'g> {
    fn forward(&self, x: &Tensor<'g>) -> Result<Tensor<'g>, GraphError> {
        x.matmul(&self.weight)?.add(&self.bias)
    }
}

struct LayerNorm<'g> {
    gamma: Tensor<'g>,
    beta: Tensor<'g>,
}

impl<'g> LayerNorm<'g> {
    fn forward(&self, x: &Tensor<'g>) -> Result<Tensor<'g>, GraphError> {
        x.layer_norm(&self.gamma, &self.beta, 1e-5)
    }
}

/// The projections of attention's queries, keys and values.
enum Projections<'g> {
    /// Three, for the products and the masked softmax.
    Apart { query: Linear<'g>, key: Linear<'g>, value: Linear<'g> },
    /// One, to `[B·T, H·3·d]` (per head its query, key and value rows), for the fused op.
    Packed(Linear<'g>),
}

/// One pre-LayerNorm transformer block.
struct Block<'g> {
    ln1: LayerNorm<'g>,
    projections: Projections<'g>,
    attn_out: Linear<'g>,
    ln2: LayerNorm<'g>,
    mlp_in: Linear<'g>,
    mlp_out: Linear<'g>,
    config: GptConfig,
}

impl<'g> Block<'g> {
    fn new(params: &mut Params<'g>, name: &str) -> Result<Self, GraphError> {
        let c = params.config;
        // GPT-2 scales the projections that write into the residual stream by 1/√(2·layers),
        // so the stream's variance does not grow with depth.
        let residual_std = 0.02 / ((2 * c.layers) as f64).sqrt();
        Ok(Self {
            ln1: params.layer_norm(&format!("{name}.ln1"))?,
            projections: if c.fused_attention && !c.apart_qkv {
                Projections::Packed(params.linear(&format!("{name}.attn.qkv"), c.d_model, 3 * c.d_model, 0.02)?)
            } else {
                Projections::Apart {
                    query: params.linear(&format!("{name}.attn.query"), c.d_model, c.d_model, 0.02)?,
                    key: params.linear(&format!("{name}.attn.key"), c.d_model, c.d_model, 0.02)?,
                    value: params.linear(&format!("{name}.attn.value"), c.d_model, c.d_model, 0.02)?,
                }
            },
            attn_out: params.linear(&format!("{name}.attn.out"), c.d_model, c.d_model, residual_std)?,
            ln2: params.layer_norm(&format!("{name}.ln2"))?,
            mlp_in: params.linear(&format!("{name}.mlp.in"), c.d_model, c.mlp_width, 0.02)?,
            mlp_out: params.linear(&format!("{name}.mlp.out"), c.mlp_width, c.d_model, residual_std)?,
            config: c,
        })
    }

    /// `x` is the residual stream as rows `[B·T, D]`; `mask` is `[T, T]`.
    fn forward(&self, x: Tensor<'g>, batch: usize, mask: &Tensor<'g>) -> Result<Tensor<'g>, GraphError> {
        let c = self.config;
        let (b, t) = (batch as isize, c.context as isize);
        // [B·T, D] -> [B, T, H, d], read as [B, H, T, d] by the products below (through
        // strides, no permute copies): one attention problem per (sequence, head).
        let (heads, head_dim) = (c.heads as isize, c.head_dim() as isize);
        let split_heads = |rows: Tensor<'g>| rows.reshape(&[b, t, heads, head_dim]);
        let h = self.ln1.forward(&x)?;
        let scale = 1.0 / (c.head_dim() as f64).sqrt();
        let (query, key, value) = match &self.projections {
            Projections::Packed(qkv) => {
                // softmax(q·kᵀ/√d, causal)·v in one op over [B, T, H, 3, d] (a view of
                // the product's rows), written as [B, T, H, d].
                let packed = qkv.forward(&h)?.reshape(&[b, t, heads, 3, head_dim])?;
                let attended = packed.attention_packed(scale, true)?;
                let merged = attended.reshape(&[b * t, c.d_model as isize])?;
                return self.rest(x, merged);
            }
            Projections::Apart { query, key, value } => (query, key, value),
        };
        let q = split_heads(query.forward(&h)?)?;
        let k = split_heads(key.forward(&h)?)?;
        let v = split_heads(value.forward(&h)?)?;
        if c.fused_attention {
            // The fused op over the projections apart (`apart_qkv`).
            let attended = q.attention(&k, &v, scale, true)?;
            return self.rest(x, attended.reshape(&[b * t, c.d_model as isize])?);
        }
        // q·kᵀ: [B, H, T, d] x [B, H, d, T] -> [B, H, T, T].
        let scores = q.matmul_permuted(&k, &HEADS_FIRST, &[0, 2, 3, 1], &[0, 1, 2, 3])?;
        // softmax(q·kᵀ/√d + mask) in one kernel, forward and backward.
        let weights = scores.masked_softmax(mask, scale)?;
        // weights·v: [B, H, T, T] x [B, H, T, d] -> [B, H, T, d], stored [B, T, H, d].
        let attended = weights.matmul_permuted(&v, &[0, 1, 2, 3], &HEADS_FIRST, &HEADS_FIRST)?;
        let merged = attended.reshape(&[b * t, c.d_model as isize])?;
        self.rest(x, merged)
    }

    /// The rest of the block after attention: `merged` (`[B·T, D]`, the heads side by
    /// side) through the output projection into the residual stream, then the MLP.
    fn rest(&self, x: Tensor<'g>, merged: Tensor<'g>) -> Result<Tensor<'g>, GraphError> {
        let x = x.add(&self.attn_out.forward(&merged)?)?;
        // gelu(h·w1 + b1): the bias add and the activation in one kernel.
        let hidden = self.ln2.forward(&x)?.matmul(&self.mlp_in.weight)?.bias_gelu(&self.mlp_in.bias)?;
        x.add(&self.mlp_out.forward(&hidden)?)
    }
}

/// The model's parameters.
pub(crate) struct Gpt<'g> {
    token_embedding: Tensor<'g>,
    position_embedding: Tensor<'g>,
    blocks: Vec<Block<'g>>,
    ln_final: LayerNorm<'g>,
    config: GptConfig,
    /// The vocabulary, and the logits' columns when padded ([`Gpt::pad_vocab`]).
    vocab: usize,
    padded_vocab: Option<usize>,
}

impl<'g> Gpt<'g> {
    /// Creates the parameters (seeded, so two graphs get the same initial weights).
    pub(crate) fn new(graph: &'g Graph, config: GptConfig, vocab_size: usize) -> Result<Self, GraphError> {
        let mut params = Params { graph, next_seed: 0, config };
        Ok(Self {
            token_embedding: params.normal("token_embedding", [vocab_size, config.d_model], 0.02)?,
            position_embedding: params.normal("position_embedding", [config.context, config.d_model], 0.01)?,
            blocks: (0..config.layers)
                .map(|i| Block::new(&mut params, &format!("block{i}")))
                .collect::<Result<_, _>>()?,
            ln_final: params.layer_norm("ln_final")?,
            config,
            vocab: vocab_size,
            padded_vocab: None,
        })
    }

    /// Pads the logits' columns to a multiple of `multiple` (GPT-2's 50257 to 50304 with
    /// 64): the output projection reads the token table with zero rows appended, so the
    /// products that make and read the logits run on aligned tensor-core kernels, and
    /// [`Gpt::loss`] takes the cross-entropy over the real columns only. The model is the
    /// unpadded one: the padding holds zeros, takes no part in the loss and gets no
    /// gradient, and the table keeps its shape (the zeros are not a parameter).
    #[allow(dead_code)] // only the GPT-2 benchmark and the tests pad; the other examples share this module
    pub(crate) fn pad_vocab(mut self, multiple: usize) -> Self {
        let padded = self.vocab.div_ceil(multiple.max(1)) * multiple.max(1);
        self.padded_vocab = (padded != self.vocab).then_some(padded);
        self
    }

    /// The mean cross-entropy of `targets` (`[B·T]`) under `logits` from [`Gpt::logits`]:
    /// over the vocabulary's columns only when it is padded.
    pub(crate) fn loss(&self, logits: &Tensor<'g>, targets: &Tensor<'g>) -> Result<Tensor<'g>, GraphError> {
        match self.padded_vocab {
            Some(_) => logits.sparse_cross_entropy_of_first(targets, self.vocab),
            None => logits.sparse_cross_entropy(targets),
        }
    }

    /// Next-character logits `[B·T, V]` for ids `[B, T]` (`V` padded by [`Gpt::pad_vocab`]).
    pub(crate) fn logits(&self, ids: &Tensor<'g>, mask: &Tensor<'g>) -> Result<Tensor<'g>, GraphError> {
        self.logits_staged(ids, mask, &[])
    }

    /// The pipeline stage of block `l` of `layers` over `stages` stages.
    pub(crate) fn stage_of_block(l: usize, layers: usize, stages: usize) -> usize {
        l * stages / layers
    }

    /// Logits with the blocks spread over `stages` (embeddings on the first, the final
    /// LayerNorm and the tied projection on the last): the residual stream and the tied
    /// table cross stage edges explicitly. No stages: one placement.
    pub(crate) fn logits_staged(
        &self,
        ids: &Tensor<'g>,
        mask: &Tensor<'g>,
        stages: &[regflow::graph::sbp::Mesh],
    ) -> Result<Tensor<'g>, GraphError> {
        let batch = ids.shape().dims()[0];
        let (t, d) = (self.config.context, self.config.d_model);
        // [B, T, D] + [T, D]: the position table broadcasts over the batch.
        let embedded = self.token_embedding.embedding(ids)?.add(&self.position_embedding)?;
        let mut x = embedded.reshape(&[(batch * t) as isize, d as isize])?;
        let mut stage = 0;
        let mut mask = *mask;
        for (l, block) in self.blocks.iter().enumerate() {
            let s = Self::stage_of_block(l, self.blocks.len(), stages.len().max(1));
            if s != stage {
                // The residual stream and the mask cross to the next stage.
                x = x.to_placement(&stages[s])?;
                mask = mask.to_placement(&stages[s])?;
                stage = s;
            }
            x = block.forward(x, batch, &mask)?;
        }
        let mut table = self.token_embedding;
        if let Some(last) = stages.last() {
            if stage + 1 != stages.len() {
                x = x.to_placement(last)?;
            }
            if stages.len() > 1 {
                table = table.to_placement(last)?;
            }
        }
        if let Some(padded) = self.padded_vocab {
            // Zero rows appended (their logits are 0, and ignored by `loss`).
            let padding = table.graph().constant(0.0, [padded - self.vocab, d], table.dtype())?;
            table = table.concat(&[padding], 0)?;
        }
        // Tied output projection: the token table read transposed.
        self.ln_final.forward(&x)?.matmul_transposed(&table, false, true)
    }
}
