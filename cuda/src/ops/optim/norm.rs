//! `sum_squares_group` on CUDA: a device's part of the global gradient norm, the chain of
//! `sum_squares` and scalar adds the compiler fuses (`compile/fuse_norms.rs` in
//! `regflow-graph`), as launch pairs of `regflow_sum_squares_group_{parts,total}_*`
//! (`optim.cu`) of up to [`NORM_MEMBERS`] tensors each, instead of two launches per
//! gradient (GPT-2: 391 kernels of a few microseconds each per step).
//!
//! The first launch of a pair sums the squares of each chunk of each member, one block
//! per chunk, into a partial in the stream's scratch; the second, one block, adds each
//! member's partials in order, rounds the member's sum to its dtype as `sum_squares` does,
//! and adds it to the running total as the scalar `add` did (the carry in, or the previous
//! pair's total). The order of every addition depends on the tensors' sizes alone.

use crate::driver::{launch, Function, Grid, MAX_LINEAR_BLOCKS};
use crate::ops::chunks::plan_chunks;
use crate::ops::fail;
use crate::ops::{function, op_conf, stream, suffix};
use regflow_kernels::{Kernel, KernelError, KernelIo, KernelSpec};
use regflow_plan::ops::SumSquaresGroup;
use regflow_plan::DType;

/// Tensors one launch pair sums (`NORM_MEMBERS` in `optim.cu`).
const NORM_MEMBERS: usize = 64;

/// Elements of one block's chunk (32 per thread of a block of [`NORM_THREADS`]); a member
/// of more than [`MAX_LINEAR_BLOCKS`] chunks takes larger ones, alone.
const NORM_CHUNK: u64 = 8192;

/// Threads per block of both launches.
const NORM_THREADS: u32 = 256;

/// The members of one launch pair (`struct NormTable` in `optim.cu`: the same fields in the
/// same order, 1296 bytes with the tail padding, 8-aligned).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct NormTable {
    /// Each member's device address (filled per firing).
    addr: [u64; NORM_MEMBERS],
    /// Each member's elements.
    n: [u64; NORM_MEMBERS],
    /// Elements of one block's chunk.
    chunk: u64,
    /// Member `m`'s blocks are `first_block[m]..first_block[m + 1]`.
    first_block: [u32; NORM_MEMBERS + 1],
    /// Members in this pair (1..=[`NORM_MEMBERS`]).
    members: u32,
}

impl NormTable {
    const EMPTY: Self = Self {
        addr: [0; NORM_MEMBERS],
        n: [0; NORM_MEMBERS],
        chunk: NORM_CHUNK,
        first_block: [0; NORM_MEMBERS + 1],
        members: 0,
    };

    fn blocks(&self) -> u32 {
        self.first_block[self.members as usize]
    }
}

/// One launch pair: its table (without addresses), the group's index of its first member,
/// and where its partials start in the scratch (in partials).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct NormLaunch {
    table: NormTable,
    first_member: usize,
    first_part: u64,
}

/// The launch pairs summing members of `lens` elements in member order: up to
/// [`NORM_MEMBERS`] members and `max_blocks` blocks each, chunks of [`NORM_CHUNK`]
/// (larger for a member too large for one launch, alone: [`plan_chunks`]), with where each
/// pair's partials start.
fn plan_launches(lens: &[u64], max_blocks: u64) -> Vec<NormLaunch> {
    let mut first_part = 0u64;
    plan_chunks(lens, NORM_MEMBERS, NORM_CHUNK, max_blocks)
        .into_iter()
        .map(|planned| {
            let mut table = NormTable::EMPTY;
            table.chunk = planned.chunk;
            table.members = planned.fill(lens, &mut table.n, &mut table.first_block);
            let launch = NormLaunch { table, first_member: planned.first_member, first_part };
            first_part += u64::from(planned.blocks());
            launch
        })
        .collect()
}

/// Makes the kernel of a `sum_squares_group`: inputs `([carry], x₀, x₁, …)` of one float
/// dtype, one scalar output of it.
pub(super) fn make_sum_squares_group(spec: &KernelSpec<'_>) -> Result<NormKernel, KernelError> {
    let conf = op_conf(spec)?;
    let op: SumSquaresGroup = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    let dtype = super::float_dtype(spec, conf)?;
    op.check(conf).map_err(|e| fail(spec, conf, e))?;
    let carried = usize::from(op.carried);
    let lens: Vec<u64> = conf.inputs[carried..].iter().map(|m| m.shape.numel() as u64).collect();
    let launches = plan_launches(&lens, MAX_LINEAR_BLOCKS);
    let parts = launches.last().map_or(0, |l| l.first_part + u64::from(l.table.blocks()));
    let name = |stage: &str| format!("regflow_sum_squares_group_{stage}_{}", suffix(dtype));
    Ok(NormKernel {
        parts_fn: function(spec, &name("parts"))?,
        total_fn: function(spec, &name("total"))?,
        carry: op.carried.then(|| conf.input_map[0]),
        members: conf.input_map[carried..].to_vec(),
        launches,
        part_bytes: parts * dtype.size() as u64,
        dtype,
    })
}

/// A `sum_squares_group`'s launch pairs, planned when made.
#[derive(Debug)]
pub(super) struct NormKernel {
    parts_fn: Function,
    total_fn: Function,
    /// The actor input of the carried total, if any.
    carry: Option<usize>,
    /// Each member's actor input.
    members: Vec<usize>,
    launches: Vec<NormLaunch>,
    /// Scratch for every pair's partials.
    part_bytes: u64,
    dtype: DType,
}

impl Kernel for NormKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let (out, parts) = (io.output_addr(0), io.scratch(self.part_bytes)?);
        let size = self.dtype.size() as u64;
        let threads = (NORM_THREADS, 1, 1);
        for (k, l) in self.launches.iter().enumerate() {
            let mut table = l.table;
            for (slot, &input) in
                table.addr.iter_mut().zip(&self.members[l.first_member..]).take(l.table.members as usize)
            {
                *slot = io.input_addr(input);
            }
            // The first pair adds to the carry (if any), every later one to the total so far.
            let (carry, carried) = match (k, self.carry) {
                (0, Some(input)) => (io.input_addr(input), 1u64),
                (0, None) => (0, 0),
                _ => (out, 1),
            };
            let part = parts + l.first_part * size;
            let blocks = table.blocks().max(1);
            let first = Grid { blocks: (blocks, 1, 1), threads, shared_bytes: 0 };
            let second = Grid { blocks: (1, 1, 1), threads, shared_bytes: 0 };
            // SAFETY: every member address holds `n` elements of the dtype (the op's checked
            // metas), `part` holds this pair's `blocks` partials in the scratch, the carry
            // and out one element; the entries take (table, parts) and (table, parts,
            // carry, carried, out). The stream orders the pairs.
            unsafe {
                if table.blocks() > 0 {
                    launch(stream(io), self.parts_fn, first, &mut args![table, part])?;
                }
                launch(stream(io), self.total_fn, second, &mut args![table, part, carry, carried, out])?;
            }
        }
        Ok(())
    }

    fn scratch_bytes(&self) -> u64 {
        self.part_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every element of every member is in exactly one block's chunk, in member order.
    fn check_cover(lens: &[u64], max_blocks: u64) {
        let launches = plan_launches(lens, max_blocks);
        let mut next_member = 0;
        let mut next_part = 0;
        for l in &launches {
            assert_eq!((l.first_member, l.first_part), (next_member, next_part), "{launches:?}");
            let t = &l.table;
            assert!(t.members as usize >= 1 && t.members as usize <= NORM_MEMBERS);
            assert!(u64::from(t.blocks()) <= max_blocks.min(MAX_LINEAR_BLOCKS));
            for m in 0..t.members as usize {
                let blocks = u64::from(t.first_block[m + 1] - t.first_block[m]);
                assert_eq!(t.n[m], lens[l.first_member + m]);
                assert_eq!(blocks, t.n[m].div_ceil(t.chunk), "member {m} of {launches:?}");
            }
            next_member += t.members as usize;
            next_part += u64::from(t.blocks());
        }
        assert_eq!(next_member, lens.len());
    }

    #[test]
    fn the_table_has_the_c_structs_layout() {
        // 64 + 64 u64s, the chunk, 65 + 1 u32s, padded to 8: 1296 bytes.
        assert_eq!(std::mem::size_of::<NormTable>(), 1296);
        assert_eq!(std::mem::align_of::<NormTable>(), 8);
        let source = crate::sources::SOURCES.iter().find(|s| s.name == "optim").map(|s| s.code).unwrap_or("");
        assert!(source.contains(&format!("#define NORM_MEMBERS {NORM_MEMBERS}")));
    }

    #[test]
    fn launches_take_64_members_and_split_large_ones_off() {
        // GPT-2's 196 gradients: four pairs.
        let gpt2: Vec<u64> = (0..196).map(|i| if i == 0 { 50257 * 768 } else { 768 * (1 + i % 4) as u64 }).collect();
        let launches = plan_launches(&gpt2, MAX_LINEAR_BLOCKS);
        assert_eq!(launches.iter().map(|l| l.table.members).collect::<Vec<_>>(), [64, 64, 64, 4]);
        assert_eq!(launches[0].table.first_block[1], (50257u64 * 768).div_ceil(NORM_CHUNK) as u32);
        check_cover(&gpt2, MAX_LINEAR_BLOCKS);
        // A member of more chunks than a launch may have: alone, larger chunks.
        let lens = [5, 1 << 40, 7, 0, 0];
        let launches = plan_launches(&lens, MAX_LINEAR_BLOCKS);
        assert_eq!(launches.iter().map(|l| l.table.members).collect::<Vec<_>>(), [1, 1, 3]);
        assert!(launches[1].table.chunk > NORM_CHUNK && launches[1].table.chunk.is_multiple_of(NORM_CHUNK));
        check_cover(&lens, MAX_LINEAR_BLOCKS);
        check_cover(&[3, 9000, 8192, 8193, 1, 70_001], 4);
        check_cover(&[0], MAX_LINEAR_BLOCKS);
    }
}
