// Optimizer updates (`update`: SGD with momentum, AdamW), one fused elementwise pass each,
// and the mean over a gradient-accumulation group (`accumulate_mean`). Formulas and
// rounding follow kernels/src/cpu/optim.rs and kernels/src/builtin.rs.

// Dtype codes of the scalar registers the update reads on the device (the learning rate
// and step counter come from other actors' registers, not from attributes): the Rust side
// passes `ops::optim::scalar_code`.
#define SCALAR_F32 0ull
#define SCALAR_F64 1ull
#define SCALAR_I64 2ull
#define SCALAR_BF16 3ull


// The first element of a scalar register as f64, as the CPU's `scalar_input` reads it.
__device__ __forceinline__ double read_scalar(const void* p, u64 code) {
    if (code == SCALAR_F32) return (double)*(const float*)p;
    if (code == SCALAR_I64) return (double)*(const i64*)p;
    if (code == SCALAR_BF16) return (double)bf16_to_f32(*(const bf16*)p);
    return *(const double*)p;
}

// The gradient scale (gradient clipping's factor) in T, or 1 (exact) without one.
template <typename T> __device__ __forceinline__ T grad_scale(const void* scale_at, u64 scale_code) {
    return scale_at ? (T)read_scalar(scale_at, scale_code) : (T)1;
}

// v' = μ·v + (s·g + λ·p); p' = p - lr·v', in T with lr, μ, λ, s rounded to T (s the
// gradient scale: the clip factor, or 1).
template <typename T>
__device__ __forceinline__ void sgd(const T* p, const T* g, const void* lr_at, u64 lr_code, const void* scale_at,
                                    u64 scale_code, const T* v, T* p_out, T* v_out, T momentum, T weight_decay, u64 n) {
    T lr = (T)read_scalar(lr_at, lr_code), scale = grad_scale<T>(scale_at, scale_code);
    FOR_EACH(i, n) {
        T velocity = momentum * v[i] + (g[i] * scale + weight_decay * p[i]);
        v_out[i] = velocity;
        p_out[i] = p[i] - lr * velocity;
    }
}

// The bias corrections and decay of the step are computed in f64 from the registers, then
// rounded to T, exactly as the CPU hoists them; `b1`..`eps` arrive rounded to T already.
template <typename T>
__device__ __forceinline__ void adamw(const T* p, const T* g, const void* lr_at, u64 lr_code, const void* step_at,
                                      u64 step_code, const void* scale_at, u64 scale_code, const T* m, const T* v,
                                      T* p_out, T* m_out, T* v_out, T b1, T b2, T one_b1, T one_b2, T eps,
                                      double beta1, double beta2, double weight_decay, u64 n) {
    double lr = read_scalar(lr_at, lr_code), step = read_scalar(step_at, step_code);
    T scale = grad_scale<T>(scale_at, scale_code);
    T c1 = (T)(1.0 - pow(beta1, step));
    T c2 = (T)(1.0 - pow(beta2, step));
    T lr_t = (T)lr;
    T decay = (T)(1.0 - lr * weight_decay);
    FOR_EACH(i, n) {
        T grad = g[i] * scale;
        T m1 = b1 * m[i] + one_b1 * grad;
        T v1 = b2 * v[i] + one_b2 * grad * grad;
        m_out[i] = m1;
        v_out[i] = v1;
        p_out[i] = p[i] * decay - lr_t * (m1 / c1) / (m_sqrt(v1 / c2) + eps);
    }
}

// The update entries of one dtype S (elements T, hyperparameters the entries take rounded
// to T): written once, declared per dtype below (cuda/src/sources.rs reads the entries off
// the invocations).
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

// The step's scalar ops (`learning_rate`, `clip_factor`, `next_step`), one thread each, so
// a training step's scalars stay on the device and its stream never drains for them.
// Formulas as kernels/src/cpu/optim.rs and `Schedule::at` (plan/src/ops/optim.rs), in f64,
// written to every element of an f32 or f64 output.
__device__ __forceinline__ void write_scalar(void* out, u64 code, double value, u64 n) {
    for (u64 i = 0; i < n; ++i) {
        if (code == SCALAR_F32) ((float*)out)[i] = (float)value;
        else ((double*)out)[i] = value;
    }
}

extern "C" __global__ void regflow_next_step(const void* step, u64 step_code, void* out, u64 out_code, u64 n) {
    if (blockIdx.x == 0 && threadIdx.x == 0) write_scalar(out, out_code, read_scalar(step, step_code) + 1.0, n);
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
