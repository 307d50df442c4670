// Data movement: `reshape` (a device copy), `broadcast_to`, `permute` (strided gathers),
// `slice`, `slice_grad`, `concat` (copies of axis ranges), `sum_to` (the adjoint of
// broadcasting), `embedding` (a row gather) and `embedding_grad` (its adjoint, each table
// row summed in id order). Zero-filling the gradient's row counts uses `regflow_fill_f32`
// of fill.cu.


// The offset of linear index i (row-major over s.dims) in the operand of strides s.a.
__device__ __forceinline__ u64 offset_a(const Indexing& s, u64 i) {
    u64 a = 0;
    for (int d = (int)s.rank - 1; d >= 0; --d) a += div_step(&i, s.dims[d]) * s.a[d];
    return a;
}

// ---- copies ------------------------------------------------------------------------

template <typename T> __device__ __forceinline__ void copy(const T* src, T* dst, u64 n) {
    FOR_EACH(i, n) dst[i] = src[i];
}

// dst[i] = src[offset of i]: s.dims is dst's shape, s.a src's strides as read (permuted
// for `permute`, 0 on stretched dimensions for `broadcast_to`).
template <typename T> __device__ __forceinline__ void gather(const T* src, T* dst, Indexing s, u64 n) {
    FOR_EACH(i, n) dst[i] = src[offset_a(s, i)];
}

// `outer` blocks of `run` contiguous elements: block o goes from src[o·src_block +
// src_start ..] to dst[o·dst_block + dst_start ..]. A range of one axis of a row-major
// tensor is such blocks (slice, slice_grad, one input of concat).
template <typename T>
__device__ __forceinline__ void copy_blocks(const T* src, T* dst, u64 outer, u64 run, u64 src_block, u64 src_start,
                                            u64 dst_block, u64 dst_start) {
    FOR_EACH(i, outer * run) {
        u64 o = i, j = div_step(&o, run);
        dst[o * dst_block + dst_start + j] = src[o * src_block + src_start + j];
    }
}

// `count` runs of `len` 16-bit elements, run c from src[c·src_ld ..] to dst[c·dst_ld ..]: a
// band of a column-major matrix staged into or out of a product's aligned scratch
// (cuda/src/ops/matmul.rs, "aligned staging"). Runs go over the grid's y axis and elements
// over x, so no index is divided (copy_blocks divides every one).
extern "C" __global__ void regflow_copy_runs_u16(const bf16* src, bf16* dst, u64 count, u64 len, u64 src_ld,
                                                 u64 dst_ld) {
    for (u64 c = blockIdx.y; c < count; c += gridDim.y) {
        for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < len; i += (u64)gridDim.x * blockDim.x) {
            dst[c * dst_ld + i] = src[c * src_ld + i];
        }
    }
}

extern "C" __global__ void regflow_copy_f32(const float* src, float* dst, u64 n) { copy(src, dst, n); }
extern "C" __global__ void regflow_copy_f64(const double* src, double* dst, u64 n) { copy(src, dst, n); }
extern "C" __global__ void regflow_copy_i64(const i64* src, i64* dst, u64 n) { copy(src, dst, n); }
extern "C" __global__ void regflow_copy_bf16(const bf16* src, bf16* dst, u64 n) { copy(src, dst, n); }
extern "C" __global__ void regflow_copy_f16(const f16* src, f16* dst, u64 n) { copy(src, dst, n); }

extern "C" __global__ void regflow_gather_f32(const float* src, float* dst, Indexing s, u64 n) { gather(src, dst, s, n); }
extern "C" __global__ void regflow_gather_f64(const double* src, double* dst, Indexing s, u64 n) { gather(src, dst, s, n); }
extern "C" __global__ void regflow_gather_i64(const i64* src, i64* dst, Indexing s, u64 n) { gather(src, dst, s, n); }
extern "C" __global__ void regflow_gather_bf16(const bf16* src, bf16* dst, Indexing s, u64 n) { gather(src, dst, s, n); }
extern "C" __global__ void regflow_gather_f16(const f16* src, f16* dst, Indexing s, u64 n) { gather(src, dst, s, n); }

extern "C" __global__ void regflow_copy_blocks_f32(const float* src, float* dst, u64 outer, u64 run, u64 src_block,
                                                   u64 src_start, u64 dst_block, u64 dst_start) {
    copy_blocks(src, dst, outer, run, src_block, src_start, dst_block, dst_start);
}
extern "C" __global__ void regflow_copy_blocks_f64(const double* src, double* dst, u64 outer, u64 run, u64 src_block,
                                                   u64 src_start, u64 dst_block, u64 dst_start) {
    copy_blocks(src, dst, outer, run, src_block, src_start, dst_block, dst_start);
}
extern "C" __global__ void regflow_copy_blocks_i64(const i64* src, i64* dst, u64 outer, u64 run, u64 src_block,
                                                   u64 src_start, u64 dst_block, u64 dst_start) {
    copy_blocks(src, dst, outer, run, src_block, src_start, dst_block, dst_start);
}
extern "C" __global__ void regflow_copy_blocks_bf16(const bf16* src, bf16* dst, u64 outer, u64 run, u64 src_block,
                                                    u64 src_start, u64 dst_block, u64 dst_start) {
    copy_blocks(src, dst, outer, run, src_block, src_start, dst_block, dst_start);
}
extern "C" __global__ void regflow_copy_blocks_f16(const f16* src, f16* dst, u64 outer, u64 run, u64 src_block,
                                                   u64 src_start, u64 dst_block, u64 dst_start) {
    copy_blocks(src, dst, outer, run, src_block, src_start, dst_block, dst_start);
}

// ---- sum_to ------------------------------------------------------------------------

// Σ x[base + reduced offset(k)] over k = first, first + step, … below end, added in that
// order (sum_to's reduced positions). The reduced positions are nearly always one axis
// once axes are merged: then one multiply per element, in a loop of its own, unrolled;
// else the general walk, whose divisions would otherwise dominate a memory-bound sum, in
// a loop that is not unrolled. As one unrolled loop over both, every f32, bf16 and f16
// sum_to entry spilled 24 / 44 bytes (stores / loads) on sm_90, 32 / 64 on sm_80; now
// none does on sm_90 (sum_to_split still spills 32 / 48 on sm_80).
template <typename T>
__device__ __forceinline__ typename Wide<T>::type sum_reduced(const T* x, u64 base, const Indexing& reduced, u64 first,
                                                              u64 end, u64 step) {
    typedef typename Wide<T>::type W;
    W sum = (W)0;
    if (reduced.rank == 1) {
        u64 stride = reduced.a[0];
#pragma unroll 4
        for (u64 k = first; k < end; k += step) sum += ld(&x[base + k * stride]);
    } else {
        for (u64 k = first; k < end; k += step) sum += ld(&x[base + offset_a(reduced, k)]);
    }
    return sum;
}

// out[o] = Σ over the reduced positions k of x[kept offset(o) + reduced offset(k)], a
// column reduction (see the prelude): slice y of output o adds k = y, y + blockDim.y, ...
// (k row-major over the reduced dimensions), then the slices' partials are added in order.
// With one slice (a short range) that is the CPU kernel's order; otherwise the sums differ
// from the CPU's by rounding. `kept.dims` is the output's shape and `kept.a` the input's
// strides of those dimensions; `reduced.dims` the summed dimensions and `reduced.a` their
// input strides.
template <typename T>
__device__ __forceinline__ void sum_to(const T* x, T* out, Indexing kept, Indexing reduced, u64 n_out, u64 n_reduced) {
    typedef typename Wide<T>::type W;
    __shared__ W partial[COLUMN_THREADS][COLUMN_THREADS];
    FOR_EACH_COLUMN(o, n_out) {
        bool mine = o < n_out;
        u64 base = mine ? offset_a(kept, o) : 0, end = mine ? n_reduced : 0;
        W sum = sum_reduced(x, base, reduced, threadIdx.y, end, blockDim.y);
        sum = column_sum(sum, partial);
        if (mine && threadIdx.y == 0) st(&out[o], sum);
    }
}

// Few outputs over long ranges (a long input summed to [1, 3]; one output takes the flat
// sums below), where a column block would put one SM on millions of elements: two launches. First the
// range of output blockIdx.y is cut into gridDim.x chunks of `chunk` positions, one block
// each, whose threads add the chunk's elements and combine them with the block reduction
// into parts[o · gridDim.x + chunk index]; then one block per output adds its parts in
// chunk order. The chunking depends on the shape alone, so the same inputs give the same
// bits; bf16 adds in f32 and rounds once, as the CPU does.
template <typename T>
__device__ __forceinline__ void sum_to_chunks(const T* x, typename Wide<T>::type* parts, Indexing kept, Indexing reduced,
                                              u64 n_reduced, u64 chunk) {
    typedef typename Wide<T>::type W;
    __shared__ W scratch[32];
    u64 o = blockIdx.y, base = offset_a(kept, o);
    u64 begin = (u64)blockIdx.x * chunk, end = begin + chunk < n_reduced ? begin + chunk : n_reduced;
    W sum = sum_reduced(x, base, reduced, begin + threadIdx.x, end, blockDim.x);
    sum = block_sum(sum, scratch);
    if (threadIdx.x == 0) parts[o * gridDim.x + blockIdx.x] = sum;
}

template <typename T> __device__ __forceinline__ void sum_parts(const typename Wide<T>::type* parts, T* out, u64 chunks) {
    typedef typename Wide<T>::type W;
    __shared__ W scratch[32];
    W sum = (W)0;
    for (u64 c = threadIdx.x; c < chunks; c += blockDim.x) sum += parts[(u64)blockIdx.x * chunks + c];
    sum = block_sum(sum, scratch);
    if (threadIdx.x == 0) st(&out[blockIdx.x], sum);
}

// Many outputs, each over a long range, but too few outputs to fill the GPU with column
// blocks (a bias gradient: 768 outputs are 24 blocks of 32, each walking 8192 rows): two
// launches. First block (bx, by) of a (column blocks × splits) grid is the column block bx
// over the range's split by, positions [by·chunk, (by + 1)·chunk), and writes its sums to
// parts[by · n_out + o]; then a thread per output adds its splits' sums in split order. The
// splits depend on the shape alone (movement.rs), so the same inputs give the same bits.
template <typename T>
__device__ __forceinline__ void sum_to_split(const T* x, typename Wide<T>::type* parts, Indexing kept, Indexing reduced,
                                             u64 n_out, u64 n_reduced, u64 chunk) {
    typedef typename Wide<T>::type W;
    __shared__ W partial[COLUMN_THREADS][COLUMN_THREADS];
    u64 begin = (u64)blockIdx.y * chunk, end_all = begin + chunk < n_reduced ? begin + chunk : n_reduced;
    FOR_EACH_COLUMN(o, n_out) {
        bool mine = o < n_out;
        u64 base = mine ? offset_a(kept, o) : 0, end = mine ? end_all : begin;
        W sum = sum_reduced(x, base, reduced, begin + threadIdx.y, end, blockDim.y);
        sum = column_sum(sum, partial);
        if (mine && threadIdx.y == 0) parts[(u64)blockIdx.y * n_out + o] = sum;
    }
}

template <typename T>
__device__ __forceinline__ void sum_splits(const typename Wide<T>::type* parts, T* out, u64 n_out, u64 splits) {
    typedef typename Wide<T>::type W;
    FOR_EACH(o, n_out) {
        W sum = (W)0;
        for (u64 s = 0; s < splits; ++s) sum += parts[s * n_out + o];
        st(&out[o], sum);
    }
}

// ---- flat sums: a whole contiguous input to one value ----------------------------------
// Every sum_squares, and every sum_to to one value, reads its input whole and in order, so
// needs no Indexing walk. A block adds the elements [begin, end) as packs of 16 bytes (4 f32, 2
// f64, 8 bf16/f16): thread t takes packs t, t + blockDim.x, ... in that order, each pack's
// elements in order, then the elements past the last whole pack (t < their count), and
// block_sum combines the threads. Where x + begin is 16-byte aligned a pack is one vector
// load, else its elements load one by one: the same summands in the same order, so the bits
// depend on n and the block's range alone, not on the address. FLAT_UNROLL packs load
// before any is added, so each thread has 64 bytes in flight.
#define FLAT_UNROLL 4

template <typename T> struct Pack {
    static const int N = 16 / sizeof(T);
    typename Wide<T>::type v[N];
};

// A pack's words as element e: the words of a 16-byte vector load, little-endian.
__device__ __forceinline__ float pack_element(const u32* w, int e, const float*) { return __uint_as_float(w[e]); }
__device__ __forceinline__ double pack_element(const u32* w, int e, const double*) {
    return __hiloint2double((int)w[2 * e + 1], (int)w[2 * e]);
}
__device__ __forceinline__ float pack_element(const u32* w, int e, const bf16*) {
    return bf16_to_f32((bf16)(w[e / 2] >> (16 * (e % 2))));
}
__device__ __forceinline__ float pack_element(const u32* w, int e, const f16*) {
    f16 h;
    h.bits = (unsigned short)(w[e / 2] >> (16 * (e % 2)));
    return f16_to_f32(h);
}

// Pack p of x (elements p·N ..), or zeros past `packs` (adding +0 changes no sum: the
// partials start at +0, and NaN and infinities stay as they are).
template <typename T, bool ALIGNED> __device__ __forceinline__ Pack<T> load_pack(const T* x, u64 p, u64 packs) {
    Pack<T> r;
    if (p >= packs) {
#pragma unroll
        for (int e = 0; e < Pack<T>::N; ++e) r.v[e] = 0;
    } else if (ALIGNED) {
        uint4 q = reinterpret_cast<const uint4*>(x)[p];
        u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int e = 0; e < Pack<T>::N; ++e) r.v[e] = pack_element(w, e, x);
    } else {
#pragma unroll
        for (int e = 0; e < Pack<T>::N; ++e) r.v[e] = ld(&x[p * Pack<T>::N + e]);
    }
    return r;
}

// SQ: each summand is squared as it loads (`sum_squares`: the bits of x · x, then summed).
template <typename W> __device__ __forceinline__ W summand(W v, bool square) { return square ? v * v : v; }

// This thread's sum (of squares with SQ) of its packs of x[0 .. len).
template <typename T, bool SQ, bool ALIGNED>
__device__ __forceinline__ typename Wide<T>::type flat_thread_sum(const T* x, u64 len) {
    typedef typename Wide<T>::type W;
    const u64 packs = len / Pack<T>::N, stride = blockDim.x;
    W sum = (W)0;
    for (u64 p = threadIdx.x; p < packs; p += FLAT_UNROLL * stride) {
        Pack<T> loaded[FLAT_UNROLL];
#pragma unroll
        for (int u = 0; u < FLAT_UNROLL; ++u) loaded[u] = load_pack<T, ALIGNED>(x, p + u * stride, packs);
#pragma unroll
        for (int u = 0; u < FLAT_UNROLL; ++u)
#pragma unroll
            for (int e = 0; e < Pack<T>::N; ++e) sum += summand(loaded[u].v[e], SQ);
    }
    u64 rest = packs * Pack<T>::N + threadIdx.x;
    if (rest < len) sum += summand(ld(&x[rest]), SQ);
    return sum;
}

// The block's sum of x[begin .. end), in every thread.
template <typename T, bool SQ>
__device__ __forceinline__ typename Wide<T>::type flat_block_sum(const T* x, u64 begin, u64 end) {
    typedef typename Wide<T>::type W;
    __shared__ W scratch[32];
    const T* from = x + begin;
    W sum = ((u64)from & 15) == 0 ? flat_thread_sum<T, SQ, true>(from, end - begin)
                                  : flat_thread_sum<T, SQ, false>(from, end - begin);
    return block_sum(sum, scratch);
}

// A short input (movement.rs, FLAT_SINGLE_MAX): one block of up to 1024 threads, one launch.
template <typename T, bool SQ = false> __device__ __forceinline__ void sum_flat(const T* x, T* out, u64 n) {
    typename Wide<T>::type sum = flat_block_sum<T, SQ>(x, 0, n);
    if (threadIdx.x == 0) st(out, sum);
}

// A long input: block b adds x[b·chunk .. min((b + 1)·chunk, n)) into parts[b]; then
// sum_parts adds the parts in block order. `chunk` is a multiple of 1024 elements (so
// every block's range starts 16-byte aligned where x is).
template <typename T, bool SQ = false>
__device__ __forceinline__ void sum_flat_chunks(const T* x, typename Wide<T>::type* parts, u64 n, u64 chunk) {
    u64 begin = (u64)blockIdx.x * chunk, end = begin + chunk < n ? begin + chunk : n;
    typename Wide<T>::type sum = flat_block_sum<T, SQ>(x, begin, end);
    if (threadIdx.x == 0) parts[blockIdx.x] = sum;
}

// ---- row sums: a row-major [rows, cols] matrix to its cols column sums -----------------
// A bias gradient: the reduced axes lead and the kept ones are the trailing, contiguous
// ones (movement.rs, `rows_plan`). Thread (tx, ty) of a ROWS_TX × ROWS_TY block owns the
// Pack<T>::N adjacent columns of column group blockIdx.x · ROWS_TX + tx (one 16-byte load
// per row where x and the row length are 16-byte aligned, else element by element: the
// same summands in the same order) and adds rows begin + ty, begin + ty + ROWS_TY, ... of
// the block's slice [blockIdx.y · slice_rows, + slice_rows), ROWS_UNROLL rows loaded before
// any is added, with no index math but row · cols. Slice ty's partials are then added in ty
// order through shared memory. With one slice (gridDim.y 1) the block writes the outputs;
// else the slice's sums go to parts[slice · cols + column] and sum_row_slices adds each
// column's slices. Every order depends on the shape alone.
#define ROWS_TX 32
#define ROWS_TY 8
#define ROWS_UNROLL 4
// Row-sum entries run blocks of ROWS_TX × ROWS_TY threads (launch bounds as BLOCK_1024).
#define ROWS_BLOCK __launch_bounds__(ROWS_TX * ROWS_TY)

// Columns c0 .. c0 + N of `row`, zeros past `cols` (adding +0 changes no sum).
template <typename T, bool ALIGNED> __device__ __forceinline__ Pack<T> load_row_pack(const T* row, u64 c0, u64 cols) {
    Pack<T> r;
    if (ALIGNED) {
        uint4 q = *reinterpret_cast<const uint4*>(row + c0);
        u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int e = 0; e < Pack<T>::N; ++e) r.v[e] = pack_element(w, e, row);
    } else {
#pragma unroll
        for (int e = 0; e < Pack<T>::N; ++e) r.v[e] = c0 + e < cols ? ld(&row[c0 + e]) : 0;
    }
    return r;
}

// This thread's partial sums of its columns c0 .. over rows r0, r0 + ROWS_TY, ... < end.
template <typename T, bool ALIGNED>
__device__ __forceinline__ void row_slice_sum(const T* x, u64 cols, u64 c0, u64 r0, u64 end,
                                              typename Wide<T>::type (&sum)[Pack<T>::N]) {
    for (u64 r = r0; r < end; r += ROWS_TY * ROWS_UNROLL) {
        Pack<T> loaded[ROWS_UNROLL];
#pragma unroll
        for (int u = 0; u < ROWS_UNROLL; ++u) {
            u64 row = r + u * ROWS_TY;
            if (row < end) {
                loaded[u] = load_row_pack<T, ALIGNED>(x + row * cols, c0, cols);
            } else {
#pragma unroll
                for (int e = 0; e < Pack<T>::N; ++e) loaded[u].v[e] = 0;
            }
        }
#pragma unroll
        for (int u = 0; u < ROWS_UNROLL; ++u)
#pragma unroll
            for (int e = 0; e < Pack<T>::N; ++e) sum[e] += loaded[u].v[e];
    }
}

// The block's slice sums of its columns; thread (tx, 0) writes them to out (T) or parts (P).
template <typename T, typename D>
__device__ __forceinline__ void sum_rows(const T* x, D* dst, u64 rows, u64 cols, u64 slice_rows) {
    typedef typename Wide<T>::type W;
    const int N = Pack<T>::N;
    __shared__ W partial[ROWS_TY][N][ROWS_TX];
    const u64 c0 = ((u64)blockIdx.x * ROWS_TX + threadIdx.x) * N;
    const u64 begin = (u64)blockIdx.y * slice_rows, end = begin + slice_rows < rows ? begin + slice_rows : rows;
    W sum[N];
#pragma unroll
    for (int e = 0; e < N; ++e) sum[e] = 0;
    if (c0 < cols) {
        if (((u64)x & 15) == 0 && (cols * sizeof(T)) % 16 == 0)
            row_slice_sum<T, true>(x, cols, c0, begin + threadIdx.y, end, sum);
        else
            row_slice_sum<T, false>(x, cols, c0, begin + threadIdx.y, end, sum);
    }
#pragma unroll
    for (int e = 0; e < N; ++e) partial[threadIdx.y][e][threadIdx.x] = sum[e];
    __syncthreads();
    if (threadIdx.y != 0 || c0 >= cols) return;
    for (int y = 1; y < ROWS_TY; ++y)
#pragma unroll
        for (int e = 0; e < N; ++e) sum[e] += partial[y][e][threadIdx.x];
    D* to = dst + (u64)blockIdx.y * cols;
#pragma unroll
    for (int e = 0; e < N; ++e)
        if (c0 + e < cols) st(&to[c0 + e], sum[e]);
}

// The second launch of a sliced row sum: out[c] = the sum of parts[s · cols + c] over the
// slices s, a column reduction (Grid::columns: 32 × 32-thread blocks from 32 slices up, else
// a thread per column adding its slices in order). sum_splits would add ~100 slices of one
// column in one thread, a chain of dependent round trips to memory on a few SMs; here slice
// y adds slices y, y + 32, ... and column_sum adds the 32 partials in y order, an order
// that depends on the slice count alone.
template <typename T>
__device__ __forceinline__ void sum_row_slices(const typename Wide<T>::type* parts, T* out, u64 cols, u64 slices) {
    typedef typename Wide<T>::type W;
    __shared__ W partial[COLUMN_THREADS][COLUMN_THREADS];
    FOR_EACH_COLUMN(c, cols) {
        bool mine = c < cols;
        u64 end = mine ? slices : 0;
        W sum = (W)0;
#pragma unroll 4
        for (u64 s = threadIdx.y; s < end; s += blockDim.y) sum += parts[s * cols + c];
        sum = column_sum(sum, partial);
        if (mine && threadIdx.y == 0) st(&out[c], sum);
    }
}

// The sum_to entries of one dtype S (stored as T, its partial sums in P): written once,
// declared per dtype below (cuda/src/sources.rs reads the entries off the invocations).
#define SUM_TO_ENTRIES(S, T, P)                                                                         \
    extern "C" __global__ void BLOCK_1024 regflow_sum_to_##S(const T* x, T* out, Indexing kept,         \
                                                             Indexing reduced, u64 n_out, u64 n_reduced) { \
        sum_to(x, out, kept, reduced, n_out, n_reduced);                                                \
    }                                                                                                   \
    extern "C" __global__ void regflow_sum_to_chunks_##S(const T* x, P* parts, Indexing kept,           \
                                                         Indexing reduced, u64 n_reduced, u64 chunk) {  \
        sum_to_chunks(x, parts, kept, reduced, n_reduced, chunk);                                       \
    }                                                                                                   \
    extern "C" __global__ void regflow_sum_parts_##S(const P* parts, T* out, u64 chunks) {              \
        sum_parts(parts, out, chunks);                                                                  \
    }                                                                                                   \
    extern "C" __global__ void BLOCK_1024 regflow_sum_to_split_##S(const T* x, P* parts, Indexing kept, \
                                                                   Indexing reduced, u64 n_out,         \
                                                                   u64 n_reduced, u64 chunk) {          \
        sum_to_split(x, parts, kept, reduced, n_out, n_reduced, chunk);                                 \
    }                                                                                                   \
    extern "C" __global__ void regflow_sum_splits_##S(const P* parts, T* out, u64 n_out, u64 splits) {  \
        sum_splits(parts, out, n_out, splits);                                                          \
    }                                                                                                   \
    extern "C" __global__ void BLOCK_1024 regflow_sum_flat_##S(const T* x, T* out, u64 n) {             \
        sum_flat(x, out, n);                                                                            \
    }                                                                                                   \
    extern "C" __global__ void regflow_sum_flat_chunks_##S(const T* x, P* parts, u64 n, u64 chunk) {    \
        sum_flat_chunks(x, parts, n, chunk);                                                            \
    }                                                                                                   \
    extern "C" __global__ void ROWS_BLOCK regflow_sum_rows_##S(const T* x, T* out, u64 rows, u64 cols,  \
                                                               u64 slice_rows) {                        \
        sum_rows(x, out, rows, cols, slice_rows);                                                       \
    }                                                                                                   \
    extern "C" __global__ void ROWS_BLOCK regflow_sum_rows_split_##S(const T* x, P* parts, u64 rows,    \
                                                                     u64 cols, u64 slice_rows) {        \
        sum_rows(x, parts, rows, cols, slice_rows);                                                     \
    }                                                                                                   \
    extern "C" __global__ void BLOCK_1024 regflow_sum_row_slices_##S(const P* parts, T* out, u64 cols,  \
                                                                     u64 slices) {                      \
        sum_row_slices(parts, out, cols, slices);                                                       \
    }
SUM_TO_ENTRIES(f32, float, float)
SUM_TO_ENTRIES(f64, double, double)
SUM_TO_ENTRIES(bf16, bf16, float)
SUM_TO_ENTRIES(f16, f16, float)

// `sum_squares` (a scalar: always the flat sums) with each summand squared as it loads (f32
// and f64; the second launch of the chunked one is sum_to's `sum_parts`).
#define SUM_SQUARES_ENTRIES(S, T, P)                                                                         \
    extern "C" __global__ void BLOCK_1024 regflow_sum_squares_flat_##S(const T* x, T* out, u64 n) {          \
        sum_flat<T, true>(x, out, n);                                                                        \
    }                                                                                                        \
    extern "C" __global__ void regflow_sum_squares_flat_chunks_##S(const T* x, P* parts, u64 n, u64 chunk) { \
        sum_flat_chunks<T, true>(x, parts, n, chunk);                                                        \
    }
SUM_SQUARES_ENTRIES(f32, float, float)
SUM_SQUARES_ENTRIES(f64, double, double)

// ---- embedding ---------------------------------------------------------------------

// out[i, f] = table[ids[i] - first, f] for n = ids · features elements: the table holds rows
// first..first + rows of the vocabulary (all of it for `embedding`, first = 0; a device's
// part for `vocab_part`). An id held elsewhere reads zeros (another device adds its row);
// an id outside the vocabulary too: the CPU kernel reports it as an error, which a queued
// kernel cannot do.
template <typename T>
__device__ __forceinline__ void embedding(const T* table, const i64* ids, T* out, u64 n, u64 features, u64 first,
                                          u64 rows) {
    FOR_EACH(i, n) {
        u64 row = i, f = div_step(&row, features);
        // Compared before subtracting: an id far below `first` must not overflow.
        i64 id = ids[row];
        bool held = id >= (i64)first && (u64)id - first < rows;
        out[i] = held ? table[((u64)id - first) * features + f] : (T)0;
    }
}

// The gradient of a gather: table[r, f] = Σ dy[i, f] over the ids i with ids[i] = first + r,
// added in id order from 0, as the CPU kernel adds them, so the bits are the CPU's and the
// same from run to run (atomic adds would sum a row's contributions in whatever order the
// threads arrive). Ids held elsewhere or outside the vocabulary add nothing. Four launches,
// through the stream's scratch (rows + 1 offsets, then one u32 per id):
// 1. embedding_grad_count: offsets[r] = how many ids fall on row r (offsets zeroed first);
// 2. embedding_grad_offsets: offsets made exclusive prefix sums in place, offsets[rows] the
//    number of ids held;
// 3. embedding_grad_order: order[offsets[r] + k] = the k-th id (in id order) of row r, its
//    rank k counted by a warp over the ids before it (no sort, so the order is fixed);
// 4. embedding_grad_<dtype>: each table row, whole, from its ids' dy rows in that order
//    (zeros where none), so the table needs no zero fill of its own.

// Whether id falls on the rows first..first + rows (compared before subtracting: an id far
// below `first` must not overflow).
__device__ __forceinline__ bool held_id(i64 id, u64 first, u64 rows) {
    return id >= (i64)first && (u64)id - first < rows;
}

extern "C" __global__ void regflow_embedding_grad_count(const i64* ids, u32* offsets, u64 tokens, u64 first,
                                                        u64 rows) {
    FOR_EACH(i, tokens) {
        i64 id = ids[i];
        if (held_id(id, first, rows)) atomicAdd(&offsets[(u64)id - first], 1u);
    }
}

// One block of 1024 threads: thread t counts a contiguous run of rows, the block scans the
// runs' totals, and each thread rewrites its run as exclusive sums from its start.
extern "C" __global__ void BLOCK_1024 regflow_embedding_grad_offsets(u32* offsets, u64 rows) {
    __shared__ u32 totals[1024];
    u32 t = threadIdx.x;
    u64 per = (rows + blockDim.x - 1) / blockDim.x;
    u64 begin = (u64)t * per < rows ? (u64)t * per : rows;
    u64 end = begin + per < rows ? begin + per : rows;
    // Unrolled so that eight of a thread's loads are in flight at once: the block's 1024
    // threads are all the scan has (GPT-2's 50257 rows: 50 each, twice).
    u32 run = 0;
#pragma unroll 8
    for (u64 r = begin; r < end; ++r) run += offsets[r];
    totals[t] = run;
    __syncthreads();
    // Inclusive scan of the runs' totals (Hillis-Steele over the block).
    for (u32 step = 1; step < blockDim.x; step <<= 1) {
        u32 before = t >= step ? totals[t - step] : 0u;
        __syncthreads();
        totals[t] += before;
        __syncthreads();
    }
    run = t == 0 ? 0u : totals[t - 1];
#pragma unroll 8
    for (u64 r = begin; r < end; ++r) {
        u32 count = offsets[r];
        offsets[r] = run;
        run += count;
    }
    if (t == blockDim.x - 1) offsets[rows] = totals[t];
}

// One warp per id (grid-stride over warps): its rank among the earlier ids of its row.
extern "C" __global__ void regflow_embedding_grad_order(const i64* ids, const u32* offsets, u32* order, u64 tokens,
                                                        u64 first, u64 rows) {
    u32 lane = threadIdx.x & 31;
    u64 warps = (u64)gridDim.x * (blockDim.x >> 5);
    for (u64 i = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); i < tokens; i += warps) {
        i64 id = ids[i];
        if (!held_id(id, first, rows)) continue;
        u32 rank = 0;
#pragma unroll 4
        for (u64 j = lane; j < i; j += 32) rank += ids[j] == id ? 1u : 0u;
        rank = warp_sum(rank);
        if (lane == 0) order[offsets[(u64)id - first] + rank] = (u32)i;
    }
}

// One block per table row (grid-stride), its threads over the features. With a base
// (EmbeddingGrad::base, B its element type, 16-bit ones widened), each element is then
// added to the base's, as an `add` of the two would.
template <typename T, typename B>
__device__ __forceinline__ void embedding_grad_rows(const T* dy, const u32* offsets, const u32* order, const B* base,
                                                    T* table, u64 features, u64 rows) {
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        u32 begin = offsets[r], end = offsets[r + 1];
        for (u64 f = threadIdx.x; f < features; f += blockDim.x) {
            T sum = (T)0;
            for (u32 k = begin; k < end; ++k) sum += dy[(u64)order[k] * features + f];
            table[r * features + f] = base ? sum + (T)ld(base + r * features + f) : sum;
        }
    }
}

extern "C" __global__ void regflow_embedding_f32(const float* table, const i64* ids, float* out, u64 n, u64 features,
                                                 u64 first, u64 rows) {
    embedding(table, ids, out, n, features, first, rows);
}
extern "C" __global__ void regflow_embedding_f64(const double* table, const i64* ids, double* out, u64 n, u64 features,
                                                 u64 first, u64 rows) {
    embedding(table, ids, out, n, features, first, rows);
}
extern "C" __global__ void regflow_embedding_grad_f32(const float* dy, const u32* offsets, const u32* order,
                                                      float* table, u64 features, u64 rows) {
    embedding_grad_rows(dy, offsets, order, (const float*)nullptr, table, features, rows);
}
extern "C" __global__ void regflow_embedding_grad_f64(const double* dy, const u32* offsets, const u32* order,
                                                      double* table, u64 features, u64 rows) {
    embedding_grad_rows(dy, offsets, order, (const double*)nullptr, table, features, rows);
}
#define EMBEDDING_GRAD_BASE(S, T, B)                                                                        \
    extern "C" __global__ void regflow_embedding_grad_base_##S(const T* dy, const u32* offsets, const u32* order, \
                                                               const B* base, T* table, u64 features, u64 rows) { \
        embedding_grad_rows(dy, offsets, order, base, table, features, rows);                               \
    }
EMBEDDING_GRAD_BASE(f32_f32, float, float)
EMBEDDING_GRAD_BASE(f32_bf16, float, bf16)
EMBEDDING_GRAD_BASE(f32_f16, float, f16)
EMBEDDING_GRAD_BASE(f64_f64, double, double)
