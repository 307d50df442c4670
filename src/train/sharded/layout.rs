//! Parts into wholes: copying a part's rows into its place in a whole tensor, marking the
//! elements it covers, and describing the elements no part covered.

use regflow_plan::{HostArray, HostData};

/// The contiguous runs of a part of shape `part` at `offsets` in a row-major whole of
/// shape `whole`: `(start in the whole, start in the part, length)`.
fn runs(whole: &[usize], offsets: &[usize], part: &[usize]) -> Vec<(usize, usize, usize)> {
    let Some((&inner, outer)) = part.split_last() else {
        return vec![(0, 0, 1)];
    };
    if part.contains(&0) {
        return Vec::new();
    }
    let mut strides = vec![1usize; whole.len()];
    for d in (0..whole.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * whole[d + 1];
    }
    let rows: usize = outer.iter().product();
    let mut index = vec![0usize; outer.len()];
    let mut out = Vec::with_capacity(rows);
    for row in 0..rows {
        let start: usize = offsets
            .iter()
            .zip(index.iter().chain(std::iter::once(&0)))
            .zip(&strides)
            .map(|((o, i), s)| (o + i) * s)
            .sum();
        out.push((start, row * inner, inner));
        for d in (0..outer.len()).rev() {
            index[d] += 1;
            if index[d] < outer[d] {
                break;
            }
            index[d] = 0;
        }
    }
    out
}

/// Copies `part` into `whole` at `offsets` (which the caller checked it fits, with the
/// same dtype) and marks its elements in `covered`.
pub(super) fn copy_into(whole: &mut HostArray, covered: &mut [bool], offsets: &[usize], part: &HostArray) {
    let runs = runs(whole.shape.dims(), offsets, part.shape.dims());
    fn copy<T: Copy>(into: &mut [T], from: &[T], runs: &[(usize, usize, usize)]) {
        for &(at, from_at, len) in runs {
            into[at..at + len].copy_from_slice(&from[from_at..from_at + len]);
        }
    }
    match (&mut whole.data, &part.data) {
        (HostData::F32(into), HostData::F32(from)) => copy(into, from, &runs),
        (HostData::F64(into), HostData::F64(from)) => copy(into, from, &runs),
        (HostData::I64(into), HostData::I64(from)) => copy(into, from, &runs),
        (HostData::Bf16(into), HostData::Bf16(from)) => copy(into, from, &runs),
        (HostData::F16(into), HostData::F16(from)) => copy(into, from, &runs),
        _ => panic!(
            "copy_into: a {:?} part into a {:?} whole (the caller checks the dtypes)",
            part.dtype(),
            whole.dtype()
        ),
    }
    for &(at, _, len) in &runs {
        covered[at..at + len].fill(true);
    }
}

/// When some element of a whole of shape `dims` is not `covered`: the box that holds all
/// such elements (`[0..2, 8..16]`) and how many they are.
pub(super) fn uncovered(dims: &[usize], covered: &[bool]) -> Option<(String, usize)> {
    let missing = covered.iter().filter(|&&c| !c).count();
    if missing == 0 {
        return None;
    }
    let mut low = vec![usize::MAX; dims.len()];
    let mut high = vec![0usize; dims.len()];
    let mut index = vec![0usize; dims.len()];
    for &is_covered in covered {
        if !is_covered {
            for d in 0..dims.len() {
                low[d] = low[d].min(index[d]);
                high[d] = high[d].max(index[d] + 1);
            }
        }
        for d in (0..dims.len()).rev() {
            index[d] += 1;
            if index[d] < dims[d] {
                break;
            }
            index[d] = 0;
        }
    }
    let ranges: Vec<String> = low.iter().zip(&high).map(|(l, h)| format!("{l}..{h}")).collect();
    Some((format!("[{}]", ranges.join(", ")), missing))
}

#[cfg(test)]
mod tests {
    use super::{copy_into, uncovered};
    use regflow_plan::{DType, HostArray, TensorMeta};

    #[test]
    fn a_part_lands_in_its_place_and_the_rest_is_reported_uncovered() {
        let mut whole = HostArray::zeros(&TensorMeta::new([3, 4], DType::F32));
        let mut covered = vec![false; 12];
        let part = HostArray::f32([2, 2], vec![1.0, 2.0, 3.0, 4.0]).unwrap();
        copy_into(&mut whole, &mut covered, &[1, 2], &part);
        assert_eq!(whole.to_f64_vec(), [0., 0., 0., 0., 0., 0., 1., 2., 0., 0., 3., 4.]);
        assert_eq!(uncovered(&[3, 4], &covered), Some(("[0..3, 0..4]".to_string(), 8)));
        let left = HostArray::f32([3, 2], vec![9.0; 6]).unwrap();
        copy_into(&mut whole, &mut covered, &[0, 0], &left);
        assert_eq!(uncovered(&[3, 4], &covered), Some(("[0..1, 2..4]".to_string(), 2)));
        copy_into(&mut whole, &mut covered, &[0, 2], &HostArray::f32([1, 2], vec![5.0, 6.0]).unwrap());
        assert_eq!(uncovered(&[3, 4], &covered), None);
    }

    #[test]
    fn a_scalar_is_one_run() {
        let mut whole = HostArray::zeros(&TensorMeta::new(Vec::<usize>::new(), DType::I64));
        let mut covered = vec![false];
        copy_into(&mut whole, &mut covered, &[], &HostArray::i64(Vec::<usize>::new(), vec![7]).unwrap());
        assert_eq!(whole.to_f64_vec(), [7.0]);
        assert_eq!(uncovered(&[], &covered), None);
    }
}
