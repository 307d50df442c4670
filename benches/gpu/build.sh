#!/usr/bin/env bash
# Builds what a lent GPU machine runs (it has the CUDA driver, toolkit, PyTorch and NCCL but
# no Rust toolchain): the CUDA tests, the GEMM and GPT-2 benchmarks, release, with the `cuda`
# feature, stripped, into gpu-bin/ (ignored by git) beside benches/gpu/run.sh, and packed
# into gpu-pack/gpu-bin.tgz (ignored too): unpacked they pass the device tool's 64 MiB.
# PREVIOUS=path/to/an/older/bench_gpu_gpt2 adds it as gpu-bin/bench_gpu_gpt2.old, which
# run.sh times beside the new one in the same call. Then, with the session's device tool:
#   run(command="tar xzf gpu-pack/gpu-bin.tgz && bash gpu-bin/run.sh", carry=["gpu-pack"])
set -euo pipefail
cd "$(dirname "$0")/../.."
out=gpu-bin
rm -rf "$out" && mkdir -p "$out"
# Test binaries: the backend's op-by-op comparisons, NCCL, and training on a GPU.
list=$(cargo test --release -p regflow-cuda --features cuda --tests --no-run --message-format=json 2>/dev/null;
       cargo test --release --features regflow/cuda --test cuda_plans --no-run --message-format=json 2>/dev/null)
echo "$list" | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])
' | while read -r exe; do
  name=$(basename "$exe" | sed 's/-[0-9a-f]*$//')
  strip -o "$out/test-$name" "$exe"
done
cargo build --release --features regflow/cuda --example bench_gpu_gpt2
cargo build --release -p regflow-cuda --features cuda --example bench_cuda_gemm
strip -o "$out/bench_gpu_gpt2" target/release/examples/bench_gpu_gpt2
strip -o "$out/bench_cuda_gemm" target/release/examples/bench_cuda_gemm
cp benches/gpu/run.sh benches/gpu/ncu.sh benches/gpu/op_profile.py benches/peers/gpt2_torch.py benches/peers/gemm_torch.py benches/peers/ops_torch.py "$out/"
if [ -n "${PREVIOUS:-}" ]; then
  cp "$PREVIOUS" "$out/bench_gpu_gpt2.old"
fi
mkdir -p gpu-pack
tar -czf gpu-pack/gpu-bin.tgz "$out"
du -sh "$out" gpu-pack/gpu-bin.tgz
ls "$out"
