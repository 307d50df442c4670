//! regflow patch (not in upstream gemm-common 0.19.0): a process-wide cap on the
//! instruction set that the real-type dispatch of `gemm_def!` (f32, f64, f16) picks on x86,
//! so that a test or a benchmark can run the AVX2 or the scalar kernels on a machine that
//! has AVX-512. A cap never raises the level past what the CPU has. Without a cap the
//! dispatch is upstream's, cached once; under a cap it is decided again on every call
//! (the CPU feature checks are cached by `std`), so a cap takes effect at once. The complex
//! types' dispatch and other architectures are unchanged.

use core::sync::atomic::{AtomicU8, Ordering};

/// An instruction-set level of the x86 kernels, lowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdLevel {
    /// No SIMD: the portable kernels.
    Scalar = 1,
    /// x86-64-v3: AVX2 and FMA (pulp's `V3`), 256-bit vectors.
    V3 = 2,
    /// x86-64-v4: AVX-512 (pulp's `V4`, with the `x86-v4` feature), 512-bit vectors.
    V4 = 3,
}

/// No cap: upstream's dispatch.
const UNCAPPED: u8 = 0;

static CAP: AtomicU8 = AtomicU8::new(UNCAPPED);

/// Caps the level the real-type dispatch picks from now on (`None`: upstream's choice).
pub fn force_simd_level(level: Option<SimdLevel>) {
    CAP.store(level.map_or(UNCAPPED, |level| level as u8), Ordering::Relaxed);
}

/// The cap set by [`force_simd_level`], if any.
pub fn forced_simd_level() -> Option<SimdLevel> {
    match CAP.load(Ordering::Relaxed) {
        1 => Some(SimdLevel::Scalar),
        2 => Some(SimdLevel::V3),
        3 => Some(SimdLevel::V4),
        _ => None,
    }
}

/// Whether the dispatch may pick `level` (no cap, or a cap at or above it).
#[doc(hidden)]
#[inline]
pub fn allows(level: SimdLevel) -> bool {
    let cap = CAP.load(Ordering::Relaxed);
    cap == UNCAPPED || level as u8 <= cap
}

/// The level the real-type dispatch picks now, on x86 (`None` on other architectures).
pub fn simd_level() -> Option<SimdLevel> {
    #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
    {
        #[cfg(feature = "x86-v4")]
        if allows(SimdLevel::V4) && crate::feature_detected!("avx512f") {
            return Some(SimdLevel::V4);
        }
        if allows(SimdLevel::V3) && crate::feature_detected!("fma") {
            Some(SimdLevel::V3)
        } else {
            Some(SimdLevel::Scalar)
        }
    }
    #[cfg(not(any(target_arch = "x86", target_arch = "x86_64")))]
    None
}
