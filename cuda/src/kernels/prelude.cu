// The prelude of every regflow kernel source: integer types, bf16 and f16 conversions, grid-stride
// loops and block reductions. No #include: NVRTC compiles these without the toolkit's
// headers, so CI can check them with NVRTC alone.

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;
// bf16 travels as its bits; arithmetic is in f32.
typedef unsigned short bf16;

__device__ __forceinline__ float bf16_to_f32(bf16 x) { return __uint_as_float(((u32)x) << 16); }

// Round to nearest even; NaN stays NaN (quiet), its sign and payload kept. From Ampere on
// one conversion instruction rounds (it would make every NaN the canonical one, hence the
// select), where the bit arithmetic took six: kernels that store bf16 row by row (the
// cross-entropy's gradient stores 412 M per GPT-2 step) were limited by instructions.
// `BF16_CVT=0` (REGFLOW_CUDA_DEFINES) takes the bit arithmetic everywhere.
#ifndef BF16_CVT
#define BF16_CVT 1
#endif
__device__ __forceinline__ bf16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
#if BF16_CVT && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return f != f ? (bf16)((u >> 16) | 0x40u) : (bf16)r;
#else
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
#endif
}

// f16 (IEEE half) travels as its bits too, wrapped in a struct so that it is a type of its
// own (bf16 is an unsigned short) and the loads and stores below tell the two apart. The
// conversions are the PTX instructions the toolkit's cuda_fp16.h uses (round to nearest
// even; past 65504 to infinity). `f16(0)` is +0.0 (all zero bits), as `T(0)` is for the
// other types.
struct f16 {
    unsigned short bits;
    f16() = default;
    __device__ explicit f16(int zero) : bits((unsigned short)(zero != 0 ? 0x3c00u : 0u)) {}
};

__device__ __forceinline__ float f16_to_f32(f16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}

__device__ __forceinline__ f16 f32_to_f16(float v) {
    f16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(v));
    return r;
}

// Loads and stores by element type, for kernels written once for f32, f64, bf16 and f16:
// a 16-bit float is widened to f32 for arithmetic and rounded to nearest even when stored,
// as the CPU's 16-bit kernels do; f32 and f64 pass through. `Wide<T>::type` is the
// arithmetic type.
__device__ __forceinline__ float ld(const float* p) { return *p; }
__device__ __forceinline__ double ld(const double* p) { return *p; }
__device__ __forceinline__ float ld(const bf16* p) { return bf16_to_f32(*p); }
__device__ __forceinline__ float ld(const f16* p) { return f16_to_f32(*p); }
__device__ __forceinline__ void st(float* p, float v) { *p = v; }
__device__ __forceinline__ void st(double* p, double v) { *p = v; }
__device__ __forceinline__ void st(bf16* p, float v) { *p = f32_to_bf16(v); }
__device__ __forceinline__ void st(f16* p, float v) { *p = f32_to_f16(v); }
template <typename T> struct Wide { typedef T type; };
template <> struct Wide<bf16> { typedef float type; };
template <> struct Wide<f16> { typedef float type; };

// -infinity by type (an empty max, a masked score).
template <typename T> __device__ __forceinline__ T minus_infinity();
template <> __device__ __forceinline__ float minus_infinity<float>() { return __int_as_float(0xff800000); }
template <> __device__ __forceinline__ double minus_infinity<double>() {
    return __longlong_as_double((long long)0xfff0000000000000ULL);
}

// Math by element type: explicit overloads, so no header's overload set is needed.
__device__ __forceinline__ float m_exp(float x) { return expf(x); }
__device__ __forceinline__ double m_exp(double x) { return exp(x); }
__device__ __forceinline__ float m_log(float x) { return logf(x); }
__device__ __forceinline__ double m_log(double x) { return log(x); }
__device__ __forceinline__ float m_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double m_sqrt(double x) { return sqrt(x); }

// e^x for a value stored as T, computed in Wide<T>: for bf16 and f16 the hardware's
// approximation (`__expf`: a multiply and `ex2.approx`, relative error about 2^-21 for the
// arguments a softmax or a GELU gives it, far below the 2^-9 of a bf16 result) where `expf`
// takes about ten instructions with its range reduction; f32 and f64 keep the accurate
// function. The cross-entropy and GELU kernels over 16-bit data were limited by issuing
// those instructions, not by memory. `FAST16=0` (REGFLOW_CUDA_DEFINES) takes `expf` for
// every type, as before.
#ifndef FAST16
#define FAST16 1
#endif
template <typename T> __device__ __forceinline__ typename Wide<T>::type stored_exp(typename Wide<T>::type x) {
    return m_exp(x);
}
template <> __device__ __forceinline__ float stored_exp<bf16>(float x) { return FAST16 ? __expf(x) : expf(x); }
template <> __device__ __forceinline__ float stored_exp<f16>(float x) { return FAST16 ? __expf(x) : expf(x); }

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

// ---- eight elements per access: the elementwise kernels' fast path ----------------------
// An elementwise kernel moves EIGHT elements per step of its grid-stride loop where every
// pointer it steps through is aligned to eight elements (a register's slot is 256-byte
// aligned; a window into one may not be): one 16-byte access for the 16-bit types, two for
// f32, four for f64, instead of a narrow access per element, so far more bytes are in
// flight per thread. Each element is still computed by the same expression, so results
// are bitwise those of the one-element loop, which takes the rest (n mod 8, or everything
// when a pointer is not aligned). The host sizes such grids with `Grid::eights`.
#define EIGHT 8
template <typename T> struct alignas(EIGHT * sizeof(T)) Eight {
    T v[EIGHT];
};
template <typename T> __device__ __forceinline__ bool eight_aligned(const T* p) {
    return ((u64)p % (EIGHT * sizeof(T))) == 0;
}
template <typename T> __device__ __forceinline__ Eight<T> ld8(const T* p) { return *reinterpret_cast<const Eight<T>*>(p); }
template <typename T> __device__ __forceinline__ void st8(T* p, const Eight<T>& v) { *reinterpret_cast<Eight<T>*>(p) = v; }

// Kernels launched with blocks of up to 1024 threads (Grid::columns, reduce's blocks):
// the bound makes the compiler keep to the 64 registers per thread that such a block
// may use, where a kernel using more would fail to launch.
#define BLOCK_1024 __launch_bounds__(1024)

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

// ---- column reductions (Grid::columns) ----------------------------------------------
// Each output of a column reduction has a thread in x, so a warp reads neighbouring
// addresses where the outputs are neighbours in the input (a bias gradient's columns);
// the output's reduced range is split over threadIdx.y: slice y combines the elements
// k = y, y + blockDim.y, y + 2·blockDim.y, ... in that order in a register, then
// column_sum / column_max combine the blockDim.y partials in y order in the threads of
// slice 0. Blocks are 32×32 threads for long ranges (32 outputs each) and 256×1 for short
// ones, where the single slice walks the whole range in order (the CPU kernels' order).
// The order depends on the block's shape alone, which the host picks from the reduced
// count, so the same inputs always give the same bits; with 32 slices it is not the CPU's
// serial order, so sums differ from the CPU's by rounding (and are usually closer to the
// exact sum: each slice adds a 32nd of the range).

// Every output index of a column reduction this thread takes: groups of blockDim.x
// consecutive outputs, one per block, striding by the grid. `o - threadIdx.x` (the group's
// first output) is the same in every thread of a block, so all of them run the loop
// equally often, as column_sum's barriers need; `o` may be past `n` in the last group, so
// the body checks it.
#define FOR_EACH_COLUMN(o, n) \
    for (u64 o = (u64)blockIdx.x * blockDim.x + threadIdx.x; o - threadIdx.x < (u64)(n); o += (u64)gridDim.x * blockDim.x)

// Most threads of a column block in x and in y; the partials' shared array is this square.
#define COLUMN_THREADS 32

// Publishes this thread's partial to the block's `partial` array (shared memory of
// COLUMN_THREADS × COLUMN_THREADS values) once every thread has finished reading the
// previous group's partials. Every thread of a block with blockDim.y > 1 calls it.
template <typename T> __device__ __forceinline__ void column_publish(T v, T (*partial)[COLUMN_THREADS]) {
    __syncthreads();
    partial[threadIdx.y][threadIdx.x] = v;
    __syncthreads();
}

// The sum of the slices' partials `v` of output threadIdx.x, added in slice order, in the
// threads of slice 0 (the others get their own partial back). Every thread of the block
// calls it; with one slice it is `v`.
template <typename T> __device__ __forceinline__ T column_sum(T v, T (*partial)[COLUMN_THREADS]) {
    if (blockDim.y == 1) return v;
    column_publish(v, partial);
    if (threadIdx.y == 0)
        for (u32 y = 1; y < blockDim.y; ++y) v += partial[y][threadIdx.x];
    return v;
}

// The maximum of the slices' partials, as column_sum; `p > v ? p : v` as the slices' own
// loops, so the maximum's value is the one a serial pass finds (partials are never NaN).
template <typename T> __device__ __forceinline__ T column_max(T v, T (*partial)[COLUMN_THREADS]) {
    if (blockDim.y == 1) return v;
    column_publish(v, partial);
    if (threadIdx.y == 0)
        for (u32 y = 1; y < blockDim.y; ++y) {
            T p = partial[y][threadIdx.x];
            v = p > v ? p : v;
        }
    return v;
}
