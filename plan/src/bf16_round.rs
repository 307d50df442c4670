//! f64 → bf16 and f64 → f16 correctly rounded, which `half`'s `from_f64` are not.
//!
//! `half` drops the low 32 mantissa bits of the f64 before it rounds, so a value just above
//! a halfway point between two bf16 values can land exactly on it and round to even (down):
//! 7.5156250001 gives 7.5 where 7.53125 is nearest. The CUDA cast rounds correctly, and the
//! two devices must agree bit for bit, so every f64 → bf16 conversion goes through here.

use half::{bf16, f16};

/// `x` rounded to the nearest bf16, ties to even; NaN stays NaN, out-of-range values go
/// to ±infinity.
///
/// Rounds to f32 toward zero with a sticky last bit (round-to-odd), then to bf16 to
/// nearest even: f32 keeps 16 more bits than bf16, so the sticky bit decides ties exactly
/// as the infinitely precise value would.
pub fn bf16_from_f64(x: f64) -> bf16 {
    if !x.is_finite() {
        return bf16::from_f64(x);
    }
    bf16::from_f32(f32_round_to_odd(x))
}

/// `x` rounded to the nearest f16, ties to even; NaN stays NaN, values past 65504 (after
/// rounding) go to ±infinity. The same two steps as [`bf16_from_f64`]: f32 keeps 13 more
/// bits than f16, subnormal f16 values included.
pub fn f16_from_f64(x: f64) -> f16 {
    if !x.is_finite() {
        return f16::from_f64(x);
    }
    f16::from_f32(f32_round_to_odd(x))
}

/// `x` rounded to f32 toward zero, its last bit set when that was inexact (round-to-odd):
/// rounding this to any format at least two bits narrower than f32 gives what rounding `x`
/// itself would.
fn f32_round_to_odd(x: f64) -> f32 {
    let mut f = x as f32;
    if f64::from(f).abs() > x.abs() {
        // Rounded away from zero (possibly to infinity): one step back toward zero.
        f = f32::from_bits(f.to_bits() - 1);
    }
    if f64::from(f) != x {
        f = f32::from_bits(f.to_bits() | 1);
    }
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_values_just_past_a_midpoint_round_up_and_large_ones_overflow() {
        // 1 + 2^-11 is halfway between 1 and 1 + 2^-10 (f16's step at 1).
        let half_step = 1.0 + 2f64.powi(-11);
        assert_eq!(f16_from_f64(half_step).to_f64(), 1.0, "a tie rounds to even");
        assert_eq!(f16_from_f64(half_step + 1e-12).to_f64(), 1.0 + 2f64.powi(-10));
        assert_eq!(f16_from_f64(-(half_step + 1e-12)).to_f64(), -(1.0 + 2f64.powi(-10)));
        assert_eq!(f16_from_f64(65504.0).to_f64(), 65504.0);
        assert_eq!(f16_from_f64(65520.0), f16::INFINITY, "past the largest finite value after rounding");
        assert!(f16_from_f64(f64::NAN).is_nan());
        // Subnormal: 2^-24 is f16's smallest step.
        assert_eq!(f16_from_f64(1.5 * 2f64.powi(-24) + 1e-20).to_f64(), 2f64.powi(-23));
    }

    #[test]
    fn values_just_past_a_midpoint_round_up() {
        // 7.515625 is halfway between 7.5 and 7.53125.
        let above = 7.515625 + 1e-12;
        assert_eq!(bf16_from_f64(above).to_f64(), 7.53125);
        assert_eq!(bf16_from_f64(-above).to_f64(), -7.53125);
        assert_eq!(bf16_from_f64(7.515625 - 1e-12).to_f64(), 7.5);
        // An exact tie goes to even.
        assert_eq!(bf16_from_f64(7.515625).to_f64(), 7.5);
    }

    #[test]
    fn f32_values_round_as_from_f32_does() {
        let mut rng = crate::SplitMix64::new(3);
        for _ in 0..100_000 {
            let v = f32::from_bits((rng.next_u64() >> 32) as u32);
            if v.is_finite() {
                assert_eq!(bf16_from_f64(f64::from(v)).to_bits(), bf16::from_f32(v).to_bits(), "{v:e}");
            }
        }
    }

    #[test]
    fn specials_and_range_ends() {
        assert!(bf16_from_f64(f64::NAN).is_nan());
        assert_eq!(bf16_from_f64(f64::INFINITY), bf16::INFINITY);
        assert_eq!(bf16_from_f64(1e300), bf16::INFINITY);
        assert_eq!(bf16_from_f64(-1e300), bf16::NEG_INFINITY);
        assert_eq!(bf16_from_f64(0.0).to_bits(), 0);
        assert_eq!(bf16_from_f64(-0.0).to_bits(), 0x8000);
        assert_eq!(bf16_from_f64(1e-300).to_bits(), 0);
    }
}
