#!/usr/bin/env bash
# The MLP training-step benchmark of issue 4: regflow vs JAX (jit, CPU) and PyTorch (eager,
# CPU), in one run, 1 and 2 threads. Peers go into a virtual environment outside the repo
# ($REGFLOW_PEERS_VENV, default /tmp/regflow-peers/venv). Prints samples/s and ratios.
set -euo pipefail
cd "$(dirname "$0")/../.."
. benches/peers/venv.sh numpy jax torch

. benches/peers/compare.sh
compare bench_mlp 30 mlp_peers.py samples/s
