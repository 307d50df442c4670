//! Seeded variable initializers. The same seed gives the same bits on every machine: the
//! generator is SplitMix64 and normals come from Box–Muller, both in plain integer and f64
//! arithmetic.

use crate::tensor::{HostArray, HostData, TensorMeta};
use serde::{Deserialize, Serialize};

/// How a variable starts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Init {
    /// All zeros.
    Zeros,
    /// All ones.
    Ones,
    /// Every element the same value.
    Constant(f64),
    /// Normal(mean, std).
    Normal {
        /// Mean.
        mean: f64,
        /// Standard deviation.
        std: f64,
        /// Seed.
        seed: u64,
    },
    /// Uniform on [low, high).
    Uniform {
        /// Lower bound.
        low: f64,
        /// Upper bound.
        high: f64,
        /// Seed.
        seed: u64,
    },
    /// Glorot/Xavier uniform: U(±sqrt(6 / (fan_in + fan_out))).
    Xavier {
        /// Seed.
        seed: u64,
    },
    /// He/Kaiming normal for ReLU: N(0, sqrt(2 / fan_in)).
    Kaiming {
        /// Seed.
        seed: u64,
    },
}

/// SplitMix64: a tiny, well-mixed, reproducible generator.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

/// SplitMix64's increment: its state after `k` draws is the seed plus `k` of these.
const SPLITMIX_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

impl SplitMix64 {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The generator as it is after `draws` more calls of [`SplitMix64::next_u64`], in
    /// O(1): its state only counts.
    pub fn skip(&mut self, draws: u64) {
        self.0 = self.0.wrapping_add(draws.wrapping_mul(SPLITMIX_GAMMA));
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(SPLITMIX_GAMMA);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform on [0, 1) with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box–Muller; one of the pair).
    pub fn next_normal(&mut self) -> f64 {
        let u1 = 1.0 - self.next_f64(); // (0, 1]: ln is finite
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

/// Fan-in and fan-out of a weight: `[fan_in, fan_out]` for matrices (regflow's
/// `x.matmul(w)` convention); for higher ranks the last two dimensions, times the rest.
fn fans(meta: &TensorMeta) -> (f64, f64) {
    let d = meta.shape.dims();
    match d.len() {
        0 => (1.0, 1.0),
        1 => (d[0] as f64, d[0] as f64),
        n => {
            let receptive: usize = d[..n - 2].iter().product();
            ((d[n - 2] * receptive) as f64, (d[n - 1] * receptive) as f64)
        }
    }
}

impl Init {
    /// Checks the initializer fits the variable (floats for random ones).
    pub fn check(&self, meta: &TensorMeta) -> Result<(), String> {
        match self {
            Init::Zeros | Init::Ones | Init::Constant(_) => Ok(()),
            _ if !meta.dtype.is_float() => {
                let name = match self {
                    Init::Normal { .. } => "normal",
                    Init::Uniform { .. } => "uniform",
                    Init::Xavier { .. } => "Xavier",
                    _ => "Kaiming",
                };
                Err(format!("a {name} initializer needs a float variable, not {}", meta.dtype))
            }
            // Written so that NaN parameters are rejected too.
            Init::Normal { std, .. } if std.is_nan() || *std < 0.0 => {
                Err(format!("normal std must be >= 0, got {std}"))
            }
            Init::Uniform { low, high, .. } if low.is_nan() || high.is_nan() || low >= high => {
                Err(format!("uniform needs low < high, got [{low}, {high})"))
            }
            _ => Ok(()),
        }
    }

    /// The initial value. Deterministic for a given seed and shape: element `i` is made
    /// from the generator's draws after those of the `i` elements before it, whether the
    /// elements are drawn in order or, for large tensors, in chunks on several threads.
    pub fn value(&self, meta: &TensorMeta) -> HostArray {
        let n = meta.shape.numel();
        let values: Vec<f64> = match self {
            Init::Zeros => vec![0.0; n],
            Init::Ones => vec![1.0; n],
            Init::Constant(c) => vec![*c; n],
            Init::Normal { mean, std, seed } => drawn(n, *seed, 2, |rng| mean + std * rng.next_normal()),
            Init::Uniform { low, high, seed } => drawn(n, *seed, 1, |rng| low + (high - low) * rng.next_f64()),
            Init::Xavier { seed } => {
                let (fan_in, fan_out) = fans(meta);
                let bound = (6.0 / (fan_in + fan_out)).sqrt();
                drawn(n, *seed, 1, |rng| -bound + 2.0 * bound * rng.next_f64())
            }
            Init::Kaiming { seed } => {
                let (fan_in, _) = fans(meta);
                let std = (2.0 / fan_in).sqrt();
                drawn(n, *seed, 2, |rng| std * rng.next_normal())
            }
        };
        HostArray { shape: meta.shape.clone(), data: HostData::from_f64(meta.dtype, &values) }
    }
}

/// Elements below which a tensor is drawn on one thread.
const PARALLEL_DRAW_MIN: usize = 1 << 18;

/// `n` values of `value`, each taking `draws` draws of one generator seeded `seed`, in
/// order. A large tensor is drawn in chunks on the machine's threads, each chunk's generator
/// skipped past the draws of the chunks before it, so the values are the same bits (GPT-2's
/// 124 M initial values took seconds of a job's build on one thread).
fn drawn(n: usize, seed: u64, draws: u64, value: impl Fn(&mut SplitMix64) -> f64 + Sync) -> Vec<f64> {
    let mut out = vec![0.0; n];
    // (The thread count reads the process's cgroup limits: only asked for where it matters.)
    let threads = if n < PARALLEL_DRAW_MIN { 1 } else { std::thread::available_parallelism().map_or(1, |t| t.get()) };
    let chunk = if threads == 1 { n.max(1) } else { n.div_ceil(threads) };
    std::thread::scope(|scope| {
        for (c, part) in out.chunks_mut(chunk).enumerate() {
            let value = &value;
            let mut fill = move || {
                let mut rng = SplitMix64::new(seed);
                rng.skip((c * chunk) as u64 * draws);
                part.iter_mut().for_each(|v| *v = value(&mut rng));
            };
            if chunk == n {
                fill();
            } else {
                scope.spawn(fill);
            }
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    #[test]
    fn large_tensors_drawn_in_chunks_are_the_bits_one_generator_draws_in_order() {
        let n = 3 * PARALLEL_DRAW_MIN + 7;
        let meta = TensorMeta::new([n], DType::F64);
        type Draw = dyn Fn(&mut SplitMix64) -> f64;
        let cases: [(Init, &Draw); 2] = [
            (Init::Normal { mean: 0.5, std: 2.0, seed: 9 }, &|rng| 0.5 + 2.0 * rng.next_normal()),
            (Init::Uniform { low: -1.0, high: 3.0, seed: 4 }, &|rng| -1.0 + 4.0 * rng.next_f64()),
        ];
        for (init, one) in cases {
            let seed = match init {
                Init::Normal { seed, .. } | Init::Uniform { seed, .. } => seed,
                _ => unreachable!(),
            };
            let mut rng = SplitMix64::new(seed);
            let want: Vec<u64> = (0..n).map(|_| one(&mut rng).to_bits()).collect();
            let got: Vec<u64> = init.value(&meta).to_f64_vec().iter().map(|v| v.to_bits()).collect();
            assert!(
                got == want,
                "{init:?}: the first difference at {:?}",
                got.iter().zip(&want).position(|(a, b)| a != b)
            );
        }
        let mut skipped = SplitMix64::new(5);
        skipped.skip(1000);
        let mut walked = SplitMix64::new(5);
        (0..1000).for_each(|_| {
            walked.next_u64();
        });
        assert_eq!(skipped.next_u64(), walked.next_u64());
    }

    #[test]
    fn initializers_are_seeded_and_scaled() {
        let meta = TensorMeta::new([256, 128], DType::F64);
        let a = Init::Kaiming { seed: 7 }.value(&meta).to_f64_vec();
        assert_eq!(a, Init::Kaiming { seed: 7 }.value(&meta).to_f64_vec());
        assert_ne!(a, Init::Kaiming { seed: 8 }.value(&meta).to_f64_vec());
        let var = a.iter().map(|x| x * x).sum::<f64>() / a.len() as f64;
        assert!((var - 2.0 / 256.0).abs() < 0.1 * 2.0 / 256.0, "{var}");
        let x = Init::Xavier { seed: 1 }.value(&meta).to_f64_vec();
        let bound = (6.0f64 / 384.0).sqrt();
        assert!(x.iter().all(|v| v.abs() <= bound));
        assert!(Init::Normal { mean: 0.0, std: 1.0, seed: 0 }.check(&TensorMeta::new([2], DType::I64)).is_err());
    }
}
