//! Vectorizable `exp` and `tanh` for the kernels whose time goes to them (softmax,
//! cross-entropy, GELU): branch-free polynomial forms for f32, within a few ulp of the
//! standard library's; f64 keeps the standard library's, so f64 gradient checks see the
//! exact functions.

use regflow_plan::Real;

/// `exp` and `tanh` as fast, vectorizable approximations where the type has one.
pub trait FastMath: Real {
    /// e^x (0 below the smallest normal result).
    fn fast_exp(self) -> Self;
    /// Hyperbolic tangent.
    fn fast_tanh(self) -> Self;
}

impl FastMath for f64 {
    #[inline(always)]
    fn fast_exp(self) -> f64 {
        self.exp()
    }

    #[inline(always)]
    fn fast_tanh(self) -> f64 {
        self.tanh()
    }
}

impl FastMath for f32 {
    #[inline(always)]
    fn fast_exp(self) -> f32 {
        exp_f32(self)
    }

    #[inline(always)]
    fn fast_tanh(self) -> f32 {
        tanh_f32(self)
    }
}

/// e^x as `2^n · e^r` with `n = round(x / ln 2)` and a degree-6 polynomial for `e^r`
/// (Cephes' `expf`); 0 below `ln` of the smallest normal f32, +∞ above `ln(f32::MAX)`, and
/// e^88 between 88 and `ln(f32::MAX)` (the kernels using it exponentiate `x - max <= 0`).
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 in two parts, so that `n · ln 2` is exact in the high part.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding and subtracting 1.5·2^23 rounds to the nearest integer without a call.
    const ROUND: f32 = 12_582_912.0;
    const MIN: f32 = -87.336_55;
    const MAX: f32 = 88.722_83;
    let clamped = x.clamp(MIN, 88.0);
    let rounded = clamped * LOG2E + ROUND;
    let n = rounded - ROUND;
    let r = clamped - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_2e-4;
    p = p * r + 1.398_2e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    p = p * r * r + r + 1.0;
    // `n` as an integer is in the low bits of `rounded` (no float-to-int conversion, which
    // would not vectorize): 2^n has exponent bits n + 127.
    let scale = f32::from_bits(rounded.to_bits().wrapping_sub(ROUND.to_bits()).wrapping_add(127) << 23);
    let y = p * scale;
    if x < MIN {
        0.0
    } else if x > MAX {
        f32::INFINITY
    } else {
        y
    }
}

/// tanh(x) as the rational function of degree 13 / 6 that Eigen (and so XLA) uses for
/// f32, clamped where tanh rounds to ±1, and `x` itself near 0.
#[inline(always)]
pub fn tanh_f32(x: f32) -> f32 {
    const CLAMP: f32 = 7.905_311;
    let x_clamped = x.clamp(-CLAMP, CLAMP);
    let x2 = x_clamped * x_clamped;
    let mut p = -2.760_768_5e-16;
    p = p * x2 + 2.000_188e-13;
    p = p * x2 - 8.604_672e-11;
    p = p * x2 + 5.122_297e-8;
    p = p * x2 + 1.485_722_4e-5;
    p = p * x2 + 6.372_619_3e-4;
    p = p * x2 + 4.893_524_6e-3;
    let mut q = 1.198_258_4e-6;
    q = q * x2 + 1.185_347_1e-4;
    q = q * x2 + 2.268_434_6e-3;
    q = q * x2 + 4.893_525e-3;
    let y = x_clamped * p / q;
    if x.abs() < 4e-4 {
        x
    } else {
        y
    }
}

/// Runs `kernel` compiled for AVX-512 (16 floats a vector) where the processor has it and
/// the products may use it (`REGFLOW_CPU_ISA` unset, `auto` or `avx512`: [`isa_in_use`]),
/// else for AVX2 (8 floats instead of SSE2's 4) when the CPU has it, else as the baseline
/// build compiled it. The closure and the `#[inline(always)]` helpers it calls are inlined
/// into the chosen function, so their loops vectorize for it; detection is a cached flag,
/// nothing is allocated. The width changes no bit: Rust does not contract a multiply and an
/// add into an FMA, each element is computed by the same operations at any width, and the
/// reductions keep eight partial sums (`LANES`) in a fixed order.
///
/// [`isa_in_use`]: super::isa::isa_in_use
#[inline(always)]
pub fn vectorized<R>(kernel: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        /// `kernel` inside a function compiled with AVX-512 enabled.
        #[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2")]
        fn run_avx512<R>(kernel: impl FnOnce() -> R) -> R {
            kernel()
        }
        /// `kernel` inside a function compiled with AVX2 enabled.
        #[target_feature(enable = "avx2")]
        fn run_avx2<R>(kernel: impl FnOnce() -> R) -> R {
            kernel()
        }
        if super::isa::isa_in_use().ok() == Some(super::isa::Isa::Avx512)
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512dq")
        {
            // SAFETY: the CPU supports these AVX-512 subsets (checked just above) and AVX2
            // with them.
            return unsafe { run_avx512(kernel) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2 (checked just above).
            return unsafe { run_avx2(kernel) };
        }
    }
    kernel()
}

/// Independent accumulators of the reductions below: a float sum in one accumulator is a
/// chain the compiler may not reorder (nor vectorize); eight chains are eight lanes.
const LANES: usize = 8;

/// `Σ f(i)` over `0..len`, in eight (`LANES`) interleaved partial sums.
#[inline(always)]
pub fn lane_reduce<T: Real>(len: usize, f: impl Fn(usize) -> T) -> T {
    let mut partial = [T::zero(); LANES];
    let full = len / LANES * LANES;
    for base in (0..full).step_by(LANES) {
        for (lane, acc) in partial.iter_mut().enumerate() {
            *acc += f(base + lane);
        }
    }
    let mut total = T::zero();
    for i in full..len {
        total += f(i);
    }
    partial.iter().fold(total, |acc, &p| acc + p)
}

/// `Σ x` in eight (`LANES`) partial sums (vectorizable).
#[inline(always)]
pub fn sum<T: Real>(xs: &[T]) -> T {
    lane_reduce(xs.len(), |i| xs[i])
}

/// `Σ a·b` in eight (`LANES`) partial sums (vectorizable); `b` at least as long as `a`.
#[inline(always)]
pub fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    let b = &b[..a.len()];
    lane_reduce(a.len(), |i| a[i] * b[i])
}

/// The largest of `xs` (the first element if they are all NaN; `None` if empty), in
/// eight (`LANES`) partial maxima.
#[inline(always)]
pub fn max<T: Real>(xs: &[T]) -> Option<T> {
    let &first = xs.first()?;
    let mut partial = [first; LANES];
    let full = xs.len() / LANES * LANES;
    for chunk in xs[..full].chunks_exact(LANES) {
        for (acc, &v) in partial.iter_mut().zip(chunk) {
            *acc = if v > *acc { v } else { *acc };
        }
    }
    let tail = xs[full..].iter().fold(first, |m, &v| if v > m { v } else { m });
    Some(partial.iter().fold(tail, |m, &v| if v > m { v } else { m }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grid() -> impl Iterator<Item = f32> {
        (-200_000..=200_000).map(|i| i as f32 * 1e-4)
    }

    #[test]
    fn exp_f32_is_within_two_ulp_of_std_over_the_normal_range() {
        for x in grid().map(|x| x * 4.0).chain([-87.0, -80.5, 88.0, 0.0]) {
            let (fast, exact) = (exp_f32(x), (x as f64).exp());
            assert!(((fast as f64 - exact) / exact).abs() < 2.5e-7, "exp({x}) = {fast}, expected {exact}");
        }
        assert_eq!(exp_f32(-1e9), 0.0);
        assert_eq!(exp_f32(-100.0), 0.0);
        assert_eq!(exp_f32(1e9), f32::INFINITY);
    }

    #[test]
    fn tanh_f32_is_within_a_few_ulp_of_std() {
        for x in grid().chain([-1e9, 1e9, 1e-6, -3e-4]) {
            let (fast, exact) = (tanh_f32(x), (x as f64).tanh());
            assert!((fast as f64 - exact).abs() < 1e-6 * exact.abs().max(1e-3), "tanh({x}) = {fast}, expected {exact}");
        }
    }
}
