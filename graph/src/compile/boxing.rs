//! Boxing plans: how to turn one n-d layout into another, one mesh axis at a time, and the
//! local (traffic-free) boxing ops.
//!
//! A single-axis step is direct when no other mesh axis splits a dimension the step splits
//! or gathers. Otherwise the parts would nest the wrong way (a finer axis holding parts of
//! parts), so the dependent axes first go to `Broadcast` from the finest to the coarsest,
//! then to their targets from the coarsest to the finest ([`steps`]).

use crate::ops::{GradCtx, InputGrads, OpDef};
use crate::plan::TensorMeta;
use crate::sbp::{part_range, NdSbp, Sbp};
use crate::GraphError;
pub use regflow_plan::ops::{KeepOnFirst, TakePart};

/// One single-axis boxing step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Step {
    /// The mesh axis it converts.
    pub axis: usize,
    /// Layout before the step.
    pub from: NdSbp,
    /// Layout after the step (differs from `from` on `axis` only).
    pub to: NdSbp,
}

/// Dimensions a layout entry splits.
fn split_dim(s: Sbp) -> Option<usize> {
    match s {
        Sbp::Split(d) => Some(d),
        _ => None,
    }
}

/// Single-axis conversions with a direct implementation (one collective or one local op).
fn direct(from: Sbp, to: Sbp) -> bool {
    !matches!((from, to), (Sbp::Split(_), Sbp::Partial))
}

/// The steps from `from` to `to` on a mesh of `shape`. Axes of size 1 need none.
pub(crate) fn steps(from: &NdSbp, to: &NdSbp, shape: &[usize]) -> Vec<Step> {
    let n = shape.len();
    let mut current = from.clone();
    let mut out = Vec::new();
    let mut push = |current: &mut NdSbp, axis: usize, sbp: Sbp| {
        if current.0[axis] != sbp {
            let mut next = current.clone();
            next.0[axis] = sbp;
            out.push(Step { axis, from: current.clone(), to: next.clone() });
            *current = next;
        }
    };
    let changing: Vec<usize> = (0..n).filter(|&k| shape[k] > 1 && from.0[k] != to.0[k]).collect();
    let touched = |k: usize| -> Vec<usize> { [from.0[k], to.0[k]].into_iter().filter_map(split_dim).collect() };
    // Independent axes: no other axis splits (before or after) a dimension they touch.
    let independent = |k: usize| {
        let mine = touched(k);
        (0..n).filter(|&j| j != k && shape[j] > 1).all(|j| touched(j).iter().all(|d| !mine.contains(d)))
    };
    let mut dependent = Vec::new();
    for &k in &changing {
        if independent(k) {
            if direct(from.0[k], to.0[k]) {
                push(&mut current, k, to.0[k]);
            } else {
                push(&mut current, k, Sbp::Broadcast);
                push(&mut current, k, to.0[k]);
            }
        } else {
            dependent.push(k);
        }
    }
    if dependent.is_empty() {
        return out;
    }
    // Closure: a finer axis that splits a dimension a dependent axis splits or will split
    // must be gathered first and re-split after.
    let mut through_broadcast = vec![false; n];
    for &k in &dependent {
        through_broadcast[k] = true;
    }
    loop {
        let mut grew = false;
        for k in 0..n {
            if !through_broadcast[k] {
                continue;
            }
            let dims = touched(k);
            for j in k + 1..n {
                if !through_broadcast[j] && shape[j] > 1 && split_dim(current.0[j]).is_some_and(|d| dims.contains(&d)) {
                    through_broadcast[j] = true;
                    grew = true;
                }
            }
        }
        if !grew {
            break;
        }
    }
    for k in (0..n).rev().filter(|&k| through_broadcast[k]) {
        push(&mut current, k, Sbp::Broadcast);
    }
    for k in (0..n).filter(|&k| through_broadcast[k]) {
        push(&mut current, k, to.0[k]);
    }
    out
}

/// What one collective costs beyond its bytes, in bytes: an in-process rendezvous takes
/// about 45 µs however small the tensor, the time a collective needs to move about 1 MiB
/// (`bench_collectives`). Without it, three small collectives in a row look cheaper than
/// one all-reduce, and each waits on the one before, so nothing overlaps.
pub(crate) const COLLECTIVE_LATENCY_BYTES: f64 = 1024.0 * 1024.0;

/// Bytes a single-axis conversion moves for a tensor of `bytes` over `p` devices (the
/// costs signature choice compares): `S -> B` and `P -> S` move T(p-1), `P -> B` 2T(p-1),
/// `S(i) -> S(j)` T(p-1)/p, local slices nothing; each collective adds its latency.
pub(crate) fn axis_cost(from: Sbp, to: Sbp, bytes: f64, p: usize) -> f64 {
    let p1 = (p as f64) - 1.0;
    let moved = match (from, to) {
        _ if from == to || p <= 1 => return 0.0,
        (Sbp::Broadcast, _) | (Sbp::Partial, Sbp::Partial) => return 0.0,
        (Sbp::Split(_), Sbp::Broadcast) | (Sbp::Partial, Sbp::Split(_)) | (Sbp::Split(_), Sbp::Partial) => bytes * p1,
        (Sbp::Partial, Sbp::Broadcast) => 2.0 * bytes * p1,
        (Sbp::Split(_), Sbp::Split(_)) => bytes * p1 / p as f64,
    };
    moved + COLLECTIVE_LATENCY_BYTES
}

/// Bytes an n-d conversion moves (sum over the axes that change).
pub(crate) fn cost(from: &NdSbp, to: &NdSbp, bytes: f64, shape: &[usize]) -> f64 {
    from.0.iter().zip(&to.0).zip(shape).map(|((&f, &t), &p)| axis_cost(f, t, bytes, p)).sum()
}

fn no_grad<'g>(op: &str) -> Result<InputGrads<'g>, GraphError> {
    Err(GraphError::NoGradient { op: op.into(), index: 0 })
}

impl OpDef for TakePart {
    fn name(&self) -> &'static str {
        "take_part"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let [x] = inputs else { return Err(format!("takes 1 input, got {}", inputs.len())) };
        let mut shape = x.shape.clone();
        let len = shape.0.get_mut(self.dim).ok_or_else(|| format!("dim {} out of range for {x}", self.dim))?;
        *len = part_range(*len, self.parts, self.index).len();
        Ok(vec![TensorMeta { shape, dtype: x.dtype }])
    }

    fn grad<'g>(&self, _ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        no_grad(self.name())
    }
}

impl OpDef for KeepOnFirst {
    fn name(&self) -> &'static str {
        "keep_on_first"
    }

    fn infer(&self, inputs: &[TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        let [x] = inputs else { return Err(format!("takes 1 input, got {}", inputs.len())) };
        Ok(vec![x.clone()])
    }

    fn grad<'g>(&self, _ctx: &GradCtx<'g>) -> Result<InputGrads<'g>, GraphError> {
        no_grad(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Sbp::{Broadcast as B, Partial as P, Split as S};

    #[test]
    fn independent_axes_convert_directly() {
        let s = steps(&NdSbp(vec![P, S(0)]), &NdSbp(vec![B, S(0)]), &[2, 2]);
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].axis, 0);
        let s = steps(&NdSbp(vec![S(0), S(1)]), &NdSbp(vec![S(1), S(0)]), &[2, 2]);
        // Both axes touch dims 0 and 1: gather the finer first, then re-split in order.
        let axes: Vec<usize> = s.iter().map(|s| s.axis).collect();
        assert_eq!(axes, vec![1, 0, 0, 1]);
        assert_eq!(s.last().map(|s| s.to.clone()), Some(NdSbp(vec![S(1), S(0)])));
    }

    #[test]
    fn split_to_partial_goes_through_broadcast() {
        let s = steps(&NdSbp(vec![S(0)]), &NdSbp(vec![P]), &[3]);
        assert_eq!(s.iter().map(|s| s.to.0[0]).collect::<Vec<_>>(), vec![B, P]);
    }

    #[test]
    fn size_one_axes_need_nothing() {
        assert!(steps(&NdSbp(vec![S(0), P]), &NdSbp(vec![S(0), B]), &[2, 1]).is_empty());
    }
}
