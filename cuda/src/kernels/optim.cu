// Optimizer updates (`update`: SGD with momentum, AdamW), one fused elementwise pass each;
// `update_group`, many parameters' updates in one multi-tensor launch; and the mean over a
// gradient-accumulation group (`accumulate_mean`). Formulas and rounding follow
// kernels/src/cpu/optim.rs and kernels/src/builtin.rs.

// Dtype codes of the scalar registers the update reads on the device (the learning rate
// and step counter come from other actors' registers, not from attributes): the Rust side
// passes `ops::optim::scalar_code`.
#define SCALAR_F32 0ull
#define SCALAR_F64 1ull
#define SCALAR_I64 2ull
#define SCALAR_BF16 3ull
#define SCALAR_F16 4ull


// The first element of a scalar register as f64, as the CPU's `scalar_input` reads it.
__device__ __forceinline__ double read_scalar(const void* p, u64 code) {
    if (code == SCALAR_F32) return (double)*(const float*)p;
    if (code == SCALAR_I64) return (double)*(const i64*)p;
    if (code == SCALAR_BF16) return (double)bf16_to_f32(*(const bf16*)p);
    if (code == SCALAR_F16) return (double)f16_to_f32(*(const f16*)p);
    return *(const double*)p;
}

// Whether a gradient scale skips the step: not finite (loss scaling found an overflow),
// as `ops::optim::skips_step` on the CPU.
__device__ __forceinline__ bool skips_step(double scale) { return !isfinite(scale); }

// Whether the launch skips its step: a gradient scale is given and is not finite.
__device__ __forceinline__ bool skipped(const void* scale_at, u64 scale_code) {
    return scale_at && skips_step(read_scalar(scale_at, scale_code));
}

// A skipped step's outputs: the parameter and its state as they came in.
template <typename T> __device__ __forceinline__ void keep(const T* from, T* to, u64 n) {
    FOR_EACH(i, n) to[i] = from[i];
}

// The gradient scale (gradient clipping's factor) in T, or 1 (exact) without one.
template <typename T> __device__ __forceinline__ T grad_scale(const void* scale_at, u64 scale_code) {
    return scale_at ? (T)read_scalar(scale_at, scale_code) : (T)1;
}

// ---- the rules, per step and per element ------------------------------------------------
// Both the single `update` entries and the `update_group` entries compute each element with
// the element functions below from the step's constants computed by the same function, so
// a fused update is bitwise the unfused one.

// SGD's constants of one step: lr and the gradient scale s, rounded to T.
template <typename T> struct SgdStep {
    T lr, scale;
};

template <typename T>
__device__ __forceinline__ SgdStep<T> sgd_step(const void* lr_at, u64 lr_code, const void* scale_at, u64 scale_code) {
    SgdStep<T> s;
    s.lr = (T)read_scalar(lr_at, lr_code);
    s.scale = grad_scale<T>(scale_at, scale_code);
    return s;
}

// v' = μ·v + (s·g + λ·p); p' = p - lr·v', in T with lr, μ, λ, s rounded to T (s the
// gradient scale: the clip factor, or 1).
template <typename T>
__device__ __forceinline__ void sgd_element(const T* p, const T* g, const T* v, T* p_out, T* v_out, u64 i,
                                            const SgdStep<T>& s, T momentum, T weight_decay) {
    T velocity = momentum * v[i] + (g[i] * s.scale + weight_decay * p[i]);
    v_out[i] = velocity;
    p_out[i] = p[i] - s.lr * velocity;
}

// AdamW's constants of one step: the bias corrections and decay are computed in f64 from
// the registers, then rounded to T, exactly as the CPU hoists them.
template <typename T> struct AdamWStep {
    T scale, c1, c2, lr, decay;
};

template <typename T>
__device__ __forceinline__ AdamWStep<T> adamw_step(const void* lr_at, u64 lr_code, const void* step_at, u64 step_code,
                                                   const void* scale_at, u64 scale_code, double beta1, double beta2,
                                                   double weight_decay) {
    double lr = read_scalar(lr_at, lr_code), step = read_scalar(step_at, step_code);
    AdamWStep<T> s;
    s.scale = grad_scale<T>(scale_at, scale_code);
    s.c1 = (T)(1.0 - pow(beta1, step));
    s.c2 = (T)(1.0 - pow(beta2, step));
    s.lr = (T)lr;
    s.decay = (T)(1.0 - lr * weight_decay);
    return s;
}

// `b1`..`eps` arrive rounded to T already.
template <typename T>
__device__ __forceinline__ void adamw_element(const T* p, const T* g, const T* m, const T* v, T* p_out, T* m_out,
                                              T* v_out, u64 i, const AdamWStep<T>& s, T b1, T b2, T one_b1,
                                              T one_b2, T eps) {
    T grad = g[i] * s.scale;
    T m1 = b1 * m[i] + one_b1 * grad;
    T v1 = b2 * v[i] + one_b2 * grad * grad;
    m_out[i] = m1;
    v_out[i] = v1;
    p_out[i] = p[i] * s.decay - s.lr * (m1 / s.c1) / (m_sqrt(v1 / s.c2) + eps);
}

// ---- update: one parameter per launch ------------------------------------------------------

template <typename T>
__device__ __forceinline__ void sgd(const T* p, const T* g, const void* lr_at, u64 lr_code, const void* scale_at,
                                    u64 scale_code, const T* v, T* p_out, T* v_out, T momentum, T weight_decay, u64 n) {
    if (skipped(scale_at, scale_code)) {
        keep(p, p_out, n);
        keep(v, v_out, n);
        return;
    }
    SgdStep<T> s = sgd_step<T>(lr_at, lr_code, scale_at, scale_code);
    FOR_EACH(i, n) sgd_element(p, g, v, p_out, v_out, i, s, momentum, weight_decay);
}

template <typename T>
__device__ __forceinline__ void adamw(const T* p, const T* g, const void* lr_at, u64 lr_code, const void* step_at,
                                      u64 step_code, const void* scale_at, u64 scale_code, const T* m, const T* v,
                                      T* p_out, T* m_out, T* v_out, T b1, T b2, T one_b1, T one_b2, T eps,
                                      double beta1, double beta2, double weight_decay, u64 n) {
    if (skipped(scale_at, scale_code)) {
        keep(p, p_out, n);
        keep(m, m_out, n);
        keep(v, v_out, n);
        return;
    }
    AdamWStep<T> s = adamw_step<T>(lr_at, lr_code, step_at, step_code, scale_at, scale_code, beta1, beta2, weight_decay);
    FOR_EACH(i, n) adamw_element(p, g, m, v, p_out, m_out, v_out, i, s, b1, b2, one_b1, one_b2, eps);
}

// ---- update_group: up to GROUP_MEMBERS parameters per launch ---------------------------------

// Members one launch updates. The table below is passed by value (kernel parameters, read
// through the constant cache, nothing to copy before the launch): 2192 bytes, with the
// other parameters well under CUDA's 4 KiB limit. The Rust twin is `ops::optim::UpdateTable`
// (#[repr(C)], same fields in the same order).
#define GROUP_MEMBERS 32

// Slots of a member's addresses: the parameter, the gradient, the states (SGD's velocity
// in STATE0; AdamW's moments in STATE0 and STATE1), then the outputs. SGD leaves the
// STATE1 slots 0.
#define SLOT_P 0
#define SLOT_G 1
#define SLOT_STATE0 2
#define SLOT_STATE1 3
#define SLOT_P_OUT 4
#define SLOT_STATE0_OUT 5
#define SLOT_STATE1_OUT 6
#define SLOTS 7

//   addr:           each member's tensors (SLOT_*), device addresses.
//   n:              each member's elements.
//   block_elements: elements of one block's chunk (a multiple of the block's threads).
//   first_block:    member m's chunks are blocks first_block[m]..first_block[m + 1]
//                   (prefix sums, computed once on the host; first_block[members] is the
//                   grid's size).
//   members:        members in this launch (1..=GROUP_MEMBERS).
struct UpdateTable {
    u64 addr[GROUP_MEMBERS][SLOTS];
    u64 n[GROUP_MEMBERS];
    u64 block_elements;
    u32 first_block[GROUP_MEMBERS + 1];
    u32 members;
};

// This block's chunk: its member (the last m with first_block[m] <= block: an empty member
// has no block) and its elements begin..end.
struct Chunk {
    u32 member;
    u64 begin, end;
};

__device__ __forceinline__ Chunk chunk_of(const UpdateTable& t) {
    u32 block = blockIdx.x, lo = 0, hi = t.members - 1;
    while (lo < hi) {
        u32 mid = (lo + hi + 1) / 2;
        if (t.first_block[mid] <= block) lo = mid;
        else hi = mid - 1;
    }
    Chunk c;
    c.member = lo;
    c.begin = (u64)(block - t.first_block[lo]) * t.block_elements;
    u64 end = c.begin + t.block_elements, n = t.n[lo];
    c.end = end < n ? end : n;
    return c;
}

// Every element of this block's chunk, consecutive threads on consecutive elements.
#define FOR_EACH_IN_CHUNK(i, c) for (u64 i = (c).begin + threadIdx.x; i < (c).end; i += blockDim.x)

// A member's tensor in slot `k`.
#define MEMBER(T, t, c, k) ((T*)(t).addr[(c).member][k])

template <typename T>
__device__ __forceinline__ void sgd_group(const UpdateTable& t, const void* lr_at, u64 lr_code, const void* scale_at,
                                          u64 scale_code, T momentum, T weight_decay) {
    Chunk c = chunk_of(t);
    const T *p = MEMBER(const T, t, c, SLOT_P), *g = MEMBER(const T, t, c, SLOT_G);
    const T* v = MEMBER(const T, t, c, SLOT_STATE0);
    T *p_out = MEMBER(T, t, c, SLOT_P_OUT), *v_out = MEMBER(T, t, c, SLOT_STATE0_OUT);
    if (skipped(scale_at, scale_code)) {
        FOR_EACH_IN_CHUNK(i, c) {
            p_out[i] = p[i];
            v_out[i] = v[i];
        }
        return;
    }
    SgdStep<T> s = sgd_step<T>(lr_at, lr_code, scale_at, scale_code);
    FOR_EACH_IN_CHUNK(i, c) sgd_element(p, g, v, p_out, v_out, i, s, momentum, weight_decay);
}

template <typename T>
__device__ __forceinline__ void adamw_group(const UpdateTable& t, const void* lr_at, u64 lr_code, const void* step_at,
                                            u64 step_code, const void* scale_at, u64 scale_code, T b1, T b2,
                                            T one_b1, T one_b2, T eps, double beta1, double beta2,
                                            double weight_decay) {
    Chunk c = chunk_of(t);
    const T *p = MEMBER(const T, t, c, SLOT_P), *g = MEMBER(const T, t, c, SLOT_G);
    const T *m = MEMBER(const T, t, c, SLOT_STATE0), *v = MEMBER(const T, t, c, SLOT_STATE1);
    T* p_out = MEMBER(T, t, c, SLOT_P_OUT);
    T *m_out = MEMBER(T, t, c, SLOT_STATE0_OUT), *v_out = MEMBER(T, t, c, SLOT_STATE1_OUT);
    if (skipped(scale_at, scale_code)) {
        FOR_EACH_IN_CHUNK(i, c) {
            p_out[i] = p[i];
            m_out[i] = m[i];
            v_out[i] = v[i];
        }
        return;
    }
    AdamWStep<T> s = adamw_step<T>(lr_at, lr_code, step_at, step_code, scale_at, scale_code, beta1, beta2, weight_decay);
    FOR_EACH_IN_CHUNK(i, c) adamw_element(p, g, m, v, p_out, m_out, v_out, i, s, b1, b2, one_b1, one_b2, eps);
}

// The update entries of one dtype S (elements T, hyperparameters the entries take rounded
// to T): written once, declared per dtype below (cuda/src/sources.rs reads the entries off
// the invocations). The group entries take the single entries' arguments, with the table
// in place of the tensors and their length.
#define UPDATE_ENTRIES(S, T)                                                                                  \
    extern "C" __global__ void regflow_update_sgd_##S(const T* p, const T* g, const void* lr, u64 lr_code,    \
                                                      const void* scale, u64 scale_code, const T* v, T* p_out, \
                                                      T* v_out, T momentum, T weight_decay, u64 n) {          \
        sgd(p, g, lr, lr_code, scale, scale_code, v, p_out, v_out, momentum, weight_decay, n);                \
    }                                                                                                         \
    extern "C" __global__ void regflow_update_adamw_##S(                                                      \
        const T* p, const T* g, const void* lr, u64 lr_code, const void* step, u64 step_code, const void* scale, \
        u64 scale_code, const T* m, const T* v, T* p_out, T* m_out, T* v_out, T b1, T b2, T one_b1, T one_b2,  \
        T eps, double beta1, double beta2, double weight_decay, u64 n) {                                      \
        adamw(p, g, lr, lr_code, step, step_code, scale, scale_code, m, v, p_out, m_out, v_out, b1, b2, one_b1, \
              one_b2, eps, beta1, beta2, weight_decay, n);                                                    \
    }                                                                                                         \
    extern "C" __global__ void regflow_update_group_sgd_##S(const UpdateTable table, const void* lr,          \
                                                            u64 lr_code, const void* scale, u64 scale_code,   \
                                                            T momentum, T weight_decay) {                     \
        sgd_group(table, lr, lr_code, scale, scale_code, momentum, weight_decay);                             \
    }                                                                                                         \
    extern "C" __global__ void regflow_update_group_adamw_##S(                                                \
        const UpdateTable table, const void* lr, u64 lr_code, const void* step, u64 step_code,                \
        const void* scale, u64 scale_code, T b1, T b2, T one_b1, T one_b2, T eps, double beta1, double beta2,  \
        double weight_decay) {                                                                                \
        adamw_group(table, lr, lr_code, step, step_code, scale, scale_code, b1, b2, one_b1, one_b2, eps, beta1, \
                    beta2, weight_decay);                                                                     \
    }
UPDATE_ENTRIES(f32, float)
UPDATE_ENTRIES(f64, double)

// One piece of a group of `count`: the first copies, the others add; the last scales the
// sum by `scale` (1/count rounded to T, as the CPU's `T::from_f64(1.0 / count)`).
template <typename T> __device__ __forceinline__ void accumulate_mean(const T* x, T* out, u64 n, u64 first, u64 last, T scale) {
    FOR_EACH(i, n) {
        T sum = first ? x[i] : out[i] + x[i];
        out[i] = last ? sum * scale : sum;
    }
}

extern "C" __global__ void regflow_accumulate_mean_f32(const float* x, float* out, u64 n, u64 first, u64 last, float scale) {
    accumulate_mean(x, out, n, first, last, scale);
}
extern "C" __global__ void regflow_accumulate_mean_f64(const double* x, double* out, u64 n, u64 first, u64 last,
                                                       double scale) {
    accumulate_mean(x, out, n, first, last, scale);
}

// The step's scalar ops (`learning_rate`, `clip_factor`, `next_step`, and loss scaling's
// `unscale_factor` and `loss_scale_update`), one thread each, so
// a training step's scalars stay on the device and its stream never drains for them.
// Formulas as kernels/src/cpu/optim.rs and `Schedule::at` (plan/src/ops/optim.rs), in f64,
// written to every element of an f32 or f64 output.
__device__ __forceinline__ void write_scalar(void* out, u64 code, double value, u64 n) {
    for (u64 i = 0; i < n; ++i) {
        if (code == SCALAR_F32) ((float*)out)[i] = (float)value;
        else ((double*)out)[i] = value;
    }
}

// `factor` (the step's gradient factor) is null without loss scaling; a skipped step
// leaves the counter as it is.
extern "C" __global__ void regflow_next_step(const void* step, u64 step_code, void* out, u64 out_code, u64 n,
                                             const void* factor, u64 factor_code) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double s = read_scalar(step, step_code);
    bool skipped = factor && skips_step(read_scalar(factor, factor_code));
    write_scalar(out, out_code, skipped ? s : s + 1.0, n);
}

// `UnscaleFactor::at` (plan/src/ops/optim.rs): the norm is the square root in the squared
// norm's own dtype (sqrtf for f32), then clip / scale in f64, NaN when the norm is not
// finite. `clip` is 0 without clipping, else max_norm.
extern "C" __global__ void regflow_unscale_factor(const void* squared_norm, u64 norm_code, const void* scale,
                                                  u64 scale_code, void* out, u64 out_code, u64 n, u64 clips,
                                                  double max_norm) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double sq = read_scalar(squared_norm, norm_code), s = read_scalar(scale, scale_code);
    double norm = norm_code == SCALAR_F64 ? sqrt(sq) : (double)sqrtf((float)sq);
    double factor;
    if (!isfinite(norm)) {
        factor = __longlong_as_double(0x7ff8000000000000ll);
    } else {
        double clip = clips ? fmin(max_norm / (norm / s + 1e-6), 1.0) : 1.0;
        factor = clip / s;
    }
    write_scalar(out, out_code, factor, n);
}

// `LossScaleUpdate::at`: after a skipped step the scale times `backoff` and the count
// restarts; otherwise the count grows, and at `interval` the scale grows by `growth`
// (kept where that would pass `max`, the scale dtype's largest value) and the count
// restarts. Outputs: the scale (`scale_out`, the scale's dtype) and the count.
extern "C" __global__ void regflow_loss_scale_update(const void* scale, u64 scale_code, const void* good,
                                                     u64 good_code, const void* factor, u64 factor_code,
                                                     void* scale_out, void* good_out, double growth,
                                                     double backoff, u64 interval, double max) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double s = read_scalar(scale, scale_code), count = read_scalar(good, good_code);
    if (skips_step(read_scalar(factor, factor_code))) {
        s *= backoff;
        count = 0.0;
    } else {
        count += 1.0;
        if (count >= (double)interval) {
            double grown = s * growth;
            if (grown <= max) s = grown;
            count = 0.0;
        }
    }
    write_scalar(scale_out, scale_code, s, 1);
    write_scalar(good_out, good_code, count, 1);
}

// min(1, max_norm / (norm + 1e-6)); fmin, like f64::min, returns 1 for a NaN quotient.
extern "C" __global__ void regflow_clip_factor(const void* norm, u64 norm_code, void* out, u64 out_code, u64 n,
                                               double max_norm) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        write_scalar(out, out_code, fmin(max_norm / (read_scalar(norm, norm_code) + 1e-6), 1.0), n);
    }
}

// `schedule` 0: constant `peak`; 1: linear warm-up to `peak` over `warmup` steps, then cosine
// decay to `min_rate` at step `total`.
extern "C" __global__ void regflow_learning_rate(const void* step, u64 step_code, void* out, u64 out_code, u64 n,
                                                 u64 schedule, double peak, u64 warmup, u64 total, double min_rate) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double s = read_scalar(step, step_code), rate;
    if (schedule == 0) {
        rate = peak;
    } else if (s <= (double)warmup) {
        rate = peak * s / (double)(warmup > 0 ? warmup : 1);
    } else if (s >= (double)total) {
        rate = min_rate;
    } else {
        u64 span = total > warmup ? total - warmup : 0;
        double progress = (s - (double)warmup) / (double)(span > 0 ? span : 1);
        rate = min_rate + 0.5 * (peak - min_rate) * (1.0 + cos(3.141592653589793 * progress));
    }
    write_scalar(out, out_code, rate, n);
}

// ---- sum_squares_group: a device's part of the global gradient norm -----------------------
// The chain `((carry + Σx₀²) + Σx₁²) + …` of `sum_squares` and scalar adds the compiler fuses
// (graph/src/compile/fuse_norms.rs), in launch pairs of up to NORM_MEMBERS tensors: the
// first sums the squares of each chunk of `chunk` elements of each member into one partial
// per block, the second (one block) adds each member's partials in order, rounds the
// member's total to T as `sum_squares` does, and adds it to the running total in T, as the
// scalar `add` did. The Rust twin of the table is `ops::optim::norm::NormTable`.
#define NORM_MEMBERS 64
// NORM_LOADS_AHEAD=0 (REGFLOW_CUDA_DEFINES): one load at a time, as before.
#ifndef NORM_LOADS_AHEAD
#define NORM_LOADS_AHEAD 1
#endif
struct NormTable {
    u64 addr[NORM_MEMBERS];
    u64 n[NORM_MEMBERS];
    u64 chunk;
    u32 first_block[NORM_MEMBERS + 1];
    u32 members;
};

// The member whose blocks include block b.
__device__ __forceinline__ u32 norm_member(const NormTable& t, u32 b) {
    u32 lo = 0, hi = t.members - 1;
    while (lo < hi) {
        u32 mid = (lo + hi + 1) / 2;
        if (t.first_block[mid] <= b) lo = mid; else hi = mid - 1;
    }
    return lo;
}

template <typename T> __device__ __forceinline__ void norm_parts(const NormTable& t, T* parts) {
    __shared__ T scratch[32];
    u32 b = blockIdx.x, m = norm_member(t, b);
    const T* x = (const T*)t.addr[m];
    u64 start = (u64)(b - t.first_block[m]) * t.chunk, end = start + t.chunk < t.n[m] ? start + t.chunk : t.n[m];
    T s = (T)0;
    u64 i = start + threadIdx.x, step = blockDim.x;
#if NORM_LOADS_AHEAD
    // Four loads in flight before their squares are added, in the same order as one at a
    // time (so the same bits): with one, a thread waited a memory round trip per element
    // and the pass ran at a third of the memory's bandwidth.
    for (; i + 3 * step < end; i += 4 * step) {
        T v0 = x[i], v1 = x[i + step], v2 = x[i + 2 * step], v3 = x[i + 3 * step];
        s += v0 * v0;
        s += v1 * v1;
        s += v2 * v2;
        s += v3 * v3;
    }
#endif
    for (; i < end; i += step) {
        T v = x[i];
        s += v * v;
    }
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) parts[b] = s;
}

template <typename T>
__device__ __forceinline__ void norm_total(const NormTable& t, const T* parts, const T* carry, u64 carried, T* out) {
    __shared__ T scratch[32];
    T total = carried ? carry[0] : (T)0;
    for (u32 m = 0; m < t.members; ++m) {
        T s = (T)0;
        for (u32 p = t.first_block[m] + threadIdx.x; p < t.first_block[m + 1]; p += blockDim.x) s += parts[p];
        s = block_sum(s, scratch);
        total = (m == 0 && !carried) ? s : total + s;
    }
    if (threadIdx.x == 0) out[0] = total;
}

#define NORM_ENTRIES(S, T)                                                                                   \
    extern "C" __global__ void regflow_sum_squares_group_parts_##S(NormTable t, T* parts) { norm_parts(t, parts); } \
    extern "C" __global__ void regflow_sum_squares_group_total_##S(NormTable t, const T* parts, const T* carry, \
                                                                    u64 carried, T* out) {                   \
        norm_total(t, parts, carry, carried, out);                                                          \
    }
NORM_ENTRIES(f32, float)
NORM_ENTRIES(f64, double)
