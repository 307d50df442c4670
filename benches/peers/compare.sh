# Sourced by the peer benchmarks, after venv.sh: `compare EXAMPLE STEPS PEERS UNIT` runs
# regflow's examples/EXAMPLE.rs (STEPS steps, then the thread count) and the JAX and PyTorch
# steps of benches/peers/PEERS (`jax THREADS`, `torch THREADS`), each pinned to 1 then 2
# cores, in one run. Each program prints its figure as "<number> UNIT"; UNIT `ms/step` is
# better lower, anything else (`samples/s`) better higher. Prints regflow's figure and its
# ratio to each peer that ran (above 1: regflow is faster).
compare() {
  local example=$1 steps=$2 peers=$3 unit=$4 threads cpus ours jax torch
  cargo build -q --release --example "$example"
  value() { sed -n "s|.* \([0-9][0-9.]*\) $unit.*|\1|p"; }
  for threads in 1 2; do
    cpus=$([ "$threads" = 1 ] && echo 0 || echo 0,1)
    # regflow: one compute stream; its matmuls split their output tiles over `threads`.
    ours=$(taskset -c "$cpus" "./target/release/examples/$example" "$steps" "$threads" | tee /dev/stderr | value)
    jax=$(XLA_FLAGS="--xla_cpu_multi_thread_eigen=$([ "$threads" = 1 ] && echo false || echo true) intra_op_parallelism_threads=$threads" \
          taskset -c "$cpus" "$venv/bin/python" "benches/peers/$peers" jax "$threads" | tee /dev/stderr | value)
    torch=$(OMP_NUM_THREADS=$threads taskset -c "$cpus" "$venv/bin/python" "benches/peers/$peers" torch "$threads" | tee /dev/stderr | value)
    awk -v t="$threads" -v o="$ours" -v j="${jax:-0}" -v p="${torch:-0}" -v u="$unit" 'BEGIN {
      printf "threads %s: regflow %s %s", t, o, u;
      if (j > 0) printf ", vs JAX %.2fx", (u == "ms/step") ? j / o : o / j;
      if (p > 0) printf ", vs PyTorch %.2fx", (u == "ms/step") ? p / o : o / p;
      printf "\n" }'
  done
}
