// Reductions over any set of axes (sum, mean, max) and the max mask. The host describes
// the input as its kept axes and its reduced axes (axes of one element dropped, adjacent
// axes of one kind merged), each with its dims and input strides; an output element's
// index over the kept axes is its row-major index in the (keepdim) output.



// kind: 0 sums (then scales by `scale`: 1 for a sum, 1 / count for a mean, so an empty mean
// is 0 · inf = NaN as on the CPU), 1 takes the maximum (NaNs skipped, -inf when empty).
// `x > m ? x : m` skips a NaN `x` and never makes `m` NaN, as the CPU kernel's `if x > o`.

// The innermost input axis is reduced: one block per output element (256 threads, or 1024
// for fewer outputs than that, see reduce.rs), its threads reading neighbouring elements
// and combining them with the block reduction.
template <typename T>
__device__ void reduce_by_blocks(const T* x, T* out, u64 outputs, Axes kept, Axes reduced, u64 count, int kind, T scale) {
    __shared__ T scratch[32];
    for (u64 o = blockIdx.x; o < outputs; o += gridDim.x) {
        const T* base = x + offset_of(kept, o);
        T v;
        if (kind == 1) {
            T m = minus_infinity<T>();
            for (u64 r = threadIdx.x; r < count; r += blockDim.x) {
                T e = base[offset_of(reduced, r)];
                m = e > m ? e : m;
            }
            v = block_max(m, scratch, minus_infinity<T>());
        } else {
            T s = 0;
            for (u64 r = threadIdx.x; r < count; r += blockDim.x) s += base[offset_of(reduced, r)];
            v = block_sum(s, scratch) * scale;
        }
        if (threadIdx.x == 0) out[o] = v;
    }
}

// The innermost input axis is kept (column sums, e.g. a bias gradient over the batch): a
// column reduction (see the prelude), neighbouring threads reading neighbouring elements,
// each slice of an output's reduced elements combined in order, then the slices in order.
template <typename T>
__device__ void reduce_by_threads(const T* x, T* out, u64 outputs, Axes kept, Axes reduced, u64 count, int kind, T scale) {
    __shared__ T partial[COLUMN_THREADS][COLUMN_THREADS];
    FOR_EACH_COLUMN(o, outputs) {
        bool mine = o < outputs;
        const T* base = x + (mine ? offset_of(kept, o) : 0);
        u64 end = mine ? count : 0;
        if (kind == 1) {
            T m = minus_infinity<T>();
            for (u64 r = threadIdx.y; r < end; r += blockDim.y) {
                T e = base[offset_of(reduced, r)];
                m = e > m ? e : m;
            }
            m = column_max(m, partial);
            if (mine && threadIdx.y == 0) out[o] = m;
        } else {
            T s = 0;
            for (u64 r = threadIdx.y; r < end; r += blockDim.y) s += base[offset_of(reduced, r)];
            s = column_sum(s, partial);
            if (mine && threadIdx.y == 0) out[o] = s * scale;
        }
    }
}

extern "C" __global__ void BLOCK_1024 regflow_reduce_blocks_f32(
    const float* x, float* out, u64 outputs, Axes kept, Axes reduced, u64 count, int kind, float scale) {
    reduce_by_blocks(x, out, outputs, kept, reduced, count, kind, scale);
}
extern "C" __global__ void BLOCK_1024 regflow_reduce_blocks_f64(
    const double* x, double* out, u64 outputs, Axes kept, Axes reduced, u64 count, int kind, double scale) {
    reduce_by_blocks(x, out, outputs, kept, reduced, count, kind, scale);
}
extern "C" __global__ void BLOCK_1024 regflow_reduce_threads_f32(
    const float* x, float* out, u64 outputs, Axes kept, Axes reduced, u64 count, int kind, float scale) {
    reduce_by_threads(x, out, outputs, kept, reduced, count, kind, scale);
}
extern "C" __global__ void BLOCK_1024 regflow_reduce_threads_f64(
    const double* x, double* out, u64 outputs, Axes kept, Axes reduced, u64 count, int kind, double scale) {
    reduce_by_threads(x, out, outputs, kept, reduced, count, kind, scale);
}

// out = 1 where x equals the (broadcast) maximum m, else 0; `m_axes` maps x's flat index
// to m's offset.
template <typename T> __device__ void max_mask(const T* x, const T* m, T* out, u64 n, Axes m_axes) {
    FOR_EACH(i, n) out[i] = x[i] == m[offset_of(m_axes, i)] ? (T)1 : (T)0;
}

extern "C" __global__ void regflow_max_mask_f32(const float* x, const float* m, float* out, u64 n, Axes m_axes) {
    max_mask(x, m, out, n, m_axes);
}
extern "C" __global__ void regflow_max_mask_f64(const double* x, const double* m, double* out, u64 n, Axes m_axes) {
    max_mask(x, m, out, n, m_axes);
}
