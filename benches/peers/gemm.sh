#!/usr/bin/env bash
# The f32 matrix product benchmark of issue 13: regflow's CPU matmul kernel (gemm) vs
# numpy's BLAS, in one run, 1 and 2 threads, pinned with taskset. numpy goes into a
# virtual environment outside the repo ($REGFLOW_PEERS_VENV, default
# /tmp/regflow-peers/venv). Prints GFLOP/s and regflow/numpy ratios: of the best run's
# wall-clock rate, and of the work per CPU-second (which other processes' load skews less).
#   benches/peers/gemm.sh [runs]
set -euo pipefail
cd "$(dirname "$0")/../.."
runs="${1:-9}"
. benches/peers/venv.sh numpy

cargo build -q --release ${REGFLOW_FEATURES:+--features "$REGFLOW_FEATURES"} --example bench_gemm
best() { sed -n "s/.* $1 threads $2: best \([0-9.]*\) GFLOP\/s.*/\1/p"; }
# Work per CPU-second each got: less sensitive than wall time to other processes' load.
per_cpu() { sed -n "s/.* $1 threads $2: .* \([0-9.]*\) GFLOP per cpu-second.*/\1/p"; }
for threads in 1 2; do
  cpus=$([ "$threads" = 1 ] && echo 0 || echo 0,1)
  ours=$(taskset -c "$cpus" ./target/release/examples/bench_gemm "$runs" "$threads")
  theirs=$(OPENBLAS_NUM_THREADS=$threads OMP_NUM_THREADS=$threads MKL_NUM_THREADS=$threads \
    taskset -c "$cpus" "$venv/bin/python" benches/peers/gemm_peers.py "$threads" "$runs")
  printf '%s\n%s\n' "$ours" "$theirs"
  for shape in 256x784x1024 256x1024x1024 1024x1024x1024 256x1024x1024:nt; do
    o=$(best "$shape" "$threads" <<<"$ours")
    t=$(best "$shape" "$threads" <<<"$theirs")
    oc=$(per_cpu "$shape" "$threads" <<<"$ours")
    tc=$(per_cpu "$shape" "$threads" <<<"$theirs")
    awk -v s="$shape" -v th="$threads" -v o="$o" -v t="$t" -v oc="$oc" -v tc="$tc" 'BEGIN {
      printf "threads %s, %s: regflow %s GFLOP/s, numpy %s GFLOP/s (best), regflow/numpy %.2fx; per cpu-second %.2fx\n",
        th, s, o, t, o / t, oc / tc }'
  done
done
