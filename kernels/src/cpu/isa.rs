//! Which instruction set the CPU matrix products run on: the widest the processor has by
//! default (AVX-512, else AVX2 with FMA, else scalar), or a lower one forced by
//! [`force_isa`] or the `REGFLOW_CPU_ISA` environment variable, so that the AVX2 and scalar
//! kernels stay tested on AVX-512 machines and a benchmark can compare the widths.
//!
//! The choice is process-wide (it caps gemm's own dispatch, through the workspace's patch
//! of gemm-common) and never raises the level past what the processor has. It does not
//! reach OpenBLAS (the `blas` backend, [`gemm_backend`](super::gemm_backend)), which
//! dispatches by itself: `OPENBLAS_CORETYPE=Haswell` forces its AVX2 kernels.

use gemm_common::isa::{self as gemm_isa, SimdLevel};
use std::sync::OnceLock;

/// The environment variable read once, at the first matrix product: `avx512`, `avx2` or
/// `scalar` caps the instruction set; unset or `auto` leaves the widest.
pub const ISA_VARIABLE: &str = "REGFLOW_CPU_ISA";

/// An instruction-set level of the CPU matrix products, lowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// No SIMD: the portable kernels. Non-x86 processors report this level too, whatever
    /// their vector unit (the caps apply to x86 only).
    Scalar,
    /// AVX2 with FMA (x86-64-v3), 8 f32 lanes.
    Avx2,
    /// AVX-512 (x86-64-v4), 16 f32 lanes.
    Avx512,
}

impl Isa {
    /// The `REGFLOW_CPU_ISA` spelling: `scalar`, `avx2` or `avx512`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// f32 values in one vector register at this level.
    pub fn f32_lanes(self) -> usize {
        match self {
            Isa::Scalar => 1,
            Isa::Avx2 => 8,
            Isa::Avx512 => 16,
        }
    }

    /// The level named `name` (`scalar`, `avx2`, `avx512`), `None` for `auto`, or why not.
    pub fn parse(name: &str) -> Result<Option<Isa>, String> {
        match name.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(None),
            "scalar" => Ok(Some(Isa::Scalar)),
            "avx2" => Ok(Some(Isa::Avx2)),
            "avx512" => Ok(Some(Isa::Avx512)),
            other => Err(format!("{ISA_VARIABLE}={other:?}: expected auto, avx512, avx2 or scalar")),
        }
    }

    fn level(self) -> SimdLevel {
        match self {
            Isa::Scalar => SimdLevel::Scalar,
            Isa::Avx2 => SimdLevel::V3,
            Isa::Avx512 => SimdLevel::V4,
        }
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Caps the instruction set of every later matrix product in the process at `isa`
/// (`None`: the widest the processor has). Overrides `REGFLOW_CPU_ISA`.
pub fn force_isa(isa: Option<Isa>) {
    // Read (and so settle) the variable first, so that it cannot override this later.
    let _ = from_environment();
    gemm_isa::force_simd_level(isa.map(Isa::level));
}

/// The instruction set the next matrix product runs on (after `REGFLOW_CPU_ISA`).
pub fn isa_in_use() -> Result<Isa, String> {
    from_environment()?;
    Ok(match gemm_isa::simd_level() {
        Some(SimdLevel::V4) => Isa::Avx512,
        Some(SimdLevel::V3) => Isa::Avx2,
        Some(SimdLevel::Scalar) | None => Isa::Scalar,
    })
}

/// Applies `REGFLOW_CPU_ISA` the first time it is called; every call reports whether its
/// value was valid. Matrix products call it, so the variable holds from the first one.
pub fn from_environment() -> Result<(), String> {
    static APPLIED: OnceLock<Result<(), String>> = OnceLock::new();
    APPLIED
        .get_or_init(|| {
            let Ok(value) = std::env::var(ISA_VARIABLE) else { return Ok(()) };
            let isa = Isa::parse(&value)?;
            gemm_isa::force_simd_level(isa.map(Isa::level));
            Ok(())
        })
        .clone()
}
