#!/usr/bin/env bash
# The character-GPT training-step benchmark of issue 13: regflow (examples/bench_gpt.rs) vs
# JAX (jit, CPU) and PyTorch (eager, CPU) on the same model (benches/peers/gpt_peers.py),
# in one run, 1 and 2 threads. Peers go into a virtual environment outside the repo
# ($REGFLOW_PEERS_VENV, default /tmp/regflow-peers/venv). Prints ms/step and ratios
# (above 1: regflow is faster).
set -euo pipefail
cd "$(dirname "$0")/../.."
. benches/peers/venv.sh numpy jax torch

. benches/peers/compare.sh
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
compare bench_gpt 50 gpt_peers.py ms/step
