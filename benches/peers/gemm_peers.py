"""f32 matrix products in numpy (its BLAS, OpenBLAS in the wheels) on the shapes of
`cargo run --release --example bench_gemm`: GFLOP/s, best and median of several runs.
The thread count comes from the caller (`gemm.sh` sets OPENBLAS_NUM_THREADS,
OMP_NUM_THREADS and MKL_NUM_THREADS, and pins the process with taskset)."""

import sys
import time

import numpy as np

# (m, k, n, b read transposed): the last is the MLP's input gradient `dy · wᵀ`.
SHAPES = ((256, 784, 1024, False), (256, 1024, 1024, False), (1024, 1024, 1024, False), (256, 1024, 1024, True))


def blas():
    try:
        config = np.__config__.CONFIG["Build Dependencies"]["blas"]
        return f"{config['name']} {config.get('version', '')}".strip()
    except (AttributeError, KeyError, TypeError):
        return "unknown BLAS"


def main():
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 9
    print(f"numpy {np.__version__}, {blas()}")
    rng = np.random.default_rng(7)
    for m, k, n, transposed in SHAPES:
        a = rng.random((m, k), dtype=np.float32) - 0.5
        # Stored [n, k] and read through its transpose (a view: BLAS reads it in place).
        b = (rng.random((n, k), dtype=np.float32) - 0.5).T if transposed else rng.random((k, n), dtype=np.float32) - 0.5
        label = f"{m}x{k}x{n}" + (":nt" if transposed else "")
        out = np.empty((m, n), dtype=np.float32)
        for _ in range(2):
            np.matmul(a, b, out=out)
        rates = []
        cpu_start, wall_start = time.process_time(), time.perf_counter()
        for _ in range(runs):
            start = time.perf_counter()
            np.matmul(a, b, out=out)
            rates.append(2.0 * m * k * n / (time.perf_counter() - start) / 1e9)
        # As bench_gemm: CPU time all threads got, per wall second, and the work done in it.
        cpu_seconds = time.process_time() - cpu_start
        busy = cpu_seconds / (time.perf_counter() - wall_start)
        per_cpu_second = 2.0 * m * k * n * runs / cpu_seconds / 1e9
        rates.sort()
        print(f"numpy f32 {label} threads {threads}: best {rates[-1]:.1f} GFLOP/s, "
              f"median {rates[len(rates) // 2]:.1f} GFLOP/s, {busy:.2f} cpus busy, "
              f"{per_cpu_second:.1f} GFLOP per cpu-second")


if __name__ == "__main__":
    main()
