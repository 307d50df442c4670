"""`torch.matmul` on the shapes of `cuda/examples/bench_cuda_gemm.rs` (GPT-2 124M's products at
batch 8 x 1024 tokens, and 4096 cubed), f32 with TF32 off and bf16, in TFLOP/s: the peer
for regflow's cuBLAS matmul kernel, in the same run (`benches/gpu/run.sh`). Each figure is
the median of `--repeats` products, each timed as regflow's are: a host clock around the
launch and a synchronize, after three warm-ups.

    python3 benches/peers/gemm_torch.py [--repeats 20]
"""

import argparse
import time

import torch

# (m, k, n, transpose_a, transpose_b, what): an operand stored transposed is read through
# `.t()`, which cuBLAS takes as an op flag, as regflow's kernel does.
SHAPES = [
    (8192, 768, 768, False, False, "attention projection"),
    (8192, 768, 3072, False, False, "MLP up"),
    (8192, 3072, 768, False, False, "MLP down"),
    (8192, 768, 50257, False, True, "logits = x·tableT"),
    (8192, 50257, 768, False, False, "dx = dlogits·table"),
    (50257, 8192, 768, True, False, "dtable = dlogitsT·x"),
    (4096, 4096, 4096, False, False, "square"),
]


def operand(rows, cols, transposed, dtype):
    """A `rows x cols` matrix of uniform values in [-1, 1), stored transposed if asked."""
    if transposed:
        return (torch.rand(cols, rows, device="cuda", dtype=dtype) * 2 - 1).t()
    return torch.rand(rows, cols, device="cuda", dtype=dtype) * 2 - 1


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    for name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        for m, k, n, ta, tb, what in SHAPES:
            a = operand(m, k, ta, dtype)
            b = operand(k, n, tb, dtype)
            times = []
            for i in range(3 + args.repeats):
                torch.cuda.synchronize()
                start = time.perf_counter()
                torch.matmul(a, b)
                torch.cuda.synchronize()
                if i >= 3:
                    times.append(time.perf_counter() - start)
            median = sorted(times)[len(times) // 2]
            print(f"torch gemm {name} {m}x{k}x{n} ({what}): {median * 1e3:.3f} ms, "
                  f"{2 * m * k * n / median / 1e12:.1f} TFLOP/s")


if __name__ == "__main__":
    main()
