// Row-wise kernels: softmax and its gradients, masked softmax, layer norm, sparse
// cross-entropy. One block per row (or lane) with the prelude's block reductions; every
// kernel loops over its rows by gridDim.x, so any row count runs on a capped grid. Each
// reduction sums in a fixed order per launch geometry, so results are deterministic.

// Math by element type: no headers, so no overloads from <cmath>.
// The larger of two values, ignoring a NaN `x` as the CPU's `f32::max` does.
__device__ __forceinline__ float bigger(float m, float x) { return fmaxf(m, x); }
__device__ __forceinline__ double bigger(double m, double x) { return fmax(m, x); }
template <typename T> __device__ __forceinline__ T quiet_nan();
template <> __device__ __forceinline__ float quiet_nan<float>() { return __int_as_float(0x7fc00000); }
template <> __device__ __forceinline__ double quiet_nan<double>() {
    return __longlong_as_double((long long)0x7ff8000000000000ULL);
}

// Every row (lane) index this block takes.
#define FOR_EACH_ROW(r, rows) for (u64 r = blockIdx.x; r < (u64)(rows); r += gridDim.x)
// Every element of a row of `len` this thread takes.
#define FOR_EACH_COL(j, len) for (u64 j = threadIdx.x; j < (u64)(len); j += blockDim.x)

// Softmax (or log-softmax) along one axis of a tensor seen as [outer, len, inner]: lane
// `r` is the `len` elements at (r / inner) * len * inner + r % inner, `inner` apart.
template <typename T> __device__ void softmax_lanes(const T* x, T* y, u64 lanes, u64 len, u64 inner, int log_) {
    __shared__ T scratch[32];
    FOR_EACH_ROW(r, lanes) {
        u64 start = (r / inner) * len * inner + r % inner;
        const T* xl = x + start;
        T* yl = y + start;
        T m = minus_infinity<T>();
        FOR_EACH_COL(j, len) m = bigger(m, xl[j * inner]);
        m = block_max(m, scratch, minus_infinity<T>());
        T s = 0;
        FOR_EACH_COL(j, len) s += m_exp(xl[j * inner] - m);
        s = block_sum(s, scratch);
        if (log_) {
            T log_sum = m_log(s);
            FOR_EACH_COL(j, len) yl[j * inner] = xl[j * inner] - m - log_sum;
        } else {
            FOR_EACH_COL(j, len) yl[j * inner] = m_exp(xl[j * inner] - m) / s;
        }
    }
}

extern "C" __global__ void regflow_softmax_f32(const float* x, float* y, u64 lanes, u64 len, u64 inner, int log_) {
    softmax_lanes(x, y, lanes, len, inner, log_);
}
extern "C" __global__ void regflow_softmax_f64(const double* x, double* y, u64 lanes, u64 len, u64 inner, int log_) {
    softmax_lanes(x, y, lanes, len, inner, log_);
}

// The gradient of softmax (log_ = 0: dx = y (dy - Σ dy y)) or log-softmax (log_ = 1:
// dx = dy - e^y Σ dy) along one axis, lanes as in softmax_lanes.
template <typename T>
__device__ void softmax_grad_lanes(const T* y, const T* dy, T* dx, u64 lanes, u64 len, u64 inner, int log_) {
    __shared__ T scratch[32];
    FOR_EACH_ROW(r, lanes) {
        u64 start = (r / inner) * len * inner + r % inner;
        T s = 0;
        FOR_EACH_COL(j, len) {
            u64 i = start + j * inner;
            s += log_ ? dy[i] : dy[i] * y[i];
        }
        s = block_sum(s, scratch);
        FOR_EACH_COL(j, len) {
            u64 i = start + j * inner;
            dx[i] = log_ ? dy[i] - m_exp(y[i]) * s : y[i] * (dy[i] - s);
        }
    }
}

extern "C" __global__ void regflow_softmax_grad_f32(
    const float* y, const float* dy, float* dx, u64 lanes, u64 len, u64 inner, int log_) {
    softmax_grad_lanes(y, dy, dx, lanes, len, inner, log_);
}
extern "C" __global__ void regflow_softmax_grad_f64(
    const double* y, const double* dy, double* dx, u64 lanes, u64 len, u64 inner, int log_) {
    softmax_grad_lanes(y, dy, dx, lanes, len, inner, log_);
}


// softmax(scale · x + mask) over the last axis (rows of `len`). The mask's part of row r
// starts at offset_of(mask_rows, r) and steps by mask_step (1, or 0 for a broadcast last
// axis). Computed in T; the scores are stored as X and the probabilities as Y: both T, or
// both bf16 with an f32 mask (mixed precision: widened as they load, rounded once as they
// are stored, so equal to the f32 softmax of the widened scores cast to bf16).
template <typename X, typename T, typename Y>
__device__ void masked_softmax_rows(const X* x, const T* mask, Y* y, u64 rows, u64 len, T scale, Axes mask_rows, u64 mask_step) {
    __shared__ T scratch[32];
    FOR_EACH_ROW(r, rows) {
        const X* xr = x + r * len;
        const T* mr = mask + offset_of(mask_rows, r);
        Y* yr = y + r * len;
        T m = minus_infinity<T>();
        FOR_EACH_COL(j, len) m = bigger(m, scale * ld(xr + j) + mr[j * mask_step]);
        m = block_max(m, scratch, minus_infinity<T>());
        T s = 0;
        FOR_EACH_COL(j, len) s += m_exp(scale * ld(xr + j) + mr[j * mask_step] - m);
        // Times the sum's inverse, as the CPU kernel (normalize_row): a division per
        // element was slow on the zeros a causal mask makes (see masked_softmax_warp).
        T inverse = (T)1 / block_sum(s, scratch);
        FOR_EACH_COL(j, len) st(yr + j, m_exp(scale * ld(xr + j) + mr[j * mask_step] - m) * inverse);
    }
}

extern "C" __global__ void regflow_masked_softmax_f32(
    const float* x, const float* mask, float* y, u64 rows, u64 len, float scale, Axes mask_rows, u64 mask_step) {
    masked_softmax_rows(x, mask, y, rows, len, scale, mask_rows, mask_step);
}
extern "C" __global__ void regflow_masked_softmax_f64(
    const double* x, const double* mask, double* y, u64 rows, u64 len, double scale, Axes mask_rows, u64 mask_step) {
    masked_softmax_rows(x, mask, y, rows, len, scale, mask_rows, mask_step);
}
// bf16 scores, an f32 mask, bf16 probabilities (and f16 likewise).
extern "C" __global__ void regflow_masked_softmax_bf16(
    const bf16* x, const float* mask, bf16* y, u64 rows, u64 len, float scale, Axes mask_rows, u64 mask_step) {
    masked_softmax_rows(x, mask, y, rows, len, scale, mask_rows, mask_step);
}
extern "C" __global__ void regflow_masked_softmax_f16(
    const f16* x, const float* mask, f16* y, u64 rows, u64 len, float scale, Axes mask_rows, u64 mask_step) {
    masked_softmax_rows(x, mask, y, rows, len, scale, mask_rows, mask_step);
}

// The gradient of masked softmax with respect to the scores: dx = scale · y (dy - Σ y dy),
// computed in T from y, dy and dx stored as S (T, or bf16 for mixed precision).
template <typename S, typename T>
__device__ void masked_softmax_grad_rows(const S* y, const S* dy, S* dx, u64 rows, u64 len, T scale) {
    __shared__ T scratch[32];
    FOR_EACH_ROW(r, rows) {
        const S* yr = y + r * len;
        const S* dyr = dy + r * len;
        T s = 0;
        FOR_EACH_COL(j, len) s += ld(yr + j) * ld(dyr + j);
        s = block_sum(s, scratch);
        FOR_EACH_COL(j, len) st(dx + r * len + j, scale * ld(yr + j) * (ld(dyr + j) - s));
    }
}

extern "C" __global__ void regflow_masked_softmax_grad_f32(
    const float* y, const float* dy, float* dx, u64 rows, u64 len, float scale) {
    masked_softmax_grad_rows(y, dy, dx, rows, len, scale);
}
extern "C" __global__ void regflow_masked_softmax_grad_f64(
    const double* y, const double* dy, double* dx, u64 rows, u64 len, double scale) {
    masked_softmax_grad_rows(y, dy, dx, rows, len, scale);
}
// bf16 probabilities, their gradient and the scores' gradient, computed in f32.
extern "C" __global__ void regflow_masked_softmax_grad_bf16(
    const bf16* y, const bf16* dy, bf16* dx, u64 rows, u64 len, float scale) {
    masked_softmax_grad_rows(y, dy, dx, rows, len, scale);
}
extern "C" __global__ void regflow_masked_softmax_grad_f16(
    const f16* y, const f16* dy, f16* dx, u64 rows, u64 len, float scale) {
    masked_softmax_grad_rows(y, dy, dx, rows, len, scale);
}

// Mean and 1 / sqrt(var + eps) of a row, two passes as the CPU kernel (the variance of
// the centred values, not E[x²] - E[x]², which cancels badly).
template <typename T> __device__ void row_stats(const T* xr, u64 len, T eps, T* scratch, T* mean, T* rstd) {
    T s = 0;
    FOR_EACH_COL(j, len) s += xr[j];
    T m = block_sum(s, scratch) / (T)len;
    T v = 0;
    FOR_EACH_COL(j, len) v += (xr[j] - m) * (xr[j] - m);
    v = block_sum(v, scratch) / (T)len;
    *mean = m;
    *rstd = (T)1 / m_sqrt(v + eps);
}

// y = (x - mean) · rstd · gamma + beta per row of `len` features, computed in T and stored
// One addition, never contracted into a multiply-add (as an `add` op's is not): the
// folded adds' sums (`LayerNorm::residual`, `LayerNormGrad::base`) keep the add's bits.
__device__ __forceinline__ float exact_add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double exact_add(double a, double b) { return __dadd_rn(a, b); }
// Element i of a summand stored as `kind` (1: T itself, 2: bf16, 3: f16, widened exactly).
template <typename T> __device__ __forceinline__ T summand_at(const void* b, u32 kind, u64 i) {
    if (kind == 2) return (T)ld((const bf16*)b + i);
    if (kind == 3) return (T)ld((const f16*)b + i);
    return ((const T*)b)[i];
}
// A bf16 summand's value s plus its bf16 bias's c (both widened), as a bf16 `binary` add
// computes it: in f32, rounded once.
__device__ __forceinline__ float bf16_add(float s, float c) { return bf16_to_f32(f32_to_bf16(__fadd_rn(s, c))); }

// Element i of a summand plus, where `bias` is non-null, bias[j] added first as a `binary`
// add of the summand's dtype computes it (in f32 for 16-bit ones, rounded once).
template <typename T>
__device__ __forceinline__ T biased_summand_at(const void* b, u32 kind, const void* bias, u64 i, u64 j) {
    if (!bias) return summand_at<T>(b, kind, i);
    if (kind == 2) return (T)bf16_add(ld((const bf16*)b + i), ld((const bf16*)bias + j));
    if (kind == 3) return (T)f16_to_f32(f32_to_f16(__fadd_rn(ld((const f16*)b + i), ld((const f16*)bias + j))));
    return exact_add(((const T*)b)[i], ((const T*)bias)[j]);
}
// Element i of a 16-bit copy stored as `kind` (1: bf16, 2: f16, 0: none), rounded as a cast.
template <typename T> __device__ __forceinline__ void st_narrow(void* narrow, u32 kind, u64 i, T v) {
    if (kind == 1) st((bf16*)narrow + i, (float)v);
    else if (kind == 2) st((f16*)narrow + i, (float)v);
}

// as Y: T, or (mixed precision's cast folded into the norm) bf16 or f16 from f32, rounded
// by the conversion the cast kernels use, so the bits are those of the cast of the f32 y.
// With a summand (`LayerNorm::residual`: `b` non-null) the row is x + b, written to `sum`
// first and normalized from there.
template <typename T, typename Y>
__device__ void layer_norm_rows(const T* x, const T* gamma, const T* beta, Y* y, u64 rows, u64 len, T eps,
                                const void* b, u32 b_kind, T* sum, const void* bias) {
    __shared__ T scratch[32];
    FOR_EACH_ROW(r, rows) {
        const T* xr = x + r * len;
        if (b) {
            FOR_EACH_COL(j, len) sum[r * len + j] = exact_add(xr[j], biased_summand_at<T>(b, b_kind, bias, r * len + j, j));
            // The row's sum, written by every thread of the block, is read by all of them.
            __syncthreads();
            xr = sum + r * len;
        }
        T mean, rstd;
        row_stats(xr, len, eps, scratch, &mean, &rstd);
        FOR_EACH_COL(j, len) st(y + r * len + j, (xr[j] - mean) * rstd * gamma[j] + beta[j]);
    }
}

// One block per row for one set of element types: S their suffix, T the input's and the
// computation's, Y the output's: T itself, or bf16 or f16 from f32 (`_f32_<out>`).
#define LAYER_NORM_ENTRY(S, T, Y)                                                                          \
    extern "C" __global__ void regflow_layer_norm_##S(const T* x, const T* gamma, const T* beta, Y* y,      \
                                                      u64 rows, u64 len, T eps, const void* b, u32 b_kind,  \
                                                      T* sum, const void* bias) {                           \
        layer_norm_rows(x, gamma, beta, y, rows, len, eps, b, b_kind, sum, bias);                          \
    }
LAYER_NORM_ENTRY(f32, float, float)
LAYER_NORM_ENTRY(f64, double, double)
LAYER_NORM_ENTRY(f32_bf16, float, bf16)
LAYER_NORM_ENTRY(f32_f16, float, f16)

// Layer norm's gradient, in three launches on one stream:
// 1. x̂ = (x - mean) · rstd into dx (dx is the only row-sized memory the op owns);
// 2. per feature, dgamma = Σ_rows dy · x̂ and dbeta = Σ_rows dy, a column reduction (see
//    the prelude): deterministic, no atomics; with more than a few rows the rows are
//    added in slices, so the sums differ from the CPU's serial ones by rounding;
// 3. dx = rstd · (g - mean(g) - x̂ · mean(g · x̂)) with g = dy · gamma, overwriting x̂.
// dy is stored as D: T, or (mixed precision's cast folded into the gradient) bf16 or f16
// beside f32, widened exactly as it loads, as the cast kernels widen.
template <typename T> __device__ void layer_norm_x_hat_rows(const T* x, T* x_hat, u64 rows, u64 len, T eps) {
    __shared__ T scratch[32];
    FOR_EACH_ROW(r, rows) {
        const T* xr = x + r * len;
        T mean, rstd;
        row_stats(xr, len, eps, scratch, &mean, &rstd);
        FOR_EACH_COL(j, len) x_hat[r * len + j] = (xr[j] - mean) * rstd;
    }
}

// dgamma[j] and dbeta[j] as two column reductions (prelude) over `rows`, in one pass: each
// row r adds its terms with `terms(r, j, dg, db)`. Both layer-norm gradients end with it:
// over dy · x̂ and dy here, over the warps' partials in layer_norm_grad_warp's second step.
template <typename T, typename Terms>
__device__ void layer_norm_params_columns(T* dgamma, T* dbeta, u64 rows, u64 len, Terms terms) {
    __shared__ T partial[COLUMN_THREADS][COLUMN_THREADS];
    FOR_EACH_COLUMN(j, len) {
        bool mine = j < len;
        u64 end = mine ? rows : 0;
        T dg = 0, db = 0;
        for (u64 r = threadIdx.y; r < end; r += blockDim.y) terms(r, j, dg, db);
        dg = column_sum(dg, partial);
        db = column_sum(db, partial);
        if (mine && threadIdx.y == 0) {
            dgamma[j] = dg;
            dbeta[j] = db;
        }
    }
}

// Row r's terms of dgamma and dbeta: dy · x̂ and dy.
template <typename T, typename D> struct XHatTerms {
    const T* x_hat;
    const D* dy;
    u64 len;
    __device__ void operator()(u64 r, u64 j, T& dg, T& db) const {
        T d = ld(dy + r * len + j);
        dg += d * x_hat[r * len + j];
        db += d;
    }
};

template <typename T, typename D>
__device__ void layer_norm_params_grad(const T* x_hat, const D* dy, T* dgamma, T* dbeta, u64 rows, u64 len) {
    layer_norm_params_columns(dgamma, dbeta, rows, len, XHatTerms<T, D>{x_hat, dy, len});
}

// `LayerNormGrad::base` and `dx_narrow`: the computed dx plus the base (`exact_add`), and
// the sum's 16-bit copy (`narrow_kind` 1: bf16, 2: f16, 0: none) rounded as a cast rounds.
template <typename T, typename D>
__device__ void layer_norm_dx_rows(const T* x, const T* gamma, const D* dy, T* dx, u64 rows, u64 len, T eps,
                                   const T* base, void* narrow, u32 narrow_kind) {
    __shared__ T scratch[32];
    FOR_EACH_ROW(r, rows) {
        const T* xr = x + r * len;
        const D* dyr = dy + r * len;
        T* dxr = dx + r * len;
        T mean, rstd;
        row_stats(xr, len, eps, scratch, &mean, &rstd);
        T g = 0, gx = 0;
        FOR_EACH_COL(j, len) {
            T dg = ld(dyr + j) * gamma[j];
            g += dg;
            gx += dg * dxr[j];
        }
        T g_mean = block_sum(g, scratch) / (T)len;
        T gx_mean = block_sum(gx, scratch) / (T)len;
        FOR_EACH_COL(j, len) {
            T v = rstd * (ld(dyr + j) * gamma[j] - g_mean - dxr[j] * gx_mean);
            if (base) v = exact_add(base[r * len + j], v);
            dxr[j] = v;
            st_narrow(narrow, narrow_kind, r * len + j, v);
        }
    }
}

extern "C" __global__ void regflow_layer_norm_x_hat_f32(const float* x, float* x_hat, u64 rows, u64 len, float eps) {
    layer_norm_x_hat_rows(x, x_hat, rows, len, eps);
}
extern "C" __global__ void regflow_layer_norm_x_hat_f64(const double* x, double* x_hat, u64 rows, u64 len, double eps) {
    layer_norm_x_hat_rows(x, x_hat, rows, len, eps);
}
// Steps 2 and 3 for one set of element types: S their suffix, T the computation's (x, x̂,
// gamma, the results), D dy's: T itself, or bf16 or f16 beside f32 (`_f32_dy_<dy>`).
#define LAYER_NORM_GRAD_ENTRIES(S, T, D)                                                                 \
    extern "C" __global__ void BLOCK_1024 regflow_layer_norm_params_grad_##S(                            \
        const T* x_hat, const D* dy, T* dgamma, T* dbeta, u64 rows, u64 len) {                           \
        layer_norm_params_grad(x_hat, dy, dgamma, dbeta, rows, len);                                     \
    }                                                                                                    \
    extern "C" __global__ void regflow_layer_norm_dx_##S(const T* x, const T* gamma, const D* dy, T* dx,  \
                                                         u64 rows, u64 len, T eps, const T* base,        \
                                                         void* narrow, u32 narrow_kind) {                \
        layer_norm_dx_rows(x, gamma, dy, dx, rows, len, eps, base, narrow, narrow_kind);                 \
    }
LAYER_NORM_GRAD_ENTRIES(f32, float, float)
LAYER_NORM_GRAD_ENTRIES(f64, double, double)
LAYER_NORM_GRAD_ENTRIES(f32_dy_bf16, float, bf16)
LAYER_NORM_GRAD_ENTRIES(f32_dy_f16, float, f16)

// The mean over rows of -log softmax(logits)[label], in two launches: one block per row
// writes its row's loss (in f64, as the CPU kernel sums) to its stream's scratch, then one
// block adds the rows' losses in a fixed order, so the scalar is deterministic and the work
// is spread over the GPU (one block for all rows took batch×T×vocab = 8×1024×50257 through
// a single multiprocessor). A label out of range makes the loss NaN (a kernel cannot
// return the CPU kernel's error). `T` is how the logits are stored; the arithmetic is in
// `Wide<T>` (bf16 logits are widened as they load, so no f32 copy of them exists).
//
// CE_GROUPS=0 (REGFLOW_CUDA_DEFINES) takes aligned rows one element at a time through
// online_add, as before groups of eight (softmax_stats).
#ifndef CE_GROUPS
#define CE_GROUPS 1
#endif

// A row's max `m` and sum `s` of exp(x - m) come from one pass over it (an online softmax:
// when a larger value arrives, the sum so far is rescaled to it), with four loads in flight
// per thread; the gradient's second pass writes. Before, a max pass and a sum pass read the
// row twice (three times in the gradient).

// Adds x to the running (m, s). x = -inf adds nothing; NaN makes s NaN (as exp(NaN - m) in
// a separate sum pass would; the max ignores it, as `bigger` does).
template <typename W> __device__ __forceinline__ void online_add(W x, W& m, W& s) {
    if (x > m) {
        s = s * m_exp(m - x) + (W)1;
        m = x;
    } else if (x != minus_infinity<W>()) {
        s += m_exp(x - m);
    }
}

// Combines (m2, s2) into (m, s). A pair whose max is -inf has a sum of 0, or NaN where it
// saw a NaN (online_add adds exp(NaN - m) whatever m is), which must survive: so it is added
// as it is, not rescaled (exp(-inf - -inf) would make a clean 0 NaN).
template <typename W> __device__ __forceinline__ void combine_stats(W& m, W& s, W m2, W s2) {
    if (m2 > m) {
        W t = m; m = m2; m2 = t;
        t = s; s = s2; s2 = t;
    }
    s += m2 == minus_infinity<W>() ? s2 : s2 * m_exp(m2 - m);
}

// (m, s) over a warp, in lane 0: shuffles down, as warp_sum.
template <typename W> __device__ __forceinline__ void warp_combine_stats(W& m, W& s) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        W m2 = __shfl_down_sync(0xffffffffu, m, offset), s2 = __shfl_down_sync(0xffffffffu, s, offset);
        combine_stats(m, s, m2, s2);
    }
}

// (m, s) of the row over the block, returned to every thread: each warp combines its lanes'
// pairs, then warp 0 the warps' pairs from shared memory. A +inf max makes the sum NaN, as
// exp(inf - inf) in a separate sum pass does. A row that starts aligned to eight elements
// (a padded vocabulary's rows all do) is read eight elements a thread at a time, one
// 16-byte access for bf16 and f16 where one element per access used a 32nd of a warp's
// loads; the rest (the last len mod 8, or an unaligned row) one element at a time.
template <typename T, typename W> __device__ void softmax_stats(const T* xr, u64 len, W* scratch_m, W* scratch_s,
                                                                W& m_out, W& s_out) {
    W m = minus_infinity<W>(), s = 0;
    u64 step = blockDim.x, j = threadIdx.x;
    if (eight_aligned(xr)) {
        u64 groups = len / EIGHT;
#pragma unroll 2
        for (u64 g = threadIdx.x; g < groups; g += step) {
            Eight<T> v = ld8(xr + g * EIGHT);
#if CE_GROUPS
            // The group's max first, so the running sum is rescaled at most once per eight
            // elements and each element costs one exponential and no branch (online_add per
            // element was most of the kernel's instructions). NaN is ignored by the max and
            // makes the sum NaN through its exponential; while the max is still -inf, the
            // elements are measured from 0 (exp(-inf - -inf) would make a clean 0 NaN).
            W x[EIGHT], gm = minus_infinity<W>();
#pragma unroll
            for (int k = 0; k < EIGHT; ++k) {
                x[k] = ld(&v.v[k]);
                gm = x[k] > gm ? x[k] : gm;
            }
            if (gm > m) {
                s *= stored_exp<T>(m - gm);
                m = gm;
            }
            W from = m == minus_infinity<W>() ? (W)0 : m;
#pragma unroll
            for (int k = 0; k < EIGHT; ++k) s += stored_exp<T>(x[k] - from);
#else
#pragma unroll
            for (int k = 0; k < EIGHT; ++k) online_add((W)ld(&v.v[k]), m, s);
#endif
        }
        j = groups * EIGHT + threadIdx.x;
    }
    for (; j + 3 * step < len; j += 4 * step) {
        W x0 = ld(xr + j), x1 = ld(xr + j + step), x2 = ld(xr + j + 2 * step), x3 = ld(xr + j + 3 * step);
        online_add(x0, m, s);
        online_add(x1, m, s);
        online_add(x2, m, s);
        online_add(x3, m, s);
    }
    for (; j < len; j += step) online_add((W)ld(xr + j), m, s);
    warp_combine_stats(m, s);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) {
        scratch_m[warp] = m;
        scratch_s[warp] = s;
    }
    __syncthreads();
    if (warp == 0) {
        m = lane < warps ? scratch_m[lane] : minus_infinity<W>();
        s = lane < warps ? scratch_s[lane] : (W)0;
        warp_combine_stats(m, s);
        if (lane == 0) {
            scratch_m[0] = m;
            scratch_s[0] = m == -minus_infinity<W>() ? quiet_nan<W>() : s;
        }
    }
    __syncthreads();
    m_out = scratch_m[0];
    s_out = scratch_s[0];
}

// Rows of `width` logits of which the first `classes` are classes (the rest padding, a
// vocabulary padded to aligned products: it takes no part).
template <typename T>
__device__ void cross_entropy_row_losses(const T* logits, const i64* labels, double* losses, u64 rows, u64 classes,
                                         u64 width) {
    typedef typename Wide<T>::type W;
    __shared__ W scratch_m[32], scratch_s[32];
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = logits + r * width;
        W m, s;
        softmax_stats(xr, classes, scratch_m, scratch_s, m, s);
        if (threadIdx.x == 0) {
            i64 c = labels[r];
            bool valid = c >= 0 && (u64)c < classes;
            losses[r] = valid ? (double)(m_log(s) - (ld(xr + c) - m)) : (double)quiet_nan<W>();
        }
    }
}

template <typename T>
__device__ void cross_entropy_mean(const double* losses, T* out, u64 rows, double divisor) {
    __shared__ double scratch[32];
    double total = 0;
    for (u64 r = threadIdx.x; r < rows; r += blockDim.x) total += losses[r];
    total = block_sum(total, scratch);
    if (threadIdx.x == 0) out[0] = (T)(total / divisor);
}

extern "C" __global__ void regflow_cross_entropy_rows_f32(
    const float* logits, const i64* labels, double* losses, u64 rows, u64 classes, u64 width) {
    cross_entropy_row_losses(logits, labels, losses, rows, classes, width);
}
extern "C" __global__ void regflow_cross_entropy_rows_f64(
    const double* logits, const i64* labels, double* losses, u64 rows, u64 classes, u64 width) {
    cross_entropy_row_losses(logits, labels, losses, rows, classes, width);
}
// bf16 logits; the loss is f32 (`regflow_cross_entropy_mean_f32`).
extern "C" __global__ void regflow_cross_entropy_rows_bf16(
    const bf16* logits, const i64* labels, double* losses, u64 rows, u64 classes, u64 width) {
    cross_entropy_row_losses(logits, labels, losses, rows, classes, width);
}
extern "C" __global__ void regflow_cross_entropy_rows_f16(
    const f16* logits, const i64* labels, double* losses, u64 rows, u64 classes, u64 width) {
    cross_entropy_row_losses(logits, labels, losses, rows, classes, width);
}
extern "C" __global__ void regflow_cross_entropy_mean_f32(const double* losses, float* out, u64 rows, double divisor) {
    cross_entropy_mean(losses, out, rows, divisor);
}
extern "C" __global__ void regflow_cross_entropy_mean_f64(const double* losses, double* out, u64 rows, double divisor) {
    cross_entropy_mean(losses, out, rows, divisor);
}

// The gradient of the mean cross-entropy: dx = (softmax(x) - onehot(label)) · dy / divisor,
// one block per row; dy is the device scalar the loss's consumer wrote (in the loss's
// dtype, `Wide<T>`), dx is stored like the logits (bf16 rounded once from f32). A label out
// of range makes its row NaN. Rows hold `width` columns; those past `classes` (padding)
// get 0.
template <typename T>
__device__ void cross_entropy_grad_rows(const T* logits, const i64* labels, const typename Wide<T>::type* dy, T* dx,
                                        u64 rows, u64 classes, u64 width, typename Wide<T>::type divisor) {
    typedef typename Wide<T>::type W;
    __shared__ W scratch_m[32], scratch_s[32];
    W scale = dy[0] / divisor;
    FOR_EACH_ROW(r, rows) {
        const T* xr = logits + r * width;
        W m, s;
        softmax_stats(xr, classes, scratch_m, scratch_s, m, s);
        W shift = m + m_log(s);
        i64 c = labels[r];
        bool valid = c >= 0 && (u64)c < classes;
        T* dr = dx + r * width;
        // Eight elements a thread at a time where the row is aligned (as the statistics
        // read it), each computed by the same expression as one at a time.
        u64 done = 0;
        if (eight_aligned(xr) && eight_aligned(dr)) {
            u64 groups = classes / EIGHT;
            for (u64 g = threadIdx.x; g < groups; g += blockDim.x) {
                u64 base = g * EIGHT;
                Eight<T> x = ld8(xr + base), out;
#pragma unroll
                for (int k = 0; k < EIGHT; ++k) {
                    W v = stored_exp<T>(ld(&x.v[k]) - shift) * scale;
                    if ((i64)(base + k) == c) v -= scale;
                    st(&out.v[k], valid ? v : quiet_nan<W>());
                }
                st8(dr + base, out);
            }
            done = groups * EIGHT;
        }
#pragma unroll 4
        for (u64 j = done + threadIdx.x; j < classes; j += blockDim.x) {
            W v = stored_exp<T>(ld(xr + j) - shift) * scale;
            if ((i64)j == c) v -= scale;
            st(dr + j, valid ? v : quiet_nan<W>());
        }
        for (u64 j = classes + threadIdx.x; j < width; j += blockDim.x) st(dr + j, (W)0);
    }
}

extern "C" __global__ void regflow_sparse_cross_entropy_grad_f32(
    const float* logits, const i64* labels, const float* dy, float* dx, u64 rows, u64 classes, u64 width, float divisor) {
    cross_entropy_grad_rows(logits, labels, dy, dx, rows, classes, width, divisor);
}
extern "C" __global__ void regflow_sparse_cross_entropy_grad_f64(
    const double* logits, const i64* labels, const double* dy, double* dx, u64 rows, u64 classes, u64 width, double divisor) {
    cross_entropy_grad_rows(logits, labels, dy, dx, rows, classes, width, divisor);
}
// bf16 logits and gradient; dy is the f32 loss's gradient.
extern "C" __global__ void regflow_sparse_cross_entropy_grad_bf16(
    const bf16* logits, const i64* labels, const float* dy, bf16* dx, u64 rows, u64 classes, u64 width, float divisor) {
    cross_entropy_grad_rows(logits, labels, dy, dx, rows, classes, width, divisor);
}
extern "C" __global__ void regflow_sparse_cross_entropy_grad_f16(
    const f16* logits, const i64* labels, const float* dy, f16* dx, u64 rows, u64 classes, u64 width, float divisor) {
    cross_entropy_grad_rows(logits, labels, dy, dx, rows, classes, width, divisor);
}

// ---- warp-per-row kernels: f32 rows of at most 32·N elements ----------------------------
// A row of up to 1024 f32 values fits one warp's registers, so the row is read from memory
// once and written once, and its reductions are warp shuffles with no barrier. (One block
// of up to 512 threads per row, above, spent most of a 1024-wide softmax's time in
// barriers: three block reductions for two elements per thread.) Blocks hold WARP_ROWS
// warps; the host takes the smallest N of 8, 16, 24, 32 that holds a row. Butterfly
// shuffles (xor) give every lane the same sum: each step adds the same two values in
// either order, and IEEE addition commutes.
//
// Which elements a lane holds: where a row fills all 32·N places and every row it reads or
// writes starts 16 bytes aligned (registers are 256-byte aligned and such rows are 32·N
// elements apart, so only a window into a register falls back), lane l holds RUNS of
// V = 16 / sizeof(stored type) contiguous elements (8 bf16 or f16, 4 f32), its a-th run
// at 32·V·a + V·l, each moved with one 16-byte access; otherwise lane l holds elements
// l + 32k, one access per element. (A warp access of a 2-byte element per lane moved 64
// bytes: the bf16 softmax of GPT-2's attention ran at half the H200's bandwidth.) The
// reductions add a lane's values in another order under the two layouts, so their results
// may differ in the last bits; the choice depends on the shape and alignment alone.
#define WARP_ROWS 8

// Every row this warp takes: warp w of the grid takes rows w, w + all warps, ...
#define FOR_EACH_WARP_ROW(r, rows)                                                   \
    for (u64 r = (u64)blockIdx.x * WARP_ROWS + (threadIdx.x >> 5); r < (u64)(rows); \
         r += (u64)gridDim.x * WARP_ROWS)

__device__ __forceinline__ float warp_all_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_all_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sixteen bytes of T: one vector access.
template <typename T> struct alignas(16) Pack16 {
    T v[16 / sizeof(T)];
};
template <typename T> __device__ __forceinline__ bool aligned16(const T* p) { return ((u64)p & 15) == 0; }

// The V elements at p (16-byte aligned), widened to f32, into v: V · sizeof(T) / 16
// accesses (an f32 mask's run beside a bf16 row's takes two).
template <int V, typename T> __device__ __forceinline__ void ld_run(const T* p, float* v) {
    const int per = 16 / sizeof(T);
#pragma unroll
    for (int a = 0; a < V / per; ++a) {
        Pack16<T> pack = reinterpret_cast<const Pack16<T>*>(p)[a];
#pragma unroll
        for (int i = 0; i < per; ++i) v[a * per + i] = ld(&pack.v[i]);
    }
}
// The V values of v, rounded to T, to p (16-byte aligned).
template <int V, typename T> __device__ __forceinline__ void st_run(T* p, const float* v) {
    const int per = 16 / sizeof(T);
#pragma unroll
    for (int a = 0; a < V / per; ++a) {
        Pack16<T> pack;
#pragma unroll
        for (int i = 0; i < per; ++i) st(&pack.v[i], v[a * per + i]);
        reinterpret_cast<Pack16<T>*>(p)[a] = pack;
    }
}
// The first element of a lane's a-th run of V.
template <int V> __device__ __forceinline__ u32 run_start(u32 lane, int a) { return 32u * V * a + V * lane; }

// masked_softmax_rows for one warp per row (scores stored as X, probabilities as Y: f32,
// or bf16). Rows filling all 32·N places (attention's T of 256, 512, 1024: most calls)
// load without bounds tests, in runs where aligned, and a contiguous mask row is
// addressed from one pointer. (Nsight Compute read the general form at 732 GB/s and 25 %
// occupancy on GPT-2's causal softmax, against 4.2 TB/s for the gradient: its PTX kept a
// 64-bit mask offset per element, j · mask_step, and a branch around every load.)
template <typename X, typename Y, int N>
__device__ void masked_softmax_warp(const X* x, const float* mask, Y* y, u64 rows, u64 len, float scale,
                                    Axes mask_rows, u64 mask_step) {
    const int V = 16 / sizeof(X);
    static_assert(sizeof(X) == sizeof(Y) && N % V == 0, "runs of one width for scores and probabilities");
    u32 lane = threadIdx.x & 31;
    bool full = len == 32u * N;
    FOR_EACH_WARP_ROW(r, rows) {
        const X* xr = x + r * len;
        const float* mr = mask + offset_of(mask_rows, r);
        Y* yr = y + r * len;
        // A mask broadcast along the row (step 0) is its first value.
        bool runs = full && aligned16(xr) && aligned16(yr) && (mask_step == 0 || aligned16(mr));
        float v[N];
        if (runs) {
#pragma unroll
            for (int a = 0; a < N / V; ++a) {
                u32 j = run_start<V>(lane, a);
                float xs[V], ms[V];
                ld_run<V>(xr + j, xs);
                if (mask_step) {
                    ld_run<V>(mr + j, ms);
                } else {
#pragma unroll
                    for (int i = 0; i < V; ++i) ms[i] = mr[0];
                }
#pragma unroll
                for (int i = 0; i < V; ++i) v[a * V + i] = scale * xs[i] + ms[i];
            }
        } else if (full && mask_step == 1) {
#pragma unroll
            for (int k = 0; k < N; ++k) v[k] = scale * ld(xr + lane + 32 * k) + mr[lane + 32 * k];
        } else {
            // Bounds-tested.
#pragma unroll
            for (int k = 0; k < N; ++k) {
                u32 j = lane + 32 * k;
                v[k] = j < len ? scale * ld(xr + j) + mr[mask_step ? j : 0] : minus_infinity<float>();
            }
        }
        float m = minus_infinity<float>();
#pragma unroll
        for (int k = 0; k < N; ++k) m = bigger(m, v[k]);
        m = warp_all_max(m);
        float s = 0;
#pragma unroll
        for (int k = 0; k < N; ++k) {
            // The places past the end hold -inf: their e^(v - m) is 0.
            v[k] = m_exp(v[k] - m);
            s += v[k];
        }
        // Times the sum's inverse, as the block version and the CPU kernel. (A division
        // per element took GPT-2's causal softmax from 830 to 980 µs on an H200: half its
        // numerators are 0, most likely IEEE division's long path; not profiled alone.)
        float inverse = 1.0f / warp_all_sum(s);
#pragma unroll
        for (int k = 0; k < N; ++k) v[k] *= inverse;
        if (runs) {
#pragma unroll
            for (int a = 0; a < N / V; ++a) st_run<V>(yr + run_start<V>(lane, a), v + a * V);
        } else {
#pragma unroll
            for (int k = 0; k < N; ++k) {
                u32 j = lane + 32 * k;
                if (full || j < len) st(yr + j, v[k]);
            }
        }
    }
}

// masked_softmax_grad_rows for one warp per row (y, dy and dx stored as S: f32, or bf16).
template <typename S, int N>
__device__ void masked_softmax_grad_warp(const S* y, const S* dy, S* dx, u64 rows, u64 len, float scale) {
    const int V = 16 / sizeof(S);
    static_assert(N % V == 0, "whole runs per lane");
    u32 lane = threadIdx.x & 31;
    bool full = len == 32u * N;
    FOR_EACH_WARP_ROW(r, rows) {
        const S* yr = y + r * len;
        const S* dyr = dy + r * len;
        S* dxr = dx + r * len;
        bool runs = full && aligned16(yr) && aligned16(dyr) && aligned16(dxr);
        float yv[N], dv[N];
        if (runs) {
#pragma unroll
            for (int a = 0; a < N / V; ++a) {
                u32 j = run_start<V>(lane, a);
                ld_run<V>(yr + j, yv + a * V);
                ld_run<V>(dyr + j, dv + a * V);
            }
        } else if (full) {
#pragma unroll
            for (int k = 0; k < N; ++k) {
                yv[k] = ld(yr + lane + 32 * k);
                dv[k] = ld(dyr + lane + 32 * k);
            }
        } else {
#pragma unroll
            for (int k = 0; k < N; ++k) {
                u32 j = lane + 32 * k;
                yv[k] = j < len ? ld(yr + j) : 0.0f;
                dv[k] = j < len ? ld(dyr + j) : 0.0f;
            }
        }
        float s = 0;
#pragma unroll
        for (int k = 0; k < N; ++k) s += yv[k] * dv[k];
        s = warp_all_sum(s);
#pragma unroll
        for (int k = 0; k < N; ++k) yv[k] = scale * yv[k] * (dv[k] - s);
        if (runs) {
#pragma unroll
            for (int a = 0; a < N / V; ++a) st_run<V>(dxr + run_start<V>(lane, a), yv + a * V);
        } else {
            // Stores need no unpredicated path: nothing waits on them.
#pragma unroll
            for (int k = 0; k < N; ++k) {
                u32 j = lane + 32 * k;
                if (full || j < len) st(dxr + j, yv[k]);
            }
        }
    }
}

// The layer-norm kernels' rows are f32 (x, gamma, beta, dx): runs of four. A bf16 or f16
// output or dy beside them (mixed precision's casts folded in) moves in runs of four too,
// 8 bytes an access, so every lane holds the same elements of each tensor.
#define F32_RUN 4

// Four contiguous elements of T: one 16-byte access for f32, one 8-byte access for bf16
// and f16 (aligned to that: every run starts at a multiple of four elements).
template <typename T> struct alignas(F32_RUN * sizeof(T)) Four {
    T v[F32_RUN];
};
// The four elements at p, widened to f32, into v.
template <typename T> __device__ __forceinline__ void ld_four(const T* p, float* v) {
    Four<T> four = *reinterpret_cast<const Four<T>*>(p);
#pragma unroll
    for (int i = 0; i < F32_RUN; ++i) v[i] = ld(&four.v[i]);
}
// The four values of v, stored as T (rounded to nearest even for bf16 and f16), to p.
template <typename T> __device__ __forceinline__ void st_four(T* p, const float* v) {
    Four<T> four;
#pragma unroll
    for (int i = 0; i < F32_RUN; ++i) st(&four.v[i], v[i]);
    *reinterpret_cast<Four<T>*>(p) = four;
}

// The element of a row that value k of this lane holds: in runs of four (`runs`), or l + 32k.
__device__ __forceinline__ u64 lane_element(bool runs, u32 lane, int k) {
    return runs ? run_start<F32_RUN>(lane, k / F32_RUN) + k % F32_RUN : lane + 32u * k;
}

// This lane's N values of the row at p (f32, or bf16 or f16 widened) into v: in runs, or
// bounds-tested, 0 past len.
template <int N, typename T> __device__ __forceinline__ void ld_lane(const T* p, bool runs, u64 len, float* v) {
    u32 lane = threadIdx.x & 31;
    if (runs) {
#pragma unroll
        for (int a = 0; a < N / F32_RUN; ++a) ld_four(p + run_start<F32_RUN>(lane, a), v + a * F32_RUN);
    } else {
#pragma unroll
        for (int k = 0; k < N; ++k) {
            u64 j = lane + 32 * k;
            v[k] = j < len ? ld(p + j) : 0.0f;
        }
    }
}

// This lane's N values v to the row at p (f32, or bf16 or f16 rounded): in runs, or those
// before len.
template <int N, typename T> __device__ __forceinline__ void st_lane(T* p, bool runs, u64 len, const float* v) {
    u32 lane = threadIdx.x & 31;
    if (runs) {
#pragma unroll
        for (int a = 0; a < N / F32_RUN; ++a) st_four(p + run_start<F32_RUN>(lane, a), v + a * F32_RUN);
    } else {
#pragma unroll
        for (int k = 0; k < N; ++k) {
            u64 j = lane + 32 * k;
            if (j < len) st(p + j, v[k]);
        }
    }
}

// The mean and 1 / sqrt(var + eps) of the row in v (0 past the end), two passes over the
// registers as row_stats does over memory.
template <int N>
__device__ __forceinline__ void warp_stats(const float* v, bool runs, u64 len, float eps, float* mean, float* rstd) {
    u32 lane = threadIdx.x & 31;
    float s = 0;
#pragma unroll
    for (int k = 0; k < N; ++k) s += v[k];
    float m = warp_all_sum(s) / (float)len;
    float q = 0;
#pragma unroll
    for (int k = 0; k < N; ++k) {
        float d = runs || lane + 32u * k < len ? v[k] - m : 0.0f;
        q += d * d;
    }
    *mean = m;
    *rstd = 1.0f / m_sqrt(warp_all_sum(q) / (float)len + eps);
}

// The row's values into v (0 past the end), and its mean and 1 / sqrt(var + eps), two
// passes over the registers as row_stats does over memory.
template <int N>
__device__ __forceinline__ void warp_row_stats(const float* xr, bool runs, u64 len, float eps, float* v, float* mean,
                                               float* rstd) {
    ld_lane<N>(xr, runs, len, v);
    warp_stats<N>(v, runs, len, eps, mean, rstd);
}

// Whether the layer-norm rows of `len` at these pointers go in runs: rows fill all 32·N
// places (so every row starts as its tensor does) and every tensor is 16-byte aligned.
template <int N, typename C, typename D>
__device__ __forceinline__ bool layer_norm_runs(u64 len, const float* a, const float* b, const C* c, const D* d) {
    return len == 32u * N && aligned16(a) && aligned16(b) && aligned16(c) && aligned16(d);
}

// This lane's N values of row r of a summand stored as `kind` (layer_norm_rows), widened.
template <int N>
__device__ __forceinline__ void ld_summand(const void* b, u32 kind, u64 at, bool runs, u64 len, float* w) {
    if (kind == 2) ld_lane<N>((const bf16*)b + at, runs, len, w);
    else if (kind == 3) ld_lane<N>((const f16*)b + at, runs, len, w);
    else ld_lane<N>((const float*)b + at, runs, len, w);
}

// y = (v - mean) · rstd · gamma + beta for this lane's runs of row r, gamma and beta a run
// at a time (arrays of N of them took registers, and warps).
template <int N, typename Y>
__device__ __forceinline__ void layer_norm_out_runs(const float* v, float mean, float rstd, const float* gamma,
                                                    const float* beta, Y* yr) {
    u32 lane = threadIdx.x & 31;
#pragma unroll
    for (int a = 0; a < N / F32_RUN; ++a) {
        u32 j = run_start<F32_RUN>(lane, a);
        float g[F32_RUN], b[F32_RUN], o[F32_RUN];
        ld_run<F32_RUN>(gamma + j, g);
        ld_run<F32_RUN>(beta + j, b);
#pragma unroll
        for (int i = 0; i < F32_RUN; ++i) o[i] = (v[a * F32_RUN + i] - mean) * rstd * g[i] + b[i];
        st_four(yr + j, o);
    }
}

// LN_SUMMAND_RUNS=0 (REGFLOW_CUDA_DEFINES) takes layer_norm_warp's general loop for a bf16
// summand in runs too, as before.
#ifndef LN_SUMMAND_RUNS
#define LN_SUMMAND_RUNS 1
#endif

// layer_norm_warp for rows in runs with a bf16 summand and, where `bias` is non-null, its
// bf16 bias (8-byte aligned): the residual stream of a pre-norm block under bf16 mixed
// precision, 24 of GPT-2's 25 norms a step. The general loop added the bias element by
// element, loading each summand element again beside it and choosing the summand's type
// per element; here the summand and the bias come a run at a time, and each element is
// computed by the same functions (`bf16_add`, `exact_add`, `layer_norm_out_runs`: the same
// bits).
template <int N, typename Y>
__device__ void layer_norm_warp_bf16_summand(const float* x, const float* gamma, const float* beta, Y* y, u64 rows,
                                             u64 len, float eps, const bf16* b, float* sum, const bf16* bias) {
    u32 lane = threadIdx.x & 31;
    FOR_EACH_WARP_ROW(r, rows) {
        float v[N], w[N], mean, rstd;
        ld_lane<N>(x + r * len, true, len, v);
        ld_lane<N>(b + r * len, true, len, w);
        if (bias) {
#pragma unroll
            for (int a = 0; a < N / F32_RUN; ++a) {
                float c[F32_RUN];
                ld_four(bias + run_start<F32_RUN>(lane, a), c);
#pragma unroll
                for (int i = 0; i < F32_RUN; ++i) w[a * F32_RUN + i] = bf16_add(w[a * F32_RUN + i], c[i]);
            }
        }
#pragma unroll
        for (int k = 0; k < N; ++k) v[k] = exact_add(v[k], w[k]);
        st_lane<N>(sum + r * len, true, len, v);
        warp_stats<N>(v, true, len, eps, &mean, &rstd);
        layer_norm_out_runs<N>(v, mean, rstd, gamma, beta, y + r * len);
    }
}

// layer_norm_rows for one warp per row (y stored as Y: f32, or bf16 or f16 rounded; with
// a summand, the row x + b written to `sum` and normalized from the registers).
template <int N, typename Y>
__device__ void layer_norm_warp(const float* x, const float* gamma, const float* beta, Y* y, u64 rows, u64 len,
                                float eps, const void* b, u32 b_kind, float* sum, const void* bias) {
    u32 lane = threadIdx.x & 31;
    // A summand's runs are 8 (16-bit) or 16 bytes (f32) a lane: aligned to that, and the
    // sum to 16.
    bool b_aligned = !b || ((u64)b % (b_kind == 1 ? 16 : 8) == 0 && aligned16(sum));
    bool runs = layer_norm_runs<N>(len, x, gamma, beta, y) && b_aligned;
    if (LN_SUMMAND_RUNS && runs && b && b_kind == 2 && (u64)bias % 8 == 0) {
        layer_norm_warp_bf16_summand<N>(x, gamma, beta, y, rows, len, eps, (const bf16*)b, sum, (const bf16*)bias);
        return;
    }
    FOR_EACH_WARP_ROW(r, rows) {
        float v[N], mean, rstd;
        if (b) {
            float w[N];
            ld_lane<N>(x + r * len, runs, len, v);
            ld_summand<N>(b, b_kind, r * len, runs, len, w);
            if (bias) {
                // The bias added to the summand first, rounded as its add rounds.
#pragma unroll
                for (int k = 0; k < N; ++k) {
                    u64 j = lane_element(runs, lane, k);
                    if (j < len) w[k] = biased_summand_at<float>(b, b_kind, bias, r * len + j, j);
                }
            }
#pragma unroll
            for (int k = 0; k < N; ++k) v[k] = exact_add(v[k], w[k]);
            st_lane<N>(sum + r * len, runs, len, v);
            warp_stats<N>(v, runs, len, eps, &mean, &rstd);
        } else {
            warp_row_stats<N>(x + r * len, runs, len, eps, v, &mean, &rstd);
        }
        if (runs) {
            layer_norm_out_runs<N>(v, mean, rstd, gamma, beta, y + r * len);
        } else {
#pragma unroll
            for (int k = 0; k < N; ++k) {
                u64 j = lane + 32 * k;
                if (j < len) st(y + r * len + j, (v[k] - mean) * rstd * gamma[j] + beta[j]);
            }
        }
    }
}

// d[k] times this lane's gamma (0 past len): gamma read a run at a time, so no second
// array of N values is live beside layer_norm_grad_warp's four.
template <int N> __device__ __forceinline__ void times_gamma(float* d, const float* gamma, bool runs, u64 len) {
    u32 lane = threadIdx.x & 31;
    if (runs) {
#pragma unroll
        for (int a = 0; a < N / F32_RUN; ++a) {
            float g[F32_RUN];
            ld_run<F32_RUN>(gamma + run_start<F32_RUN>(lane, a), g);
#pragma unroll
            for (int i = 0; i < F32_RUN; ++i) d[a * F32_RUN + i] *= g[i];
        }
    } else {
#pragma unroll
        for (int k = 0; k < N; ++k) {
            u64 j = lane + 32 * k;
            d[k] = j < len ? d[k] * gamma[j] : 0.0f;
        }
    }
}

// Layer norm's gradient for rows that fit a warp, in two launches (no x̂ pass through
// memory, no atomics):
// 1. warp w of W takes rows w, w + W, ...: x̂ and dx of each row in registers, and its own
//    running Σ dy·x̂ and Σ dy per feature, written at the end to parts[w·len + j] (dgamma)
//    and parts[(W + w)·len + j] (dbeta); every warp writes, rowless ones zeros;
// 2. a column reduction adds each feature's W partials in warp order.
// W depends on the shape alone (rows.rs), so the bits do not change from run to run; so
// does the layout (runs or not), decided once for the launch, as the partials must be.
// dy is stored as D: f32, or bf16 or f16 widened as it loads.
// LN_PIPELINE=0 (REGFLOW_CUDA_DEFINES) loads each row when its turn comes, as before.
#ifndef LN_PIPELINE
#define LN_PIPELINE 1
#endif
// This lane's part of row r's x, dy and (with a base) base, asked for at once.
template <int N, typename D>
__device__ __forceinline__ void ld_grad_row(const float* x, const D* dy, const float* base, u64 r, bool runs, u64 len,
                                            float* v, float* d, float* b) {
    ld_lane<N>(x + r * len, runs, len, v);
    ld_lane<N>(dy + r * len, runs, len, d);
    if (base) ld_lane<N>(base + r * len, runs, len, b);
}
template <int N, typename D>
__device__ void layer_norm_grad_warp(const float* x, const float* gamma, const D* dy, float* dx, float* parts,
                                     u64 rows, u64 len, float eps, const float* base, void* narrow, u32 narrow_kind) {
    u32 lane = threadIdx.x & 31;
    u64 w = (u64)blockIdx.x * WARP_ROWS + (threadIdx.x >> 5), warps = (u64)gridDim.x * WARP_ROWS;
    // A base and a copy take runs where they are aligned for them as well (8 bytes for a
    // copy's runs of four 16-bit values).
    bool runs = layer_norm_runs<N>(len, x, gamma, dy, dx) && (!base || aligned16(base)) &&
                (narrow_kind == 0 || (u64)narrow % 8 == 0);
    float pg[N], pb[N];
#pragma unroll
    for (int k = 0; k < N; ++k) pg[k] = pb[k] = 0.0f;
    // At N = 24 (rows of 768, GPT-2's) the warp's next row is loaded while it computes this
    // one: the kernel's registers hold one block of 8 warps per SM, too few to keep the
    // memory busy when each waited for its row before computing it. Pipelined, it takes 243
    // registers and still one block. Below 24 the unpipelined kernel fits two blocks, which
    // the pipeline's registers would halve; at 32 they would spill. The arithmetic is the
    // same either way, so are the bits.
    const bool pipelined = LN_PIPELINE && N == 24;
    float nx[N], nd[N], nb[N];
    // Without a base nothing loads nb: zeros, so that no register is read unset.
#pragma unroll
    for (int k = 0; k < N; ++k) nb[k] = 0.0f;
    if (pipelined && w < rows) ld_grad_row<N>(x, dy, base, w, runs, len, nx, nd, nb);
    for (u64 r = w; r < rows; r += warps) {
        float v[N], d[N], b[N], mean, rstd;
        if (pipelined) {
#pragma unroll
            for (int k = 0; k < N; ++k) {
                v[k] = nx[k];
                d[k] = nd[k];
                b[k] = nb[k];
            }
            if (r + warps < rows) ld_grad_row<N>(x, dy, base, r + warps, runs, len, nx, nd, nb);
        } else {
            ld_grad_row<N>(x, dy, nullptr, r, runs, len, v, d, b);
        }
        warp_stats<N>(v, runs, len, eps, &mean, &rstd);
#pragma unroll
        for (int k = 0; k < N; ++k) {
            v[k] = (v[k] - mean) * rstd;
            pg[k] += d[k] * v[k];
            pb[k] += d[k];
        }
        // From here d holds dy · gamma.
        times_gamma<N>(d, gamma, runs, len);
        float g = 0, gx = 0;
#pragma unroll
        for (int k = 0; k < N; ++k) {
            g += d[k];
            gx += d[k] * v[k];
        }
        g = warp_all_sum(g) / (float)len;
        gx = warp_all_sum(gx) / (float)len;
#pragma unroll
        for (int k = 0; k < N; ++k) v[k] = rstd * (d[k] - g - v[k] * gx);
        if (base) {
            // Unpipelined, the base's row comes now: asked for with x and dy it would keep a
            // third row's registers live through the reductions (N = 16: two blocks per SM
            // would become one).
            if (!pipelined) ld_lane<N>(base + r * len, runs, len, b);
#pragma unroll
            for (int k = 0; k < N; ++k) v[k] = exact_add(b[k], v[k]);
        }
        st_lane<N>(dx + r * len, runs, len, v);
        if (narrow_kind == 1) st_lane<N>((bf16*)narrow + r * len, runs, len, v);
        else if (narrow_kind == 2) st_lane<N>((f16*)narrow + r * len, runs, len, v);
    }
#pragma unroll
    for (int k = 0; k < N; ++k) {
        u64 j = lane_element(runs, lane, k);
        if (j < len) {
            parts[w * len + j] = pg[k];
            parts[(warps + w) * len + j] = pb[k];
        }
    }
}

// Warp w's terms of dgamma and dbeta: its partials, parts[w·len + j] and
// parts[(warps + w)·len + j].
struct WarpPartialTerms {
    const float* parts;
    u64 warps;
    u64 len;
    __device__ void operator()(u64 w, u64 j, float& dg, float& db) const {
        dg += parts[w * len + j];
        db += parts[(warps + w) * len + j];
    }
};

// Step 2 of layer_norm_grad_warp: dgamma[j] = Σ_w parts[w·len + j], dbeta[j] likewise from
// the second half, in warp order.
__device__ void layer_norm_params_sum(const float* parts, float* dgamma, float* dbeta, u64 warps, u64 len) {
    layer_norm_params_columns(dgamma, dbeta, warps, len, WarpPartialTerms{parts, warps, len});
}

extern "C" __global__ void BLOCK_1024 regflow_layer_norm_params_sum_f32(
    const float* parts, float* dgamma, float* dbeta, u64 warps, u64 len) {
    layer_norm_params_sum(parts, dgamma, dbeta, warps, len);
}

// The warp-per-row entries holding N elements per lane: `regflow_<op>_<dtype>_w<N>`, with
// the arguments of the block-per-row entries of the same op and dtype (and the partials
// for the layer-norm gradient).
#define WARP_ROW_ENTRIES(N)                                                                                       \
    extern "C" __global__ void regflow_masked_softmax_f32_w##N(const float* x, const float* mask, float* y,       \
                                                               u64 rows, u64 len, float scale, Axes mask_rows,    \
                                                               u64 mask_step) {                                   \
        masked_softmax_warp<float, float, N>(x, mask, y, rows, len, scale, mask_rows, mask_step);                 \
    }                                                                                                             \
    extern "C" __global__ void regflow_masked_softmax_bf16_w##N(const bf16* x, const float* mask, bf16* y,        \
                                                                u64 rows, u64 len, float scale, Axes mask_rows,   \
                                                                u64 mask_step) {                                  \
        masked_softmax_warp<bf16, bf16, N>(x, mask, y, rows, len, scale, mask_rows, mask_step);                   \
    }                                                                                                             \
    extern "C" __global__ void regflow_masked_softmax_f16_w##N(const f16* x, const float* mask, f16* y,           \
                                                               u64 rows, u64 len, float scale, Axes mask_rows,    \
                                                               u64 mask_step) {                                   \
        masked_softmax_warp<f16, f16, N>(x, mask, y, rows, len, scale, mask_rows, mask_step);                     \
    }                                                                                                             \
    extern "C" __global__ void regflow_masked_softmax_grad_f32_w##N(const float* y, const float* dy, float* dx,   \
                                                                    u64 rows, u64 len, float scale) {             \
        masked_softmax_grad_warp<float, N>(y, dy, dx, rows, len, scale);                                          \
    }                                                                                                             \
    extern "C" __global__ void regflow_masked_softmax_grad_bf16_w##N(const bf16* y, const bf16* dy, bf16* dx,     \
                                                                     u64 rows, u64 len, float scale) {            \
        masked_softmax_grad_warp<bf16, N>(y, dy, dx, rows, len, scale);                                           \
    }                                                                                                             \
    extern "C" __global__ void regflow_masked_softmax_grad_f16_w##N(const f16* y, const f16* dy, f16* dx,         \
                                                                    u64 rows, u64 len, float scale) {             \
        masked_softmax_grad_warp<f16, N>(y, dy, dx, rows, len, scale);                                            \
    }                                                                                                             \
    extern "C" __global__ void regflow_layer_norm_f32_w##N(const float* x, const float* gamma, const float* beta, \
                                                           float* y, u64 rows, u64 len, float eps, const void* b, \
                                                           u32 b_kind, float* sum, const void* bias) {            \
        layer_norm_warp<N>(x, gamma, beta, y, rows, len, eps, b, b_kind, sum, bias);                              \
    }                                                                                                             \
    extern "C" __global__ void regflow_layer_norm_f32_bf16_w##N(const float* x, const float* gamma,               \
                                                                const float* beta, bf16* y, u64 rows, u64 len,    \
                                                                float eps, const void* b, u32 b_kind,             \
                                                                float* sum, const void* bias) {                   \
        layer_norm_warp<N>(x, gamma, beta, y, rows, len, eps, b, b_kind, sum, bias);                              \
    }                                                                                                             \
    extern "C" __global__ void regflow_layer_norm_f32_f16_w##N(const float* x, const float* gamma,                \
                                                               const float* beta, f16* y, u64 rows, u64 len,      \
                                                               float eps, const void* b, u32 b_kind,              \
                                                               float* sum, const void* bias) {                    \
        layer_norm_warp<N>(x, gamma, beta, y, rows, len, eps, b, b_kind, sum, bias);                              \
    }                                                                                                             \
    extern "C" __global__ void regflow_layer_norm_grad_f32_w##N(const float* x, const float* gamma,               \
                                                                const float* dy, float* dx, float* parts,         \
                                                                u64 rows, u64 len, float eps, const float* base,  \
                                                                void* narrow, u32 narrow_kind) {                  \
        layer_norm_grad_warp<N>(x, gamma, dy, dx, parts, rows, len, eps, base, narrow, narrow_kind);              \
    }                                                                                                             \
    extern "C" __global__ void regflow_layer_norm_grad_f32_dy_bf16_w##N(const float* x, const float* gamma,       \
                                                                        const bf16* dy, float* dx, float* parts,  \
                                                                        u64 rows, u64 len, float eps,             \
                                                                        const float* base, void* narrow,          \
                                                                        u32 narrow_kind) {                        \
        layer_norm_grad_warp<N>(x, gamma, dy, dx, parts, rows, len, eps, base, narrow, narrow_kind);              \
    }                                                                                                             \
    extern "C" __global__ void regflow_layer_norm_grad_f32_dy_f16_w##N(const float* x, const float* gamma,        \
                                                                       const f16* dy, float* dx, float* parts,    \
                                                                       u64 rows, u64 len, float eps,              \
                                                                       const float* base, void* narrow,           \
                                                                       u32 narrow_kind) {                         \
        layer_norm_grad_warp<N>(x, gamma, dy, dx, parts, rows, len, eps, base, narrow, narrow_kind);              \
    }
WARP_ROW_ENTRIES(8)
WARP_ROW_ENTRIES(16)
WARP_ROW_ENTRIES(24)
WARP_ROW_ENTRIES(32)
