#!/usr/bin/env bash
# The character-GPT training-step benchmark of issue 13: regflow (examples/bench_gpt.rs) vs
# JAX (jit, CPU) and PyTorch (eager, CPU) on the same model (benches/peers/gpt_peers.py),
# in one run, 1 and 2 threads. Peers go into a virtual environment outside the repo
# ($REGFLOW_PEERS_VENV, default /tmp/regflow-peers/venv). Prints ms/step and ratios
# (above 1: regflow is faster).
set -euo pipefail
cd "$(dirname "$0")/../.."
. benches/peers/venv.sh numpy jax torch

cargo build -q --release --example bench_gpt
ms() { sed -n 's/.* \([0-9][0-9.]*\) ms\/step.*/\1/p'; }
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
for threads in 1 2; do
  cpus=$([ "$threads" = 1 ] && echo 0 || echo 0,1)
  # regflow: one compute stream; its matmuls split their output tiles over `threads`.
  ours=$(taskset -c "$cpus" ./target/release/examples/bench_gpt 50 "$threads" | tee /dev/stderr | ms)
  jax=$(XLA_FLAGS="--xla_cpu_multi_thread_eigen=$([ "$threads" = 1 ] && echo false || echo true) intra_op_parallelism_threads=$threads" \
        taskset -c "$cpus" "$venv/bin/python" benches/peers/gpt_peers.py jax "$threads" | tee /dev/stderr | ms)
  torch=$(OMP_NUM_THREADS=$threads taskset -c "$cpus" "$venv/bin/python" benches/peers/gpt_peers.py torch "$threads" | tee /dev/stderr | ms)
  awk -v t="$threads" -v o="$ours" -v j="${jax:-0}" -v p="${torch:-0}" 'BEGIN {
    printf "threads %s: regflow %s ms/step", t, o;
    if (j > 0) printf ", vs JAX %.2fx", j / o;
    if (p > 0) printf ", vs PyTorch %.2fx", p / o;
    printf "\n" }'
done
