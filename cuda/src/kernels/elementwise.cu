// Elementwise ops: `unary` (one entry per kind), `binary` with numpy broadcasting,
// `bias_gelu` and its gradient, `dropout` and `dropout_part`. Each formula is the CPU
// kernel's (kernels/src/cpu/unary.rs, binary.rs, fused.rs, dropout.rs), written in the
// same order of operations, with the accurate math library (no fast math). Each is written
// once over the element type T: elements are read with `ld` and written with `st`, and the
// arithmetic is in `W = Wide<T>::type`, so f32 and f64 compute in their own type and bf16 as
// the CPU's bf16 kernels do (inputs widened to f32, the f32 formula, the output rounded to
// nearest even once). Scalar arguments (constants, scales) are of type W: f32 for bf16.
// The entries of each group are declared once, by a macro invoked per element type.


// The offsets of linear index i (row-major over s.dims) in operands a and b.
__device__ __forceinline__ void offsets_of(const Indexing& s, u64 i, u64* oa, u64* ob) {
    u64 a = 0, b = 0;
    for (int d = (int)s.rank - 1; d >= 0; --d) {
        u64 k = div_step(&i, s.dims[d]);
        a += k * s.a[d];
        b += k * s.b[d];
    }
    *oa = a;
    *ob = b;
}

// ---- math by type: explicit overloads, so no header's overload set is needed ----------

__device__ __forceinline__ float m_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double m_tanh(double x) { return tanh(x); }

// ---- unary -------------------------------------------------------------------------

// GELU's constants as the CPU has them (f64 literals rounded to the arithmetic type).
#define GELU_C 0.7978845608028654
#define GELU_A 0.044715

// x/2 · (1 + tanh(√(2/π)·(x + 0.044715·x³))), in the CPU's order of operations. The CPU's
// f32 tanh is a rational approximation within a few ulp of tanhf; this uses tanhf.
template <typename T> __device__ __forceinline__ T gelu(T x) {
    T inner = (T)GELU_C * (x + (T)GELU_A * x * x * x);
    return (T)0.5 * x * ((T)1 + m_tanh(inner));
}

template <typename T> __device__ __forceinline__ T gelu_derivative(T x) {
    T inner = (T)GELU_C * (x + (T)GELU_A * x * x * x);
    T t = m_tanh(inner);
    T dinner = (T)GELU_C * ((T)1 + (T)(3.0 * GELU_A) * x * x);
    return (T)0.5 * ((T)1 + t) + (T)0.5 * x * ((T)1 - t * t) * dinner;
}

// The same two functions in the logistic form, for values stored in 16 bits (FAST16, see
// `stored_exp`): x/2 · (1 + tanh u) = x · σ(2u) = x / (1 + e^(-2u)), and with s = σ(2u),
// 1 + tanh u = 2s and 1 - tanh² u = 4s(1 - s), so the derivative is s + 2x · s(1 - s) · u'.
// One `__expf` and an approximate division where `tanhf` took a few dozen instructions:
// within a few f32 ulps of the tanh form, far below a bf16 result's rounding. Large |x|
// give what the tanh form gives (e^(-2u) = inf: x / inf = -0, s = 0).
__device__ __forceinline__ float gelu_logistic(float x) {
    float inner = (float)GELU_C * (x + (float)GELU_A * x * x * x);
    return __fdividef(x, 1.0f + __expf(-2.0f * inner));
}

__device__ __forceinline__ float gelu_logistic_derivative(float x) {
    float inner = (float)GELU_C * (x + (float)GELU_A * x * x * x);
    float s = __fdividef(1.0f, 1.0f + __expf(-2.0f * inner));
    float dinner = (float)GELU_C * (1.0f + (float)(3.0 * GELU_A) * x * x);
    return s + 2.0f * x * s * (1.0f - s) * dinner;
}

// GELU and its derivative for a value stored as T, computed in Wide<T>.
template <typename T> __device__ __forceinline__ typename Wide<T>::type stored_gelu(typename Wide<T>::type x) {
    return gelu(x);
}
template <> __device__ __forceinline__ float stored_gelu<bf16>(float x) { return FAST16 ? gelu_logistic(x) : gelu(x); }
template <> __device__ __forceinline__ float stored_gelu<f16>(float x) { return FAST16 ? gelu_logistic(x) : gelu(x); }
template <typename T>
__device__ __forceinline__ typename Wide<T>::type stored_gelu_derivative(typename Wide<T>::type x) {
    return gelu_derivative(x);
}
template <> __device__ __forceinline__ float stored_gelu_derivative<bf16>(float x) {
    return FAST16 ? gelu_logistic_derivative(x) : gelu_derivative(x);
}
template <> __device__ __forceinline__ float stored_gelu_derivative<f16>(float x) {
    return FAST16 ? gelu_logistic_derivative(x) : gelu_derivative(x);
}

// Stable on both sides, as the CPU: never exponentiates a large positive number.
template <typename T> __device__ __forceinline__ T sigmoid(T x) {
    if (x >= (T)0) return (T)1 / ((T)1 + m_exp(-x));
    T e = m_exp(x);
    return e / ((T)1 + e);
}

struct Neg { template <typename T> __device__ T operator()(T x) const { return -x; } };
struct Relu { template <typename T> __device__ T operator()(T x) const { return x > (T)0 ? x : (T)0; } };
struct Step { template <typename T> __device__ T operator()(T x) const { return x > (T)0 ? (T)1 : (T)0; } };
struct Exp { template <typename T> __device__ T operator()(T x) const { return m_exp(x); } };
struct Log { template <typename T> __device__ T operator()(T x) const { return m_log(x); } };
struct Sqrt { template <typename T> __device__ T operator()(T x) const { return m_sqrt(x); } };
struct Tanh { template <typename T> __device__ T operator()(T x) const { return m_tanh(x); } };
struct Sigmoid { template <typename T> __device__ T operator()(T x) const { return sigmoid(x); } };
// GELU of values stored as S (see stored_gelu).
template <typename S> struct Gelu {
    template <typename W> __device__ W operator()(W x) const { return stored_gelu<S>(x); }
};
template <typename S> struct GeluDerivative {
    template <typename W> __device__ W operator()(W x) const { return stored_gelu_derivative<S>(x); }
};

// out = f(x), eight elements per step where aligned (see EIGHT in the prelude).
template <typename T, typename F> __device__ __forceinline__ void map1(const T* x, T* out, u64 n, F f) {
    u64 done = 0;
    if (eight_aligned(x) && eight_aligned(out)) {
        u64 groups = n / EIGHT;
        FOR_EACH(g, groups) {
            Eight<T> a = ld8(x + g * EIGHT), r;
#pragma unroll
            for (int k = 0; k < EIGHT; ++k) st(&r.v[k], f(ld(&a.v[k])));
            st8(out + g * EIGHT, r);
        }
        done = groups * EIGHT;
    }
    FOR_EACH(i, n - done) st(&out[done + i], f(ld(&x[done + i])));
}

// x + c and x · c with c already rounded to W (the CPU's `T::from_f64(c)` of the type it
// computes in: f32 for bf16).
template <typename W> struct AddScalar {
    W c;
    __device__ W operator()(W x) const { return x + c; }
};
template <typename W> struct MulScalar {
    W c;
    __device__ W operator()(W x) const { return x * c; }
};
template <typename T> __device__ __forceinline__ void add_scalar(const T* x, T* out, typename Wide<T>::type c, u64 n) {
    AddScalar<typename Wide<T>::type> f;
    f.c = c;
    map1(x, out, n, f);
}
template <typename T> __device__ __forceinline__ void mul_scalar(const T* x, T* out, typename Wide<T>::type c, u64 n) {
    MulScalar<typename Wide<T>::type> f;
    f.c = c;
    map1(x, out, n, f);
}
// x^p in f64, then rounded to W (and a bf16 from there), as the CPU computes it for every T.
template <typename T> __device__ __forceinline__ void pow_scalar(const T* x, T* out, double p, u64 n) {
    typedef typename Wide<T>::type W;
    FOR_EACH(i, n) st(&out[i], (W)pow((double)ld(&x[i]), p));
}

// Every unary entry for one element type: S its suffix, T the type, W its arithmetic type
// (the scalar's type: f32 for bf16).
#define UNARY_ENTRIES(S, T, W)                                                                          \
    extern "C" __global__ void regflow_unary_neg_##S(const T* x, T* out, u64 n) { map1(x, out, n, Neg()); }   \
    extern "C" __global__ void regflow_unary_relu_##S(const T* x, T* out, u64 n) { map1(x, out, n, Relu()); } \
    extern "C" __global__ void regflow_unary_step_##S(const T* x, T* out, u64 n) { map1(x, out, n, Step()); } \
    extern "C" __global__ void regflow_unary_exp_##S(const T* x, T* out, u64 n) { map1(x, out, n, Exp()); }   \
    extern "C" __global__ void regflow_unary_log_##S(const T* x, T* out, u64 n) { map1(x, out, n, Log()); }   \
    extern "C" __global__ void regflow_unary_sqrt_##S(const T* x, T* out, u64 n) { map1(x, out, n, Sqrt()); } \
    extern "C" __global__ void regflow_unary_tanh_##S(const T* x, T* out, u64 n) { map1(x, out, n, Tanh()); } \
    extern "C" __global__ void regflow_unary_sigmoid_##S(const T* x, T* out, u64 n) {                          \
        map1(x, out, n, Sigmoid());                                                                     \
    }                                                                                                   \
    extern "C" __global__ void regflow_unary_gelu_##S(const T* x, T* out, u64 n) { map1(x, out, n, Gelu<T>()); } \
    extern "C" __global__ void regflow_unary_gelu_derivative_##S(const T* x, T* out, u64 n) {                  \
        map1(x, out, n, GeluDerivative<T>());                                                              \
    }                                                                                                   \
    extern "C" __global__ void regflow_unary_add_scalar_##S(const T* x, T* out, W c, u64 n) {                  \
        add_scalar(x, out, c, n);                                                                       \
    }                                                                                                   \
    extern "C" __global__ void regflow_unary_mul_scalar_##S(const T* x, T* out, W c, u64 n) {                  \
        mul_scalar(x, out, c, n);                                                                       \
    }                                                                                                   \
    extern "C" __global__ void regflow_unary_pow_scalar_##S(const T* x, T* out, double p, u64 n) {             \
        pow_scalar(x, out, p, n);                                                                       \
    }
UNARY_ENTRIES(f32, float, float)
UNARY_ENTRIES(f64, double, double)
UNARY_ENTRIES(bf16, bf16, float)
UNARY_ENTRIES(f16, f16, float)

// ---- binary ------------------------------------------------------------------------

struct Add { template <typename T> __device__ T operator()(T a, T b) const { return a + b; } };
struct Sub { template <typename T> __device__ T operator()(T a, T b) const { return a - b; } };
struct Mul { template <typename T> __device__ T operator()(T a, T b) const { return a * b; } };
struct Div { template <typename T> __device__ T operator()(T a, T b) const { return a / b; } };
// ReLU's gradient from its output: `a` (the gradient) where `b > 0`, else 0.
struct ReluGrad { template <typename T> __device__ T operator()(T a, T b) const { return b > (T)0 ? a : (T)0; } };

// Eight outputs from eight elements of each operand. The operands and the output share
// one element type, except where a 16-bit operand is read widened to an f32 op (a cast
// folded into it, the `_f32_bf16a`-style entries below): `ld` widens it exactly, as the
// cast did.
template <typename TA, typename TB, typename TO, typename F>
__device__ __forceinline__ void eight2(const TA* a, const TB* b, TO* out, F f) {
    Eight<TA> x = ld8(a);
    Eight<TB> y = ld8(b);
    Eight<TO> r;
#pragma unroll
    for (int k = 0; k < EIGHT; ++k) st(&r.v[k], f(ld(&x.v[k]), ld(&y.v[k])));
    st8(out, r);
}

// Both operands of the output's shape: no index arithmetic; eight elements per step where
// aligned (see EIGHT in the prelude).
template <typename TA, typename TB, typename TO, typename F>
__device__ __forceinline__ void map2(const TA* a, const TB* b, TO* out, u64 n, F f) {
    u64 done = 0;
    if (eight_aligned(a) && eight_aligned(b) && eight_aligned(out)) {
        u64 groups = n / EIGHT;
        FOR_EACH(g, groups) eight2(a + g * EIGHT, b + g * EIGHT, out + g * EIGHT, f);
        done = groups * EIGHT;
    }
    FOR_EACH(i, n - done) st(&out[done + i], f(ld(&a[done + i]), ld(&b[done + i])));
}

// map2, also storing every f32 result narrowed to N (bf16 or f16) in `narrow`: a cast of
// the output folded into the op; `st` rounds the same f32 value the cast would read back.
template <typename N, typename F>
__device__ __forceinline__ void map2_and_narrow(const float* a, const float* b, float* out, N* narrow, u64 n, F f) {
    u64 done = 0;
    if (eight_aligned(a) && eight_aligned(b) && eight_aligned(out) && eight_aligned(narrow)) {
        u64 groups = n / EIGHT;
        FOR_EACH(g, groups) {
            Eight<float> x = ld8(a + g * EIGHT), y = ld8(b + g * EIGHT), r;
            Eight<N> q;
#pragma unroll
            for (int k = 0; k < EIGHT; ++k) {
                float v = f(x.v[k], y.v[k]);
                r.v[k] = v;
                st(&q.v[k], v);
            }
            st8(out + g * EIGHT, r);
            st8(narrow + g * EIGHT, q);
        }
        done = groups * EIGHT;
    }
    FOR_EACH(k, n - done) {
        u64 i = done + k;
        float v = f(a[i], b[i]);
        out[i] = v;
        st(&narrow[i], v);
    }
}

// Operands read broadcast to the output: s.dims is the output's shape (coalesced on the
// host), s.a and s.b the operands' strides with 0 on broadcast dimensions. Rows of a
// multiple of eight that both operands read contiguously (a bias added to every row, a
// row-wise scale) take eight elements per step with one division per eight; anything else
// one index map per element.
template <typename TA, typename TB, typename TO, typename F>
__device__ __forceinline__ void map2_broadcast(const TA* a, const TB* b, TO* out, Indexing s, u64 n, F f) {
    u64 done = 0;
    if (s.rank == 2 && s.a[1] == 1 && s.b[1] == 1 && s.dims[1] % EIGHT == 0 && s.a[0] % EIGHT == 0 &&
        s.b[0] % EIGHT == 0 && eight_aligned(a) && eight_aligned(b) && eight_aligned(out)) {
        u64 groups = n / EIGHT, cols = s.dims[1];
        FOR_EACH(g, groups) {
            u64 row = g * EIGHT, col = div_step(&row, cols);
            eight2(a + row * s.a[0] + col, b + row * s.b[0] + col, out + g * EIGHT, f);
        }
        done = groups * EIGHT;
    }
    FOR_EACH(k, n - done) {
        u64 i = done + k, ia, ib;
        offsets_of(s, i, &ia, &ib);
        st(&out[i], f(ld(&a[ia]), ld(&b[ib])));
    }
}

// Every binary entry for one set of element types: S their suffix, TA and TB the operands',
// TO the output's; `_broadcast` reads the operands through `Indexing`.
#define BINARY_ENTRIES(S, TA, TB, TO)                                                                           \
    extern "C" __global__ void regflow_binary_add_##S(const TA* a, const TB* b, TO* out, u64 n) { map2(a, b, out, n, Add()); } \
    extern "C" __global__ void regflow_binary_sub_##S(const TA* a, const TB* b, TO* out, u64 n) { map2(a, b, out, n, Sub()); } \
    extern "C" __global__ void regflow_binary_mul_##S(const TA* a, const TB* b, TO* out, u64 n) { map2(a, b, out, n, Mul()); } \
    extern "C" __global__ void regflow_binary_div_##S(const TA* a, const TB* b, TO* out, u64 n) { map2(a, b, out, n, Div()); } \
    extern "C" __global__ void regflow_binary_relu_grad_##S(const TA* a, const TB* b, TO* out, u64 n) {   \
        map2(a, b, out, n, ReluGrad());                                                                 \
    }                                                                                                   \
    extern "C" __global__ void regflow_binary_add_broadcast_##S(const TA* a, const TB* b, TO* out, Indexing s, u64 n) { \
        map2_broadcast(a, b, out, s, n, Add());                                                         \
    }                                                                                                   \
    extern "C" __global__ void regflow_binary_sub_broadcast_##S(const TA* a, const TB* b, TO* out, Indexing s, u64 n) { \
        map2_broadcast(a, b, out, s, n, Sub());                                                         \
    }                                                                                                   \
    extern "C" __global__ void regflow_binary_mul_broadcast_##S(const TA* a, const TB* b, TO* out, Indexing s, u64 n) { \
        map2_broadcast(a, b, out, s, n, Mul());                                                         \
    }                                                                                                   \
    extern "C" __global__ void regflow_binary_div_broadcast_##S(const TA* a, const TB* b, TO* out, Indexing s, u64 n) { \
        map2_broadcast(a, b, out, s, n, Div());                                                         \
    }                                                                                                   \
    extern "C" __global__ void regflow_binary_relu_grad_broadcast_##S(const TA* a, const TB* b, TO* out, Indexing s, u64 n) { \
        map2_broadcast(a, b, out, s, n, ReluGrad());                                                    \
    }
BINARY_ENTRIES(f32, float, float, float)
BINARY_ENTRIES(f64, double, double, double)
BINARY_ENTRIES(bf16, bf16, bf16, bf16)
BINARY_ENTRIES(f16, f16, f16, f16)
// One 16-bit operand (`a` or `b`, by the suffix's last letter) widened to an f32 op.
BINARY_ENTRIES(f32_bf16a, bf16, float, float)
BINARY_ENTRIES(f32_bf16b, float, bf16, float)
BINARY_ENTRIES(f32_f16a, f16, float, float)
BINARY_ENTRIES(f32_f16b, float, f16, float)

// Every binary kind on f32 operands of the output's shape, the f32 result also stored
// narrowed to N (suffix S): `regflow_binary_<kind>_f32_and_<S>`. One macro level, with the
// suffix first, as `sources.rs` reads entry names out of macros.
#define BINARY_AND_NARROW_ENTRIES(S, N)                                                                   \
    extern "C" __global__ void regflow_binary_add_f32_and_##S(const float* a, const float* b, float* out, N* narrow, u64 n) { \
        map2_and_narrow(a, b, out, narrow, n, Add());                                                     \
    }                                                                                                     \
    extern "C" __global__ void regflow_binary_sub_f32_and_##S(const float* a, const float* b, float* out, N* narrow, u64 n) { \
        map2_and_narrow(a, b, out, narrow, n, Sub());                                                     \
    }                                                                                                     \
    extern "C" __global__ void regflow_binary_mul_f32_and_##S(const float* a, const float* b, float* out, N* narrow, u64 n) { \
        map2_and_narrow(a, b, out, narrow, n, Mul());                                                     \
    }                                                                                                     \
    extern "C" __global__ void regflow_binary_div_f32_and_##S(const float* a, const float* b, float* out, N* narrow, u64 n) { \
        map2_and_narrow(a, b, out, narrow, n, Div());                                                     \
    }                                                                                                     \
    extern "C" __global__ void regflow_binary_relu_grad_f32_and_##S(const float* a, const float* b, float* out, N* narrow, u64 n) { \
        map2_and_narrow(a, b, out, narrow, n, ReluGrad());                                                \
    }
BINARY_AND_NARROW_ENTRIES(bf16, bf16)
BINARY_AND_NARROW_ENTRIES(f16, f16)

// ---- bias GELU ---------------------------------------------------------------------

// Whether a [rows, width] tensor and its [width] bias step eight elements at a time (see
// EIGHT in the prelude): widths of a multiple of eight, pointers aligned.
template <typename T> __device__ __forceinline__ bool bias_eights(const T* x, const T* bias, const T* out, u64 width) {
    return width % EIGHT == 0 && eight_aligned(x) && eight_aligned(bias) && eight_aligned(out);
}

// gelu(x + bias) for x [..., width] and bias [width].
template <typename T> __device__ __forceinline__ void bias_gelu(const T* x, const T* bias, T* out, u64 n, u64 width) {
    u64 done = 0;
    if (bias_eights(x, bias, out, width)) {
        u64 groups = n / EIGHT;
        FOR_EACH(g, groups) {
            u64 row = g * EIGHT, col = div_step(&row, width);
            Eight<T> xs = ld8(x + g * EIGHT), bs = ld8(bias + col), r;
#pragma unroll
            for (int k = 0; k < EIGHT; ++k) st(&r.v[k], stored_gelu<T>(ld(&xs.v[k]) + ld(&bs.v[k])));
            st8(out + g * EIGHT, r);
        }
        done = groups * EIGHT;
    }
    FOR_EACH(k, n - done) {
        u64 i = done + k, row = i;
        st(&out[i], stored_gelu<T>(ld(&x[i]) + ld(&bias[div_step(&row, width)])));
    }
}

// dy · gelu'(x + bias).
template <typename T>
__device__ __forceinline__ void bias_gelu_grad(const T* x, const T* bias, const T* dy, T* dx, u64 n, u64 width) {
    u64 done = 0;
    if (bias_eights(x, bias, dx, width) && eight_aligned(dy)) {
        u64 groups = n / EIGHT;
        FOR_EACH(g, groups) {
            u64 row = g * EIGHT, col = div_step(&row, width);
            Eight<T> xs = ld8(x + g * EIGHT), bs = ld8(bias + col), ds = ld8(dy + g * EIGHT), r;
#pragma unroll
            for (int k = 0; k < EIGHT; ++k) st(&r.v[k], ld(&ds.v[k]) * stored_gelu_derivative<T>(ld(&xs.v[k]) + ld(&bs.v[k])));
            st8(dx + g * EIGHT, r);
        }
        done = groups * EIGHT;
    }
    FOR_EACH(k, n - done) {
        u64 i = done + k, row = i;
        st(&dx[i], ld(&dy[i]) * stored_gelu_derivative<T>(ld(&x[i]) + ld(&bias[div_step(&row, width)])));
    }
}

// The bias-GELU entries for one element type: S its suffix, T the type.
#define BIAS_GELU_ENTRIES(S, T)                                                                         \
    extern "C" __global__ void regflow_bias_gelu_##S(const T* x, const T* bias, T* out, u64 n, u64 width) { \
        bias_gelu(x, bias, out, n, width);                                                              \
    }                                                                                                   \
    extern "C" __global__ void regflow_bias_gelu_grad_##S(const T* x, const T* bias, const T* dy, T* dx, u64 n, \
                                                          u64 width) {                                  \
        bias_gelu_grad(x, bias, dy, dx, n, width);                                                      \
    }
BIAS_GELU_ENTRIES(f32, float)
BIAS_GELU_ENTRIES(f64, double)
BIAS_GELU_ENTRIES(bf16, bf16)
BIAS_GELU_ENTRIES(f16, f16)

// ---- dropout -----------------------------------------------------------------------

// The first output of SplitMix64 seeded with `seed + index·GAMMA` (regflow_plan's
// `Dropout::keeps`): a counter-based draw, bit-exact with the CPU's.
__device__ __forceinline__ u64 splitmix_at(u64 seed, u64 index) {
    const u64 GAMMA = 0x9e3779b97f4a7c15ull;
    u64 z = seed + index * GAMMA + GAMMA;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Element i is kept iff its draw is at least `threshold` (p · 2^64, saturated, computed on
// the host); kept elements are scaled by `scale` (1 / (1 - p) rounded to W: f32 for bf16).
template <typename T>
__device__ __forceinline__ void dropout(const T* x, T* out, u64 n, u64 seed, u64 threshold, typename Wide<T>::type scale) {
    typedef typename Wide<T>::type W;
    FOR_EACH(i, n) st(&out[i], splitmix_at(seed, i) >= threshold ? ld(&x[i]) * scale : (W)0);
}

// A part of a split tensor: s.dims is the part's shape, s.a the logical tensor's strides
// and s.b the part's offsets in the logical tensor (not strides), so local element i is
// drawn at logical index Σ (k_d + offset_d) · stride_d.
template <typename T>
__device__ __forceinline__ void dropout_part(
    const T* x, T* out, Indexing s, u64 n, u64 seed, u64 threshold, typename Wide<T>::type scale) {
    typedef typename Wide<T>::type W;
    FOR_EACH(i, n) {
        u64 rest = i, index = 0;
        for (int d = (int)s.rank - 1; d >= 0; --d) {
            index += (rest % s.dims[d] + s.b[d]) * s.a[d];
            rest /= s.dims[d];
        }
        st(&out[i], splitmix_at(seed, index) >= threshold ? ld(&x[i]) * scale : (W)0);
    }
}

// The dropout entries for one element type: S its suffix, T the type, W the scale's type.
#define DROPOUT_ENTRIES(S, T, W)                                                                        \
    extern "C" __global__ void regflow_dropout_##S(const T* x, T* out, u64 n, u64 seed, u64 threshold, W scale) { \
        dropout(x, out, n, seed, threshold, scale);                                                     \
    }                                                                                                   \
    extern "C" __global__ void regflow_dropout_part_##S(const T* x, T* out, Indexing s, u64 n, u64 seed,       \
                                                        u64 threshold, W scale) {                       \
        dropout_part(x, out, s, n, seed, threshold, scale);                                             \
    }
DROPOUT_ENTRIES(f32, float, float)
DROPOUT_ENTRIES(f64, double, double)
DROPOUT_ENTRIES(bf16, bf16, float)
DROPOUT_ENTRIES(f16, f16, float)
