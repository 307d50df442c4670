//! What one member of a collective computes: shapes checked into byte sizes, then sums in
//! rank order and copies of parts, reading every member's input.

use super::Peers;
use regflow_plan::part_range;
use regflow_plan::DType;
use regflow_plan::{CollectiveConf, CollectiveOp};

/// All-reduces of at least this many bytes run as a reduce-scatter then an all-gather
/// ([`Layout::two_step`]).
pub(super) const TWO_STEP_MIN_BYTES: usize = 256 * 1024;

/// One group member's view of what the group computes; validated, with byte sizes.
#[derive(Debug, Clone)]
pub(super) struct Layout {
    op: CollectiveOp,
    dtype: DType,
    shape: Vec<usize>,
    pub(super) size: usize,
    pub(super) rank: usize,
    pub(super) input_bytes: usize,
    pub(super) output_bytes: usize,
    /// Where this member's own part lies in its output, for an all-gather along dimension 0
    /// ([`CollectiveConf::own_part_bytes`], in this machine's sizes); `None` otherwise.
    pub(super) own_part: Option<std::ops::Range<usize>>,
}

impl Layout {
    pub(super) fn new(conf: &CollectiveConf) -> Result<Self, String> {
        if conf.size == 0 {
            return Err("size is 0".into());
        }
        if conf.rank >= conf.size {
            return Err(format!("rank {} is not below size {}", conf.rank, conf.size));
        }
        let dims = match conf.op {
            op if op.is_bucket() && op.parts() == 0 => return Err("a bucket of 0 tensors".into()),
            op => match op.flat() {
                CollectiveOp::ReduceScatter { dim } | CollectiveOp::AllGather { dim } => vec![dim],
                CollectiveOp::AllToAll { from, to } => vec![from, to],
                _ => vec![],
            },
        };
        if let Some(dim) = dims.into_iter().find(|&d| d >= conf.shape.len()) {
            return Err(format!("dimension {dim} is out of range for shape {:?}", conf.shape));
        }
        let bytes = |shape: &[usize]| {
            shape.iter().try_fold(conf.dtype.size(), |acc, &d| acc.checked_mul(d)).ok_or_else(|| {
                format!("shape {:?} of {} has more bytes than this machine can address", conf.shape, conf.dtype)
            })
        };
        Ok(Self {
            // A bucket is, to the group, one collective of its parts end to end.
            op: conf.op.flat(),
            dtype: conf.dtype,
            shape: conf.shape.clone(),
            size: conf.size as usize,
            rank: conf.rank as usize,
            input_bytes: bytes(&conf.input_shape())?,
            output_bytes: bytes(&conf.output_shape())?,
            own_part: conf
                .own_part_bytes()
                .and_then(|r| Some(usize::try_from(r.start).ok()?..usize::try_from(r.end).ok()?)),
        })
    }

    /// Shape seen as `(outer, shape[dim], inner)`, inner in bytes.
    fn around(&self, dim: usize) -> (usize, usize, usize) {
        let outer = self.shape[..dim].iter().product();
        let inner = self.shape[dim + 1..].iter().product::<usize>() * self.dtype.size();
        (outer, self.shape[dim], inner)
    }

    /// The element type, when the group is an all-reduce: its output is the elementwise
    /// sum of the inputs, so any byte range of it can be computed on its own.
    pub(super) fn all_reduce(&self) -> Option<DType> {
        matches!(self.op, CollectiveOp::AllReduce).then_some(self.dtype)
    }

    /// Whether this member's all-reduce runs as a reduce-scatter then an all-gather
    /// between its round's barriers (module docs of `collective`): a group of more than one
    /// and a tensor of at least [`TWO_STEP_MIN_BYTES`], where a middle barrier costs less
    /// than the reads it saves.
    pub(super) fn two_step(&self) -> bool {
        self.all_reduce().is_some() && self.size > 1 && self.output_bytes >= TWO_STEP_MIN_BYTES
    }

    /// The bytes of this member's part of a two-step all-reduce's output (`rank`'s share of
    /// the elements).
    fn part_bytes(&self, rank: usize) -> std::ops::Range<usize> {
        let width = self.dtype.size();
        let elements = part_range(self.output_bytes / width, self.size, rank);
        elements.start * width..elements.end * width
    }

    /// A two-step all-reduce: sums this member's part of every input into its part of the
    /// output, waits for every member at a middle barrier, then copies every other part from
    /// its owner's output. Each element is summed once, in rank order, as [`sum_into`] does.
    ///
    /// # Safety
    /// `output` points to this member's `output_bytes`-long output, published in the round
    /// (`Rendezvous::round_with_outputs`), borrowed mutably for the whole round and written
    /// only through this pointer while the round lasts.
    pub(super) unsafe fn all_reduce_in_two_steps(&self, peers: Peers<'_>, output: *mut u8) {
        let write = |range: std::ops::Range<usize>| {
            // SAFETY: `range` lies in the output (caller's contract); this member writes its
            // own part before the middle barrier and other parts after it, and peers read only
            // its own part, only after the barrier: the writes never overlap a read.
            unsafe { std::slice::from_raw_parts_mut(output.add(range.start), range.len()) }
        };
        let mine = self.part_bytes(self.rank);
        sum_into(self.dtype, write(mine.clone()), self.size, |r| &peers.input(r)[mine.clone()]);
        peers.barrier();
        for r in (0..self.size).filter(|&r| r != self.rank) {
            let part = self.part_bytes(r);
            write(part.clone()).copy_from_slice(peers.output(r, part));
        }
    }

    /// An all-gather along dimension 0 whose own part is in place already: copies every
    /// other member's input to its part of the output.
    ///
    /// # Safety
    /// `output` points to this member's `output_bytes`-long output, written only through this
    /// pointer during the round; peers read only its own part, which is not written here.
    pub(super) unsafe fn gather_others(&self, peers: Peers<'_>, output: *mut u8) {
        let (_, len, inner) = self.around(0);
        for r in (0..self.size).filter(|&r| r != self.rank) {
            let part = part_range(len, self.size, r);
            // SAFETY: the part lies in the output (parts tile dimension 0) and is not the own
            // part, the only bytes of the output anybody else reads during the round.
            let (target, source) = (unsafe { output.add(part.start * inner) }, peers.input(r));
            // Members that hold the output once for the process (`RegstDesc::home`): the
            // peer's part is already there, written in place by its update.
            if std::ptr::eq(target.cast_const(), source.as_ptr()) {
                continue;
            }
            // SAFETY: as above; the peer's input is another buffer.
            let target = unsafe { std::slice::from_raw_parts_mut(target, part.len() * inner) };
            target.copy_from_slice(source);
        }
    }

    /// Computes this member's output from every member's input.
    pub(super) fn compute(&self, peers: Peers<'_>, output: &mut [u8]) {
        match self.op {
            // `Layout::new` keeps a bucket's flat op, so buckets never reach this match; they
            // are listed with the all-reduce only to make it exhaustive.
            CollectiveOp::AllReduce
            | CollectiveOp::AllReduceBucket { .. }
            | CollectiveOp::ReduceScatterBucket { .. }
            | CollectiveOp::AllGatherBucket { .. } => sum_into(self.dtype, output, self.size, |r| peers.input(r)),
            CollectiveOp::ReduceScatter { dim } => {
                let (outer, len, inner) = self.around(dim);
                let part = part_range(len, self.size, self.rank);
                let run = part.len() * inner;
                for o in 0..outer {
                    let at = (o * len + part.start) * inner;
                    let out = &mut output[o * run..(o + 1) * run];
                    sum_into(self.dtype, out, self.size, |r| &peers.input(r)[at..at + run]);
                }
            }
            CollectiveOp::AllGather { dim } => {
                let (outer, len, inner) = self.around(dim);
                for r in 0..self.size {
                    let part = part_range(len, self.size, r);
                    let (run, input) = (part.len() * inner, peers.input(r));
                    for o in 0..outer {
                        let at = (o * len + part.start) * inner;
                        output[at..at + run].copy_from_slice(&input[o * run..(o + 1) * run]);
                    }
                }
            }
            CollectiveOp::AllToAll { from, to } if from == to => output.copy_from_slice(peers.input(self.rank)),
            CollectiveOp::AllToAll { from, to } => {
                for r in 0..self.size {
                    self.copy_block(from, to, r, peers.input(r), output);
                }
            }
        }
    }

    /// All-to-all: copies the block of rank `r`'s input (its part along `from`) that lies
    /// in this member's part along `to`. The shape is seen as `(a, n1, b, n2, c)` around
    /// the two dimensions, and the block is copied in runs contiguous along the later one.
    fn copy_block(&self, from: usize, to: usize, r: usize, input: &[u8], output: &mut [u8]) {
        // Per dimension: the block's range (global coordinates), and where that dimension
        // starts and how long it is in the input and in the output.
        let along = |dim: usize, rank: usize, input_side: bool| {
            let range = part_range(self.shape[dim], self.size, rank);
            let (whole, local) = ((0, self.shape[dim]), (range.start, range.len()));
            let (input_extent, output_extent) = if input_side { (local, whole) } else { (whole, local) };
            (range, input_extent, output_extent)
        };
        let (first, second) = (from.min(to), from.max(to));
        let (from_dim, to_dim) = (along(from, r, true), along(to, self.rank, false));
        let (d1, d2) = if from < to { (from_dim, to_dim) } else { (to_dim, from_dim) };
        let a: usize = self.shape[..first].iter().product();
        let b: usize = self.shape[first + 1..second].iter().product();
        let c = self.shape[second + 1..].iter().product::<usize>() * self.dtype.size();
        let run = d2.0.len() * c;
        if run == 0 {
            return;
        }
        let at = |ia: usize, g1: usize, ib: usize, (start1, len1): (usize, usize), (start2, len2): (usize, usize)| {
            (((ia * len1 + g1 - start1) * b + ib) * len2 + d2.0.start - start2) * c
        };
        for ia in 0..a {
            for g1 in d1.0.clone() {
                for ib in 0..b {
                    let source = at(ia, g1, ib, d1.1, d2.1);
                    let target = at(ia, g1, ib, d1.2, d2.2);
                    output[target..target + run].copy_from_slice(&input[source..source + run]);
                }
            }
        }
    }
}

/// An element type a collective sums.
trait Element: bytemuck::Pod {
    fn add(self, other: Self) -> Self;
    fn read(bytes: &[u8]) -> Self;
    fn write(self, bytes: &mut [u8]);
}

macro_rules! element {
    ($t:ty, $add:expr) => {
        impl Element for $t {
            fn add(self, other: Self) -> Self {
                $add(self, other)
            }
            fn read(bytes: &[u8]) -> Self {
                let mut word = [0u8; std::mem::size_of::<$t>()];
                word.copy_from_slice(&bytes[..std::mem::size_of::<$t>()]);
                <$t>::from_le_bytes(word)
            }
            fn write(self, bytes: &mut [u8]) {
                bytes.copy_from_slice(&self.to_le_bytes());
            }
        }
    };
}

element!(f32, |x: f32, y: f32| x + y);
element!(f64, |x: f64, y: f64| x + y);
// Integer sums wrap, as on every accelerator, instead of panicking in debug builds.
element!(i64, i64::wrapping_add);
// bf16 summands add in f32 and round once per addition (mixed precision keeps its
// all-reduced weight gradients f32; this serves a plan that reduces bf16 anyway).
element!(regflow_plan::bf16, |x: regflow_plan::bf16, y: regflow_plan::bf16| regflow_plan::bf16::from_f32(
    x.to_f32() + y.to_f32()
));
// f16 likewise (an overflow to infinity is what loss scaling looks for).
element!(regflow_plan::f16, |x: regflow_plan::f16, y: regflow_plan::f16| regflow_plan::f16::from_f32(
    x.to_f32() + y.to_f32()
));

/// `out = ((input(0) + input(1)) + input(2)) + ...`, elementwise, in rank order.
pub(super) fn sum_into<'a>(dtype: DType, out: &mut [u8], count: usize, input: impl Fn(usize) -> &'a [u8]) {
    match dtype {
        DType::F32 => sum_typed::<f32>(out, count, input),
        DType::F64 => sum_typed::<f64>(out, count, input),
        DType::I64 => sum_typed::<i64>(out, count, input),
        DType::Bf16 => sum_typed::<regflow_plan::bf16>(out, count, input),
        DType::F16 => sum_typed::<regflow_plan::f16>(out, count, input),
    }
}

fn sum_typed<'a, T: Element>(out: &mut [u8], count: usize, input: impl Fn(usize) -> &'a [u8]) {
    if count == 1 {
        out.copy_from_slice(input(0));
        return;
    }
    // Fast path: little-endian host and aligned registers (arenas align every slot), so
    // the bytes are the elements; the loops vectorize.
    let typed = |r: usize| bytemuck::try_cast_slice::<u8, T>(input(r)).ok();
    if cfg!(target_endian = "little") && (0..count).all(|r| typed(r).is_some()) {
        if let (Ok(out), Some(first), Some(second)) = (bytemuck::try_cast_slice_mut::<u8, T>(out), typed(0), typed(1)) {
            for ((o, &x), &y) in out.iter_mut().zip(first).zip(second) {
                *o = x.add(y);
            }
            for r in 2..count {
                for (o, &x) in out.iter_mut().zip(typed(r).unwrap_or_default()) {
                    *o = o.add(x);
                }
            }
            return;
        }
    }
    let width = std::mem::size_of::<T>();
    for (i, o) in out.chunks_exact_mut(width).enumerate() {
        let at = i * width;
        let mut sum = T::read(&input(0)[at..]);
        for r in 1..count {
            sum = sum.add(T::read(&input(r)[at..]));
        }
        sum.write(o);
    }
}

/// `acc += x`, elementwise (a ring all-reduce's accumulation step).
pub(super) fn add_into(dtype: DType, acc: &mut [u8], x: &[u8]) {
    match dtype {
        DType::F32 => add_typed::<f32>(acc, x),
        DType::F64 => add_typed::<f64>(acc, x),
        DType::I64 => add_typed::<i64>(acc, x),
        DType::Bf16 => add_typed::<regflow_plan::bf16>(acc, x),
        DType::F16 => add_typed::<regflow_plan::f16>(acc, x),
    }
}

fn add_typed<T: Element>(acc: &mut [u8], x: &[u8]) {
    if cfg!(target_endian = "little") {
        if let (Ok(acc), Ok(x)) = (bytemuck::try_cast_slice_mut::<u8, T>(acc), bytemuck::try_cast_slice::<u8, T>(x)) {
            for (a, &v) in acc.iter_mut().zip(x) {
                *a = a.add(v);
            }
            return;
        }
    }
    let width = std::mem::size_of::<T>();
    for (a, v) in acc.chunks_exact_mut(width).zip(x.chunks_exact(width)) {
        T::read(a).add(T::read(v)).write(a);
    }
}
