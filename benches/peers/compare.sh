# Sourced by the peer benchmarks, after venv.sh: `compare EXAMPLE STEPS PEERS UNIT` runs
# regflow's examples/EXAMPLE.rs (STEPS steps, then the thread count) and the JAX and PyTorch
# steps of benches/peers/PEERS (`jax THREADS`, `torch THREADS`), each pinned to 1 then 2
# cores. It does so in $ROUNDS rounds (default 3), each running all three once, because
# this host's clock drifts by up to 2x between minutes: a ratio is only fair between runs of
# the same round (every other round runs them in the opposite order, so that none always
# runs first). Each program prints its figure as "<number> UNIT"; UNIT `ms/step` is
# better lower, anything else (`samples/s`) better higher. Prints every round's figures and
# ratios (above 1: regflow is faster), then per thread count the median ratio over rounds.
compare() {
  local example=$1 steps=$2 peers=$3 unit=$4 threads cpus ours jax torch round rounds=${ROUNDS:-3}
  local results
  results=$(mktemp)
  cargo build -q --release ${REGFLOW_FEATURES:+--features "$REGFLOW_FEATURES"} --example "$example"
  value() { sed -n "s|.* \([0-9][0-9.]*\) $unit.*|\1|p"; }
  # Each program once, on the loop's `threads` pinned to `cpus`, its figure into `ours`,
  # `jax` or `torch`. regflow: one compute stream; its matmuls split their output tiles
  # over `threads`.
  run_ours() { ours=$(taskset -c "$cpus" "./target/release/examples/$example" "$steps" "$threads" | tee -a /dev/stderr | value); }
  run_jax() {
    jax=$(XLA_FLAGS="--xla_cpu_multi_thread_eigen=$([ "$threads" = 1 ] && echo false || echo true) intra_op_parallelism_threads=$threads" \
          taskset -c "$cpus" "$venv/bin/python" "benches/peers/$peers" jax "$threads" | tee -a /dev/stderr | value)
  }
  run_torch() { torch=$(OMP_NUM_THREADS=$threads taskset -c "$cpus" "$venv/bin/python" "benches/peers/$peers" torch "$threads" | tee -a /dev/stderr | value); }
  for round in $(seq "$rounds"); do
    for threads in 1 2; do
      cpus=$([ "$threads" = 1 ] && echo 0 || echo 0,1)
      # Every other round in the opposite order, so that no program always runs first.
      if [ $((round % 2)) = 1 ]; then run_ours; run_jax; run_torch; else run_torch; run_jax; run_ours; fi
      awk -v r="$round" -v t="$threads" -v o="$ours" -v j="${jax:-0}" -v p="${torch:-0}" -v u="$unit" 'BEGIN {
        jr = (j > 0) ? ((u == "ms/step") ? j / o : o / j) : 0;
        pr = (p > 0) ? ((u == "ms/step") ? p / o : o / p) : 0;
        line = sprintf("round %s, threads %s: regflow %s %s", r, t, o, u);
        if (j > 0) line = line sprintf(", vs JAX %.2fx", jr);
        if (p > 0) line = line sprintf(", vs PyTorch %.2fx", pr);
        print line > "/dev/stderr";
        printf "%s %s %.4f %.4f\n", t, o, jr, pr }' >>"$results"
    done
  done
  for threads in 1 2; do
    awk -v t="$threads" -v u="$unit" '$1 == t { n++; o[n] = $2; j[n] = $3; p[n] = $4 }
      function median(a, n,   i, k, x) {
        for (i = 2; i <= n; i++) { x = a[i]; for (k = i - 1; k >= 1 && a[k] > x; k--) a[k + 1] = a[k]; a[k + 1] = x }
        return (n % 2) ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2 }
      END {
        printf "threads %s: regflow %s %s (median of %d rounds)", t, median(o, n), u, n;
        if (j[1] > 0) printf ", vs JAX %.2fx", median(j, n);
        if (p[1] > 0) printf ", vs PyTorch %.2fx", median(p, n);
        printf " (median per-round ratios)\n" }' "$results"
  done
  rm -f "$results"
}
