// Filling and casting: constant tensors, and dtype conversions (f32 <-> bf16 or f16 for
// mixed precision).

// out[i] = f(x[i]) for i < n, eight elements per step where both are aligned (see EIGHT in
// the prelude), the rest one by one; this thread takes every `step`-th group (and element)
// from `first`.
template <typename A, typename B, typename F>
__device__ __forceinline__ void convert_strided(const A* x, B* out, u64 n, F f, u64 first, u64 step) {
    u64 done = 0;
    if (eight_aligned(x) && eight_aligned(out)) {
        u64 groups = n / EIGHT;
        for (u64 g = first; g < groups; g += step) {
            Eight<A> a = ld8(x + g * EIGHT);
            Eight<B> r;
#pragma unroll
            for (int k = 0; k < EIGHT; ++k) r.v[k] = f(a.v[k]);
            st8(out + g * EIGHT, r);
        }
        done = groups * EIGHT;
    }
    for (u64 i = done + first; i < n; i += step) out[i] = f(x[i]);
}

// `convert_strided` over the whole grid (FOR_EACH's order): each cast entry is one
// conversion function run through this.
template <typename A, typename B, typename F> __device__ __forceinline__ void convert(const A* x, B* out, u64 n, F f) {
    convert_strided(x, out, n, f, (u64)blockIdx.x * blockDim.x + threadIdx.x, (u64)gridDim.x * blockDim.x);
}

// A conversion as a function object, for `convert`: `CONVERSION(Name, A, B, expression of v)`.
#define CONVERSION(NAME, A, B, EXPR) \
    struct NAME {                      \
        __device__ B operator()(A v) const { return EXPR; } \
    };

extern "C" __global__ void regflow_fill_f32(float* out, float value, u64 n) {
    FOR_EACH(i, n) out[i] = value;
}

extern "C" __global__ void regflow_fill_f64(double* out, double value, u64 n) {
    FOR_EACH(i, n) out[i] = value;
}

extern "C" __global__ void regflow_fill_i64(i64* out, i64 value, u64 n) {
    FOR_EACH(i, n) out[i] = value;
}

CONVERSION(Cast_f32_bf16, float, bf16, f32_to_bf16(v))
extern "C" __global__ void regflow_cast_f32_bf16(const float* x, bf16* out, u64 n) {
    convert(x, out, n, Cast_f32_bf16());
}

CONVERSION(Cast_bf16_f32, bf16, float, bf16_to_f32(v))
extern "C" __global__ void regflow_cast_bf16_f32(const bf16* x, float* out, u64 n) {
    convert(x, out, n, Cast_bf16_f32());
}

// bf16 and f16 fills take the value as its 16 bits.
extern "C" __global__ void regflow_fill_bf16(bf16* out, bf16 value, u64 n) {
    FOR_EACH(i, n) out[i] = value;
}
extern "C" __global__ void regflow_fill_f16(f16* out, f16 value, u64 n) {
    FOR_EACH(i, n) out[i] = value;
}

CONVERSION(Cast_f32_f16, float, f16, f32_to_f16(v))
extern "C" __global__ void regflow_cast_f32_f16(const float* x, f16* out, u64 n) {
    convert(x, out, n, Cast_f32_f16());
}

CONVERSION(Cast_f16_f32, f16, float, f16_to_f32(v))
extern "C" __global__ void regflow_cast_f16_f32(const f16* x, float* out, u64 n) {
    convert(x, out, n, Cast_f16_f32());
}

// Between the two 16-bit types through f32, which holds both exactly: one rounding.
CONVERSION(Cast_bf16_f16, bf16, f16, f32_to_f16(bf16_to_f32(v)))
extern "C" __global__ void regflow_cast_bf16_f16(const bf16* x, f16* out, u64 n) {
    convert(x, out, n, Cast_bf16_f16());
}

CONVERSION(Cast_f16_bf16, f16, bf16, f32_to_bf16(f16_to_f32(v)))
extern "C" __global__ void regflow_cast_f16_bf16(const f16* x, bf16* out, u64 n) {
    convert(x, out, n, Cast_f16_bf16());
}

// A causal mask [len, len]: 0 at (i, j <= i), `masked` above the diagonal (the CPU's
// kernels/src/cpu/fill.rs). The value arrives in the element type (bf16 as its 16 bits).
template <typename T> __device__ __forceinline__ void causal_mask(T* out, T masked, u64 len, u64 n) {
    FOR_EACH(i, n) {
        u64 row = i, col = div_step(&row, len);
        out[i] = col > row ? masked : T(0);
    }
}

extern "C" __global__ void regflow_causal_mask_f32(float* out, float masked, u64 len, u64 n) {
    causal_mask(out, masked, len, n);
}
extern "C" __global__ void regflow_causal_mask_f64(double* out, double masked, u64 len, u64 n) {
    causal_mask(out, masked, len, n);
}
// bf16 travels as its bits, and bf16 0.0 is all zero bits: the same template.
extern "C" __global__ void regflow_causal_mask_bf16(bf16* out, bf16 masked, u64 len, u64 n) {
    causal_mask(out, masked, len, n);
}
// f16 likewise (`f16(0)` is all zero bits).
extern "C" __global__ void regflow_causal_mask_f16(f16* out, f16 masked, u64 len, u64 n) {
    causal_mask(out, masked, len, n);
}

// f64 rounded to f32 toward zero, the lowest bit set when anything was dropped (round to
// odd): rounding that to a format at least two bits narrower than f32 gives what rounding
// the f64 itself would (NaN stays NaN). The CPU's `plan/src/bf16_round.rs` does the same.
__device__ __forceinline__ float f64_to_f32_odd(double x) {
    float f = __double2float_rz(x);
    if ((double)f != x && x == x && !isinf(f)) f = __uint_as_float(__float_as_uint(f) | 1u);
    if (x != x) f = __double2float_rn(x);
    return f;
}

// f64 to bf16 in one rounding: f32's 24 bits round to bf16's 8 as the f64 would.
__device__ __forceinline__ bf16 f64_to_bf16(double x) { return f32_to_bf16(f64_to_f32_odd(x)); }

CONVERSION(Cast_f64_bf16, double, bf16, f64_to_bf16(v))
extern "C" __global__ void regflow_cast_f64_bf16(const double* x, bf16* out, u64 n) {
    convert(x, out, n, Cast_f64_bf16());
}

CONVERSION(Cast_bf16_f64, bf16, double, (double)bf16_to_f32(v))
extern "C" __global__ void regflow_cast_bf16_f64(const bf16* x, double* out, u64 n) {
    convert(x, out, n, Cast_bf16_f64());
}

// f64 to f16 in one rounding, the same way: f32 keeps 13 bits more than f16.
__device__ __forceinline__ f16 f64_to_f16(double x) { return f32_to_f16(f64_to_f32_odd(x)); }

CONVERSION(Cast_f64_f16, double, f16, f64_to_f16(v))
extern "C" __global__ void regflow_cast_f64_f16(const double* x, f16* out, u64 n) {
    convert(x, out, n, Cast_f64_f16());
}

CONVERSION(Cast_f16_f64, f16, double, (double)f16_to_f32(v))
extern "C" __global__ void regflow_cast_f16_f64(const f16* x, double* out, u64 n) {
    convert(x, out, n, Cast_f16_f64());
}

CONVERSION(Cast_f32_f64, float, double, (double)v)
extern "C" __global__ void regflow_cast_f32_f64(const float* x, double* out, u64 n) {
    convert(x, out, n, Cast_f32_f64());
}

CONVERSION(Cast_f64_f32, double, float, (float)v)
extern "C" __global__ void regflow_cast_f64_f32(const double* x, float* out, u64 n) {
    convert(x, out, n, Cast_f64_f32());
}

// ---- cast_group: up to CAST_MEMBERS casts per launch ----------------------------------------
// The compiler's fused casts (a device's weights at a step's start, its gradients for the
// update). The table is passed by value (kernel parameters: nothing to copy before the
// launch, nothing to free after it); its Rust twin is `ops::cast::CastTable` (#[repr(C)],
// the same fields in the same order, 912 bytes).
#define CAST_MEMBERS 32

//   src, dst:       each member's input and output, device addresses.
//   n:              each member's elements.
//   block_elements: elements of one block's chunk (a multiple of EIGHT, so a chunk of an
//                   aligned member starts aligned).
//   first_block:    member m's chunks are blocks first_block[m]..first_block[m + 1]
//                   (prefix sums computed once on the host; first_block[members] is the
//                   grid's size).
//   members:        members in this launch (1..=CAST_MEMBERS).
struct CastTable {
    u64 src[CAST_MEMBERS];
    u64 dst[CAST_MEMBERS];
    u64 n[CAST_MEMBERS];
    u64 block_elements;
    u32 first_block[CAST_MEMBERS + 1];
    u32 members;
};

// This block's chunk of its member (the last m with first_block[m] <= block), converted by
// f as `convert` converts a whole tensor: eight elements per step where aligned, the rest
// one by one; each element by the same function, so the bits are one `cast`'s.
template <typename A, typename B, typename F> __device__ __forceinline__ void convert_chunk(const CastTable& t, F f) {
    u32 block = blockIdx.x, lo = 0, hi = t.members - 1;
    while (lo < hi) {
        u32 mid = (lo + hi + 1) / 2;
        if (t.first_block[mid] <= block) lo = mid;
        else hi = mid - 1;
    }
    u64 begin = (u64)(block - t.first_block[lo]) * t.block_elements;
    u64 end = begin + t.block_elements < t.n[lo] ? begin + t.block_elements : t.n[lo];
    convert_strided((const A*)t.src[lo] + begin, (B*)t.dst[lo] + begin, end - begin, f, threadIdx.x, blockDim.x);
}

#define CAST_GROUP(S, A, B, CONV) \
    extern "C" __global__ void regflow_cast_group_##S(CastTable t) { convert_chunk<A, B>(t, CONV()); }
CAST_GROUP(f32_bf16, float, bf16, Cast_f32_bf16)
CAST_GROUP(bf16_f32, bf16, float, Cast_bf16_f32)
CAST_GROUP(f32_f16, float, f16, Cast_f32_f16)
CAST_GROUP(f16_f32, f16, float, Cast_f16_f32)
