#!/usr/bin/env bash
# Nsight Compute on the masked softmax (forward and gradient) of a one-layer GPT-2 step, in
# bf16 and f32: duration, DRAM throughput, registers and occupancy of each kernel. Runs on a
# lent GPU machine after benches/gpu/run.sh (which finds the CUDA libraries), e.g.
#   run(command="bash gpu-bin/run.sh; bash gpu-bin/ncu.sh", carry=["gpu-bin"])
# KERNELS (a regex, default masked_softmax) profiles other kernels the same way.
set -u
here="$(cd "$(dirname "$0")" && pwd)"
libs=/tmp/regflow-gpu-logs/libs
[ -f "$libs" ] && export LD_LIBRARY_PATH="$(cat "$libs")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
for precision in bf16 f32; do
  echo "== ncu $precision"
  timeout 120 "$ncu" --kernel-name "regex:${KERNELS:-masked_softmax}" --launch-count 2 \
    --section SpeedOfLight --section Occupancy --section LaunchStats \
    "$here/bench_gpu_gpt2" --device cuda --size gpt2 --layers 1 --batch 8 --warmup 0 --steps 1 \
    --precision "$precision" 2>&1 |
    grep -E "regflow_|Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Size|Grid Size"
done
