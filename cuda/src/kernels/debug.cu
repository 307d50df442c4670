// Kernels for the runtime's own tests on a GPU (tests/cuda_invariants.rs): work that takes
// long on purpose, so a consumer told too early, or a slot reused too early, shows.

// Spins for `cycles` clock cycles, then writes `value` to out[0]. One thread does it all.
extern "C" __global__ void regflow_debug_spin_write_i64(i64* out, i64 value, i64 cycles) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        long long start = clock64();
        while (clock64() - start < cycles) {
        }
        out[0] = value;
    }
}

// Spins for `cycles` clock cycles, then copies in[0] to out[0]. One thread does it all.
extern "C" __global__ void regflow_debug_spin_copy_i64(i64* out, const i64* in, i64 cycles) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        long long start = clock64();
        while (clock64() - start < cycles) {
        }
        out[0] = in[0];
    }
}
