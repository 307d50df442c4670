//! A plain MLP for serving, shared by `serve_http`, `bench_serve` and `tests/serve_http.rs`:
//! `relu(x·w1 + b1)·w2 + b2 …`, one `w{k}`/`b{k}` pair per layer, the names
//! `examples/train_digits.rs` saves its checkpoint under, so a trained checkpoint loads into
//! it (its sizes are read from the checkpoint).

use regflow::graph::{CompileOptions, DType, Graph, GraphError, HostArray, Init};
use regflow::plan::{HostData, Plan};
use std::path::Path;

/// The layer widths, input first: `[784, 1024, 1024, 10]` is a 784-input MLP with two
/// hidden layers of 1024 and 10 outputs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MlpShape {
    pub(crate) widths: Vec<usize>,
}

impl MlpShape {
    /// Parses `784,1024,1024,10`.
    #[allow(dead_code)] // not every user parses widths
    pub(crate) fn parse(text: &str) -> Result<Self, String> {
        let widths: Vec<usize> = text
            .split(',')
            .map(|w| w.trim().parse::<usize>().map_err(|e| format!("layer width '{w}': {e}")))
            .collect::<Result<_, _>>()?;
        if widths.len() < 2 || widths.contains(&0) {
            return Err(format!("an MLP needs at least two non-zero widths (input, output), got '{text}'"));
        }
        Ok(Self { widths })
    }

    /// The widths of the `w1, w2, …` of a checkpoint saved by `train_digits`.
    #[allow(dead_code)] // not every user loads checkpoints
    pub(crate) fn of_checkpoint(path: &Path) -> Result<Self, String> {
        let tensors = regflow::graph::checkpoint::load(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut widths = Vec::new();
        for layer in 1.. {
            let Some((_, w)) = tensors.iter().find(|(name, _)| *name == format!("w{layer}")) else { break };
            let dims = w.shape.dims();
            if dims.len() != 2 || (!widths.is_empty() && widths.last() != Some(&dims[0])) {
                return Err(format!(
                    "{}: w{layer} is {:?}, which does not follow the layer before",
                    path.display(),
                    dims
                ));
            }
            if widths.is_empty() {
                widths.push(dims[0]);
            }
            widths.push(dims[1]);
        }
        if widths.is_empty() {
            return Err(format!("{}: no MLP weights (w1, b1, w2, …) in this checkpoint", path.display()));
        }
        Ok(Self { widths })
    }

    /// The inputs of a request: `x` of `[rows, widths[0]]`.
    pub(crate) fn features(&self) -> usize {
        self.widths[0]
    }

    /// The logits' width.
    #[allow(dead_code)] // not every user reads it
    pub(crate) fn classes(&self) -> usize {
        self.widths[self.widths.len() - 1]
    }

    /// The forward plan for batches of `batch` rows: input `x`, one output (the logits);
    /// weights seeded (Kaiming), biases zero, unless a checkpoint or preloads replace them.
    pub(crate) fn plan(&self, batch: usize) -> Result<Plan, GraphError> {
        self.plan_with(batch, &CompileOptions::default())
    }

    /// [`MlpShape::plan`] compiled with `options` (e.g. fewer input registers, so fewer
    /// sealed pieces wait in the plan while a server could still batch requests together).
    pub(crate) fn plan_with(&self, batch: usize, options: &CompileOptions) -> Result<Plan, GraphError> {
        let g = Graph::new();
        let mut h = g.input("x", [batch, self.features()], DType::F32)?;
        let layers = self.widths.len() - 1;
        for (k, pair) in self.widths.windows(2).enumerate() {
            let w = g.variable(
                &format!("w{}", k + 1),
                [pair[0], pair[1]],
                DType::F32,
                Init::Kaiming { seed: k as u64 + 1 },
            )?;
            let b = g.variable(&format!("b{}", k + 1), [pair[1]], DType::F32, Init::Zeros)?;
            h = h.matmul(&w)?.add(&b)?;
            if k + 1 < layers {
                h = h.relu()?;
            }
        }
        Ok(g.compile(&[h], &[], options)?.plan)
    }

    /// Deterministic weights (small, varied values) for every variable, to preload instead
    /// of a checkpoint, so a test can compute the same model another way.
    #[allow(dead_code)] // not every user preloads
    pub(crate) fn weights(&self) -> Vec<(String, HostArray)> {
        let mut out = Vec::new();
        for (k, pair) in self.widths.windows(2).enumerate() {
            let (rows, cols) = (pair[0], pair[1]);
            let scale = 1.0 / (rows as f32).sqrt();
            let w = (0..rows * cols).map(|i| (((i * 7 + k * 3) % 17) as f32 - 8.0) / 8.0 * scale).collect();
            let b = (0..cols).map(|i| ((i % 5) as f32 - 2.0) / 20.0).collect();
            out.push((format!("w{}", k + 1), HostArray { shape: [rows, cols].into(), data: HostData::F32(w) }));
            out.push((format!("b{}", k + 1), HostArray { shape: [cols].into(), data: HostData::F32(b) }));
        }
        out
    }
}

/// One deterministic input row of `features` values in [0, 1), different per `seed`.
#[allow(dead_code)] // not every user makes inputs
pub(crate) fn input_row(features: usize, seed: u64) -> Vec<f32> {
    let mut rng = regflow::graph::SplitMix64::new(seed);
    (0..features).map(|_| (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32).collect()
}
