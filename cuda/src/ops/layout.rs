//! Index maps of the strided kernels, computed on the host when a kernel is made: the
//! [`Indexing`] struct passed by value to `elementwise.cu` and `movement.cu`, and the
//! broadcast, permutation and reduction layouts built from shapes.

use regflow_kernels::cpu::axes;

/// The most dimensions an [`Indexing`] holds (`MAX_RANK` in the sources). Higher ranks are
/// refused when the kernel is made (after merging dimensions, so few real tensors reach it).
pub(crate) const MAX_RANK: usize = 8;

/// How a grid-stride loop index maps to element offsets: linear index `i`, row-major over
/// `dims[..rank]`, is at `Σ k_d·a[d]` in one operand and `Σ k_d·b[d]` in another.
///
/// Layout (the C `struct Indexing` in `elementwise.cu` and `movement.cu`): `rank`, then
/// `dims`, `a` and `b`, each [`MAX_RANK`] `u64`s; 200 bytes, 8-byte aligned, no padding.
/// Unused trailing entries are 0.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Indexing {
    /// Dimensions used.
    pub(crate) rank: u64,
    /// The iterated shape.
    pub(crate) dims: [u64; MAX_RANK],
    /// Element strides of the first operand (0 on broadcast dimensions).
    pub(crate) a: [u64; MAX_RANK],
    /// Element strides of the second operand (or, for `dropout_part`, the part's offsets).
    pub(crate) b: [u64; MAX_RANK],
}

impl Indexing {
    /// The map over `dims` with strides `a` and `b` (as many as `dims`), or why not: a rank
    /// above [`MAX_RANK`].
    pub(crate) fn new(dims: &[usize], a: &[usize], b: &[usize]) -> Result<Self, String> {
        if dims.len() > MAX_RANK {
            return Err(format!(
                "the CUDA kernels index at most {MAX_RANK} dimensions, but this one needs {} ({dims:?})",
                dims.len()
            ));
        }
        let mut s = Self { rank: dims.len() as u64, dims: [0; MAX_RANK], a: [0; MAX_RANK], b: [0; MAX_RANK] };
        for (d, ((&n, &sa), &sb)) in dims.iter().zip(a).zip(b).enumerate() {
            (s.dims[d], s.a[d], s.b[d]) = (n as u64, sa as u64, sb as u64);
        }
        Ok(s)
    }

    /// The offsets of linear index `i` in both operands, as the kernels compute them (for
    /// tests of the host-side layouts).
    #[cfg(test)]
    pub(crate) fn offsets(&self, mut i: u64) -> (u64, u64) {
        let (mut a, mut b) = (0, 0);
        for d in (0..self.rank as usize).rev() {
            let k = i % self.dims[d];
            i /= self.dims[d];
            a += k * self.a[d];
            b += k * self.b[d];
        }
        (a, b)
    }
}

/// `dims` with strides `a` and `b` merged where the kernels can walk two dimensions as one
/// (each operand's outer stride is its inner stride times the inner size) and without
/// size-1 dimensions: the same map from linear index to offsets, with fewer divisions per
/// element and fewer ranks refused. Returns (dims, a, b).
pub(crate) fn coalesce(dims: &[usize], a: &[usize], b: &[usize]) -> (Vec<usize>, Vec<usize>, Vec<usize>) {
    let (mut od, mut oa, mut ob): (Vec<usize>, Vec<usize>, Vec<usize>) = (Vec::new(), Vec::new(), Vec::new());
    for ((&n, &sa), &sb) in dims.iter().zip(a).zip(b) {
        if n == 1 {
            continue;
        }
        let last = od.len().wrapping_sub(1);
        if !od.is_empty() && oa[last] == sa * n && ob[last] == sb * n {
            // The merged dimension steps like the inner one.
            (od[last], oa[last], ob[last]) = (od[last] * n, sa, sb);
        } else {
            od.push(n);
            oa.push(sa);
            ob.push(sb);
        }
    }
    (od, oa, ob)
}

/// The map of an output of dimensions `out` reading operands of dimensions `a` and `b`
/// broadcast to it (numpy rules; `out` must be their broadcast), coalesced.
pub(crate) fn broadcast(out: &[usize], a: &[usize], b: &[usize]) -> Result<Indexing, String> {
    let (sa, sb) = (axes::broadcast_strides(a, out), axes::broadcast_strides(b, out));
    let (dims, sa, sb) = coalesce(out, &sa, &sb);
    Indexing::new(&dims, &sa, &sb)
}

/// The map of a permutation: output axis `d` is input axis `perm[d]` of an input of
/// dimensions `input`; `a` holds the input's strides in output order, coalesced.
pub(crate) fn permutation(input: &[usize], perm: &[usize]) -> Result<Indexing, String> {
    let strides = axes::strides(input);
    let dims: Vec<usize> = perm.iter().map(|&p| input[p]).collect();
    let a: Vec<usize> = perm.iter().map(|&p| strides[p]).collect();
    let (dims, a, b) = coalesce(&dims, &a, &vec![0; a.len()]);
    Indexing::new(&dims, &a, &b)
}

/// How `sum_to` walks an input of dimensions `input` to sum it down to `out` (which
/// broadcasts to `input`): the kept dimensions (the output's, with the input's strides)
/// and the reduced ones (with theirs), each coalesced, and their element counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reduction {
    /// Output element `o` starts at `kept.offsets(o).0` of the input.
    pub(crate) kept: Indexing,
    /// Its summands are at `reduced.offsets(k).0` from there, `k` in `0..reduced_count`.
    pub(crate) reduced: Indexing,
    /// Output elements.
    pub(crate) kept_count: u64,
    /// Summands per output element.
    pub(crate) reduced_count: u64,
}

/// The [`Reduction`] summing `input` down to `out`, or why `out` does not broadcast to it.
pub(crate) fn reduction(input: &[usize], out: &[usize]) -> Result<Reduction, String> {
    if out.len() > input.len() {
        return Err(format!("cannot sum {input:?} down to {out:?}: the target has a higher rank"));
    }
    let offset = input.len() - out.len();
    let strides = axes::strides(input);
    let (mut kept, mut kept_strides, mut reduced, mut reduced_strides) = (vec![], vec![], vec![], vec![]);
    for (d, &n) in input.iter().enumerate() {
        let target = if d < offset { 1 } else { out[d - offset] };
        if target == n {
            kept.push(n);
            kept_strides.push(strides[d]);
        } else if target == 1 {
            reduced.push(n);
            reduced_strides.push(strides[d]);
        } else {
            return Err(format!(
                "cannot sum {input:?} down to {out:?}: dimension {d} is {n} in one, {target} in the other"
            ));
        }
    }
    let count = |dims: &[usize]| dims.iter().product::<usize>() as u64;
    let (kept_count, reduced_count) = (count(&kept), count(&reduced));
    let (kd, ka, kb) = coalesce(&kept, &kept_strides, &vec![0; kept.len()]);
    let (rd, ra, rb) = coalesce(&reduced, &reduced_strides, &vec![0; reduced.len()]);
    Ok(Reduction {
        kept: Indexing::new(&kd, &ka, &kb)?,
        reduced: Indexing::new(&rd, &ra, &rb)?,
        kept_count,
        reduced_count,
    })
}

/// A tensor of dimensions `dims` seen around `axis` as (`outer`, `inner`): the products of
/// the dimensions before and after it (the CPU's `AxisBlocks`).
pub(crate) fn around_axis(dims: &[usize], axis: usize) -> (u64, u64) {
    let outer: usize = dims[..axis].iter().product();
    let inner: usize = dims[axis + 1..].iter().product();
    (outer as u64, inner as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use regflow_plan::Shape;

    /// Every (output, a, b) offset triple of a broadcast, as the CPU walks it.
    fn cpu_broadcast(out: &[usize], a: &[usize], b: &[usize]) -> Vec<(usize, usize)> {
        let mut v = Vec::new();
        regflow_kernels::cpu::binary::for_each_broadcast(out, a, b, |o, ia, ib| {
            assert_eq!(o, v.len());
            v.push((ia, ib));
        });
        v
    }

    #[test]
    fn the_struct_has_the_c_layout() {
        assert_eq!(std::mem::size_of::<Indexing>(), 8 * (1 + 3 * MAX_RANK));
        assert_eq!(std::mem::align_of::<Indexing>(), 8);
        assert_eq!(std::mem::offset_of!(Indexing, dims), 8);
        assert_eq!(std::mem::offset_of!(Indexing, a), 8 + 8 * MAX_RANK);
        assert_eq!(std::mem::offset_of!(Indexing, b), 8 + 16 * MAX_RANK);
    }

    #[test]
    fn the_prelude_declares_the_struct_once_for_every_source() {
        let prelude = crate::sources::PRELUDE;
        assert!(prelude.contains(&format!("#define MAX_RANK {MAX_RANK}\n")));
        assert_eq!(prelude.matches("struct Indexing {").count(), 1);
        for source in crate::sources::SOURCES {
            assert!(!source.code.contains("struct Indexing {"), "{} declares its own Indexing", source.name);
            assert!(!source.code.contains("#define MAX_RANK"), "{} defines its own MAX_RANK", source.name);
        }
    }

    #[test]
    fn broadcast_maps_agree_with_the_cpu_walk() {
        let cases: &[(&[usize], &[usize])] = &[
            (&[2, 3, 4], &[4]),
            (&[2, 3, 4], &[3, 1]),
            (&[1], &[5, 1, 7]),
            (&[2, 1, 4], &[1, 3, 1]),
            (&[], &[3, 2]),
            (&[6, 5], &[6, 5]),
            (&[2, 1, 3, 1, 2, 1, 2, 1, 2, 1], &[2, 1, 3, 1, 2, 1, 2, 1, 2, 1]),
        ];
        for &(a, b) in cases {
            let out = Shape::broadcast(&Shape::new(a), &Shape::new(b)).expect("broadcasts");
            let s = broadcast(out.dims(), a, b).expect("fits");
            let expected = cpu_broadcast(out.dims(), a, b);
            let got: Vec<(usize, usize)> =
                (0..out.numel() as u64).map(|i| s.offsets(i)).map(|(x, y)| (x as usize, y as usize)).collect();
            assert_eq!(got, expected, "{a:?} with {b:?}");
        }
    }

    #[test]
    fn coalescing_merges_what_is_contiguous_and_drops_ones() {
        // [B, T, H] + [H]: two dimensions, a contiguous and a bias row.
        let s = broadcast(&[4, 5, 6], &[4, 5, 6], &[6]).expect("fits");
        assert_eq!((s.rank, &s.dims[..2], &s.a[..2], &s.b[..2]), (2, &[20, 6][..], &[6, 1][..], &[0, 1][..]));
        // Rank 10 with ones coalesces below the limit; rank 9 without ones is refused.
        assert!(broadcast(&[2; 9], &[2; 9], &[2; 9]).is_ok(), "contiguous merges to one dimension");
        let a: Vec<usize> = (0..9).map(|d| if d % 2 == 0 { 2 } else { 1 }).collect();
        let b: Vec<usize> = (0..9).map(|d| if d % 2 == 0 { 1 } else { 2 }).collect();
        let e = broadcast(&[2; 9], &a, &b).unwrap_err();
        assert!(e.contains("at most 8 dimensions, but this one needs 9"), "{e}");
    }

    #[test]
    fn permutations_read_the_input_where_the_cpu_does() {
        let input = [2, 3, 4, 5];
        let perm = [2, 0, 3, 1];
        let s = permutation(&input, &perm).expect("fits");
        let strides = axes::strides(&input);
        let out_dims: Vec<usize> = perm.iter().map(|&p| input[p]).collect();
        let out_strides = axes::strides(&out_dims);
        for i in 0..120u64 {
            // Output index -> coordinates -> input offset by hand.
            let mut rest = i as usize;
            let mut offset = 0;
            for d in 0..4 {
                let k = rest / out_strides[d];
                rest %= out_strides[d];
                offset += k * strides[perm[d]];
            }
            assert_eq!(s.offsets(i).0 as usize, offset, "element {i}");
        }
        // The identity is one contiguous dimension.
        let id = permutation(&input, &[0, 1, 2, 3]).expect("fits");
        assert_eq!((id.rank, id.dims[0], id.a[0]), (1, 120, 1));
    }

    #[test]
    fn reductions_visit_each_summand_once_in_input_order() {
        let cases: &[(&[usize], &[usize])] = &[
            (&[2, 3, 4], &[4]),
            (&[2, 3, 4], &[3, 1]),
            (&[2, 3, 4], &[]),
            (&[2, 3, 4], &[2, 3, 4]),
            (&[5, 1, 3], &[1, 1]),
        ];
        for &(input, out) in cases {
            let r = reduction(input, out).expect("reduces");
            let n: usize = input.iter().product();
            let mut seen = vec![0; n];
            let mut last_for_output = vec![None; r.kept_count as usize];
            for o in 0..r.kept_count {
                for k in 0..r.reduced_count {
                    let at = (r.kept.offsets(o).0 + r.reduced.offsets(k).0) as usize;
                    seen[at] += 1;
                    // Summands of one output come in increasing input order (the CPU's).
                    let last = &mut last_for_output[o as usize];
                    assert!(last.is_none_or(|l| l < at), "{input:?} -> {out:?}");
                    *last = Some(at);
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "{input:?} -> {out:?}: {seen:?}");
            // And output o gets the summands the CPU's broadcast walk gives it.
            let mut expected = vec![Vec::new(); r.kept_count as usize];
            regflow_kernels::cpu::binary::for_each_broadcast(input, input, out, |i, _, o| expected[o].push(i));
            for (o, summands) in expected.iter().enumerate() {
                let got: Vec<usize> = (0..r.reduced_count)
                    .map(|k| (r.kept.offsets(o as u64).0 + r.reduced.offsets(k).0) as usize)
                    .collect();
                assert_eq!(&got, summands, "{input:?} -> {out:?}, output {o}");
            }
        }
        assert!(reduction(&[2, 3], &[2]).unwrap_err().contains("dimension 1 is 3 in one, 2 in the other"));
        assert!(reduction(&[3], &[1, 3]).unwrap_err().contains("higher rank"));
    }

    #[test]
    fn axis_blocks_split_a_shape() {
        assert_eq!(around_axis(&[2, 3, 4], 0), (1, 12));
        assert_eq!(around_axis(&[2, 3, 4], 1), (2, 4));
        assert_eq!(around_axis(&[2, 3, 4], 2), (6, 1));
    }
}
