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

SHAPES = [
    (8192, 768, 768, "attention projection"),
    (8192, 768, 3072, "MLP up"),
    (8192, 3072, 768, "MLP down"),
    (8192, 768, 50257, "logits"),
    (4096, 4096, 4096, "square"),
]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    for name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        for m, k, n, what in SHAPES:
            a = torch.rand(m, k, device="cuda", dtype=dtype) * 2 - 1
            b = torch.rand(k, n, device="cuda", dtype=dtype) * 2 - 1
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
