//! CPU kernel of the `cast` op: every float dtype pair (f32, f64, bf16, f16), narrowing by
//! rounding to nearest even (`half` for bf16 and f16, the IEEE conversion for f64 → f32;
//! an f16 past 65504 becomes infinity). bf16 ↔ f16 goes through f32, which holds both
//! exactly, so it rounds once.

use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::{Cast, CastGroup};
use regflow_plan::{bf16, f16, HostSlice, HostSliceMut, HostTensor, HostTensorMut, TensorMeta};

impl HostCompute for Cast {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        let (input, out) = (&inputs[0], &mut outputs[0]);
        let (from, to) = (input.dtype(), out.dtype());
        macro_rules! map {
            ($x:expr, $o:expr, $f:expr) => {{
                if $x.len() != $o.len() {
                    return Err(format!("{} input elements for {} outputs (broken invariant)", $x.len(), $o.len()));
                }
                for (o, &v) in $o.iter_mut().zip($x.iter()) {
                    *o = $f(v);
                }
            }};
        }
        match (input.data, &mut out.data) {
            (HostSlice::F32(x), HostSliceMut::F32(o)) => map!(x, o, |v| v),
            (HostSlice::F32(x), HostSliceMut::F64(o)) => map!(x, o, f64::from),
            (HostSlice::F32(x), HostSliceMut::Bf16(o)) => map!(x, o, bf16::from_f32),
            (HostSlice::F64(x), HostSliceMut::F32(o)) => map!(x, o, |v| v as f32),
            (HostSlice::F64(x), HostSliceMut::F64(o)) => map!(x, o, |v| v),
            (HostSlice::F64(x), HostSliceMut::Bf16(o)) => map!(x, o, regflow_plan::bf16_from_f64),
            (HostSlice::Bf16(x), HostSliceMut::F32(o)) => map!(x, o, bf16::to_f32),
            (HostSlice::Bf16(x), HostSliceMut::F64(o)) => map!(x, o, bf16::to_f64),
            (HostSlice::Bf16(x), HostSliceMut::Bf16(o)) => map!(x, o, |v| v),
            (HostSlice::F32(x), HostSliceMut::F16(o)) => map!(x, o, f16::from_f32),
            (HostSlice::F64(x), HostSliceMut::F16(o)) => map!(x, o, regflow_plan::f16_from_f64),
            (HostSlice::F16(x), HostSliceMut::F32(o)) => map!(x, o, f16::to_f32),
            (HostSlice::F16(x), HostSliceMut::F64(o)) => map!(x, o, f16::to_f64),
            (HostSlice::F16(x), HostSliceMut::F16(o)) => map!(x, o, |v| v),
            (HostSlice::Bf16(x), HostSliceMut::F16(o)) => map!(x, o, |v: bf16| f16::from_f32(v.to_f32())),
            (HostSlice::F16(x), HostSliceMut::Bf16(o)) => map!(x, o, |v: f16| bf16::from_f32(v.to_f32())),
            _ => return Err(format!("casts between float dtypes only, got {from} to {to}")),
        }
        Ok(())
    }

    fn check(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Result<(), String> {
        match (inputs, outputs) {
            ([input], [out]) if input.shape == out.shape && out.dtype == self.to && input.dtype.is_float() => Ok(()),
            ([input], [out]) => Err(format!("casts {input} to {}, but the output is {out}", self.to)),
            _ => Err(format!("takes 1 input and gives 1 output, but has {} and {}", inputs.len(), outputs.len())),
        }
    }

    /// Converts bf16 and f16 itself (widening them first would round twice for f64 → bf16).
    fn half_native(&self) -> bool {
        true
    }
}

impl HostCompute for CastGroup {
    /// Each member as its own [`Cast`]: the same bits.
    fn compute(
        &self,
        context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        let cast = Cast { to: self.to };
        for (m, (input, output)) in inputs.iter().zip(outputs.iter_mut()).enumerate() {
            cast.compute(context, std::slice::from_ref(input), std::slice::from_mut(output))
                .map_err(|e| format!("member {m}: {e}"))?;
        }
        Ok(())
    }

    fn check(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Result<(), String> {
        let members = self.members as usize;
        if members == 0 || inputs.len() != members || outputs.len() != members {
            return Err(format!(
                "groups {members} cast(s), one input and one output each, but has {} inputs and {} outputs",
                inputs.len(),
                outputs.len()
            ));
        }
        let cast = Cast { to: self.to };
        for (m, (input, output)) in inputs.iter().zip(outputs).enumerate() {
            cast.check(std::slice::from_ref(input), std::slice::from_ref(output))
                .map_err(|e| format!("member {m}: {e}"))?;
        }
        Ok(())
    }

    fn half_native(&self) -> bool {
        true
    }
}
