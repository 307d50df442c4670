// Filling and casting: constant tensors, and dtype conversions (f32 <-> bf16 for mixed
// precision).

extern "C" __global__ void regflow_fill_f32(float* out, float value, u64 n) {
    FOR_EACH(i, n) out[i] = value;
}

extern "C" __global__ void regflow_fill_f64(double* out, double value, u64 n) {
    FOR_EACH(i, n) out[i] = value;
}

extern "C" __global__ void regflow_fill_i64(i64* out, i64 value, u64 n) {
    FOR_EACH(i, n) out[i] = value;
}

extern "C" __global__ void regflow_cast_f32_bf16(const float* x, bf16* out, u64 n) {
    FOR_EACH(i, n) out[i] = f32_to_bf16(x[i]);
}

extern "C" __global__ void regflow_cast_bf16_f32(const bf16* x, float* out, u64 n) {
    FOR_EACH(i, n) out[i] = bf16_to_f32(x[i]);
}
