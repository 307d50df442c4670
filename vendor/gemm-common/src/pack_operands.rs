use crate::simd::Simd;

#[inline(always)]
pub fn quick_zero<T: Copy>(slice: &mut [core::mem::MaybeUninit<T>]) {
    let n = slice.len();
    match n {
        1 => unsafe { *(slice.as_mut_ptr() as *mut [T; 1]) = core::mem::zeroed() },
        2 => unsafe { *(slice.as_mut_ptr() as *mut [T; 2]) = core::mem::zeroed() },
        3 => unsafe { *(slice.as_mut_ptr() as *mut [T; 3]) = core::mem::zeroed() },
        4 => unsafe { *(slice.as_mut_ptr() as *mut [T; 4]) = core::mem::zeroed() },
        5 => unsafe { *(slice.as_mut_ptr() as *mut [T; 5]) = core::mem::zeroed() },
        6 => unsafe { *(slice.as_mut_ptr() as *mut [T; 6]) = core::mem::zeroed() },
        7 => unsafe { *(slice.as_mut_ptr() as *mut [T; 7]) = core::mem::zeroed() },
        8 => unsafe { *(slice.as_mut_ptr() as *mut [T; 8]) = core::mem::zeroed() },
        9 => unsafe { *(slice.as_mut_ptr() as *mut [T; 9]) = core::mem::zeroed() },
        10 => unsafe { *(slice.as_mut_ptr() as *mut [T; 10]) = core::mem::zeroed() },
        11 => unsafe { *(slice.as_mut_ptr() as *mut [T; 11]) = core::mem::zeroed() },
        12 => unsafe { *(slice.as_mut_ptr() as *mut [T; 12]) = core::mem::zeroed() },
        13 => unsafe { *(slice.as_mut_ptr() as *mut [T; 13]) = core::mem::zeroed() },
        14 => unsafe { *(slice.as_mut_ptr() as *mut [T; 14]) = core::mem::zeroed() },
        15 => unsafe { *(slice.as_mut_ptr() as *mut [T; 15]) = core::mem::zeroed() },
        16 => unsafe { *(slice.as_mut_ptr() as *mut [T; 16]) = core::mem::zeroed() },
        17 => unsafe { *(slice.as_mut_ptr() as *mut [T; 17]) = core::mem::zeroed() },
        18 => unsafe { *(slice.as_mut_ptr() as *mut [T; 18]) = core::mem::zeroed() },
        19 => unsafe { *(slice.as_mut_ptr() as *mut [T; 19]) = core::mem::zeroed() },
        20 => unsafe { *(slice.as_mut_ptr() as *mut [T; 20]) = core::mem::zeroed() },
        21 => unsafe { *(slice.as_mut_ptr() as *mut [T; 21]) = core::mem::zeroed() },
        22 => unsafe { *(slice.as_mut_ptr() as *mut [T; 22]) = core::mem::zeroed() },
        23 => unsafe { *(slice.as_mut_ptr() as *mut [T; 23]) = core::mem::zeroed() },
        24 => unsafe { *(slice.as_mut_ptr() as *mut [T; 24]) = core::mem::zeroed() },
        25 => unsafe { *(slice.as_mut_ptr() as *mut [T; 25]) = core::mem::zeroed() },
        26 => unsafe { *(slice.as_mut_ptr() as *mut [T; 26]) = core::mem::zeroed() },
        27 => unsafe { *(slice.as_mut_ptr() as *mut [T; 27]) = core::mem::zeroed() },
        28 => unsafe { *(slice.as_mut_ptr() as *mut [T; 28]) = core::mem::zeroed() },
        29 => unsafe { *(slice.as_mut_ptr() as *mut [T; 29]) = core::mem::zeroed() },
        30 => unsafe { *(slice.as_mut_ptr() as *mut [T; 30]) = core::mem::zeroed() },
        31 => unsafe { *(slice.as_mut_ptr() as *mut [T; 31]) = core::mem::zeroed() },
        32 => unsafe { *(slice.as_mut_ptr() as *mut [T; 32]) = core::mem::zeroed() },
        33 => unsafe { *(slice.as_mut_ptr() as *mut [T; 33]) = core::mem::zeroed() },
        34 => unsafe { *(slice.as_mut_ptr() as *mut [T; 34]) = core::mem::zeroed() },
        35 => unsafe { *(slice.as_mut_ptr() as *mut [T; 35]) = core::mem::zeroed() },
        36 => unsafe { *(slice.as_mut_ptr() as *mut [T; 36]) = core::mem::zeroed() },
        37 => unsafe { *(slice.as_mut_ptr() as *mut [T; 37]) = core::mem::zeroed() },
        38 => unsafe { *(slice.as_mut_ptr() as *mut [T; 38]) = core::mem::zeroed() },
        39 => unsafe { *(slice.as_mut_ptr() as *mut [T; 39]) = core::mem::zeroed() },
        40 => unsafe { *(slice.as_mut_ptr() as *mut [T; 40]) = core::mem::zeroed() },
        41 => unsafe { *(slice.as_mut_ptr() as *mut [T; 41]) = core::mem::zeroed() },
        42 => unsafe { *(slice.as_mut_ptr() as *mut [T; 42]) = core::mem::zeroed() },
        43 => unsafe { *(slice.as_mut_ptr() as *mut [T; 43]) = core::mem::zeroed() },
        44 => unsafe { *(slice.as_mut_ptr() as *mut [T; 44]) = core::mem::zeroed() },
        45 => unsafe { *(slice.as_mut_ptr() as *mut [T; 45]) = core::mem::zeroed() },
        46 => unsafe { *(slice.as_mut_ptr() as *mut [T; 46]) = core::mem::zeroed() },
        47 => unsafe { *(slice.as_mut_ptr() as *mut [T; 47]) = core::mem::zeroed() },
        48 => unsafe { *(slice.as_mut_ptr() as *mut [T; 48]) = core::mem::zeroed() },
        49 => unsafe { *(slice.as_mut_ptr() as *mut [T; 49]) = core::mem::zeroed() },
        50 => unsafe { *(slice.as_mut_ptr() as *mut [T; 50]) = core::mem::zeroed() },
        51 => unsafe { *(slice.as_mut_ptr() as *mut [T; 51]) = core::mem::zeroed() },
        52 => unsafe { *(slice.as_mut_ptr() as *mut [T; 52]) = core::mem::zeroed() },
        53 => unsafe { *(slice.as_mut_ptr() as *mut [T; 53]) = core::mem::zeroed() },
        54 => unsafe { *(slice.as_mut_ptr() as *mut [T; 54]) = core::mem::zeroed() },
        55 => unsafe { *(slice.as_mut_ptr() as *mut [T; 55]) = core::mem::zeroed() },
        56 => unsafe { *(slice.as_mut_ptr() as *mut [T; 56]) = core::mem::zeroed() },
        57 => unsafe { *(slice.as_mut_ptr() as *mut [T; 57]) = core::mem::zeroed() },
        58 => unsafe { *(slice.as_mut_ptr() as *mut [T; 58]) = core::mem::zeroed() },
        59 => unsafe { *(slice.as_mut_ptr() as *mut [T; 59]) = core::mem::zeroed() },
        60 => unsafe { *(slice.as_mut_ptr() as *mut [T; 60]) = core::mem::zeroed() },
        61 => unsafe { *(slice.as_mut_ptr() as *mut [T; 61]) = core::mem::zeroed() },
        62 => unsafe { *(slice.as_mut_ptr() as *mut [T; 62]) = core::mem::zeroed() },
        63 => unsafe { *(slice.as_mut_ptr() as *mut [T; 63]) = core::mem::zeroed() },
        64 => unsafe { *(slice.as_mut_ptr() as *mut [T; 64]) = core::mem::zeroed() },
        _ => {
            for value in slice {
                *value = unsafe { core::mem::zeroed() };
            }
        }
    }
}

#[inline(always)]
unsafe fn quick_copy<T: Copy>(dst: *mut T, src: *const T, n: usize) {
    match n {
        1 => unsafe { *(dst as *mut [T; 1]) = *(src as *const [T; 1]) },
        2 => unsafe { *(dst as *mut [T; 2]) = *(src as *const [T; 2]) },
        3 => unsafe { *(dst as *mut [T; 3]) = *(src as *const [T; 3]) },
        4 => unsafe { *(dst as *mut [T; 4]) = *(src as *const [T; 4]) },
        5 => unsafe { *(dst as *mut [T; 5]) = *(src as *const [T; 5]) },
        6 => unsafe { *(dst as *mut [T; 6]) = *(src as *const [T; 6]) },
        7 => unsafe { *(dst as *mut [T; 7]) = *(src as *const [T; 7]) },
        8 => unsafe { *(dst as *mut [T; 8]) = *(src as *const [T; 8]) },
        9 => unsafe { *(dst as *mut [T; 9]) = *(src as *const [T; 9]) },
        10 => unsafe { *(dst as *mut [T; 10]) = *(src as *const [T; 10]) },
        11 => unsafe { *(dst as *mut [T; 11]) = *(src as *const [T; 11]) },
        12 => unsafe { *(dst as *mut [T; 12]) = *(src as *const [T; 12]) },
        13 => unsafe { *(dst as *mut [T; 13]) = *(src as *const [T; 13]) },
        14 => unsafe { *(dst as *mut [T; 14]) = *(src as *const [T; 14]) },
        15 => unsafe { *(dst as *mut [T; 15]) = *(src as *const [T; 15]) },
        16 => unsafe { *(dst as *mut [T; 16]) = *(src as *const [T; 16]) },
        17 => unsafe { *(dst as *mut [T; 17]) = *(src as *const [T; 17]) },
        18 => unsafe { *(dst as *mut [T; 18]) = *(src as *const [T; 18]) },
        19 => unsafe { *(dst as *mut [T; 19]) = *(src as *const [T; 19]) },
        20 => unsafe { *(dst as *mut [T; 20]) = *(src as *const [T; 20]) },
        21 => unsafe { *(dst as *mut [T; 21]) = *(src as *const [T; 21]) },
        22 => unsafe { *(dst as *mut [T; 22]) = *(src as *const [T; 22]) },
        23 => unsafe { *(dst as *mut [T; 23]) = *(src as *const [T; 23]) },
        24 => unsafe { *(dst as *mut [T; 24]) = *(src as *const [T; 24]) },
        25 => unsafe { *(dst as *mut [T; 25]) = *(src as *const [T; 25]) },
        26 => unsafe { *(dst as *mut [T; 26]) = *(src as *const [T; 26]) },
        27 => unsafe { *(dst as *mut [T; 27]) = *(src as *const [T; 27]) },
        28 => unsafe { *(dst as *mut [T; 28]) = *(src as *const [T; 28]) },
        29 => unsafe { *(dst as *mut [T; 29]) = *(src as *const [T; 29]) },
        30 => unsafe { *(dst as *mut [T; 30]) = *(src as *const [T; 30]) },
        31 => unsafe { *(dst as *mut [T; 31]) = *(src as *const [T; 31]) },
        32 => unsafe { *(dst as *mut [T; 32]) = *(src as *const [T; 32]) },
        33 => unsafe { *(dst as *mut [T; 33]) = *(src as *const [T; 33]) },
        34 => unsafe { *(dst as *mut [T; 34]) = *(src as *const [T; 34]) },
        35 => unsafe { *(dst as *mut [T; 35]) = *(src as *const [T; 35]) },
        36 => unsafe { *(dst as *mut [T; 36]) = *(src as *const [T; 36]) },
        37 => unsafe { *(dst as *mut [T; 37]) = *(src as *const [T; 37]) },
        38 => unsafe { *(dst as *mut [T; 38]) = *(src as *const [T; 38]) },
        39 => unsafe { *(dst as *mut [T; 39]) = *(src as *const [T; 39]) },
        40 => unsafe { *(dst as *mut [T; 40]) = *(src as *const [T; 40]) },
        41 => unsafe { *(dst as *mut [T; 41]) = *(src as *const [T; 41]) },
        42 => unsafe { *(dst as *mut [T; 42]) = *(src as *const [T; 42]) },
        43 => unsafe { *(dst as *mut [T; 43]) = *(src as *const [T; 43]) },
        44 => unsafe { *(dst as *mut [T; 44]) = *(src as *const [T; 44]) },
        45 => unsafe { *(dst as *mut [T; 45]) = *(src as *const [T; 45]) },
        46 => unsafe { *(dst as *mut [T; 46]) = *(src as *const [T; 46]) },
        47 => unsafe { *(dst as *mut [T; 47]) = *(src as *const [T; 47]) },
        48 => unsafe { *(dst as *mut [T; 48]) = *(src as *const [T; 48]) },
        49 => unsafe { *(dst as *mut [T; 49]) = *(src as *const [T; 49]) },
        50 => unsafe { *(dst as *mut [T; 50]) = *(src as *const [T; 50]) },
        51 => unsafe { *(dst as *mut [T; 51]) = *(src as *const [T; 51]) },
        52 => unsafe { *(dst as *mut [T; 52]) = *(src as *const [T; 52]) },
        53 => unsafe { *(dst as *mut [T; 53]) = *(src as *const [T; 53]) },
        54 => unsafe { *(dst as *mut [T; 54]) = *(src as *const [T; 54]) },
        55 => unsafe { *(dst as *mut [T; 55]) = *(src as *const [T; 55]) },
        56 => unsafe { *(dst as *mut [T; 56]) = *(src as *const [T; 56]) },
        57 => unsafe { *(dst as *mut [T; 57]) = *(src as *const [T; 57]) },
        58 => unsafe { *(dst as *mut [T; 58]) = *(src as *const [T; 58]) },
        59 => unsafe { *(dst as *mut [T; 59]) = *(src as *const [T; 59]) },
        60 => unsafe { *(dst as *mut [T; 60]) = *(src as *const [T; 60]) },
        61 => unsafe { *(dst as *mut [T; 61]) = *(src as *const [T; 61]) },
        62 => unsafe { *(dst as *mut [T; 62]) = *(src as *const [T; 62]) },
        63 => unsafe { *(dst as *mut [T; 63]) = *(src as *const [T; 63]) },
        64 => unsafe { *(dst as *mut [T; 64]) = *(src as *const [T; 64]) },
        _ => core::ptr::copy_nonoverlapping(src, dst, n),
    }
}

/// regflow patch: whether a transposed operand is packed by blocks (`pack_rows_blocked`);
/// on unless a test turns it off to compare with upstream's packing.
static BLOCKED_PACKING: core::sync::atomic::AtomicBool = core::sync::atomic::AtomicBool::new(true);

/// regflow patch: turns the blocked packing of transposed operands on or off, process-wide,
/// from the next packed panel on. Packing only moves values, so a product's result is the
/// same bits either way; tests compare the two to check exactly that.
pub fn set_blocked_packing(on: bool) {
    BLOCKED_PACKING.store(on, core::sync::atomic::Ordering::Relaxed);
}

/// regflow patch: the row distance from which a transposed operand is packed by blocks
/// where no SIMD tile moves it (`transpose_tiles`):
/// 48 rows 1 KiB apart share 4 L1 sets, 12 to a set, more than its 8 ways (measured on
/// `bench_gemm`'s `nt` shapes: blocks won from 4 KiB rows, lost on 256-byte ones).
const BLOCKED_MIN_ROW_BYTES: usize = 1024;

/// regflow patch: square tiles moved through SIMD registers for `pack_rows_blocked`.
///
/// Its element loop compiled to AVX-512 scatters (`vscatterqps`), which AMD's cores run
/// microcoded, a few elements per cycle at best: packing took 22 % of an `nt` product's
/// time at 1024 columns. Here a tile of 8 × 8 f32 (4 × 4 f64) is read as 8 (4) row
/// vectors, transposed with AVX shuffles and written as 8 (4) vectors of the panel: the
/// same values in the same places, so the product's bits do not change.
mod transpose_tiles {
    /// The side of the tiles `transpose` moves for elements of `T` into panels `dst_width`
    /// wide: 8 for 4-byte and 4 for 8-byte elements where the CPU has AVX and the panel
    /// width is a multiple of it; `None` otherwise (element by element then).
    #[inline(always)]
    pub fn tile_for<T>(dst_width: usize) -> Option<usize> {
        let tile = match core::mem::size_of::<T>() {
            4 => 8,
            8 => 4,
            _ => return None,
        };
        (dst_width % tile == 0 && has_avx()).then_some(tile)
    }

    #[cfg(all(feature = "std", any(target_arch = "x86", target_arch = "x86_64")))]
    #[inline(always)]
    fn has_avx() -> bool {
        // Cached by std after the first call: one relaxed load.
        std::is_x86_feature_detected!("avx")
    }

    #[cfg(not(all(feature = "std", any(target_arch = "x86", target_arch = "x86_64"))))]
    #[inline(always)]
    fn has_avx() -> bool {
        false
    }

    /// `dst[t * dst_stride + j] = src[j * src_rs + t]` for `j, t` in `0..tile`, `tile`
    /// being [`tile_for::<T>`]'s.
    ///
    /// # Safety
    /// `tile_for::<T>` returned a tile; the `tile` rows of `tile` elements at `src` and
    /// the `tile` vectors of `tile` elements at `dst` are in bounds.
    #[inline(always)]
    pub unsafe fn transpose<T>(dst: *mut T, dst_stride: usize, src: *const T, src_rs: isize) {
        #[cfg(all(feature = "std", any(target_arch = "x86", target_arch = "x86_64")))]
        match core::mem::size_of::<T>() {
            4 => avx::transpose8x8_f32(dst as *mut f32, dst_stride, src as *const f32, src_rs),
            _ => avx::transpose4x4_f64(dst as *mut f64, dst_stride, src as *const f64, src_rs),
        }
        #[cfg(not(all(feature = "std", any(target_arch = "x86", target_arch = "x86_64"))))]
        {
            let _ = (dst, dst_stride, src, src_rs);
            unreachable!("no tile without AVX")
        }
    }

    #[cfg(all(feature = "std", any(target_arch = "x86", target_arch = "x86_64")))]
    mod avx {
        #[cfg(target_arch = "x86")]
        use core::arch::x86::*;
        #[cfg(target_arch = "x86_64")]
        use core::arch::x86_64::*;

        /// An 8 × 8 f32 transpose: unpack pairs of rows, shuffle quads, swap 128-bit halves.
        #[target_feature(enable = "avx")]
        pub unsafe fn transpose8x8_f32(dst: *mut f32, dst_stride: usize, src: *const f32, src_rs: isize) {
            let row = |j: isize| _mm256_loadu_ps(src.offset(j * src_rs));
            let (r0, r1, r2, r3) = (row(0), row(1), row(2), row(3));
            let (r4, r5, r6, r7) = (row(4), row(5), row(6), row(7));
            // Elements 0, 1 (4, 5) and 2, 3 (6, 7) of two rows interleaved.
            let (t0, t1) = (_mm256_unpacklo_ps(r0, r1), _mm256_unpackhi_ps(r0, r1));
            let (t2, t3) = (_mm256_unpacklo_ps(r2, r3), _mm256_unpackhi_ps(r2, r3));
            let (t4, t5) = (_mm256_unpacklo_ps(r4, r5), _mm256_unpackhi_ps(r4, r5));
            let (t6, t7) = (_mm256_unpacklo_ps(r6, r7), _mm256_unpackhi_ps(r6, r7));
            // Columns c | c + 4 of four rows.
            let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
            let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
            let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
            let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
            let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
            let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
            let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
            let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
            let column = |c: usize, v: __m256| _mm256_storeu_ps(dst.add(c * dst_stride), v);
            column(0, _mm256_permute2f128_ps::<0x20>(s0, s4));
            column(1, _mm256_permute2f128_ps::<0x20>(s1, s5));
            column(2, _mm256_permute2f128_ps::<0x20>(s2, s6));
            column(3, _mm256_permute2f128_ps::<0x20>(s3, s7));
            column(4, _mm256_permute2f128_ps::<0x31>(s0, s4));
            column(5, _mm256_permute2f128_ps::<0x31>(s1, s5));
            column(6, _mm256_permute2f128_ps::<0x31>(s2, s6));
            column(7, _mm256_permute2f128_ps::<0x31>(s3, s7));
        }

        /// A 4 × 4 f64 transpose: unpack pairs of rows, swap 128-bit halves.
        #[target_feature(enable = "avx")]
        pub unsafe fn transpose4x4_f64(dst: *mut f64, dst_stride: usize, src: *const f64, src_rs: isize) {
            let row = |j: isize| _mm256_loadu_pd(src.offset(j * src_rs));
            let (r0, r1, r2, r3) = (row(0), row(1), row(2), row(3));
            let (t0, t1) = (_mm256_unpacklo_pd(r0, r1), _mm256_unpackhi_pd(r0, r1));
            let (t2, t3) = (_mm256_unpacklo_pd(r2, r3), _mm256_unpackhi_pd(r2, r3));
            let column = |c: usize, v: __m256d| _mm256_storeu_pd(dst.add(c * dst_stride), v);
            column(0, _mm256_permute2f128_pd::<0x20>(t0, t2));
            column(1, _mm256_permute2f128_pd::<0x20>(t1, t3));
            column(2, _mm256_permute2f128_pd::<0x31>(t0, t2));
            column(3, _mm256_permute2f128_pd::<0x31>(t1, t3));
        }
    }
}

/// regflow patch: packs a panel whose rows lie contiguous along `k` (`src_cs == 1`,
/// `src_rs != 1`: an operand read transposed) a block of `k` at a time.
///
/// Upstream's loop gathers one element from each of the panel's `src_width` rows per
/// step of `k`. Its rows are `src_rs` apart, a power of two for most model sizes, so at
/// AVX-512's 48-row f32 panels every row of a step falls in the same few L1 sets, more
/// than the cache holds, and nearly every element misses (a `dy · wᵀ` of 128×1024×1024
/// ran at half the speed of `dy · w`). Here each row's next `BLOCK` elements are read in
/// one go and written to their places in the packed panel, which for one block spans
/// `BLOCK * DST_WIDTH` elements and stays in L1 (64 beat 16, 32, 128 and 256 on
/// `bench_gemm`'s `nt` shapes). Lanes past `src_width` are zeroed as upstream's loop
/// zeroes them (only for widths other than `DST_WIDTH`, `N` and `2 * N`).
#[inline(always)]
unsafe fn pack_rows_blocked<T: Copy, const N: usize, const DST_WIDTH: usize>(
    dst: *mut T,
    src: *const T,
    src_rs: isize,
    src_width: usize,
    k: usize,
) {
    const BLOCK: usize = 64;
    let zero_tail = src_width != DST_WIDTH && src_width != N && src_width != 2 * N;
    let tiles = transpose_tiles::tile_for::<T>(DST_WIDTH);
    let mut depth = 0;
    while depth < k {
        let block = BLOCK.min(k - depth);
        let block_dst = dst.add(depth * DST_WIDTH);
        // Whole tiles of `tile x tile` elements through SIMD registers, the rest (rows past
        // the panel's last whole tile, depths past the block's) one element at a time.
        let (tiled_rows, tiled_depth) = match tiles {
            Some(tile) => (src_width - src_width % tile, block - block % tile),
            None => (0, 0),
        };
        if let Some(tile) = tiles {
            for j in (0..tiled_rows).step_by(tile) {
                let rows = src.offset(j as isize * src_rs).add(depth);
                for t in (0..tiled_depth).step_by(tile) {
                    transpose_tiles::transpose::<T>(block_dst.add(t * DST_WIDTH + j), DST_WIDTH, rows.add(t), src_rs);
                }
            }
        }
        for j in 0..src_width {
            let row = src.offset(j as isize * src_rs).add(depth);
            let first = if j < tiled_rows { tiled_depth } else { 0 };
            for t in first..block {
                *block_dst.add(t * DST_WIDTH + j) = *row.add(t);
            }
        }
        if zero_tail {
            for t in 0..block {
                quick_zero::<T>(core::slice::from_raw_parts_mut(
                    block_dst.add(t * DST_WIDTH + src_width) as _,
                    DST_WIDTH - src_width,
                ));
            }
        }
        depth += block;
    }
}

#[inline(always)]
unsafe fn pack_generic_inner_loop<T: Copy, const N: usize, const DST_WIDTH: usize>(
    mut dst: *mut T,
    mut src: *const T,
    src_rs: isize,
    src_cs: isize,
    src_width: usize,
    k: usize,
) {
    // regflow patch: a transposed operand is packed by blocks (see `pack_rows_blocked`)
    // where whole SIMD tiles move it, or where its rows lie far apart. Element by element,
    // rows closer than `BLOCKED_MIN_ROW_BYTES` spread over enough cache sets for
    // upstream's gather, which is faster on small operands; tiles beat both at every row
    // distance measured (32 B to 4 KiB).
    if src_rs != 1
        && src_cs == 1
        && (transpose_tiles::tile_for::<T>(DST_WIDTH).is_some_and(|tile| src_width >= tile)
            || src_rs.unsigned_abs() * core::mem::size_of::<T>() >= BLOCKED_MIN_ROW_BYTES)
        && BLOCKED_PACKING.load(core::sync::atomic::Ordering::Relaxed)
    {
        pack_rows_blocked::<T, N, DST_WIDTH>(dst, src, src_rs, src_width, k);
        return;
    }
    if src_width == DST_WIDTH {
        if src_rs == 1 {
            for _ in 0..k {
                let val = (src as *const [T; DST_WIDTH]).read();
                (dst as *mut [T; DST_WIDTH]).write(val);

                src = src.wrapping_offset(src_cs);
                dst = dst.add(DST_WIDTH);
            }
        } else {
            for _ in 0..k {
                for j in 0..DST_WIDTH {
                    *dst.add(j) = *src.offset(j as isize * src_rs);
                }
                src = src.wrapping_offset(src_cs);
                dst = dst.add(DST_WIDTH);
            }
        }
    } else if src_width == N {
        if src_rs == 1 {
            for _ in 0..k {
                let val = (src as *const [T; N]).read();
                (dst as *mut [T; N]).write(val);

                src = src.wrapping_offset(src_cs);
                dst = dst.add(DST_WIDTH);
            }
        } else {
            for _ in 0..k {
                for j in 0..N {
                    *dst.add(j) = *src.offset(j as isize * src_rs);
                }
                src = src.wrapping_offset(src_cs);
                dst = dst.add(DST_WIDTH);
            }
        }
    } else if src_width == 2 * N {
        if src_rs == 1 {
            for _ in 0..k {
                let val0 = (src as *const [T; N]).read();
                let val1 = (src.add(N) as *const [T; N]).read();
                (dst as *mut [T; N]).write(val0);
                (dst.add(N) as *mut [T; N]).write(val1);

                src = src.wrapping_offset(src_cs);
                dst = dst.add(DST_WIDTH);
            }
        } else {
            for _ in 0..k {
                for j in 0..2 * N {
                    *dst.add(j) = *src.offset(j as isize * src_rs);
                }
                src = src.wrapping_offset(src_cs);
                dst = dst.add(DST_WIDTH);
            }
        }
    } else {
        if src_rs == 1 {
            for _ in 0..k {
                quick_copy(dst, src, src_width);
                quick_zero::<T>(core::slice::from_raw_parts_mut(
                    dst.add(src_width) as _,
                    DST_WIDTH - src_width,
                ));
                src = src.wrapping_offset(src_cs);
                dst = dst.add(DST_WIDTH);
            }
        } else {
            for _ in 0..k {
                for j in 0..src_width {
                    *dst.add(j) = *src.offset(j as isize * src_rs);
                }
                quick_zero::<T>(core::slice::from_raw_parts_mut(
                    dst.add(src_width) as _,
                    DST_WIDTH - src_width,
                ));
                src = src.wrapping_offset(src_cs);
                dst = dst.add(DST_WIDTH);
            }
        }
    }
}

#[inline(always)]
unsafe fn pack_generic<T: Copy, const N: usize, const DST_WIDTH: usize>(
    m: usize,
    k: usize,
    mut dst: *mut T,
    mut src: *const T,
    src_cs: isize,
    src_rs: isize,
    dst_stride: usize,
) {
    let m_width = m / DST_WIDTH * DST_WIDTH;

    let mut i = 0;
    // regflow patch: two or more full panels of an operand whose panel elements of a step
    // lie next to each other are packed in the order of its rows (`pack_panels_by_rows`).
    if packs_by_rows(src_rs, m_width / DST_WIDTH) {
        let panels = m_width / DST_WIDTH;
        pack_panels_by_rows::<T, DST_WIDTH>(panels, k, dst, src, src_cs, dst_stride);
        src = src.wrapping_offset(src_rs * m_width as isize);
        dst = dst.add(panels * dst_stride);
        i = m_width;
    }
    while i < m_width {
        pack_generic_inner_loop::<_, N, DST_WIDTH>(dst, src, src_rs, src_cs, DST_WIDTH, k);
        src = src.wrapping_offset(src_rs * DST_WIDTH as isize);
        dst = dst.add(dst_stride);

        i += DST_WIDTH;
    }
    if i < m {
        pack_generic_inner_loop::<_, N, DST_WIDTH>(dst, src, src_rs, src_cs, m - i, k);
    }
}

#[inline(never)]
pub unsafe fn pack_lhs<T: Copy, const N: usize, const MR: usize, S: Simd>(
    _: S,
    m: usize,
    k: usize,
    dst: crate::Ptr<T>,
    src: crate::Ptr<T>,
    src_cs: isize,
    src_rs: isize,
    dst_stride: usize,
) {
    let dst = dst.0;
    let src = src.0;
    S::vectorize(
        #[inline(always)]
        || pack_generic::<T, N, MR>(m, k, dst, src, src_cs, src_rs, dst_stride),
    );
}

#[inline(never)]
pub unsafe fn pack_rhs<T: Copy, const N: usize, const NR: usize, S: Simd>(
    _: S,
    n: usize,
    k: usize,
    dst: crate::Ptr<T>,
    src: crate::Ptr<T>,
    src_cs: isize,
    src_rs: isize,
    dst_stride: usize,
) {
    let dst = dst.0;
    let src = src.0;
    S::vectorize(
        #[inline(always)]
        || pack_generic::<T, N, NR>(n, k, dst, src, src_rs, src_cs, dst_stride),
    );
}

/// regflow patch: whether full panels whose elements of a step lie next to each other are
/// packed in the order of the operand's rows (`pack_panels_by_rows`), and a row chunk's
/// left-hand panels all at once; on unless a test turns it off to compare with upstream's
/// panel-by-panel packing.
static ROW_PACKING: core::sync::atomic::AtomicBool = core::sync::atomic::AtomicBool::new(true);

/// regflow patch: turns the packing of panels row by row on or off, process-wide, from the
/// next packing on. Packing only moves values, so a product's result is the
/// same bits either way; tests compare the two to check exactly that.
pub fn set_row_packing(on: bool) {
    ROW_PACKING.store(on, core::sync::atomic::Ordering::Relaxed);
}

/// regflow patch: whether `panels` full panels of an operand whose panel elements of a
/// step lie `src_rs` apart are packed in the order of its rows (`pack_panels_by_rows`):
/// where those elements lie next to each other, there are two panels or more, and
/// [`set_row_packing`] left it on.
#[inline]
pub(crate) fn packs_by_rows(src_rs: isize, panels: usize) -> bool {
    src_rs == 1 && panels >= 2 && ROW_PACKING.load(core::sync::atomic::Ordering::Relaxed)
}

/// regflow patch: packs `panels` full panels of `DST_WIDTH` elements a step, for `k`
/// steps, from an operand whose panel elements of a step lie next to each other (step `p`
/// of panel `i` starts at `src + p * src_cs + i * DST_WIDTH`), into panels `dst_stride`
/// elements apart: the values and places of `pack_generic_inner_loop` panel by panel, in
/// the order of the operand's rows instead.
///
/// Why: panel by panel, each step of a panel is a short read (64 bytes of a 16-wide `f32`
/// panel, 24 of a 6-wide one) a row of the operand after the last: for a 1024-wide `f32`
/// matrix, a new 4 KiB page at every step, which the hardware prefetchers do not follow
/// across pages. Row by row, each step of all the panels is one run of
/// `panels * DST_WIDTH` elements (REGFLOW.md, section 8).
#[inline(always)]
unsafe fn pack_panels_by_rows<T: Copy, const DST_WIDTH: usize>(
    panels: usize,
    k: usize,
    dst: *mut T,
    src: *const T,
    src_cs: isize,
    dst_stride: usize,
) {
    for p in 0..k {
        let step = src.wrapping_offset(p as isize * src_cs);
        for i in 0..panels {
            let values = (step.add(i * DST_WIDTH) as *const [T; DST_WIDTH]).read_unaligned();
            (dst.add(i * dst_stride + p * DST_WIDTH) as *mut [T; DST_WIDTH]).write_unaligned(values);
        }
    }
}
