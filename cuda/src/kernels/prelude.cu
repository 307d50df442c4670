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
