//! Attributes of `dropout` ops.

use crate::{Shape, SplitMix64};
use serde::{Deserialize, Serialize};

/// `x · mask / (1 - p)`, where element `i` is kept iff the `i`-th output of
/// `SplitMix64::new(seed)` is at least `p · 2^64` (kept with probability `1 - p`).
///
/// The mask is counter-based: any element's bit is computed from `(seed, i)` alone, so
/// a device kernel can draw it in parallel, and no mask tensor is stored. The op is its
/// own adjoint: the gradient is `dropout(dy)` with the same `p` and `seed`. Split over
/// devices, each draws its elements' bits at their logical indices (the offsets its part
/// starts at), so the parts drop exactly what the whole tensor would.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Dropout {
    /// Probability of dropping an element, in `[0, 1)`.
    pub p: f64,
    /// Seed of the mask.
    pub seed: u64,
}

/// One device's part of a [`Dropout`] whose input is split: the mask of each local element
/// is drawn at its logical index, so the parts together drop what the whole would.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DropoutPart {
    /// The whole tensor's dropout (its rate and seed).
    pub dropout: Dropout,
    /// Shape of the logical tensor.
    pub logical: Shape,
    /// Where this device's part starts in each logical dimension.
    pub offsets: Vec<usize>,
}

impl Dropout {
    /// Whether element `index` is kept.
    pub fn keeps(&self, index: usize) -> bool {
        // The saturating float-to-int cast maps p in [0, 1) into 0..2^64.
        let threshold = (self.p * 18_446_744_073_709_551_616.0) as u64;
        SplitMix64::new(self.seed.wrapping_add((index as u64).wrapping_mul(GAMMA))).next_u64() >= threshold
    }
}

impl DropoutPart {
    /// The logical index of element `i` of a local part of shape `local`.
    pub fn logical_index(&self, local: &Shape, i: usize) -> usize {
        let (strides, dims) = (self.logical.strides(), local.dims());
        let mut rest = i;
        let mut index = 0;
        for d in (0..dims.len()).rev() {
            index += (rest % dims[d] + self.offsets[d]) * strides[d];
            rest /= dims[d];
        }
        index
    }
}

/// SplitMix64's increment: state `seed + (i + 1)·GAMMA` gives the stream's `i`-th output.
pub const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;
