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

impl SplitMix64 {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
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

    /// The initial value. Deterministic for a given seed and shape.
    pub fn value(&self, meta: &TensorMeta) -> HostArray {
        let n = meta.shape.numel();
        let values: Vec<f64> = match self {
            Init::Zeros => vec![0.0; n],
            Init::Ones => vec![1.0; n],
            Init::Constant(c) => vec![*c; n],
            Init::Normal { mean, std, seed } => {
                let mut rng = SplitMix64::new(*seed);
                (0..n).map(|_| mean + std * rng.next_normal()).collect()
            }
            Init::Uniform { low, high, seed } => {
                let mut rng = SplitMix64::new(*seed);
                (0..n).map(|_| low + (high - low) * rng.next_f64()).collect()
            }
            Init::Xavier { seed } => {
                let (fan_in, fan_out) = fans(meta);
                let bound = (6.0 / (fan_in + fan_out)).sqrt();
                let mut rng = SplitMix64::new(*seed);
                (0..n).map(|_| -bound + 2.0 * bound * rng.next_f64()).collect()
            }
            Init::Kaiming { seed } => {
                let (fan_in, _) = fans(meta);
                let std = (2.0 / fan_in).sqrt();
                let mut rng = SplitMix64::new(*seed);
                (0..n).map(|_| std * rng.next_normal()).collect()
            }
        };
        HostArray { shape: meta.shape.clone(), data: HostData::from_f64(meta.dtype, &values) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

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
