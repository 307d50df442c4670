//! CPU kernels of `embedding` ops.

use crate::host::{HostCompute, HostContext};
use regflow_plan::ops::*;
use regflow_plan::{HostTensor, HostTensorMut, Real, TensorMeta};

impl HostCompute for VocabPart {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        if self.grad {
            scatter(&self.rows, inputs, outputs)
        } else {
            gather(&self.rows, inputs, outputs)
        }
    }
}

impl HostCompute for Embedding {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        gather(&Rows::all(inputs[0].shape.dims()[0]), inputs, outputs)
    }
}

impl HostCompute for EmbeddingGrad {
    fn compute(
        &self,
        _context: &HostContext,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), String> {
        scatter(&Rows::all(self.vocab_size), inputs, outputs)?;
        match inputs.get(2) {
            // Each element as an `add` of the two would give it (a 16-bit base arrives
            // widened to f32, as an add's operand does).
            Some(base) => {
                by_float!(outputs[0].dtype(), "integer tables are not supported", T => add_base::<T>(base, &mut outputs[0]))
            }
            None => Ok(()),
        }
    }

    fn check(&self, inputs: &[TensorMeta], outputs: &[TensorMeta]) -> Result<(), String> {
        EmbeddingGrad::check(self, inputs, outputs)
    }
}

/// `out += base`, element by element, over `out`'s rows (the first of `base`'s).
fn add_base<T: Real>(base: &HostTensor<'_>, out: &mut HostTensorMut<'_>) -> Result<(), String> {
    let base = base.as_slice::<T>()?;
    let out = out.as_mut_slice::<T>()?;
    let Some(base) = base.get(..out.len()) else {
        return Err(format!("a base of {} elements cannot be added to a table of {}", base.len(), out.len()));
    };
    for (o, &b) in out.iter_mut().zip(base) {
        *o += b;
    }
    Ok(())
}

fn gather(rows: &Rows, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
    by_float!(outputs[0].dtype(), "integer tables are not supported", T => gather_typed::<T>(rows, inputs, &mut outputs[0]))
}

fn scatter(rows: &Rows, inputs: &[HostTensor<'_>], outputs: &mut [HostTensorMut<'_>]) -> Result<(), String> {
    by_float!(outputs[0].dtype(), "integer tables are not supported", T => scatter_typed::<T>(rows, inputs, &mut outputs[0]))
}

fn gather_typed<T: Real>(rows: &Rows, inputs: &[HostTensor<'_>], out: &mut HostTensorMut<'_>) -> Result<(), String> {
    let (table, ids) = (inputs[0].as_slice::<T>()?, inputs[1].as_slice::<i64>()?);
    let features = inputs[0].shape.dims()[1];
    let out = out.as_mut_slice::<T>()?;
    for i in 0..ids.len() {
        let dst = &mut out[i * features..(i + 1) * features];
        match rows.local(ids, i)? {
            Some(r) => dst.copy_from_slice(&table[r * features..(r + 1) * features]),
            None => dst.fill(T::zero()),
        }
    }
    Ok(())
}

fn scatter_typed<T: Real>(rows: &Rows, inputs: &[HostTensor<'_>], out: &mut HostTensorMut<'_>) -> Result<(), String> {
    let (ids, dy) = (inputs[0].as_slice::<i64>()?, inputs[1].as_slice::<T>()?);
    let features = out.shape.dims()[1];
    let out = out.as_mut_slice::<T>()?;
    out.fill(T::zero());
    for i in 0..ids.len() {
        let Some(r) = rows.local(ids, i)? else { continue };
        for (o, &d) in out[r * features..(r + 1) * features].iter_mut().zip(&dy[i * features..(i + 1) * features]) {
            *o += d;
        }
    }
    Ok(())
}
