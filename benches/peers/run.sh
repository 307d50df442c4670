#!/usr/bin/env bash
# The MLP training-step benchmark of issue 4: regflow vs JAX (jit, CPU) and PyTorch (eager,
# CPU), in one run, 1 and 2 threads. Peers go into a virtual environment outside the repo
# ($REGFLOW_PEERS_VENV, default /tmp/regflow-peers/venv). Prints samples/s and ratios.
set -euo pipefail
cd "$(dirname "$0")/../.."
. benches/peers/venv.sh numpy jax torch

cargo build -q --release --example bench_mlp
rate() { sed -n 's/.* \([0-9][0-9]*\) samples\/s.*/\1/p'; }
for threads in 1 2; do
  cpus=$([ "$threads" = 1 ] && echo 0 || echo 0,1)
  # regflow: one compute stream; its matmuls split their output tiles over `threads`.
  ours=$(taskset -c "$cpus" ./target/release/examples/bench_mlp 30 "$threads" | tee /dev/stderr | rate)
  jax=$(XLA_FLAGS="--xla_cpu_multi_thread_eigen=$([ "$threads" = 1 ] && echo false || echo true) intra_op_parallelism_threads=$threads" \
        taskset -c "$cpus" "$venv/bin/python" benches/peers/mlp_peers.py jax "$threads" | tee /dev/stderr | rate)
  torch=$(OMP_NUM_THREADS=$threads taskset -c "$cpus" "$venv/bin/python" benches/peers/mlp_peers.py torch "$threads" | tee /dev/stderr | rate)
  awk -v t="$threads" -v o="$ours" -v j="${jax:-0}" -v p="${torch:-0}" 'BEGIN {
    printf "threads %s: regflow %s samples/s", t, o;
    if (j > 0) printf ", vs JAX %.2fx", o / j;
    if (p > 0) printf ", vs PyTorch %.2fx", o / p;
    printf "\n" }'
done
