// The prelude of every regflow kernel source: integer types, bf16 conversions, grid-stride
// loops and block reductions. No #include: NVRTC compiles these without the toolkit's
// headers, so CI can check them with NVRTC alone.

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;
// bf16 travels as its bits; arithmetic is in f32.
typedef unsigned short bf16;

__device__ __forceinline__ float bf16_to_f32(bf16 x) { return __uint_as_float(((u32)x) << 16); }

// Round to nearest even; NaN stays NaN (quiet).
__device__ __forceinline__ bf16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

// Math by element type: explicit overloads, so no header's overload set is needed.
__device__ __forceinline__ float m_exp(float x) { return expf(x); }
__device__ __forceinline__ double m_exp(double x) { return exp(x); }
__device__ __forceinline__ float m_log(float x) { return logf(x); }
__device__ __forceinline__ double m_log(double x) { return log(x); }
__device__ __forceinline__ float m_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double m_sqrt(double x) { return sqrt(x); }

#define MAX_RANK 8

// How a grid-stride loop index maps to element offsets, for ranks up to MAX_RANK. Passed
// by value; the Rust twin is `ops::layout::Indexing` (#[repr(C)], same field order, every
// field a u64, so both sides agree on the 200-byte layout without padding).
//   rank:    dimensions used (0..=MAX_RANK); dims[d] for d >= rank are ignored.
//   dims:    the iterated shape, row-major (the last dimension varies fastest).
//   a, b:    per-dimension element strides of up to two operands (0 on a broadcast
//            dimension); some kernels give `b` another meaning, said where they do.
struct Indexing {
    u64 rank;
    u64 dims[MAX_RANK];
    u64 a[MAX_RANK];
    u64 b[MAX_RANK];
};

// How a flat index over `dims` (row-major) maps to an offset with `strides` (0 on broadcast
// axes): the reductions' kept and reduced axes and the row ops' broadcast masks. Axes of one
// element are dropped and contiguous ones merged on the host.
struct Axes {
    u64 rank;
    u64 dims[8];
    u64 strides[8];
};

// Divides *i by dim and returns the remainder. 64-bit division is a long emulated
// sequence on GPUs; indices and dims below 2^32 (nearly all) take the 32-bit instruction.
__device__ __forceinline__ u64 div_step(u64* i, u64 dim) {
    if (((*i) | dim) >> 32 == 0) {
        u32 a = (u32)*i, b = (u32)dim;
        *i = a / b;
        return a % b;
    }
    u64 k = *i % dim;
    *i /= dim;
    return k;
}

__device__ __forceinline__ u64 offset_of(const Axes& a, u64 flat) {
    u64 off = 0;
    for (int d = (int)a.rank - 1; d >= 0; --d) off += div_step(&flat, a.dims[d]) * a.strides[d];
    return off;
}

// Every element index of a one-dimensional grid-stride loop over n elements.
#define FOR_EACH(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (u64)(n); i += (u64)gridDim.x * blockDim.x)

template <typename T> __device__ __forceinline__ T warp_sum(T v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
    return v;
}

template <typename T> __device__ __forceinline__ T warp_max(T v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        T other = __shfl_down_sync(0xffffffffu, v, offset);
        v = other > v ? other : v;
    }
    return v;
}

// The sum of `v` over the block, returned to every thread. `scratch` holds 32 values of T
// in shared memory; blockDim.x is a multiple of 32, at most 1024.
template <typename T> __device__ T block_sum(T v, T* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int warps = (blockDim.x + 31) >> 5;
    T total = lane < warps ? scratch[lane] : (T)0;
    total = warp_sum(total);
    if (threadIdx.x == 0) scratch[0] = total;
    __syncthreads();
    return scratch[0];
}

// The maximum of `v` over the block, returned to every thread (as block_sum).
template <typename T> __device__ T block_max(T v, T* scratch, T lowest) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int warps = (blockDim.x + 31) >> 5;
    T m = lane < warps ? scratch[lane] : lowest;
    m = warp_max(m);
    if (threadIdx.x == 0) scratch[0] = m;
    __syncthreads();
    return scratch[0];
}
