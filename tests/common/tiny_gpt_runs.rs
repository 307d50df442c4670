//! The tiny GPT's training step and runs of it for comparisons bit for bit
//! (`folded_casts.rs`, `folded_table_grads.rs`, `folded_norms.rs`): its batches (each token's successor is
//! its id + 1, so the loss falls; ids repeat within a batch), the losses' bits and every
//! variable's final value, and two steps to their end on dry-run CUDA devices. A test file
//! that uses it declares `mod gpt` (`examples/common/gpt.rs`) at its root too.
#![allow(dead_code)] // each test file uses some of it

use crate::gpt::{Gpt, GptConfig};
use regflow::graph::sbp::{Mesh, NdSbp, Sbp};
use regflow::graph::{CompiledGraph, DType, Graph, HostArray, Optimizer, Precision, SplitMix64, TrainStep};
use regflow::prelude::*;

/// The tiny GPT both fold tests train: 2 blocks of width 16 (2 heads, an MLP of 32) over
/// 8 tokens of a 13-token vocabulary, batches of 4, 4 steps.
pub(crate) const RUNS: Runs = Runs {
    config: GptConfig {
        d_model: 16,
        heads: 2,
        layers: 2,
        context: 8,
        mlp_width: 32,
        fused_attention: false,
        apart_qkv: false,
    },
    vocab: 13,
    batch: 4,
    steps: 4,
    seed: 7,
};

/// The model and what the runs feed: `batch` rows of `config.context` ids of a
/// `vocab`-token vocabulary, for `steps` steps, drawn from `seed`.
pub(crate) struct Runs {
    pub(crate) config: GptConfig,
    pub(crate) vocab: usize,
    pub(crate) batch: usize,
    pub(crate) steps: usize,
    pub(crate) seed: u64,
}

impl Runs {
    /// The step (AdamW, gradients clipped to norm 1) in `precision` (f32 without one), the
    /// vocabulary padded to a multiple of `pad` (1: not padded), the batch split over
    /// `mesh`'s devices.
    pub(crate) fn step<'g>(
        &self,
        g: &'g Graph,
        mesh: &Mesh,
        precision: Option<Precision>,
        pad: usize,
    ) -> TrainStep<'g> {
        if let Some(precision) = precision {
            g.mixed_precision(precision).unwrap();
        }
        let context = self.config.context;
        let model = Gpt::new(g, self.config, self.vocab).unwrap().pad_vocab(pad);
        let mask = g.causal_mask(context, DType::F32).unwrap();
        let ids = g.input("ids", [self.batch, context], DType::I64).unwrap();
        let targets = g.input("targets", [self.batch * context], DType::I64).unwrap();
        g.set_layout(mask, mesh, NdSbp(vec![Sbp::Broadcast])).unwrap();
        for t in [ids, targets] {
            g.set_layout(t, mesh, NdSbp(vec![Sbp::Split(0)])).unwrap();
        }
        let loss = model.loss(&model.logits(&ids, &mask).unwrap(), &targets).unwrap();
        g.minimize(loss, &Optimizer::adamw(3e-3, 1e-4).with_clip_norm(1.0)).unwrap()
    }

    /// Trains `apart` on one thread (its loss must fall) and `folded` on one thread and on
    /// two: the folded plan must give the unfolded one's losses and variables, bit for bit.
    pub(crate) fn assert_same_bits(&self, folded: &CompiledGraph, apart: &CompiledGraph, what: &str) {
        let want = self.train(apart, 1);
        assert!(f64::from_bits(want.0[self.steps - 1]) < f64::from_bits(want.0[0]), "{what}: {:?}", want.0);
        for threads in [1, 2] {
            assert_eq!(self.train(folded, threads), want, "{what}, {threads} threads");
        }
    }

    /// Losses (as bits) and every variable's final value after the steps of `compiled` on
    /// `threads` threads per device.
    pub(crate) fn train(&self, compiled: &CompiledGraph, threads: usize) -> (Vec<u64>, Vec<(String, HostArray)>) {
        let mut job = Job::builder(compiled.plan.clone()).cpu_threads(threads).keep_state().build().unwrap();
        let mut feeds = job.graph_feeds().unwrap();
        let losses = job.graph_fetcher(&compiled.fetches[0]).unwrap();
        let mut rng = SplitMix64::new(self.seed);
        let tokens = self.batch * self.config.context;
        let mut got = Vec::new();
        for _ in 0..self.steps {
            let ids: Vec<i64> = (0..tokens).map(|_| (rng.next_u64() % self.vocab as u64) as i64).collect();
            let targets: Vec<i64> = ids.iter().map(|&id| (id + 1) % self.vocab as i64).collect();
            feeds.push("ids", &HostArray::i64([self.batch, self.config.context], ids).unwrap()).unwrap();
            feeds.push("targets", &HostArray::i64([tokens], targets).unwrap()).unwrap();
            got.push(losses.recv_scalar().unwrap().unwrap().to_bits());
        }
        feeds.close().unwrap();
        drop((feeds, losses));
        let report = job.wait().unwrap();
        (got, report.state.unwrap())
    }

    /// Two steps of `compiled` (on dry-run CUDA devices: every kernel built and every
    /// launch checked, nothing computed) run to their end.
    pub(crate) fn run_dry(&self, compiled: &CompiledGraph) {
        let mut job = Job::builder(compiled.plan.clone()).build().unwrap();
        let mut feeds = job.graph_feeds().unwrap();
        let losses = job.graph_fetcher(&compiled.fetches[0]).unwrap();
        let tokens = self.batch * self.config.context;
        for _ in 0..2 {
            feeds.push("ids", &HostArray::i64([self.batch, self.config.context], vec![1; tokens]).unwrap()).unwrap();
            feeds.push("targets", &HostArray::i64([tokens], vec![2; tokens]).unwrap()).unwrap();
            losses.recv_scalar().unwrap().unwrap();
        }
        drop((feeds, losses));
        job.wait().unwrap();
    }
}

/// The 16-bit dtype of `precision`, f32 without one.
pub(crate) fn low(precision: Option<Precision>) -> DType {
    match precision {
        Some(Precision::F16) => DType::F16,
        Some(_) => DType::Bf16,
        None => DType::F32,
    }
}
