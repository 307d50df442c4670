// Scaled dot-product attention in one op (`attention`, `attention_grad`): the scores of
// one (sequence, head) are made a tile of keys at a time and folded into a running
// softmax (flash attention), so the [T, T] scores and probabilities are never stored. The
// gradient recomputes the probabilities from the forward's log-sum-exp (`lse`).
//
// q, k, v, out and their gradients are [B, T, H, D] (the projections' rows reshaped):
// row t of head h of sequence b starts at ((b·T + t)·H + h)·D, so one head's rows are
// H·D elements apart. lse and the gradient's row dots are [B, H, Tq].
//
// Two kinds of entry:
// - tensor cores (bf16 and f16, D of 16, 32, 64 or 128, compute capability 8.0 and up):
//   `mma.sync` m16n8k16 with f32 accumulation. A block of 4 warps takes 64 rows (queries
//   for the forward and dq, keys for dk/dv), 16 per warp; the other side streams through
//   shared memory in tiles. Probabilities and their gradients are rounded to the 16-bit
//   type before their products, as tensor cores take them. Every output element is one
//   thread's sum in a fixed order: no atomics, so results are deterministic. Below 8.0
//   the entries trap; the host never picks them there.
// - one thread per row (every float type, D up to ATT_SIMT_MAX_D): f32 or f64 arithmetic
//   in the order of the CPU kernel (keys in order, one online-softmax pass).

#define ATT_LOG2E 1.4426950408889634f
#define ATT_LN2 0.6931471805599453f

// 2^x in the tensor-core entries: the hardware's `ex2.approx.ftz` alone (relative error
// about 2^-22, results below 2^-126 flushed to 0), as flash attention gets it by compiling
// with --use_fast_math. `exp2f` wraps the same instruction in a range test and two
// multiplies to keep results below 2^-126 exact: a probability that small never shows in a
// 16-bit product, and the three instructions are 64 a lane per tile in the forward (a
// sixth of its loop), where the entries are bound by issuing instructions. The forward,
// dq and dk/dv all take it, so the gradient recomputes the forward's probabilities.
// ATT_FAST_EXP2=0 (REGFLOW_CUDA_DEFINES) takes `exp2f`, as before.
#ifndef ATT_FAST_EXP2
#define ATT_FAST_EXP2 1
#endif
__device__ __forceinline__ float att_exp2(float x) {
#if ATT_FAST_EXP2
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#else
    return exp2f(x);
#endif
}
#define ATT_ROWS 64        // rows of a tensor-core block: 16 per warp
#define ATT_THREADS 128    // 4 warps
#define ATT_SIMT_THREADS 128
#define ATT_SIMT_MAX_D 256
// How many blocks of the tensor-core entries an SM holds at once is set by their registers
// per thread (65536 per SM; 128 threads a block): left alone, ptxas gave the forward 132,
// dq 164 and dk/dv 248 at D = 64, so 3, 3 and 2 blocks, 2-3 warps per scheduler, and Nsight
// Compute found all three latency-bound. At D = 64 the entries are compiled to fit 4, 4
// and 3 (`__launch_bounds__`'s second argument caps the registers at 128, 128 and 168; a
// few values then go through local memory, which ptxas reports and
// `cuda/tests/nvrtc_sources.rs` bounds), and at every D dq, dk and dv take a tile's other
// side in parts of ATT_PART rows, so a thread holds a part's scores and score gradients,
// not the whole tile's. Every accumulator takes the same products in the same order either
// way, so the results are the same bits. Both are macros so that a GPU session can time
// the entries unbounded and with whole tiles, as they were (but for 32-bit tile counters),
// without a rebuild: REGFLOW_CUDA_DEFINES="ATT_OCCUPANCY=0,ATT_PART=64" (`sources.rs`).
#ifndef ATT_OCCUPANCY
#define ATT_OCCUPANCY 1
#endif
#ifndef ATT_PART
#define ATT_PART 16
#endif
// An entry's bounds by head size, pasted from it (`ATT_FIT4_##D`): the entry-name reader
// in `sources.rs` takes the last word before the first parenthesis after `void`. Only D =
// 64 is capped: smaller heads already fit as many blocks or more (a cap of 128 registers
// let ptxas give the D = 16 forward 127, down from 6 blocks to 4), and D = 128 spills.
#if ATT_OCCUPANCY
#define ATT_FIT4_64 __launch_bounds__(ATT_THREADS, 4)
#define ATT_FIT3_64 __launch_bounds__(ATT_THREADS, 3)
#else
#define ATT_FIT4_64 __launch_bounds__(ATT_THREADS)
#define ATT_FIT3_64 __launch_bounds__(ATT_THREADS)
#endif
#define ATT_FIT4_16 __launch_bounds__(ATT_THREADS)
#define ATT_FIT4_32 __launch_bounds__(ATT_THREADS)
#define ATT_FIT4_128 __launch_bounds__(ATT_THREADS)
#define ATT_FIT3_16 __launch_bounds__(ATT_THREADS)
#define ATT_FIT3_32 __launch_bounds__(ATT_THREADS)
#define ATT_FIT3_128 __launch_bounds__(ATT_THREADS)

typedef unsigned short h16;  // a 16-bit float's bits, bf16 or f16

// The 16-bit types' conversions and product instruction.
template <typename T> struct Tc;
template <> struct Tc<bf16> {
    // Two values rounded to nearest even, `lo` in the low half: one instruction from 8.0
    // on (the tensor-core entries run nowhere older).
    static __device__ __forceinline__ u32 pack(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
        u32 r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
#else
        return (u32)f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16);
#endif
    }
    // c += a·b for a 16x16 (row) by 16x8 (column) tile.
    static __device__ __forceinline__ void mma(float* c, const u32* a, u32 b0, u32 b1) {
#if __CUDA_ARCH__ >= 800
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
        __trap();
#endif
    }
};
template <> struct Tc<f16> {
    static __device__ __forceinline__ u32 pack(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
        u32 r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
#else
        return (u32)f32_to_f16(lo).bits | ((u32)f32_to_f16(hi).bits << 16);
#endif
    }
    static __device__ __forceinline__ void mma(float* c, const u32* a, u32 b0, u32 b1) {
#if __CUDA_ARCH__ >= 800
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
        __trap();
#endif
    }
};

__device__ __forceinline__ u32 att_ld32(const h16* p) { return *reinterpret_cast<const u32*>(p); }
__device__ __forceinline__ float att_quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float att_quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// The shared-memory address of `p`, as `ldmatrix` takes it.
__device__ __forceinline__ u32 att_shared(const void* p) {
    u32 a;
    asm("{ .reg .u64 s; cvta.to.shared.u64 s, %1; cvt.u32.u64 %0, s; }" : "=r"(a) : "l"(p));
    return a;
}

// Starts copying rows `row0 .. row0 + ROWS` of one head (rows `stride` apart) into a shared
// tile, zeros past `rows` (`cp.async` with a source size of 0): the copy runs while the
// block computes on the other tile, and `att_wait` ends it. Every thread takes part.
//
// Where the block's threads take the tile's 16-byte chunks in whole rounds (every tile of
// these entries: 64 rows of D / 8 chunks, D / 8 dividing the 128 threads), a thread's chunks
// are the same column `j` of rows `step` apart, so the rounds are unrolled and each costs an
// add to a row, a 32-bit bounds test (positions are below 2^31, see att_pipeline) and one
// 64-bit multiply-add: the general loop below re-derived row and column by division and
// tested bounds in 64 bits, about 25 instructions a chunk, a fifth of the forward's
// per-tile loop. The same chunks land in the same places, so the bits are unchanged.
// ATT_TILE_LOADS=0 (REGFLOW_CUDA_DEFINES) takes the general loop for every tile, as before.
#ifndef ATT_TILE_LOADS
#define ATT_TILE_LOADS 1
#endif
template <int D, int ROWS>
__device__ __forceinline__ void att_load_tile(h16 (*tile)[D + 8], const h16* head, u64 row0, u64 rows, u64 stride) {
    const int chunks = D / 8;
    if (ATT_TILE_LOADS && ATT_THREADS % chunks == 0 && (ROWS * chunks) % ATT_THREADS == 0) {
        const int step = ATT_THREADS / chunks, r0 = threadIdx.x / chunks, j = threadIdx.x % chunks;
        const h16* column = head + j * 8;
        const u32 to = att_shared(&tile[r0][j * 8]);
#pragma unroll
        for (int i = 0; i < ROWS * chunks / ATT_THREADS; ++i) {
            const u32 row = (u32)row0 + (u32)(r0 + i * step);
            const bool inside = row < (u32)rows;
            const h16* from = inside ? column + (u64)row * stride : head;
#if __CUDA_ARCH__ >= 800
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(
                             to + (u32)(i * step * (D + 8) * sizeof(h16))),
                         "l"(from), "r"(inside ? 16 : 0));
#else
            (void)from;
            (void)to;
            __trap();
#endif
        }
        return;
    }
    for (int c = threadIdx.x; c < ROWS * chunks; c += ATT_THREADS) {
        const int r = c / chunks, j = c % chunks;
        const bool inside = row0 + r < rows;
        const h16* from = inside ? head + (row0 + r) * stride + j * 8 : head;
#if __CUDA_ARCH__ >= 800
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(att_shared(&tile[r][j * 8])), "l"(from),
                     "r"(inside ? 16 : 0));
#else
        (void)from;
        __trap();
#endif
    }
}

// Starts copying the 4 bytes at `from` to `to` in shared memory (zeros where not `inside`),
// in the current group of copies.
__device__ __forceinline__ void att_copy4(float* to, const float* from, bool inside) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(att_shared(to)), "l"(from), "r"(inside ? 4 : 0));
#else
    (void)to;
    (void)from;
    (void)inside;
    __trap();
#endif
}

// Closes the group of copies started since the last one.
__device__ __forceinline__ void att_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;");
#endif
}

// Waits until at most `N` groups of this thread's copies are in flight (then a barrier
// makes every thread's copies visible to the block).
template <int N> __device__ __forceinline__ void att_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
#endif
}

// Tiles in flight: two (one computed on while the next loads) where two pairs of tiles fit
// 40 KiB of shared memory, else one.
template <int D, int ROWS> struct Stages {
    static const int n = 2 * 2 * ROWS * (D + 8) * 2 <= 40960 ? 2 : 1;
};

// Runs `body(tile, stage)` over `tiles` tiles whose shared copies `load(tile, stage)` starts
// (and commits): with two stages the next tile loads while the block computes on this one,
// with one it loads after. Every thread of the block takes part. Tiles are counted in 32
// bits, and `tile * KT` (a position) too: the host takes sequences of fewer than 2^31
// positions here, and 32-bit counters leave the entries registers they need.
template <int S, typename Load, typename Body>
__device__ __forceinline__ void att_pipeline(u32 tiles, Load load, Body body) {
    if (tiles > 0) load(0, 0);
    for (u32 tile = 0; tile < tiles; ++tile) {
        const int stage = S == 2 ? (int)(tile & 1) : 0;
        if (S == 2 && tile + 1 < tiles) {
            load(tile + 1, stage ^ 1);
            att_wait<1>();
        } else {
            att_wait<0>();
        }
        __syncthreads();
        body(tile, stage);
        __syncthreads();
        if (S == 1 && tile + 1 < tiles) load(tile + 1, 0);
    }
}

// The end of the keys a block of queries from `block0` attends.
__device__ __forceinline__ u64 att_key_end(u64 block0, u64 tk, u32 causal) {
    return causal ? (block0 + ATT_ROWS < tk ? block0 + ATT_ROWS : tk) : tk;
}

// The A fragments (16 rows by D) of rows `lo` and `lo + 8` of a head, zeros past `rows`.
template <int D>
__device__ __forceinline__ void att_load_rows(u32 (*a)[4], const h16* head, u64 lo, u64 rows, u64 stride, int t4) {
    const u64 hi = lo + 8;
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
        int col = kc * 16 + 2 * t4;
        a[kc][0] = lo < rows ? att_ld32(head + lo * stride + col) : 0u;
        a[kc][1] = hi < rows ? att_ld32(head + hi * stride + col) : 0u;
        a[kc][2] = lo < rows ? att_ld32(head + lo * stride + col + 8) : 0u;
        a[kc][3] = hi < rows ? att_ld32(head + hi * stride + col + 8) : 0u;
    }
}

// Four 8x8 matrices of 16-bit values from shared memory, one per register: lanes 8i..8i+7
// give the row addresses of matrix i. Plain, each lane gets (row lane/4, columns 2·(lane%4)
// and +1); transposed (`.trans`), (rows 2·(lane%4) and +1, column lane/4): either way one
// instruction fills the B fragments of two m16n8k16 products.
__device__ __forceinline__ void att_ldmatrix(u32* r, u32 address) {
#if __CUDA_ARCH__ >= 800
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
#else
    __trap();
#endif
}
__device__ __forceinline__ void att_ldmatrix_trans(u32* r, u32 address) {
#if __CUDA_ARCH__ >= 800
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
#else
    __trap();
#endif
}

// c[N/8] = a (16 x D, fragments) · tileᵀ for tile rows 0..N (each tile row one column of
// the product): scores from queries and a key tile, or dout and a value tile. The B
// fragments of n-tiles nt and nt + 1 come from one `ldmatrix`: matrix i of lane l's address
// is tile row nt·8 + (i/2)·8 + l%8, columns kc·16 + (i%2)·8.
template <typename T, int D, int N>
__device__ __forceinline__ void att_times_rows(float (*c)[4], u32 (*a)[4], h16 (*tile)[D + 8], int lane) {
    const int m = lane >> 3;
    const u32 base = att_shared(&tile[(m >> 1) * 8 + (lane & 7)][(m & 1) * 8]);
#pragma unroll
    for (int nt = 0; nt < N / 8; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) c[nt][i] = 0.f;
#pragma unroll
    for (int nt = 0; nt < N / 8; nt += 2) {
#pragma unroll
        for (int kc = 0; kc < D / 16; ++kc) {
            u32 b[4];
            att_ldmatrix(b, base + (u32)((nt * 8 * (D + 8) + kc * 16) * sizeof(h16)));
            Tc<T>::mma(c[nt], a[kc], b[0], b[1]);
            Tc<T>::mma(c[nt + 1], a[kc], b[2], b[3]);
        }
    }
}

// acc[D/8] += p (16 x N, accumulator layout, rounded here) · tile (N rows by D). The B
// fragments of d-tiles dt and dt + 1 come from one transposed `ldmatrix`: matrix i of lane
// l's address is tile row kc·16 + (i%2)·8 + l%8, columns (dt + i/2)·8.
template <typename T, int D, int N>
__device__ __forceinline__ void att_times_tile(float (*acc)[4], float (*p)[4], h16 (*tile)[D + 8], int lane) {
    const int m = lane >> 3;
    const u32 base = att_shared(&tile[(m & 1) * 8 + (lane & 7)][(m >> 1) * 8]);
#pragma unroll
    for (int kc = 0; kc < N / 16; ++kc) {
        u32 a[4];
        a[0] = Tc<T>::pack(p[2 * kc][0], p[2 * kc][1]);
        a[1] = Tc<T>::pack(p[2 * kc][2], p[2 * kc][3]);
        a[2] = Tc<T>::pack(p[2 * kc + 1][0], p[2 * kc + 1][1]);
        a[3] = Tc<T>::pack(p[2 * kc + 1][2], p[2 * kc + 1][3]);
#pragma unroll
        for (int dt = 0; dt < D / 8; dt += 2) {
            u32 b[4];
            att_ldmatrix_trans(b, base + (u32)((kc * 16 * (D + 8) + dt * 8) * sizeof(h16)));
            Tc<T>::mma(acc[dt], a, b[0], b[1]);
            Tc<T>::mma(acc[dt + 1], a, b[2], b[3]);
        }
    }
}

// Rows `lo` and `lo + 8` of the accumulators, times `scale_lo` / `scale_hi`, stored.
template <typename T, int D>
__device__ __forceinline__ void att_store_rows(h16* head, float (*acc)[4], u64 lo, u64 rows, u64 stride, int t4,
                                               float scale_lo, float scale_hi) {
    const u64 hi = lo + 8;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
        int col = dt * 8 + 2 * t4;
        if (lo < rows)
            *reinterpret_cast<u32*>(head + lo * stride + col) = Tc<T>::pack(acc[dt][0] * scale_lo, acc[dt][1] * scale_lo);
        if (hi < rows)
            *reinterpret_cast<u32*>(head + hi * stride + col) = Tc<T>::pack(acc[dt][2] * scale_hi, acc[dt][3] * scale_hi);
    }
}

template <int D>
__device__ __forceinline__ void att_zero(float (*acc)[4]) {
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[dt][i] = 0.f;
}

// The forward: a block per 64 queries of one (sequence, head) (blockIdx.x, blockIdx.y).
template <typename T, int D, int PACK>
__device__ void att_forward_tc(const h16* q, const h16* k, const h16* v, h16* out, float* lse, u64 tq, u64 tk,
                               u64 heads, float scale, u32 causal) {
    const u64 pack = PACK;
    const int KT = 64, S = Stages<D, KT>::n;
    __shared__ __align__(16) h16 ks[S][KT][D + 8];
    __shared__ __align__(16) h16 vs[S][KT][D + 8];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    // q, k and v rows of `PACK · D` values (a packed qkv's), out's of D.
    const u64 bh = blockIdx.y, b = bh / heads, h = bh % heads, stride = heads * D;
    const u32 in_stride = (u32)heads * (D * PACK);
    const h16* qh = q + (b * tq * heads + h) * D * pack;
    const h16* kh = k + (b * tk * heads + h) * D * pack;
    const h16* vh = v + (b * tk * heads + h) * D * pack;
    const u64 block0 = (u64)blockIdx.x * ATT_ROWS, lo = block0 + warp * 16 + g, hi = lo + 8;
    u32 qa[D / 16][4];
    att_load_rows<D>(qa, qh, lo, tq, in_stride, t4);
    float o[D / 8][4];
    att_zero<D>(o);
    // Running max (log2 units) and the thread's part of the running sum, per row.
    float m_lo = minus_infinity<float>(), m_hi = minus_infinity<float>(), l_lo = 0.f, l_hi = 0.f;
    const float c = scale * ATT_LOG2E;
    const u32 tiles = (u32)((att_key_end(block0, tk, causal) + KT - 1) / KT);
    auto load = [&](u32 tile, int stage) {
        att_load_tile<D, KT>(ks[stage], kh, tile * KT, tk, in_stride);
        att_load_tile<D, KT>(vs[stage], vh, tile * KT, tk, in_stride);
        att_commit();
    };
    att_pipeline<S>(tiles, load, [&](u32 tile, int st) {
        const u64 key0 = tile * KT;
        float s[KT / 8][4];
        att_times_rows<T, D, KT>(s, qa, ks[st], lane);
        float mx_lo = minus_infinity<float>(), mx_hi = minus_infinity<float>();
        // Only a tile past the keys' end or across the diagonal has pairs to mask.
        const bool edge = key0 + KT > tk || (causal && key0 + KT > block0 + 1);
#pragma unroll
        for (int nt = 0; nt < KT / 8; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const u32 key = (u32)key0 + nt * 8 + 2 * t4 + (i & 1), row = (u32)(i < 2 ? lo : hi);
                float x = (!edge || (key < (u32)tk && !(causal && key > row))) ? s[nt][i] * c : minus_infinity<float>();
                s[nt][i] = x;
                if (i < 2) mx_lo = fmaxf(mx_lo, x);
                else mx_hi = fmaxf(mx_hi, x);
            }
        const float new_lo = fmaxf(m_lo, att_quad_max(mx_lo)), new_hi = fmaxf(m_hi, att_quad_max(mx_hi));
        // A row with no key yet keeps a base of 0, so no -inf - -inf is taken.
        const float base_lo = new_lo == minus_infinity<float>() ? 0.f : new_lo, base_hi = new_hi == minus_infinity<float>() ? 0.f : new_hi;
        const float a_lo = att_exp2(m_lo - base_lo), a_hi = att_exp2(m_hi - base_hi);
        m_lo = new_lo;
        m_hi = new_hi;
        l_lo *= a_lo;
        l_hi *= a_hi;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
            o[dt][0] *= a_lo;
            o[dt][1] *= a_lo;
            o[dt][2] *= a_hi;
            o[dt][3] *= a_hi;
        }
#pragma unroll
        for (int nt = 0; nt < KT / 8; ++nt) {
            s[nt][0] = att_exp2(s[nt][0] - base_lo);
            s[nt][1] = att_exp2(s[nt][1] - base_lo);
            s[nt][2] = att_exp2(s[nt][2] - base_hi);
            s[nt][3] = att_exp2(s[nt][3] - base_hi);
            l_lo += s[nt][0] + s[nt][1];
            l_hi += s[nt][2] + s[nt][3];
        }
        att_times_tile<T, D, KT>(o, s, vs[st], lane);
    });
    l_lo = att_quad_sum(l_lo);
    l_hi = att_quad_sum(l_hi);
    att_store_rows<T, D>(out + (b * tq * heads + h) * D, o, lo, tq, stride, t4, l_lo > 0.f ? 1.f / l_lo : 0.f,
                         l_hi > 0.f ? 1.f / l_hi : 0.f);
    if (t4 == 0) {
        if (lo < tq) lse[bh * tq + lo] = l_lo > 0.f ? (m_lo + log2f(l_lo)) * ATT_LN2 : minus_infinity<float>();
        if (hi < tq) lse[bh * tq + hi] = l_hi > 0.f ? (m_hi + log2f(l_hi)) * ATT_LN2 : minus_infinity<float>();
    }
}

// dq: a block per 64 queries; keys and values stream through shared memory.
template <typename T, int D, int PACK>
__device__ void att_dq_tc(const h16* q, const h16* k, const h16* v, const h16* dout, const float* lse,
                          const float* dots, h16* dq, u64 tq, u64 tk, u64 heads, float scale, u32 causal) {
    const u64 pack = PACK;
    const int KT = D <= 64 ? 64 : 32, KP = ATT_PART < KT ? ATT_PART : KT, S = Stages<D, KT>::n;
    __shared__ __align__(16) h16 ks[S][KT][D + 8];
    __shared__ __align__(16) h16 vs[S][KT][D + 8];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    // q, k, v and dq rows of `PACK · D` values (a packed qkv's), dout's of D.
    const u64 bh = blockIdx.y, b = bh / heads, h = bh % heads, stride = heads * D;
    const u64 in_stride = stride * pack;
    const u64 offset_q = (b * tq * heads + h) * D, offset_k = (b * tk * heads + h) * D * pack;
    const u64 block0 = (u64)blockIdx.x * ATT_ROWS, lo = block0 + warp * 16 + g, hi = lo + 8;
    u32 qa[D / 16][4], da[D / 16][4];
    att_load_rows<D>(qa, q + offset_q * pack, lo, tq, in_stride, t4);
    att_load_rows<D>(da, dout + offset_q, lo, tq, stride, t4);
    const float lse_lo = lo < tq ? lse[bh * tq + lo] * ATT_LOG2E : 0.f, lse_hi = hi < tq ? lse[bh * tq + hi] * ATT_LOG2E : 0.f;
    const float dot_lo = lo < tq ? dots[bh * tq + lo] : 0.f, dot_hi = hi < tq ? dots[bh * tq + hi] : 0.f;
    float acc[D / 8][4];
    att_zero<D>(acc);
    const float c = scale * ATT_LOG2E;
    const u32 tiles = (u32)((att_key_end(block0, tk, causal) + KT - 1) / KT);
    auto load = [&](u32 tile, int stage) {
        att_load_tile<D, KT>(ks[stage], k + offset_k, tile * KT, tk, in_stride);
        att_load_tile<D, KT>(vs[stage], v + offset_k, tile * KT, tk, in_stride);
        att_commit();
    };
    att_pipeline<S>(tiles, load, [&](u32 tile, int st) {
        // The tile's keys in parts of KP: a part's scores and their gradients are all a
        // thread holds of them, and `acc` takes the parts' products in key order, as it
        // would the whole tile's.
#pragma unroll
        for (int part = 0; part < KT / KP; ++part) {
            const u64 key0 = tile * KT + part * KP;
            float s[KP / 8][4], dp[KP / 8][4];
            att_times_rows<T, D, KP>(s, qa, ks[st] + part * KP, lane);
            att_times_rows<T, D, KP>(dp, da, vs[st] + part * KP, lane);
            const bool edge = key0 + KP > tk || (causal && key0 + KP > block0 + 1);
#pragma unroll
            for (int nt = 0; nt < KP / 8; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const u32 key = (u32)key0 + nt * 8 + 2 * t4 + (i & 1), row = (u32)(i < 2 ? lo : hi);
                    const bool ok = !edge || (key < (u32)tk && !(causal && key > row));
                    float p = ok ? att_exp2(s[nt][i] * c - (i < 2 ? lse_lo : lse_hi)) : 0.f;
                    s[nt][i] = p * (dp[nt][i] - (i < 2 ? dot_lo : dot_hi));
                }
            att_times_tile<T, D, KP>(acc, s, ks[st] + part * KP, lane);
        }
    });
    att_store_rows<T, D>(dq + offset_q * pack, acc, lo, tq, in_stride, t4, scale, scale);
}

// dk and dv: a block per 64 keys; queries, their output gradients, lse and dots stream
// through shared memory. The products are taken transposed (keys as rows): sᵀ = k·qᵀ.
template <typename T, int D, int PACK>
__device__ void att_dkv_tc(const h16* q, const h16* k, const h16* v, const h16* dout, const float* lse,
                           const float* dots, h16* dk, h16* dv, u64 tq, u64 tk, u64 heads, float scale, u32 causal) {
    const u64 pack = PACK;
    const int QT = D <= 64 ? 64 : 32, QP = ATT_PART < QT ? ATT_PART : QT, S = Stages<D, QT>::n;
    __shared__ __align__(16) h16 qs[S][QT][D + 8];
    __shared__ __align__(16) h16 ds[S][QT][D + 8];
    __shared__ float ls[S][QT], dd[S][QT];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    // q, k, v, dk and dv rows of `PACK · D` values (a packed qkv's), dout's of D.
    const u64 bh = blockIdx.y, b = bh / heads, h = bh % heads, stride = heads * D;
    const u32 in_stride = (u32)heads * (D * PACK);
    const u64 offset_q = (b * tq * heads + h) * D, offset_k = (b * tk * heads + h) * D * pack;
    const u64 block0 = (u64)blockIdx.x * ATT_ROWS, lo = block0 + warp * 16 + g, hi = lo + 8;
    u32 ka[D / 16][4], va[D / 16][4];
    att_load_rows<D>(ka, k + offset_k, lo, tk, in_stride, t4);
    att_load_rows<D>(va, v + offset_k, lo, tk, in_stride, t4);
    float dk_acc[D / 8][4], dv_acc[D / 8][4];
    att_zero<D>(dk_acc);
    att_zero<D>(dv_acc);
    const float c = scale * ATT_LOG2E;
    // Causal: queries before the block's first key attend none of its keys.
    const u64 first = causal ? block0 : 0;
    const u32 tiles = first < tq ? (u32)((tq - first + QT - 1) / QT) : 0u;
    // At D = 16 and 32 the copies' registers cost the entries blocks per SM (sm_90, D = 16:
    // 69 registers unbounded, 118 with them), and their tiles are too short for the wait
    // to matter as much.
    const bool copied_lse = ATT_TILE_LOADS && D >= 64;
    auto load = [&](u32 tile, int stage) {
        const u64 q0 = first + tile * QT;
        att_load_tile<D, QT>(qs[stage], q + offset_q * pack, q0, tq, in_stride);
        att_load_tile<D, QT>(ds[stage], dout + offset_q, q0, tq, stride);
        if (copied_lse) {
            // The rows' lse and dots copied as the tiles are (zeros past tq), in the same
            // group: loaded into registers and stored, they held every tile's barrier for a
            // memory round trip. lse is kept as it is and taken to log2 units where read.
            for (int r = threadIdx.x; r < QT; r += ATT_THREADS) {
                const bool inside = q0 + r < tq;
                const u64 at = inside ? bh * tq + q0 + r : 0;
                att_copy4(&ls[stage][r], lse + at, inside);
                att_copy4(&dd[stage][r], dots + at, inside);
            }
            att_commit();
        } else {
            att_commit();
            for (int r = threadIdx.x; r < QT; r += ATT_THREADS) {
                ls[stage][r] = q0 + r < tq ? lse[bh * tq + q0 + r] * ATT_LOG2E : 0.f;
                dd[stage][r] = q0 + r < tq ? dots[bh * tq + q0 + r] : 0.f;
            }
        }
    };
    att_pipeline<S>(tiles, load, [&](u32 tile, int st) {
        // The tile's queries in parts of QP (as dq's keys): dv and dk take the parts'
        // products in query order, as they would the whole tile's.
#pragma unroll
        for (int part = 0; part < QT / QP; ++part) {
            const u64 q0 = first + tile * QT + part * QP;
            float s[QP / 8][4], dp[QP / 8][4];
            att_times_rows<T, D, QP>(s, ka, qs[st] + part * QP, lane);
            att_times_rows<T, D, QP>(dp, va, ds[st] + part * QP, lane);
            // Only a part past the queries' end or across the diagonal has pairs to mask.
            const bool edge = q0 + QP > tq || (causal && q0 < block0 + ATT_ROWS);
#pragma unroll
            for (int nt = 0; nt < QP / 8; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int r = part * QP + nt * 8 + 2 * t4 + (i & 1);
                    const u32 query = (u32)(first + tile * QT) + r, key = (u32)(i < 2 ? lo : hi);
                    const bool ok = !edge || (query < (u32)tq && !(causal && key > query));
                    if (copied_lse) {
                        // The product the copy loop's other branch takes (0 stays 0), taken
                        // outside the select: inside it, ptxas gave a loop of 1503
                        // instructions a tile at D = 64, against 1230.
                        const float l = ls[st][r] * ATT_LOG2E;
                        s[nt][i] = ok ? att_exp2(s[nt][i] * c - l) : 0.f;
                    } else {
                        s[nt][i] = ok ? att_exp2(s[nt][i] * c - ls[st][r]) : 0.f;
                    }
                    dp[nt][i] = s[nt][i] * (dp[nt][i] - dd[st][r]);
                }
            att_times_tile<T, D, QP>(dv_acc, s, ds[st] + part * QP, lane);
            att_times_tile<T, D, QP>(dk_acc, dp, qs[st] + part * QP, lane);
        }
    });
    att_store_rows<T, D>(dk + offset_k, dk_acc, lo, tk, in_stride, t4, scale, scale);
    att_store_rows<T, D>(dv + offset_k, dv_acc, lo, tk, in_stride, t4, 1.f, 1.f);
}

// The tensor-core entries for one 16-bit type and head size: `regflow_attention_*_<S>`
// with S = <type>_d<D>, over q, k and v apart (P = 1) or, with S = <type>_d<D>_qkv, over one
// packed qkv (P = 3: the host passes q, k and v as its address plus 0, D and 2·D). The
// packing is a template argument, not a launch's: as a run-time value its strides cost the
// registers that spill at the blocks per SM these entries are bounded to.
#define ATTENTION_TC(S, T, D)                                                                                    \
    extern "C" __global__ void ATT_FIT4_##D                                                                 \
        regflow_attention_fwd_##S(const h16* q, const h16* k, const h16* v, h16* out, float* lse, u64 tq,       \
                                  u64 tk, u64 heads, float scale, u32 causal) {                                  \
        att_forward_tc<T, D, 1>(q, k, v, out, lse, tq, tk, heads, scale, causal);                                \
    }                                                                                                            \
    extern "C" __global__ void ATT_FIT4_##D                                                                 \
        regflow_attention_dq_##S(const h16* q, const h16* k, const h16* v, const h16* dout, const float* lse,   \
                                 const float* dots, h16* dq, u64 tq, u64 tk, u64 heads, float scale,             \
                                 u32 causal) {                                                                   \
        att_dq_tc<T, D, 1>(q, k, v, dout, lse, dots, dq, tq, tk, heads, scale, causal);                          \
    }                                                                                                            \
    extern "C" __global__ void ATT_FIT3_##D                                                                 \
        regflow_attention_dkv_##S(const h16* q, const h16* k, const h16* v, const h16* dout, const float* lse,  \
                                  const float* dots, h16* dk, h16* dv, u64 tq, u64 tk, u64 heads, float scale,   \
                                  u32 causal) {                                                                  \
        att_dkv_tc<T, D, 1>(q, k, v, dout, lse, dots, dk, dv, tq, tk, heads, scale, causal);                     \
    }                                                                                                            \
    extern "C" __global__ void ATT_FIT4_##D                                                                 \
        regflow_attention_fwd_##S##_qkv(const h16* q, const h16* k, const h16* v, h16* out, float* lse, u64 tq, \
                                        u64 tk, u64 heads, float scale, u32 causal) {                            \
        att_forward_tc<T, D, 3>(q, k, v, out, lse, tq, tk, heads, scale, causal);                                \
    }                                                                                                            \
    extern "C" __global__ void ATT_FIT4_##D                                                                 \
        regflow_attention_dq_##S##_qkv(const h16* q, const h16* k, const h16* v, const h16* dout,              \
                                       const float* lse, const float* dots, h16* dq, u64 tq, u64 tk, u64 heads,  \
                                       float scale, u32 causal) {                                                \
        att_dq_tc<T, D, 3>(q, k, v, dout, lse, dots, dq, tq, tk, heads, scale, causal);                          \
    }                                                                                                            \
    extern "C" __global__ void ATT_FIT3_##D                                                                 \
        regflow_attention_dkv_##S##_qkv(const h16* q, const h16* k, const h16* v, const h16* dout,             \
                                        const float* lse, const float* dots, h16* dk, h16* dv, u64 tq, u64 tk,   \
                                        u64 heads, float scale, u32 causal) {                                    \
        att_dkv_tc<T, D, 3>(q, k, v, dout, lse, dots, dk, dv, tq, tk, heads, scale, causal);                     \
    }
ATTENTION_TC(bf16_d16, bf16, 16)
ATTENTION_TC(bf16_d32, bf16, 32)
ATTENTION_TC(bf16_d64, bf16, 64)
ATTENTION_TC(bf16_d128, bf16, 128)
ATTENTION_TC(f16_d16, f16, 16)
ATTENTION_TC(f16_d32, f16, 32)
ATTENTION_TC(f16_d64, f16, 64)
ATTENTION_TC(f16_d128, f16, 128)

// ---- One thread per row: every float type, any D up to ATT_SIMT_MAX_D. ----

template <typename T, typename W>
__device__ __forceinline__ W att_dot(const T* a, const T* b, u64 d) {
    W s = W(0);
    for (u64 i = 0; i < d; ++i) s += (W)ld(a + i) * (W)ld(b + i);
    return s;
}

// The forward, a thread per query (blockIdx.x · blockDim.x + threadIdx.x, head blockIdx.y).
template <typename T>
__device__ void att_forward_simt(const T* q, const T* k, const T* v, T* out, typename Wide<T>::type* lse, u64 tq,
                                 u64 tk, u64 heads, u64 pack, u64 d, typename Wide<T>::type scale, u32 causal) {
    typedef typename Wide<T>::type W;
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x, bh = blockIdx.y, b = bh / heads, h = bh % heads;
    if (i >= tq) return;
    // q, k and v rows of `pack · d` values (a packed qkv's), out's of d.
    const u64 stride = heads * d * pack;
    const T* qi = q + ((b * tq + i) * heads + h) * d * pack;
    const T* kh = k + (b * tk * heads + h) * d * pack;
    const T* vh = v + (b * tk * heads + h) * d * pack;
    W acc[ATT_SIMT_MAX_D];
    for (u64 x = 0; x < d; ++x) acc[x] = W(0);
    W m = minus_infinity<W>(), l = W(0);
    const u64 end = causal ? (i + 1 < tk ? i + 1 : tk) : tk;
    for (u64 j = 0; j < end; ++j) {
        const W s = att_dot<T, W>(qi, kh + j * stride, d) * scale;
        if (s > m) {
            const W a = m == minus_infinity<W>() ? W(0) : m_exp(m - s);
            l *= a;
            for (u64 x = 0; x < d; ++x) acc[x] *= a;
            m = s;
        }
        const W p = m_exp(s - m);
        l += p;
        const T* vj = vh + j * stride;
        for (u64 x = 0; x < d; ++x) acc[x] += p * (W)ld(vj + x);
    }
    T* oi = out + ((b * tq + i) * heads + h) * d;
    for (u64 x = 0; x < d; ++x) st(oi + x, l > W(0) ? acc[x] / l : W(0));
    lse[bh * tq + i] = l > W(0) ? m + m_log(l) : minus_infinity<W>();
}

// dq, a thread per query.
template <typename T>
__device__ void att_dq_simt(const T* q, const T* k, const T* v, const T* dout, const typename Wide<T>::type* lse,
                            const typename Wide<T>::type* dots, T* dq, u64 tq, u64 tk, u64 heads, u64 pack, u64 d,
                            typename Wide<T>::type scale, u32 causal) {
    typedef typename Wide<T>::type W;
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x, bh = blockIdx.y, b = bh / heads, h = bh % heads;
    if (i >= tq) return;
    // q, k, v and dq rows of `pack · d` values (a packed qkv's), dout's of d.
    const u64 stride = heads * d * pack, row = ((b * tq + i) * heads + h) * d, in_row = row * pack;
    const T* kh = k + (b * tk * heads + h) * d * pack;
    const T* vh = v + (b * tk * heads + h) * d * pack;
    const W l = lse[bh * tq + i], dot = dots[bh * tq + i];
    W acc[ATT_SIMT_MAX_D];
    for (u64 x = 0; x < d; ++x) acc[x] = W(0);
    const u64 end = causal ? (i + 1 < tk ? i + 1 : tk) : tk;
    for (u64 j = 0; j < end; ++j) {
        const T* kj = kh + j * stride;
        const W p = m_exp(att_dot<T, W>(q + in_row, kj, d) * scale - l);
        const W ds = p * (att_dot<T, W>(dout + row, vh + j * stride, d) - dot);
        for (u64 x = 0; x < d; ++x) acc[x] += ds * (W)ld(kj + x);
    }
    for (u64 x = 0; x < d; ++x) st(dq + in_row + x, acc[x] * scale);
}

// dk and dv, a thread per key.
template <typename T>
__device__ void att_dkv_simt(const T* q, const T* k, const T* v, const T* dout, const typename Wide<T>::type* lse,
                             const typename Wide<T>::type* dots, T* dk, T* dv, u64 tq, u64 tk, u64 heads, u64 pack,
                             u64 d, typename Wide<T>::type scale, u32 causal) {
    typedef typename Wide<T>::type W;
    const u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x, bh = blockIdx.y, b = bh / heads, h = bh % heads;
    if (j >= tk) return;
    // q, k, v, dk and dv rows of `pack · d` values (a packed qkv's), dout's of d.
    const u64 stride = heads * d, in_stride = stride * pack, row = ((b * tk + j) * heads + h) * d * pack;
    const T* qh = q + (b * tq * heads + h) * d * pack;
    const T* oh = dout + (b * tq * heads + h) * d;
    W acc_k[ATT_SIMT_MAX_D], acc_v[ATT_SIMT_MAX_D];
    for (u64 x = 0; x < d; ++x) acc_k[x] = acc_v[x] = W(0);
    for (u64 i = causal ? j : 0; i < tq; ++i) {
        const T* qi = qh + i * in_stride;
        const T* oi = oh + i * stride;
        const W p = m_exp(att_dot<T, W>(qi, k + row, d) * scale - lse[bh * tq + i]);
        const W ds = p * (att_dot<T, W>(oi, v + row, d) - dots[bh * tq + i]);
        for (u64 x = 0; x < d; ++x) {
            acc_v[x] += p * (W)ld(oi + x);
            acc_k[x] += ds * (W)ld(qi + x);
        }
    }
    for (u64 x = 0; x < d; ++x) {
        st(dk + row + x, acc_k[x] * scale);
        st(dv + row + x, acc_v[x]);
    }
}

// The gradient's row dots Σ dout·out, [B, H, Tq], eight lanes per row (rows in memory
// order, (b, t, h)), summed by shuffles within the eight.
template <typename T>
__device__ void att_row_dots(const T* out, const T* dout, typename Wide<T>::type* dots, u64 rows, u64 tq, u64 heads,
                             u64 d) {
    typedef typename Wide<T>::type W;
    const u64 total = rows * 8, step = (u64)gridDim.x * blockDim.x;
    for (u64 base = (u64)blockIdx.x * blockDim.x; base < total; base += step) {
        const u64 idx = base + threadIdx.x, r = idx / 8;
        const u32 part = threadIdx.x & 7;
        W s = W(0);
        if (r < rows)
            for (u64 x = part; x < d; x += 8) s += (W)ld(out + r * d + x) * (W)ld(dout + r * d + x);
        s += __shfl_xor_sync(0xffffffffu, s, 4);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        if (r < rows && part == 0) {
            const u64 h = r % heads, t = (r / heads) % tq, b = r / (heads * tq);
            dots[(b * heads + h) * tq + t] = s;
        }
    }
}

// ---- One thread per row with the head size known (D of 16, 32, 64, 128): the row and
// its accumulators in registers, the other side's rows through shared memory a tile at a
// time (every thread of a block reads the same tile row: a broadcast). The arithmetic and
// its order are those of the entries above, so the results are the same. ----

#define ATT_ROW_TILE 32

// Rows `row0 ..` of one head into a shared tile of the arithmetic type, zeros past `rows`.
template <typename T, int D>
__device__ __forceinline__ void att_rows_tile(typename Wide<T>::type (*tile)[D], const T* head, u64 row0, u64 rows,
                                              u64 stride) {
    typedef typename Wide<T>::type W;
    for (int c = threadIdx.x; c < ATT_ROW_TILE * D; c += blockDim.x) {
        const int r = c / D, x = c % D;
        tile[r][x] = row0 + r < rows ? (W)ld(head + (row0 + r) * stride + x) : W(0);
    }
}

// A row of D values into registers (zeros for a row past the end).
template <typename T, int D>
__device__ __forceinline__ void att_row(typename Wide<T>::type* r, const T* p, bool inside) {
#pragma unroll
    for (int x = 0; x < D; ++x) r[x] = inside ? (typename Wide<T>::type)ld(p + x) : 0;
}

template <typename W, int D> __device__ __forceinline__ W att_row_dot(const W* a, const W* b) {
    W s = W(0);
#pragma unroll
    for (int x = 0; x < D; ++x) s += a[x] * b[x];
    return s;
}

// The forward, a thread per query.
template <typename T, int D>
__device__ void att_forward_rows(const T* q, const T* k, const T* v, T* out, typename Wide<T>::type* lse, u64 tq,
                                 u64 tk, u64 heads, u64 pack, typename Wide<T>::type scale, u32 causal) {
    typedef typename Wide<T>::type W;
    __shared__ W ks[ATT_ROW_TILE][D], vs[ATT_ROW_TILE][D];
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x, bh = blockIdx.y, b = bh / heads, h = bh % heads;
    // q, k and v rows of `pack · D` values (a packed qkv's), out's of D.
    const u64 stride = heads * D * pack;
    const bool inside = i < tq;
    W qi[D], acc[D];
    att_row<T, D>(qi, q + ((b * tq + (inside ? i : 0)) * heads + h) * D * pack, inside);
#pragma unroll
    for (int x = 0; x < D; ++x) acc[x] = W(0);
    W m = minus_infinity<W>(), l = W(0);
    const u64 last = (u64)blockIdx.x * blockDim.x + blockDim.x;
    const u64 key_end = causal ? (last < tk ? last : tk) : tk;
    const u64 end = causal ? (i + 1 < tk ? i + 1 : tk) : tk;
    for (u64 key0 = 0; key0 < key_end; key0 += ATT_ROW_TILE) {
        __syncthreads();
        att_rows_tile<T, D>(ks, k + (b * tk * heads + h) * D * pack, key0, tk, stride);
        att_rows_tile<T, D>(vs, v + (b * tk * heads + h) * D * pack, key0, tk, stride);
        __syncthreads();
        const int n = inside && end > key0 ? (int)(end - key0 < ATT_ROW_TILE ? end - key0 : ATT_ROW_TILE) : 0;
        for (int j = 0; j < n; ++j) {
            const W s = att_row_dot<W, D>(qi, ks[j]) * scale;
            if (s > m) {
                const W a = m == minus_infinity<W>() ? W(0) : m_exp(m - s);
                l *= a;
#pragma unroll
                for (int x = 0; x < D; ++x) acc[x] *= a;
                m = s;
            }
            const W p = m_exp(s - m);
            l += p;
#pragma unroll
            for (int x = 0; x < D; ++x) acc[x] += p * vs[j][x];
        }
    }
    if (!inside) return;
    T* oi = out + ((b * tq + i) * heads + h) * D;
#pragma unroll
    for (int x = 0; x < D; ++x) st(oi + x, l > W(0) ? acc[x] / l : W(0));
    lse[bh * tq + i] = l > W(0) ? m + m_log(l) : minus_infinity<W>();
}

// dq, a thread per query.
template <typename T, int D>
__device__ void att_dq_rows(const T* q, const T* k, const T* v, const T* dout, const typename Wide<T>::type* lse,
                            const typename Wide<T>::type* dots, T* dq, u64 tq, u64 tk, u64 heads, u64 pack,
                            typename Wide<T>::type scale, u32 causal) {
    typedef typename Wide<T>::type W;
    __shared__ W ks[ATT_ROW_TILE][D], vs[ATT_ROW_TILE][D];
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x, bh = blockIdx.y, b = bh / heads, h = bh % heads;
    // q, k, v and dq rows of `pack · D` values (a packed qkv's), dout's of D.
    const u64 stride = heads * D * pack, row = ((b * tq + (i < tq ? i : 0)) * heads + h) * D, in_row = row * pack;
    const bool inside = i < tq;
    W qi[D], oi[D], acc[D];
    att_row<T, D>(qi, q + in_row, inside);
    att_row<T, D>(oi, dout + row, inside);
#pragma unroll
    for (int x = 0; x < D; ++x) acc[x] = W(0);
    const W l = inside ? lse[bh * tq + i] : W(0), dot = inside ? dots[bh * tq + i] : W(0);
    const u64 last = (u64)blockIdx.x * blockDim.x + blockDim.x;
    const u64 key_end = causal ? (last < tk ? last : tk) : tk;
    const u64 end = causal ? (i + 1 < tk ? i + 1 : tk) : tk;
    for (u64 key0 = 0; key0 < key_end; key0 += ATT_ROW_TILE) {
        __syncthreads();
        att_rows_tile<T, D>(ks, k + (b * tk * heads + h) * D * pack, key0, tk, stride);
        att_rows_tile<T, D>(vs, v + (b * tk * heads + h) * D * pack, key0, tk, stride);
        __syncthreads();
        const int n = inside && end > key0 ? (int)(end - key0 < ATT_ROW_TILE ? end - key0 : ATT_ROW_TILE) : 0;
        for (int j = 0; j < n; ++j) {
            const W p = m_exp(att_row_dot<W, D>(qi, ks[j]) * scale - l);
            const W ds = p * (att_row_dot<W, D>(oi, vs[j]) - dot);
#pragma unroll
            for (int x = 0; x < D; ++x) acc[x] += ds * ks[j][x];
        }
    }
    if (!inside) return;
#pragma unroll
    for (int x = 0; x < D; ++x) st(dq + in_row + x, acc[x] * scale);
}

// dk (`want_dk`) or dv, a thread per key: two launches, so a thread holds at most three
// rows (its key, its value, one gradient) in registers.
template <typename T, int D>
__device__ void att_dkv_rows(const T* q, const T* k, const T* v, const T* dout, const typename Wide<T>::type* lse,
                             const typename Wide<T>::type* dots, T* grad, u64 tq, u64 tk, u64 heads, u64 pack,
                             typename Wide<T>::type scale, u32 causal, bool want_dk) {
    typedef typename Wide<T>::type W;
    __shared__ W qs[ATT_ROW_TILE][D], os[ATT_ROW_TILE][D], ls[ATT_ROW_TILE], dd[ATT_ROW_TILE];
    const u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x, bh = blockIdx.y, b = bh / heads, h = bh % heads;
    // q, k, v and the gradient rows of `pack · D` values (a packed qkv's), dout's of D.
    const u64 stride = heads * D, row = ((b * tk + (j < tk ? j : 0)) * heads + h) * D * pack;
    const bool inside = j < tk;
    W kj[D], vj[D], acc[D];
    att_row<T, D>(kj, k + row, inside);
    att_row<T, D>(vj, v + row, inside && want_dk);
#pragma unroll
    for (int x = 0; x < D; ++x) acc[x] = W(0);
    // Causal: the block's first key is attended by queries from it on.
    const u64 first = causal ? (u64)blockIdx.x * blockDim.x : 0;
    for (u64 q0 = first; q0 < tq; q0 += ATT_ROW_TILE) {
        __syncthreads();
        att_rows_tile<T, D>(qs, q + (b * tq * heads + h) * D * pack, q0, tq, stride * pack);
        att_rows_tile<T, D>(os, dout + (b * tq * heads + h) * D, q0, tq, stride);
        for (int r = threadIdx.x; r < ATT_ROW_TILE; r += blockDim.x) {
            ls[r] = q0 + r < tq ? lse[bh * tq + q0 + r] : W(0);
            dd[r] = q0 + r < tq ? dots[bh * tq + q0 + r] : W(0);
        }
        __syncthreads();
        if (!inside) continue;
        const u64 from = causal && j > q0 ? j - q0 : 0;
        const int n = (int)(tq - q0 < ATT_ROW_TILE ? tq - q0 : ATT_ROW_TILE);
        for (int r = (int)(from < (u64)n ? from : (u64)n); r < n; ++r) {
            const W p = m_exp(att_row_dot<W, D>(qs[r], kj) * scale - ls[r]);
            if (want_dk) {
                const W ds = p * (att_row_dot<W, D>(os[r], vj) - dd[r]);
#pragma unroll
                for (int x = 0; x < D; ++x) acc[x] += ds * qs[r][x];
            } else {
#pragma unroll
                for (int x = 0; x < D; ++x) acc[x] += p * os[r][x];
            }
        }
    }
    if (!inside) return;
    const W factor = want_dk ? scale : W(1);
#pragma unroll
    for (int x = 0; x < D; ++x) st(grad + row + x, acc[x] * factor);
}

// The row entries for a known head size: `regflow_attention_{fwd,dq,dk,dv}_<S>` with S =
// <type>_rows_d<D>.
#define ATTENTION_ROWS(S, T, D)                                                                                  \
    extern "C" __global__ void regflow_attention_fwd_##S(const T* q, const T* k, const T* v, T* out,            \
                                                         Wide<T>::type* lse, u64 tq, u64 tk, u64 heads, u64 pack,\
                                                         Wide<T>::type scale, u32 causal) {                      \
        att_forward_rows<T, D>(q, k, v, out, lse, tq, tk, heads, pack, scale, causal);                           \
    }                                                                                                            \
    extern "C" __global__ void regflow_attention_dq_##S(const T* q, const T* k, const T* v, const T* dout,      \
                                                        const Wide<T>::type* lse, const Wide<T>::type* dots,     \
                                                        T* dq, u64 tq, u64 tk, u64 heads, u64 pack,              \
                                                        Wide<T>::type scale, u32 causal) {                       \
        att_dq_rows<T, D>(q, k, v, dout, lse, dots, dq, tq, tk, heads, pack, scale, causal);                     \
    }                                                                                                            \
    extern "C" __global__ void regflow_attention_dk_##S(const T* q, const T* k, const T* v, const T* dout,      \
                                                        const Wide<T>::type* lse, const Wide<T>::type* dots,     \
                                                        T* dk, u64 tq, u64 tk, u64 heads, u64 pack,              \
                                                        Wide<T>::type scale, u32 causal) {                       \
        att_dkv_rows<T, D>(q, k, v, dout, lse, dots, dk, tq, tk, heads, pack, scale, causal, true);              \
    }                                                                                                            \
    extern "C" __global__ void regflow_attention_dv_##S(const T* q, const T* k, const T* v, const T* dout,      \
                                                        const Wide<T>::type* lse, const Wide<T>::type* dots,     \
                                                        T* dv, u64 tq, u64 tk, u64 heads, u64 pack,              \
                                                        Wide<T>::type scale, u32 causal) {                       \
        att_dkv_rows<T, D>(q, k, v, dout, lse, dots, dv, tq, tk, heads, pack, scale, causal, false);             \
    }
ATTENTION_ROWS(f32_rows_d16, float, 16)
ATTENTION_ROWS(f32_rows_d32, float, 32)
ATTENTION_ROWS(f32_rows_d64, float, 64)
ATTENTION_ROWS(f32_rows_d128, float, 128)
ATTENTION_ROWS(f64_rows_d16, double, 16)
ATTENTION_ROWS(f64_rows_d32, double, 32)
ATTENTION_ROWS(f64_rows_d64, double, 64)

#define ATTENTION_SIMT(S, T)                                                                                     \
    extern "C" __global__ void regflow_attention_fwd_##S(const T* q, const T* k, const T* v, T* out,            \
                                                         Wide<T>::type* lse, u64 tq, u64 tk, u64 heads,          \
                                                         u64 pack, u64 d, Wide<T>::type scale, u32 causal) {     \
        att_forward_simt<T>(q, k, v, out, lse, tq, tk, heads, pack, d, scale, causal);                           \
    }                                                                                                            \
    extern "C" __global__ void regflow_attention_dq_##S(const T* q, const T* k, const T* v, const T* dout,      \
                                                        const Wide<T>::type* lse, const Wide<T>::type* dots,     \
                                                        T* dq, u64 tq, u64 tk, u64 heads, u64 pack, u64 d,       \
                                                        Wide<T>::type scale, u32 causal) {                       \
        att_dq_simt<T>(q, k, v, dout, lse, dots, dq, tq, tk, heads, pack, d, scale, causal);                     \
    }                                                                                                            \
    extern "C" __global__ void regflow_attention_dkv_##S(const T* q, const T* k, const T* v, const T* dout,     \
                                                         const Wide<T>::type* lse, const Wide<T>::type* dots,    \
                                                         T* dk, T* dv, u64 tq, u64 tk, u64 heads, u64 pack,      \
                                                         u64 d, Wide<T>::type scale, u32 causal) {               \
        att_dkv_simt<T>(q, k, v, dout, lse, dots, dk, dv, tq, tk, heads, pack, d, scale, causal);                \
    }                                                                                                            \
    extern "C" __global__ void regflow_attention_dots_##S(const T* out, const T* dout, Wide<T>::type* dots,     \
                                                          u64 rows, u64 tq, u64 heads, u64 d) {                  \
        att_row_dots<T>(out, dout, dots, rows, tq, heads, d);                                                    \
    }
ATTENTION_SIMT(f32, float)
ATTENTION_SIMT(f64, double)
ATTENTION_SIMT(bf16, bf16)
ATTENTION_SIMT(f16, f16)
