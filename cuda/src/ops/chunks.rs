//! How a multi-tensor kernel cuts its members into launches and blocks (`update_group`'s,
//! `sum_squares_group`'s and `cast_group`'s): members in order, each cut into chunks of one block each,
//! a launch taking members while they fit its member and block limits; a member of more
//! chunks than a launch may have is alone in its launch, with chunks of the smallest
//! multiple of the base chunk that fits.

use crate::driver::MAX_LINEAR_BLOCKS;

/// One launch: members `first_member..first_member + first_block.len() - 1`, member `m`'s
/// blocks `first_block[m]..first_block[m + 1]` (the last entry the launch's block count),
/// each block `chunk` elements of its member (the last of a member may have fewer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ChunkLaunch {
    pub(super) first_member: usize,
    pub(super) chunk: u64,
    pub(super) first_block: Vec<u32>,
}

impl ChunkLaunch {
    /// Members of the launch.
    pub(super) fn members(&self) -> usize {
        self.first_block.len() - 1
    }

    /// Blocks of the launch.
    pub(super) fn blocks(&self) -> u32 {
        self.first_block.last().copied().unwrap_or(0)
    }

    /// Writes the launch's members into a kernel's table: their lengths (out of the
    /// group's `lens`) into `n`, their first blocks into `first_block` (every entry from
    /// the member count on holding the launch's block count). Returns the member count.
    pub(super) fn fill(&self, lens: &[u64], n: &mut [u64], first_block: &mut [u32]) -> u32 {
        let members = self.members();
        n[..members].copy_from_slice(&lens[self.first_member..self.first_member + members]);
        first_block[..=members].copy_from_slice(&self.first_block);
        first_block[members..].fill(self.blocks());
        members as u32
    }
}

/// The launches over members of `lens` elements: at most `max_members` members and
/// `max_blocks` blocks (at most [`MAX_LINEAR_BLOCKS`]: CUDA allows more blocks in x,
/// regflow's grids keep to the limit of y and z) each, chunks of `chunk` elements (see the
/// module docs). Every member is in one launch, an empty one (no blocks) too.
pub(super) fn plan_chunks(lens: &[u64], max_members: usize, chunk: u64, max_blocks: u64) -> Vec<ChunkLaunch> {
    let (max_blocks, max_members, base) = (max_blocks.clamp(1, MAX_LINEAR_BLOCKS), max_members.max(1), chunk.max(1));
    let (mut launches, mut m) = (Vec::new(), 0);
    while m < lens.len() {
        let first_member = m;
        let alone = lens[m].div_ceil(base) > max_blocks;
        let chunk = if alone { lens[m].div_ceil(max_blocks).div_ceil(base) * base } else { base };
        let (mut first_block, mut blocks) = (vec![0u32], 0u64);
        while m < lens.len() && m - first_member < max_members {
            let more = lens[m].div_ceil(chunk);
            if blocks + more > max_blocks {
                break;
            }
            blocks += more;
            // Blocks never pass `max_blocks` (<= 65535): they fit a u32.
            first_block.push(blocks as u32);
            m += 1;
            if alone {
                break;
            }
        }
        launches.push(ChunkLaunch { first_member, chunk, first_block });
    }
    launches
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every element of every member is in exactly one block's chunk, members in order.
    fn assert_covered(lens: &[u64], max_members: usize, max_blocks: u64) -> Vec<ChunkLaunch> {
        let launches = plan_chunks(lens, max_members, 4096, max_blocks);
        let mut next = 0;
        for l in &launches {
            assert_eq!(l.first_member, next, "{launches:?}");
            assert!(l.members() >= 1 && l.members() <= max_members, "{launches:?}");
            assert!(u64::from(l.blocks()) <= max_blocks.min(MAX_LINEAR_BLOCKS), "{launches:?}");
            assert!(l.chunk.is_multiple_of(4096));
            for k in 0..l.members() {
                let blocks = u64::from(l.first_block[k + 1] - l.first_block[k]);
                assert_eq!(blocks, lens[next + k].div_ceil(l.chunk), "member {} of {launches:?}", next + k);
            }
            next += l.members();
        }
        assert_eq!(next, lens.len());
        launches
    }

    #[test]
    fn launches_take_members_in_order_within_their_limits() {
        let lens: Vec<u64> = (0..37).map(|m| [1, 7, 1023, 4096, 4097, 70_001][m % 6]).collect();
        let launches = assert_covered(&lens, 32, MAX_LINEAR_BLOCKS);
        assert_eq!(launches.iter().map(ChunkLaunch::members).collect::<Vec<_>>(), [32, 5]);
        assert_eq!(&launches[0].first_block[..8], &[0, 1, 2, 3, 4, 6, 24, 25]);
        // Blocks bound a launch as well as members do.
        assert_covered(&[3, 9000, 8192, 8193, 1, 70_001], 64, 4);
        assert_covered(&[0, 0, 5], 2, 10);
    }

    #[test]
    fn a_member_of_more_than_the_most_blocks_gets_larger_chunks_and_a_launch_of_its_own() {
        let launches = assert_covered(&[5, 1 << 31, 7], 32, MAX_LINEAR_BLOCKS);
        assert_eq!(launches.iter().map(ChunkLaunch::members).collect::<Vec<_>>(), [1, 1, 1]);
        assert_eq!(launches[1].chunk, 9 * 4096);
        // An exact fit keeps the base chunk.
        let launches = assert_covered(&[MAX_LINEAR_BLOCKS * 4096], 32, MAX_LINEAR_BLOCKS);
        assert_eq!((launches[0].chunk, launches[0].blocks()), (4096, MAX_LINEAR_BLOCKS as u32));
    }
}
